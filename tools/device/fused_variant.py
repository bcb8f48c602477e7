"""Runs a benchmark with the one-kernel decode path's knobs changed (device experiments).

  python3 tools/device/fused_variant.py [--max-waste N] [--steps-buf N] -- attention <args>
  python3 tools/device/fused_variant.py [--max-waste N] [--steps-buf N] -- decode <args>

``--max-waste`` replaces ``shared_attention_plan.MAX_WASTE`` (16 lets G = 4 take the one kernel),
``--steps-buf`` the kernel's K/V slots in flight; the rest goes to
``python -m jax_shared_attn.bench`` or ``hydragen bench``.
"""

import argparse
import dataclasses
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
    fp.FusedConfig = dataclasses.make_dataclass(
        "FusedConfig", [("max_concurrent_steps", int, dataclasses.field(default=args.steps_buf))],
        bases=(fp.FusedConfig,), frozen=True)
  print(f"variant: MAX_WASTE={fp.MAX_WASTE} {fp.FusedConfig()}", flush=True)
  if rest[0] == "attention":
    from jax_shared_attn.bench.__main__ import main as bench
    return bench(rest)
  from models.cli import main as cli
  return cli(["bench"] + rest)


if __name__ == "__main__":
  sys.exit(main())
