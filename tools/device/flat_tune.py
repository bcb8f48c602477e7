"""Where the one-kernel small-batch path (``flat_rows``) pays, and its split knobs.

Run on the GPU machine:
``PYTHONPATH=. python3 tools/device/flat_tune.py --shape paper --batch 1,4,16,32,64 --out $OUT``.
For each configuration (one decode step, full suffixes) it times, in one process, with the
profiler's device clock (``jax_shared_attn.bench.timing``):

* ``off``: ``impl="auto"`` without the flat path (what shipped before it),
* ``flat`` / ``flat_b2`` / ``flat_n64``: ``impl="auto"`` forced onto the flat path with the
  default knobs, 2-step splits, 64-key steps,
* ``flat_head`` / ``flat_seq``: the flat path with head-major rows (the layout before 2026-11-23) or
  sequence-major rows (``pallas_kernels.gpu.FLAT_SEQUENCE_MAJOR``, the default since 2026-11-23): e.g.
  ``--shape llama-3-8b --batch 16 --prefix 1024 --suffix 128,512 --variants flat_head,flat_seq,off``,
* ``triton_off`` / ``triton_flat``: the same on ``impl="pallas:triton"`` (GPUs without Mosaic),
* ``cudnn`` / ``pallas_decode``: the per-sequence baselines over duplicated K/V (as in
  ``python -m jax_shared_attn.bench attention``).

Writes ``flat_tune_<shape>.json`` and prints a table. A development tool; the benchmark of
record is ``python -m jax_shared_attn.bench attention``.
"""

import argparse
import contextlib
import functools
import importlib
import itertools
import json
import os

import jax
import jax.numpy as jnp

import pallas_kernels.gpu as gpu
from jax_shared_attn import shared_prefix_attention
from jax_shared_attn.bench import attention as bench
from jax_shared_attn.bench import timing
from jax_shared_attn.iomodel import AttentionShape
sa = importlib.import_module("pallas_kernels.gpu.suffix_attention")


@contextlib.contextmanager
def knobs(block_n=None, min_blocks=None):
  before = sa.FLAT_BLOCK_N, sa.FLAT_MIN_BLOCKS
  sa.FLAT_BLOCK_N = block_n or before[0]
  sa.FLAT_MIN_BLOCKS = min_blocks or before[1]
  try:
    yield
  finally:
    sa.FLAT_BLOCK_N, sa.FLAT_MIN_BLOCKS = before


def ours(impl, flat, **kw):
  def op(q, pk, pv, sk, sv):
    with gpu.flat_decode(2**62 if flat else 0), knobs(**kw):
      return shared_prefix_attention(q, pk, pv, sk, sv, impl=impl)
  return op


def flat_layout(sequence_major: bool):
  """The flat path forced on, rows folded head-major ([Hkv, B, M, D]: a transpose in and out,
  with several KV heads XLA merging the splits fused into the out one) or sequence-major
  (``gpu.FLAT_SEQUENCE_MAJOR``: [B, Hkv, M, D], reshapes in decoding, the merge kernel)."""
  def op(q, pk, pv, sk, sv):
    with gpu.flat_decode(2**62), gpu.flat_sequence_major(sequence_major):
      return shared_prefix_attention(q, pk, pv, sk, sv, impl="auto")
  return op


VARIANTS = {
    "flat_head": flat_layout(False),
    "flat_seq": flat_layout(True),
    "off": ours("auto", False),
    "flat": ours("auto", True),
    "flat_b2": ours("auto", True, min_blocks=2),
    "flat_n64": ours("auto", True, block_n=64),
    "triton_off": ours("pallas:triton", False),
    "triton_flat": ours("pallas:triton", True),
}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="paper", choices=sorted(bench.SHAPES))
  ap.add_argument("--batch", default="1,4,16,32,64")
  ap.add_argument("--prefix", default="1024,4096,16384")
  ap.add_argument("--suffix", default="128,512")
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--trials", type=int, default=3)
  ap.add_argument("--out", default=".")
  args = ap.parse_args()
  hq, hkv, d = bench.SHAPES[args.shape]
  variants = args.variants.split(",")
  rows = []
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"flat_tune_{args.shape}.json")
  for b, p, s in itertools.product(*(map(int, x.split(",")) for x in
                                     (args.batch, args.prefix, args.suffix))):
    shape = AttentionShape(b, p, s, hq, hkv, d)
    make = functools.partial(bench._inputs, shape, jnp.bfloat16)
    n = timing.sets_needed(timing.tree_bytes(jax.eval_shape(lambda: make(0))))
    row = dict(B=b, P=p, S=s, Hq=hq, Hkv=hkv, D=d)
    row.update(timing.compare_ops({v: VARIANTS[v] for v in variants}, make, n_sets=n,
                                  trials=args.trials))
    ctx = p + s
    cap = -(-ctx // 2048) * 2048  # gqa's default 16 splits x 128-key blocks
    for name, op, capacity in (("cudnn", bench._cudnn, ctx),
                               ("pallas_decode", functools.partial(bench._pallas_decode, ctx), cap)):
      dup = functools.partial(bench._duplicated, shape, jnp.bfloat16, capacity=capacity)
      try:
        row[name] = timing.device_time(op, dup, n_sets=n, trials=args.trials) * 1e6
      except Exception as e:  # noqa: BLE001
        row[name] = f"err: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    rows.append(row)
    cells = " ".join(f"{k}={row[k]:.1f}" if isinstance(row[k], float) else f"{k}={row[k]}"
                     for k in variants + ["cudnn", "pallas_decode"])
    print(f"B={b} P={p} S={s}: {cells}", flush=True)
    with open(path, "w") as f:
      json.dump(dict(info=timing.device_info(), rows=rows), f, indent=1)
  cols = variants + ["cudnn", "pallas_decode"]
  print("\n| B | P | S | " + " | ".join(cols) + " |")
  print("|" + "---:|" * (3 + len(cols)))
  for r in rows:
    print(f"| {r['B']} | {r['P']} | {r['S']} | " + " | ".join(
        f"{r[c]:.1f}" if isinstance(r[c], float) else "err" for c in cols) + " |")


if __name__ == "__main__":
  main()
