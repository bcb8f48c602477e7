"""Runs a benchmark with the one-kernel decode path's knobs changed (device experiments).

  python3 tools/device/fused_variant.py [--max-waste N] [--steps-buf N] -- attention <args>
  python3 tools/device/fused_variant.py [--max-waste N] [--steps-buf N] -- decode <args>

``--max-waste`` replaces ``shared_attention_plan.MAX_WASTE`` (16 lets G = 4 take the one kernel),
``--steps-buf`` its K/V slots in flight (``shared_attention_plan.STAGES``, which
``default_config`` takes where they fit in shared memory); the rest goes to
``python -m jax_shared_attn.bench`` or ``hydragen bench``.
"""

import argparse
import sys


def main():
  argv = sys.argv[1:]
  split = argv.index("--")
  ap = argparse.ArgumentParser()
  ap.add_argument("--max-waste", type=int)
  ap.add_argument("--steps-buf", type=int, help="K/V slots in flight (max_concurrent_steps)")
  args = ap.parse_args(argv[:split])
  rest = argv[split + 1:]
  from pallas_kernels.gpu import shared_attention_plan as fp
  if args.max_waste is not None:
    fp.MAX_WASTE = args.max_waste
  if args.steps_buf is not None:
    # Not a FusedConfig default: default_config sets max_concurrent_steps from STAGES.
    fp.STAGES = args.steps_buf
  print(f"variant: MAX_WASTE={fp.MAX_WASTE} STAGES={fp.STAGES}", flush=True)
  if rest[0] == "attention":
    from jax_shared_attn.bench.__main__ import main as bench
    return bench(rest)
  from models.cli import main as cli
  return cli(["bench"] + rest)


if __name__ == "__main__":
  sys.exit(main())
