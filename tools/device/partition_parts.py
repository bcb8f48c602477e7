"""Where the partitioned launch's time goes (device diagnostic for issue 3).

  PYTHONPATH=. python3 tools/device/partition_parts.py --out $OUT

``tools/device/partitioned.py`` runs the suffix role and the prefix product in one flat-grid
launch and lets the GPU balance them. This times its parts apart at one shape (default Llama-3-8B,
B=256, P=4096, capacity 128), kernel µs from the profiler:

1. the prefix kernel alone (``side=None``, the shipped launch) at several key splits;
2. the suffix role alone (``suffix_role.suffix_rows_mgpu``, both layouts) on several CTA counts
   at several suffix fills;
3. the flat launch with a side role that does nothing (its outputs left unwritten: timing
   only), so the prefix units' cost in the flat grid shows without the suffix role's.

Writes ``partition_parts.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import pathlib

import jax
import jax.numpy as jnp

from jax_shared_attn.bench import timing
from pallas_kernels.gpu import prefix_attention_mgpu as mg
from pallas_kernels.gpu._common import fold_rows


def _load(name):
  spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).with_name(name + ".py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


suffix_role = _load("suffix_role")
partitioned = _load("partitioned")


def kernel_us(res: dict) -> float:
  """The Mosaic GPU kernel's device µs per call from :func:`timing.measure`'s breakdown."""
  ks = res.get("breakdown", {}).get("kernels", [])
  mosaic = [k["us"] for k in ks if "mosaic" in k.get("name", "")]
  return float(mosaic[0]) if mosaic else float("nan")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--prefix", type=int, default=4096)
  ap.add_argument("--capacity", type=int, default=128)
  ap.add_argument("--splits", default="1,2,4,8")
  ap.add_argument("--side", default="32,64")
  ap.add_argument("--fills", default="16,64,128")
  ap.add_argument("--trials", type=int, default=5)
  ap.add_argument("--layouts", default="rows,cols", help="suffix role layouts timed alone")
  ap.add_argument("--skip-idle", action="store_true", help="leave out part 3")
  args = ap.parse_args()
  b, p, s, hq, hkv, d = args.batch, args.prefix, args.capacity, 32, 8, 128
  g, r = hq // hkv, args.batch * 4
  scale = d ** -0.5
  splits_list = [int(x) for x in args.splits.split(",")]
  sides = [int(x) for x in args.side.split(",")]
  fills = [int(x) for x in args.fills.split(",")]
  rows = []

  def make(seed, fill=s):
    q, pk, pv, sk, sv = partitioned.make_inputs(jax.random.key(seed), b, p, s, hq, hkv)
    return fold_rows(q, hkv), pk, pv, sk, sv, jnp.full((b,), fill, jnp.int32)

  n_sets = timing.sets_needed(timing.tree_bytes(jax.eval_shape(lambda: make(0))))

  def record(part, **kw):
    op = kw.pop("op")
    fill = kw.get("fill", s)
    try:
      res = timing.measure(op, functools.partial(make, fill=fill), n_sets=n_sets,
                           trials=args.trials)
      row = dict(part=part, **kw, kernel_us=kernel_us(res), total_us=res["seconds"] * 1e6)
    except Exception as e:  # noqa: BLE001 -- reported
      row = dict(part=part, **kw, error=f"{type(e).__name__}: {str(e)[:300]}")
    rows.append(row)
    print(row, flush=True)

  def prefix_cfg(splits):
    cfg = dataclasses.replace(mg.default_config(r, hkv, p, d), splits=splits)
    return dataclasses.replace(cfg, block_kv=128, overlap=mg.OVERLAP)

  for splits in splits_list:  # 1. the prefix kernel alone
    record("prefix alone", splits=splits, op=lambda q, pk, pv, sk, sv, lens, splits=splits:
           mg.prefix_attention_rows_mgpu(q, pk, pv, jnp.int32(p), scale=scale,
                                         config=prefix_cfg(splits)))
  for layout in args.layouts.split(","):  # 2. the suffix role alone
    for side in sides:
      for fill in fills:
        record(f"suffix role alone ({layout})", ctas=side, fill=fill,
               op=lambda q, pk, pv, sk, sv, lens, side=side, layout=layout:
               suffix_role.suffix_rows_mgpu(q, sk, sv, lens, rows_per_seq=g, scale=scale,
                                            n_ctas=side, wgs=2, stages=2, block_s=64,
                                            layout=layout))
  for side in ([] if args.skip_idle else sides):  # 3. the flat grid with an idle side role
    for splits in splits_list:
      def idle(q, pk, pv, sk, sv, lens, side=side, splits=splits):
        def body(cta, w, q_ref, *refs):
          del cta, w, q_ref, refs
        return mg.prefix_attention_rows_mgpu(
            q, pk, pv, jnp.int32(p), scale=scale, config=prefix_cfg(splits),
            side=(side, body, (lens,), (jax.ShapeDtypeStruct((8,), jnp.float32),)))
      record("flat grid, idle side CTAs", ctas=side, splits=splits, op=idle)

  kind = jax.devices()[0].device_kind
  lines = [f"device: {kind}; jax {jax.__version__}; Llama-3-8B layout B={b} P={p} capacity {s}; "
           "the Mosaic GPU kernel's device µs", "",
           "| part | CTAs (suffix) | prefix splits | suffix keys | kernel µs |",
           "|---|---:|---:|---:|---:|"]
  for row in rows:
    us = f"{row['kernel_us']:.1f}" if "kernel_us" in row else row.get("error", "")[:60]
    lines.append(f"| {row['part']} | {row.get('ctas', '')} | {row.get('splits', '')} | "
                 f"{row.get('fill', '')} | {us} |")
  table = "\n".join(lines)
  print("\n" + table)
  tag = f"_b{b}_p{p}"
  with open(os.path.join(args.out, f"partition_parts{tag}.json"), "w") as f:
    json.dump(dict(device=kind, jax=jax.__version__, rows=rows), f, indent=1)
  with open(os.path.join(args.out, f"partition_parts{tag}.md"), "w") as f:
    f.write(table + "\n")


if __name__ == "__main__":
  main()
