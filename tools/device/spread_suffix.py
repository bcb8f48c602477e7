"""The one-kernel decode path's step plans, A/B in one process (device experiment).

  PYTHONPATH=. python3 tools/device/spread_suffix.py --out $OUT [--specs paper:1024:16384:128,...]

Times ``shared_prefix_attention(impl="auto")`` with the key splits' steps spread
(``pallas_kernels.gpu.spread_suffix(True)``: each split an equal share of prefix blocks and of
suffix steps, the suffix runs starting at positions spread over the CTAs) and as equal ranges of
"prefix blocks, then suffix steps" (``spread_suffix(False)``, the earlier plan), with the kernels
apart as a third column, on the same inputs (``bench.attention.compare_variants``: profiler device
time, outputs checked against the first op's). Writes ``spread_suffix.json``.
"""

import argparse
import os

import pallas_kernels.gpu as gpu
from jax_shared_attn import shared_prefix_attention
from jax_shared_attn.bench import attention as bench
from jax_shared_attn.bench import timing

SPECS = ",".join(f"paper:{b}:{p}:{s}" for b, p, s in [
    (1024, 16384, 128), (1024, 16384, 512), (256, 16384, 128), (256, 16384, 512),
    (1024, 4096, 128), (1024, 4096, 512), (256, 4096, 128), (256, 4096, 512),
    (1024, 1024, 128), (256, 1024, 512), (64, 4096, 128), (64, 16384, 512)])


def plan(spread: bool):
  def op(q, pk, pv, sk, sv):
    with gpu.spread_suffix(spread):
      return shared_prefix_attention(q, pk, pv, sk, sv, impl="auto")
  return op


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--specs", default=SPECS, help="shape:B:P:S, comma-separated")
  ap.add_argument("--trials", type=int, default=5)
  ap.add_argument("--out", default="runs/spread_suffix")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  ceilings = (timing.copy_bandwidth(), timing.matmul_rate())
  print(f"copy {ceilings[0] / 1e9:.0f} GB/s, matmul {ceilings[1] / 1e12:.0f} TFLOP/s", flush=True)
  ops = {"spread": plan(True), "ranges": plan(False), "apart": bench._ours_split}
  bench.compare_variants(ops, args.specs, trials=args.trials, ceilings=ceilings,
                         out_json=os.path.join(args.out, "spread_suffix.json"))


if __name__ == "__main__":
  main()
