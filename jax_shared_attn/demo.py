"""A small demo: shared-prefix attention equals full attention, and reads far less.

Run: ``python -m jax_shared_attn.demo [--batch 64 --prefix 2048 --suffix 64]``
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_shared_attn import attention_with_lse, shared_prefix_attention
from jax_shared_attn.iomodel import AttentionShape
from jax_shared_attn.testing import oracle_tree, rel_err


def _time(fn, *args, repeats=5):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--prefix", type=int, default=2048)
  ap.add_argument("--suffix", type=int, default=64)
  ap.add_argument("--q-heads", type=int, default=8)
  ap.add_argument("--kv-heads", type=int, default=1)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  args = ap.parse_args(argv)
  b, p, s, hq, hkv, d = (args.batch, args.prefix, args.suffix, args.q_heads, args.kv_heads,
                         args.head_dim)
  dtype = jnp.dtype(args.dtype)
  keys = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(keys[0], (b, 1, hq, d), dtype)
  pk = jax.random.normal(keys[1], (p, hkv, d), dtype)
  pv = jax.random.normal(keys[2], (p, hkv, d), dtype)
  sk = jax.random.normal(keys[3], (b, s, hkv, d), dtype)
  sv = jax.random.normal(keys[4], (b, s, hkv, d), dtype)
  lens = jnp.asarray(np.random.default_rng(0).integers(1, s + 1, size=b), jnp.int32)

  hydragen = jax.jit(lambda *a: shared_prefix_attention(*a, suffix_lengths=lens, return_lse=True))

  def per_sequence(q, pk, pv, sk, sv):  # the baseline: every sequence holds the whole prompt
    k = jnp.concatenate([jnp.broadcast_to(pk, (b, p, hkv, d)), sk], axis=1)
    v = jnp.concatenate([jnp.broadcast_to(pv, (b, p, hkv, d)), sv], axis=1)
    return attention_with_lse(q, k, v, kv_lengths=p + lens, causal=True)

  per_sequence = jax.jit(per_sequence)
  out, lse = hydragen(q, pk, pv, sk, sv)
  ref_out, ref_lse = per_sequence(q, pk, pv, sk, sv)
  n = min(b, 4)  # the float64 oracle is slow: check the first sequences
  f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  oracle, _ = oracle_tree(f64(q[:n]), [[f64(pk)]] * n, [[f64(pv)]] * n, f64(sk[:n]), f64(sv[:n]),
                          np.asarray(lens[:n]))
  shape = AttentionShape(b, p, s, hq, hkv, d, itemsize=dtype.itemsize)
  t_h = _time(hydragen, q, pk, pv, sk, sv)
  t_p = _time(per_sequence, q, pk, pv, sk, sv)

  print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}); dtype {dtype.name}")
  print(f"B={b} sequences share a prefix of P={p} tokens, then own suffixes of up to S={s}; "
        f"Hq={hq}, Hkv={hkv}, D={d}")
  print(f"  max |hydragen - full attention|      = {float(jnp.max(jnp.abs(out - ref_out))):.3e}")
  print(f"  rel. error vs float64 oracle (first {n}) = {rel_err(out[:n], oracle):.3e}")
  print(f"  K/V bytes read, full attention       = {shape.per_sequence_bytes() / 2**20:10.1f} MiB")
  print(f"  K/V bytes read, shared prefix        = {shape.shared_bytes() / 2**20:10.1f} MiB "
        f"({shape.read_saving():.1f}x less)")
  print(f"  time, full attention (jit)           = {t_p * 1e3:10.2f} ms")
  print(f"  time, shared prefix (jit)            = {t_h * 1e3:10.2f} ms "
        f"({t_p / t_h:.1f}x faster)")


if __name__ == "__main__":
  main()
