"""The Mosaic prefix kernel with and without FlashAttention-3's intra-warpgroup overlap.

Run on the GPU machine: ``PYTHONPATH=. python3 tools/device/overlap.py --out $OUT
[--specs paper:1024:16384 ...]``. For each prefix shape (``name:B:P``; the suffix plays no part)
it times, on the same rotated inputs and with the shipped key splits, the shipped configuration
and the overlapped kernel with 128- and 192-key steps, and prints
device µs, TFLOP/s and the fraction of this run's measured matmul rate; writes
``overlap.json`` and ``overlap.md``. A development tool (the benchmark of record is
``python -m jax_shared_attn.bench attention``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from jax_shared_attn.bench import timing
from jax_shared_attn.bench.attention import parse_spec
from pallas_kernels.gpu import prefix_attention_mgpu as mg

DEFAULT_SPECS = ["paper:1024:16384", "paper:256:4096", "llama:1024:16384", "llama:256:4096"]


def variants(rows: int, hkv: int, p: int, d: int) -> dict[str, mg.MosaicPrefixConfig]:
  shipped = mg.default_config(rows, hkv, p, d)
  # Since the overlap became the default for 128-key steps, "plain" must turn it off explicitly.
  base = dataclasses.replace(shipped, max_concurrent_steps=2, overlap=False)
  out = {"shipped": shipped,
         "plain128": dataclasses.replace(base, block_kv=128),
         "overlap128": dataclasses.replace(base, block_kv=128, overlap=True),
         "overlap192": dataclasses.replace(base, block_kv=192, overlap=True)}
  return {k: v for k, v in out.items() if mg.smem_bytes(v, d) <= mg.SMEM_LIMIT}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--specs", default=",".join(DEFAULT_SPECS))
  ap.add_argument("--trials", type=int, default=5)
  ap.add_argument("--variants", default="shipped,plain128,overlap128,overlap192",
                  help="comma-separated, from: shipped, plain128, overlap128, overlap192")
  args = ap.parse_args()
  # The ceiling (a CPU run only checks the script: its matmul rate is not worth the minutes).
  rate = timing.matmul_rate() if jax.default_backend() == "gpu" else timing.matmul_rate(n=512)
  print(f"device {jax.devices()[0].device_kind}, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
  rows_out = []
  for spec in args.specs.split(","):
    _, shape = parse_spec(spec + ":0")  # name:B:P (the suffix plays no part)
    b, p, hkv, d = shape.batch, shape.prefix, shape.kv_heads, shape.head_dim
    r = b * shape.q_heads // hkv
    flops = 4 * r * hkv * p * d
    make = lambda i: tuple(jax.random.normal(jax.random.key(3 * i + j), s, jnp.bfloat16)
                           for j, s in enumerate([(hkv, r, d), (p, hkv, d), (p, hkv, d)]))
    ops = {}
    cfgs = {k: v for k, v in variants(r, hkv, p, d).items() if k in args.variants.split(",")}
    for key, cfg in cfgs.items():
      ops[key] = (lambda cfg: lambda q, k, v: mg.prefix_attention_rows_mgpu(
          q, k, v, jnp.int32(p), scale=d**-0.5, config=cfg)[0])(cfg)
    res = timing.compare_ops(ops, make, n_sets=timing.sets_needed(2 * p * hkv * d * 2),
                             trials=args.trials)
    row = {"spec": spec, "rows": r, "hkv": hkv, "p": p, "d": d, "flops": flops,
           "configs": {k: str(v) for k, v in cfgs.items()}}
    for key in ops:
      us = res.get(key)
      row[key] = us
      row[f"err_{key}"] = res.get(f"err_{key}")
      if isinstance(us, float):
        row[f"{key}_tflops"] = flops / us / 1e6
    rows_out.append(row)
    print(spec, {k: (round(row[k], 1) if isinstance(row[k], float) else row[k]) for k in ops},
          flush=True)
  keys = args.variants.split(",")
  lines = [f"device: {jax.devices()[0].device_kind}; bf16 matmul rate {rate / 1e12:.0f} TFLOP/s; "
           "device µs (TFLOP/s, fraction of the matmul rate)", "",
           "| spec | rows x Hkv | " + " | ".join(keys) + " |",
           "|---|---|" + "---:|" * len(keys)]
  for row in rows_out:
    cells = []
    for k in keys:
      us = row.get(k)
      if isinstance(us, float):
        t = row[f"{k}_tflops"]
        cells.append(f"{us:.1f} ({t:.0f}, {t * 1e12 / rate:.2f})")
      else:
        cells.append(str(us) if us is not None else "")
    lines.append(f"| {row['spec']} | {row['rows']} x {row['hkv']} | " + " | ".join(cells) + " |")
  table = "\n".join(lines)
  print("\n" + table)
  with open(os.path.join(args.out, "overlap.json"), "w") as f:
    json.dump({"matmul_rate": rate, "device": jax.devices()[0].device_kind, "rows": rows_out}, f,
              indent=1)
  with open(os.path.join(args.out, "overlap.md"), "w") as f:
    f.write(table + "\n")


if __name__ == "__main__":
  main()
