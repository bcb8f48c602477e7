"""The flat small-batch path inside a model's decode loop: on against off.

Run on the GPU machine, once per setting (the switch is read when the decode loop is traced,
so each setting gets its own process):
``PYTHONPATH=. python3 tools/device/flat_decode.py --model smollm2-135m --batch 4,16 --prefix 1024 --flat 1 --out $OUT``.
Times decode-only tokens/s with ``models.bench_decode.run_point`` (random bf16 weights of the
named shape, the whole prompt shared by the batch) for each mode in ``--modes``, with the flat
path on (``--flat 1``, the default dispatch) or off (``pallas_kernels.gpu.flat_decode(0)``),
and appends the rows to ``flat_decode_<model>.json``. A development tool; the decode benchmark
of record is ``hydragen bench decode``.
"""

import argparse
import json
import os
import sys

import jax

import pallas_kernels.gpu as gpu
from models.bench_decode import device_random_init, run_point
from models.config import preset


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--batch", default="4,16")
  ap.add_argument("--prefix", default="1024")
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--modes", default="hydragen")
  ap.add_argument("--flat", type=int, choices=(0, 1), default=1)
  ap.add_argument("--profile-steps", type=int, default=0,
                  help="steps after the timed call run under the profiler (device ms by kernel)")
  ap.add_argument("--out", default=".")
  args = ap.parse_args()
  batches = [int(x) for x in args.batch.split(",")]
  prefixes = [int(x) for x in args.prefix.split(",")]
  config = preset(args.model)
  longest = max(prefixes) + args.new_tokens + 1
  config = config.replace(dtype="bfloat16",
                          max_position_embeddings=max(config.max_position_embeddings, longest))
  model = device_random_init(config, seed=0)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"flat_decode_{args.model}.json")
  data = json.load(open(path)) if os.path.exists(path) else dict(
      info=dict(model=args.model, device=jax.devices()[0].device_kind, jax=jax.__version__),
      rows=[])
  budget = gpu.FLAT_MAX_SHARED_READS if args.flat else 0
  for p in prefixes:
    for b in batches:
      for mode in args.modes.split(","):
        with gpu.flat_decode(budget):
          row = run_point(model, mode, b, p, args.new_tokens, impl="auto",
                          profile_steps=args.profile_steps)
        row["flat"] = bool(args.flat) if mode == "hydragen" else None
        data["rows"].append(row)
        summary = {k: row.get(k) for k in ("mode", "flat", "batch", "prefix", "step_ms",
                                           "tokens_per_s")}
        if "profile" in row:
          summary["device_ms"] = {k: round(v / 1e3, 3)
                                  for k, v in row["profile"]["by_category_us"].items()}
          summary["busy_ms"] = row["profile"]["busy_us"] / 1e3
        print(json.dumps(summary), flush=True)
        with open(path, "w") as f:
          json.dump(data, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
