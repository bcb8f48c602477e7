"""K/V slots in flight (two or three) and other plan switches of the Mosaic GPU kernels, A/B in
one process (device experiment).

  PYTHONPATH=. python3 tools/device/stages.py --out $OUT [--specs paper:1024:16384:128,...]
      [--ops s2,s3,...]

Ops on the same inputs (``bench.attention.compare_variants``: profiler device time, outputs
checked against the first op's):

- ``s2``: ``impl="auto"`` as shipped (two slots unless the defaults say otherwise);
- ``s3``: three K/V slots in the one-kernel decode path and in the prefix kernel's 128-key steps
  (``pallas_kernels.gpu.kv_stages(3, 3)``; 192-key prefix steps keep two);
- ``s3n``: ``s3`` with the prefix kernel on 128-key steps everywhere (``wide_prefix_steps(0)``),
  so long prefixes take three slots too;
- ``g4s2`` / ``g4s3``: the one kernel forced on at G = 4 (``MAX_WASTE = 16``), two or three
  slots;
- (``u2``, ``p2``, ``p3``: paired suffix steps, removed with them; see
  ``docs/results/2026-11-24-h100-paired``);
- ``tk``: the one kernel takes each row tile's longest suffix itself (``TILE_MAX_IN_KERNEL``)
  instead of XLA's reduction before it;
- ``cm``: the one kernel merges its 2-4 key splits itself, each row tile's splits one cluster
  (``CLUSTER_MERGE``), instead of the merge kernel after it; ``cmtk``: ``cm`` and ``tk``;
- (``sw``: the suffixes on a fourth warpgroup of each CTA, removed with it; see
  ``docs/results/2026-11-24-h100-suffix-warpgroup``);
- ``apart``: the prefix and suffix kernels one after the other.

``--suffix-length N`` gives every sequence N valid suffix keys of the capacity S (as in decoding,
where the suffixes grow into their buffers; default: all S), a constant inside the jitted op.
``--ragged`` instead passes each input set its own random lengths in [1, S] as an int32 array
argument (what a caller's length array costs: XLA cannot fold it). Writes ``stages.json``.
"""

import argparse
import contextlib
import os

import jax.numpy as jnp

import pallas_kernels.gpu as gpu
from jax_shared_attn import shared_prefix_attention
from jax_shared_attn.bench import attention as bench
from jax_shared_attn.bench import timing
from pallas_kernels.gpu import shared_attention_plan as fp

SPECS = ",".join(f"paper:{b}:{p}:{s}" for b, p, s in [
    (1024, 16384, 128), (1024, 16384, 512), (256, 16384, 128), (256, 16384, 512),
    (1024, 4096, 128), (1024, 4096, 512), (256, 4096, 128), (256, 4096, 512),
    (1024, 1024, 128), (64, 4096, 128)])


SUFFIX_LENGTH = None  # --suffix-length


def variant(*settings):
  def op(q, pk, pv, sk, sv, lens=None):
    if lens is None and SUFFIX_LENGTH is not None:
      lens = jnp.full((q.shape[0],), min(SUFFIX_LENGTH, sk.shape[1]), jnp.int32)
    with contextlib.ExitStack() as stack:
      for s in settings:
        stack.enter_context(s())
      return shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=lens, impl="auto")
  return op


OPS = {
    "s2": variant(),
    "s3": variant(lambda: gpu.kv_stages(3, 3)),
    "s3n": variant(lambda: gpu.kv_stages(3, 3), lambda: gpu.wide_prefix_steps(0)),
    "g4s2": variant(lambda: gpu._setting("MAX_WASTE", 16, fp)),
    "g4s3": variant(lambda: gpu._setting("MAX_WASTE", 16, fp), lambda: gpu.kv_stages(3, 3)),
    "tk": variant(lambda: gpu.tile_max_in_kernel(True)),
    "cm": variant(lambda: gpu.cluster_merge(True)),
    "cmtk": variant(lambda: gpu.cluster_merge(True), lambda: gpu.tile_max_in_kernel(True)),
    "apart": bench._ours_split,
}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--specs", default=SPECS, help="shape:B:P:S, comma-separated")
  ap.add_argument("--ops", default="s2,s3,apart", help=f"comma-separated, of {','.join(OPS)}")
  ap.add_argument("--trials", type=int, default=5)
  ap.add_argument("--out", default="runs/stages")
  ap.add_argument("--name", default="stages")
  ap.add_argument("--suffix-length", type=int, default=None,
                  help="valid suffix keys per sequence (default: the whole capacity S)")
  ap.add_argument("--ragged", action="store_true",
                  help="random suffix lengths in [1, S] per input set, passed as an argument")
  args = ap.parse_args()
  global SUFFIX_LENGTH
  SUFFIX_LENGTH = args.suffix_length
  os.makedirs(args.out, exist_ok=True)
  ceilings = (timing.copy_bandwidth(), timing.matmul_rate())
  print(f"copy {ceilings[0] / 1e9:.0f} GB/s, matmul {ceilings[1] / 1e12:.0f} TFLOP/s", flush=True)
  ops = {name: OPS[name] for name in args.ops.split(",")}
  if (SUFFIX_LENGTH is not None or args.ragged) and "apart" in ops:
    raise SystemExit("--suffix-length / --ragged: the apart op takes full suffixes only")
  bench.compare_variants(ops, args.specs, trials=args.trials, ceilings=ceilings,
                         out_json=os.path.join(args.out, f"{args.name}.json"),
                         ragged=args.ragged)


if __name__ == "__main__":
  main()
