"""What do the one kernel's suffix steps cost when their K/V are already in L2? (device experiment)

  PYTHONPATH=. python3 tools/device/l2_suffix.py --out $OUT [--specs paper:512:16384:64,...]

In the one-kernel decode path (paper shape, G = 8) a suffix step costs about what a prefix step
does (~1.45 vs ~1.64 µs) for half the products. Prefix blocks come from L2 (every CTA of a KV
head reads the same ones); suffix blocks come from HBM. Three K/V slots instead of two changed
nothing, which says the pipeline's depth is not the limit, but not whether the HBM reads are.
This times ``impl="auto"`` (the one kernel at these shapes) three ways on the same prefix and
queries:

- ``none``: every suffix length 0 (the kernel runs no suffix steps; the prefix alone),
- ``l2``: one suffix set, the same in every call, small enough to stay in L2 between calls,
- ``hbm``: ``--sets`` suffix sets in turn (the benchmark's rotation past L2).

Each case runs ``--sets`` calls per jitted program, on the same prefix and queries.

``hbm - none`` is what the suffix steps cost as shipped, ``l2 - none`` what they would cost if
their reads were L2 hits (an upper bound on what prefetching the suffixes into L2 could save).
Writes ``l2_suffix.json`` and prints a table.
"""

import argparse
import json
import os

import jax.numpy as jnp

from jax_shared_attn import shared_prefix_attention
from jax_shared_attn.bench import attention as bench
from jax_shared_attn.bench import timing

SPECS = "paper:512:16384:64,paper:256:16384:128,paper:512:16384:128,paper:1024:16384:64"


def shipped(q, pk, pv, sk, sv, lens):
  return shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=lens, impl="auto")


def run(spec: str, sets: int, trials: int) -> dict:
  shape = bench.parse_spec(spec)[1]
  hkv, d = shape.kv_heads, shape.head_dim
  q, pk, pv, _, _ = bench._inputs(shape, jnp.bfloat16, 0)
  suffixes = [bench._inputs(shape, jnp.bfloat16, i)[3:] for i in range(sets)]
  full = jnp.full((shape.batch,), shape.suffix, jnp.int32)
  zero = jnp.zeros((shape.batch,), jnp.int32)
  suffix_mb = 2 * shape.batch * shape.suffix * hkv * d * 2 / 2**20
  row = dict(spec=spec, suffix_mb=suffix_mb, sets=sets)
  # Every case runs ``sets`` calls per program (the calls per program change the busy time per
  # call at B=1024: one call per program read ~6 µs slower in a first run, 2026-11-24).
  cases = {
      "none": lambda i: (q, pk, pv, *suffixes[0], zero),
      "l2": lambda i: (q, pk, pv, *suffixes[0], full),
      "hbm": lambda i: (q, pk, pv, *suffixes[i], full),
  }
  for case, make in cases.items():
    res = timing.measure(shipped, make, n_sets=sets, trials=trials)
    row[case] = res["seconds"] * 1e6
    row[f"{case}_kernels"] = res.get("breakdown", {}).get("kernels", [])
  return row


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--specs", default=SPECS)
  ap.add_argument("--sets", type=int, default=6)
  ap.add_argument("--trials", type=int, default=7)
  ap.add_argument("--out", default=".")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  rows = []
  for spec in args.specs.split(","):
    rows.append(run(spec, args.sets, args.trials))
    print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("_kernels")}),
          flush=True)
    with open(os.path.join(args.out, "l2_suffix.json"), "w") as f:
      json.dump(dict(info=timing.device_info(), rows=rows), f, indent=1)
  print("\n| spec | suffix K+V MB | none µs | l2 µs | hbm µs | suffix steps, L2 | from HBM |")
  print("|---|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['spec']} | {r['suffix_mb']:.1f} | {r['none']:.1f} | {r['l2']:.1f} | "
          f"{r['hbm']:.1f} | {r['l2'] - r['none']:.1f} | {r['hbm'] - r['none']:.1f} |")


if __name__ == "__main__":
  main()
