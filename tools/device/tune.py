"""Device tuning sweep: each kernel alone over its knobs, against the ceilings.

Run on the GPU machine: ``PYTHONPATH=. python3 tools/device/tune.py``. Prints one
table; this is a development tool, the benchmark of record is
``python -m jax_shared_attn.bench attention``.
"""

import functools
import itertools
import sys

import jax
import jax.numpy as jnp

from jax_shared_attn.bench import timing
from pallas_kernels.gpu import _common
from pallas_kernels.gpu.prefix_attention import PrefixConfig, prefix_attention_rows
from pallas_kernels.gpu.suffix_attention import SuffixConfig, suffix_attention

bf16 = jnp.bfloat16


def rnd(i, shape):
  return jax.random.normal(jax.random.key(i), shape, bf16)


def main():
  bw = max(timing.copy_bandwidth(2 * 2**30), timing.copy_bandwidth(4 * 2**30))
  rates = {n: timing.matmul_rate(n) for n in (4096, 8192, 16384)}
  print(f"copy {bw / 1e9:.0f} GB/s; matmul " + ", ".join(f"{n}: {r / 1e12:.0f}" for n, r in rates.items()))
  rate = max(rates.values())
  rows_out = []
  for name, b, hq, hkv, p in [("paper", 1024, 8, 1, 16384), ("llama", 1024, 32, 8, 4096)]:
    d = 128
    g = hq // hkv
    r = b * g
    flops = 4 * r * hkv * p * d

    def make(i):
      return (rnd(3 * i, (hkv, r, d)), rnd(3 * i + 1, (p, hkv, d)), rnd(3 * i + 2, (p, hkv, d)))

    n_sets = timing.sets_needed(2 * p * hkv * d * 2)
    for bm, bn, warps, stages, splits in itertools.product([64, 128], [64, 128], [4, 8], [2, 3],
                                                           [1, 2]):
      if bm == 64 and warps == 8:
        continue
      cfg = PrefixConfig(bm, bn, splits, warps, stages)
      op = functools.partial(prefix_attention_rows, kv_length=jnp.int32(p), scale=d**-0.5,
                             config=cfg)
      try:
        t = timing.device_time(op, make, n_sets=n_sets, trials=3)
        rows_out.append((f"triton prefix {name} B={b} P={p}", str(cfg), t * 1e6, flops / t / 1e12))
      except Exception as e:
        rows_out.append((f"triton prefix {name} B={b} P={p}", str(cfg), -1, str(e).splitlines()[0][:80]))
    # JAX's Mosaic GPU FA3-style kernel on the same folded rows, as a yardstick.
    try:
      from jax.experimental.pallas.ops.gpu import attention_mgpu as am
      for bq, bkv, steps in [(64, 128, 2), (64, 64, 4), (128, 128, 2), (64, 128, 3)]:
        cfg = am.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=steps)

        def mg(q, k, v, cfg=cfg):
          return am.attention(q.transpose(1, 0, 2)[None], k[None], v[None], cfg, save_residuals=True)

        t = timing.device_time(mg, make, n_sets=n_sets, trials=3)
        rows_out.append((f"mgpu FA3 {name} B={b} P={p}", f"bq={bq} bkv={bkv} st={steps}", t * 1e6,
                         flops / t / 1e12))
    except Exception as e:
      rows_out.append((f"mgpu FA3 {name}", "", -1, str(e).splitlines()[0][:120]))

  for name, b, hq, hkv, s in [("paper", 1024, 8, 1, 128), ("paper", 1024, 8, 1, 512),
                              ("llama", 1024, 32, 8, 128), ("llama", 64, 32, 8, 512)]:
    d = 128
    nbytes = 2 * b * s * hkv * d * 2

    def make(i):
      return (rnd(3 * i, (b, 1, hq, d)), rnd(3 * i + 1, (b, s, hkv, d)), rnd(3 * i + 2, (b, s, hkv, d)))

    for bn, warps, stages, splits in itertools.product([64, 128], [4, 8], [2, 3], [1, 2]):
      cfg = SuffixConfig(bn, splits, warps, stages)
      op = functools.partial(suffix_attention, kv_lengths=jnp.full((b,), s, jnp.int32),
                             causal=True, scale=d**-0.5, config=cfg)
      try:
        t = timing.device_time(op, make, n_sets=timing.sets_needed(nbytes), trials=3)
        rows_out.append((f"triton suffix {name} B={b} S={s}", str(cfg), t * 1e6, nbytes / t / 1e9))
      except Exception as e:
        rows_out.append((f"triton suffix {name} B={b} S={s}", str(cfg), -1, str(e).splitlines()[0][:80]))

  # Best few per group (prefix: TFLOP/s; suffix: GB/s of K/V).
  groups = {}
  for row in rows_out:
    groups.setdefault(row[0], []).append(row)
  for key, rs in groups.items():
    ok = sorted([r for r in rs if r[2] > 0], key=lambda r: r[2])
    bad = [r for r in rs if r[2] <= 0]
    print(f"\n== {key}: {len(ok)} ok, {len(bad)} failed" + (f" (e.g. {bad[0][3]})" if bad else ""))
    for r in ok[:4]:
      print(f"  {r[2]:9.1f} us  {r[3]:7.1f}  {r[1]}")
    if ok:
      print(f"  worst {ok[-1][2]:9.1f} us  {ok[-1][3]:7.1f}  {ok[-1][1]}")
  sys.stdout.flush()


if __name__ == "__main__":
  main()
