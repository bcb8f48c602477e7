"""How the one-kernel decode path's key splits share its steps: ``suffix_cost`` sweep.

The one kernel (``pallas_kernels.gpu.shared_attention_mgpu``) cuts each CTA's step list -- the
prefix blocks, then the suffix steps -- into one range per key split. The ranges have equal cost,
a prefix step counting 4 and a suffix step ``SUFFIX_COST`` (``pallas_kernels.gpu.fused_suffix_cost``).
The last split streams the suffix bytes from HBM while the others run prefix blocks out of L2,
so equal step counts need not be equal times.

``PYTHONPATH=. python3 tools/device/split_balance.py attention --variants cost2,cost4,cost6 --out
$OUT`` times ``impl="auto"`` under each cost in one process (profiler device clock) at
``--configs`` (``shape:B:P:S``), writing ``split_balance.json``. (No decode subcommand: none of the
model presets has G >= 8, where the one kernel runs.) Development tool; the benchmark of record is
``python -m jax_shared_attn.bench attention``.
"""

import argparse
import os

import pallas_kernels.gpu as gpu
from jax_shared_attn import shared_prefix_attention
from jax_shared_attn.bench import attention as bench
from decode_ab import add_attention_parser


def with_cost(quarters: int):
  def op(q, pk, pv, sk, sv):
    with gpu.fused_suffix_cost(quarters):
      return shared_prefix_attention(q, pk, pv, sk, sv, impl="auto")
  return op


def attention(args):
  ops = {v: with_cost(int(v.removeprefix("cost"))) for v in args.variants.split(",")}
  bench.compare_variants(ops, args.configs, trials=args.trials,
                         out_json=os.path.join(args.out, "split_balance.json"),
                         ceilings=tuple(args.ceilings) if args.ceilings else None)


def main():
  ap = argparse.ArgumentParser()
  sub = ap.add_subparsers(dest="what", required=True)
  add_attention_parser(sub, "paper:1024:16384:128,paper:1024:16384:512,paper:256:16384:128,"
                       "paper:1024:4096:128,paper:256:4096:128,paper:1024:1024:128",
                       "cost4,cost2,cost3,cost5,cost6,cost8")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  attention(args)


if __name__ == "__main__":
  main()
