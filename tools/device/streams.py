"""Does running the prefix and suffix kernels on two CUDA streams overlap them?

The two-kernel path (``pallas_kernels.gpu._split_shared_attention``) runs the prefix kernel
(compute-bound on the tensor cores) and then the suffix kernel (bound by HBM reads), which
merges the prefix's state in its epilogue: their times add, where the floor takes the larger.
This experiment drops that dependency: the suffix kernel runs without the prior, one of the two
kernels goes on a second stream (``jax.experimental.compute_on.compute_on2`` with
``compute_type="gpu_stream:1"``: XLA wraps the call in call-start / call-done on another
stream), and XLA merges the two states afterwards (fused into the layout change). Variants:

* ``split``: the shipped two-kernel path (``fused_decode(False)``, ``flat_decode(0)``),
* ``sep``: prefix, suffix without prior, XLA merge, one stream (what the merge pass costs),
* ``side_prefix`` / ``side_suffix``: the same with the prefix / the suffix on stream 1.

Device time is the profiler's union of kernel intervals over all streams
(``jax_shared_attn.bench.timing``), so overlap shows as a shorter time. Run on the GPU machine:
``PYTHONPATH=. python3 tools/device/streams.py --out $OUT``. Writes ``streams.json`` and prints a
table. A development tool.
"""

import argparse
import os

import jax.numpy as jnp

import pallas_kernels.gpu as gpu
from jax_shared_attn import shared_prefix_attention
from jax_shared_attn.bench import attention as bench
from jax_shared_attn.merge import merge_states
from pallas_kernels.gpu import _common
from pallas_kernels.gpu.prefix_attention import prefix_attention_rows
from pallas_kernels.gpu.suffix_attention import suffix_rows


def _side(fn, stream):
  if stream is None:
    return fn
  from jax._src import core
  from jax.experimental import compute_on as co
  wrap = getattr(co, "compute_on2", None) or co.compute_on  # renamed in jax 0.11
  return wrap(fn, compute_type=f"gpu_stream:{stream}",
              out_memory_spaces=(core.MemorySpace.Device, core.MemorySpace.Device))


def decoupled(prefix_stream=None, suffix_stream=None):
  def op(q, pk, pv, sk, sv):
    b, tq, hq, d = q.shape
    hkv = pk.shape[1]
    m = tq * (hq // hkv)
    scale = d ** -0.5
    q_rows = _common.fold_rows(q, hkv)  # [Hkv, B*M, D]
    lens = jnp.full((b,), sk.shape[1], jnp.int32)

    def prefix(q_rows, pk, pv):
      return prefix_attention_rows(q_rows, pk, pv, kv_length=pk.shape[0], scale=scale,
                                   mosaic=True)

    def suffix(q_rows, sk, sv, lens):
      return suffix_rows(q_rows.reshape(hkv, b, m, d), sk, sv, lens, [], q_len=tq, causal=False,
                         scale=scale, out_dtype=q.dtype, by_sequence=True)

    p_out, p_lse = _side(prefix, prefix_stream)(q_rows, pk, pv)  # [n, Hkv, B*M(,D)]
    s_out, s_lse = _side(suffix, suffix_stream)(q_rows, sk, sv, lens)  # [B, Hkv, M(,D)]
    n = p_out.shape[0]
    p_out = jnp.swapaxes(p_out.reshape(n, hkv, b, m, d), 1, 2)
    p_lse = jnp.swapaxes(p_lse.reshape(n, hkv, b, m), 1, 2)
    out, _ = merge_states([*p_out, s_out.astype(jnp.float32)], [*p_lse, s_lse])
    return out.astype(q.dtype).reshape(b, tq, hq, d)
  return op


def split(q, pk, pv, sk, sv):
  with gpu.fused_decode(False), gpu.flat_decode(0):
    return shared_prefix_attention(q, pk, pv, sk, sv, impl="auto")


def shipped(q, pk, pv, sk, sv):
  return shared_prefix_attention(q, pk, pv, sk, sv, impl="auto")


VARIANTS = {
    "shipped": shipped,
    "split": split,
    "sep": decoupled(),
    "side_prefix": decoupled(prefix_stream=1),
    "side_suffix": decoupled(suffix_stream=1),
}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--configs", default="llama:1024:1024:128,llama:1024:2048:64,"
                  "llama:1024:2048:128,llama:1024:4096:128,llama:256:4096:128,"
                  "llama:256:16384:128,llama:1024:16384:128,paper:1024:16384:128,"
                  "paper:1024:4096:128")
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--trials", type=int, default=3)
  ap.add_argument("--out", default=".")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  bench.compare_variants({v: VARIANTS[v] for v in args.variants.split(",")}, args.configs,
                         trials=args.trials, out_json=os.path.join(args.out, "streams.json"))


if __name__ == "__main__":
  main()
