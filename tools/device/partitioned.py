"""A role-partitioned launch: the prefix product and the suffix attention on separate SMs of ONE
Mosaic GPU kernel, then an XLA merge (device experiment for issue 3).

  PYTHONPATH=. python3 tools/device/partitioned.py --out $OUT

One launch of :func:`pallas_kernels.gpu.prefix_attention_mgpu.prefix_attention_rows_mgpu`
with ``side=``: a flat grid whose first ``side_ctas`` CTAs run the suffix role of
``tools/device/suffix_role.py`` (transposed products, two warpgroups, 64-key blocks in two
slots; the producer warpgroup idles there) and whose other CTAs each run one prefix unit (KV
head, 128-row tile, key split). Every CTA takes a whole SM, and the GPU starts CTAs in grid
order, each on the next SM to free up: so the suffix CTAs start first, the prefix units fill the
other SMs, and where there are more units than SMs (``splits`` chosen so), the units left
over run on whichever SMs free up first -- those of the suffix CTAs as well, once their
suffixes are done. The split of the SMs between the roles thus follows the work at run time
(decoding's suffixes grow from 0 to the capacity), with no persistent loop in the kernel.
The parts -- the prefix's splits and the suffix part -- are merged by LSE in the shipped merge
kernel (``pallas_kernels.gpu.merge_kernel.merge_parts``).
``tools/partition_bound.py`` bounds what this design can reach
(docs/results/2026-11-24-h100-sm-partition).

Checks the result against the float64 oracle of full attention (Llama-3-8B and paper head
layouts, full, ragged, short and empty suffixes, a partly valid prefix, more CTAs than SMs),
then times it against the shipped path (``shared_prefix_attention(impl="auto")``) on the same
inputs in one process, at full and partly filled suffixes. Writes ``partitioned.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

from jax_shared_attn import shared_prefix_attention
from jax_shared_attn.bench import timing
from jax_shared_attn.testing import lse_err, oracle_attention, rel_err, tolerance
from pallas_kernels.gpu import prefix_attention_mgpu as mg
from pallas_kernels.gpu._common import fold_rows, unfold_rows
from pallas_kernels.gpu.merge_kernel import merge_parts

_spec = importlib.util.spec_from_file_location(
    "suffix_role", pathlib.Path(__file__).with_name("suffix_role.py"))
suffix_role = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suffix_role)

# (name, B, P, capacity, Hq, Hkv, [(prefix splits, suffix CTAs, suffix role layout)], suffix
# lengths timed)
CONFIGS = [
    ("llama", 256, 4096, 128, 32, 8, [(2, 64, "cols"), (2, 64, "rows"), (3, 64, "rows"),
                                      (4, 64, "rows"), (2, 32, "rows"), (4, 32, "rows")],
     [128, 64, 16]),
    ("llama", 256, 16384, 128, 32, 8, [(8, 16, "rows"), (8, 32, "rows"), (4, 32, "rows")],
     [128, 64]),
    ("llama", 1024, 4096, 128, 32, 8, [(1, 64, "rows"), (2, 64, "rows"), (2, 32, "rows")],
     [128, 64]),
    ("llama", 64, 16384, 128, 32, 8, [(16, 16, "rows"), (32, 16, "rows")], [128]),
    ("llama", 128, 4096, 128, 32, 8, [(4, 16, "rows"), (4, 32, "rows"), (8, 32, "rows")],
     [128, 64]),
]


def _parts(q, pk, pv, sk, sv, lens, *, splits: int, side_ctas: int, wgs: int = 2,
           stages: int = 2, block_s: int = 64, scale: float | None = None, prefix_length=None,
           layout: str = "rows"):
  """One partitioned launch: the prefix's split parts ``out [splits, Hkv, R, D]``, ``lse``, and
  the suffix part ``[Hkv, R, D]`` with its LSE (rows folded per KV head). ``prefix_length``:
  valid prefix keys (default: the whole buffer); ``layout``: the suffix role's
  (``suffix_role.ROLES``: ``"rows"``, query rows on wgmma's M side, or ``"cols"``, keys)."""
  b, _, hq, d = q.shape
  p, hkv = pk.shape[:2]
  capacity = sk.shape[1]
  g = hq // hkv
  r = b * g
  scale = d ** -0.5 if scale is None else scale
  prefix_length = p if prefix_length is None else prefix_length
  q_rows = fold_rows(q, hkv)
  cfg = dataclasses.replace(mg.default_config(r, hkv, p, d), splits=splits)
  cfg = dataclasses.replace(cfg, block_kv=128, overlap=mg.OVERLAP and d == 128)
  role = suffix_role.ROLES[layout](hkv=hkv, r=r, d=d, batch=b, capacity=capacity, dtype=q.dtype,
                                   rows_per_seq=g, scale=scale, n_ctas=side_ctas,
                                   wgs=wgs, stages=stages, block_s=block_s)

  def body(cta, w, q_ref, len_ref, k_ref, v_ref, o_ref, lse_ref):
    role.body(cta, w, len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref)

  out, lse, o_t, lse_s = mg.prefix_attention_rows_mgpu(
      q_rows, pk, pv, jnp.asarray(prefix_length, jnp.int32), scale=scale, config=cfg,
      side=(side_ctas, body, (role.lengths(lens), sk, sv), role.out_types))
  return out, lse, suffix_role.unfold(o_t, hkv, r, layout), lse_s


def partitioned_attention(q, pk, pv, sk, sv, lens, *, splits: int, side_ctas: int, **kw):
  """``q [B, 1, Hq, D]``, prefix ``[P, Hkv, D]``, suffixes ``[B, S, Hkv, D]``, lengths ``[B]``
  -> ``out [B, 1, Hq, D]`` (q's dtype) and ``lse [B, 1, Hq]``; ``kw`` as :func:`_parts`."""
  out, lse, suffix_out, lse_s = _parts(q, pk, pv, sk, sv, lens, splits=splits,
                                       side_ctas=side_ctas, **kw)
  # The shipped merge kernel (one pass over every part: the prefix's splits and the suffix's).
  merged, mlse = merge_parts([(out, lse), (suffix_out[None], lse_s[None])], out_dtype=q.dtype)
  b = q.shape[0]
  return unfold_rows(merged, b, 1), unfold_rows(mlse, b, 1)


def plan(b: int, hq: int, hkv: int, p: int):
  """``(splits, side_ctas)`` for :func:`partitioned_attention` (suffix role ``"rows"``) at one
  decode step's shape, or None where the suffix role's row tiles do not divide over its CTAs'
  two warpgroups or the shape is not the one measured (G = 4).

  ``DECODE_SIDE_CTAS`` suffix CTAs and prefix units of at least ``DECODE_UNIT_KEYS`` keys, about
  ``DECODE_UNITS`` of them: on an H100 (2026-11-25, Llama-3-8B layout, device µs with 64 and
  128 of 128 suffix keys; docs/results/2026-11-25-h100-oversubscribed) 64 suffix CTAs beat 32
  and 16, and B=256 P=4K took 3-4 splits, B=1024 P=4K one."""
  g = hq // hkv
  if g != 4 or (b * g) % 128:
    return None
  row_tiles = hkv * b * g // 64  # the suffix role's 64-row tiles
  prefix_tiles = hkv * b * g // 128
  side = min(DECODE_SIDE_CTAS, row_tiles // 2)
  if row_tiles % (2 * side):
    return None
  splits = max(1, min(p // DECODE_UNIT_KEYS, -(-DECODE_UNITS // prefix_tiles)))
  return splits, side


DECODE_SIDE_CTAS = 64
DECODE_UNIT_KEYS = 512
DECODE_UNITS = 256


def make_inputs(key, b, p, s, hq, hkv, d=128, dtype=jnp.bfloat16):
  ks = jax.random.split(key, 5)
  return (jax.random.normal(ks[0], (b, 1, hq, d), dtype),
          jax.random.normal(ks[1], (p, hkv, d), dtype),
          jax.random.normal(ks[2], (p, hkv, d), dtype),
          jax.random.normal(ks[3], (b, s, hkv, d), dtype),
          jax.random.normal(ks[4], (b, s, hkv, d), dtype))


def check(case: dict) -> dict:
  """One exactness case against the float64 oracle of full attention: ``case`` holds b, p,
  capacity s, hq, hkv, splits, side (CTAs), lengths ("full", "ragged" in [0, s], "short" in
  [0, 40], "zero") and optionally plen (valid prefix keys) and layout (the suffix role's)."""
  b, p, s, hq, hkv = (case[k] for k in ("b", "p", "s", "hq", "hkv"))
  plen = case.get("plen", p)
  q, pk, pv, sk, sv = make_inputs(jax.random.key(b + p + s + hkv + plen), b, p, s, hq, hkv)
  top = dict(full=s, ragged=s, short=min(s, 40), zero=0)[case["lengths"]]
  lens = (jnp.full((b,), top, jnp.int32) if case["lengths"] in ("full", "zero") else
          jax.random.randint(jax.random.key(3), (b,), 0, top + 1, jnp.int32))
  out, lse = jax.jit(functools.partial(
      partitioned_attention, splits=case["splits"], side_ctas=case["side"],
      layout=case.get("layout", "rows"),
      prefix_length=jnp.int32(plen)))(q, pk, pv, sk, sv, lens)
  ctx_k = [np.concatenate([np.asarray(pk[:plen]), np.asarray(sk[i, :int(lens[i])])])
           for i in range(b)]
  ctx_v = [np.concatenate([np.asarray(pv[:plen]), np.asarray(sv[i, :int(lens[i])])])
           for i in range(b)]
  ref_o, ref_l = oracle_attention(np.asarray(q, np.float64), ctx_k, ctx_v)
  out = np.asarray(out, np.float64)
  err = float(np.abs(out - ref_o).max() / np.abs(ref_o).max())
  rel, lerr = rel_err(out, ref_o), lse_err(lse, ref_l)
  return dict(err=err, rel_err=rel, lse_err=lerr,
              ok=bool(err < 2e-2 and rel < tolerance(q.dtype) and lerr < 2e-2))


CHECKS = [  # b, p, s (capacity), hq, hkv, splits, side CTAs, lengths[, plen][, layout]
    dict(b=64, p=1024, s=128, hq=32, hkv=8, splits=1, side=16, lengths="full"),
    dict(b=64, p=1024, s=128, hq=32, hkv=8, splits=4, side=8, lengths="ragged"),
    dict(b=256, p=1024, s=128, hq=32, hkv=8, splits=8, side=32, lengths="ragged"),  # 544 CTAs
    dict(b=64, p=1024, s=256, hq=8, hkv=1, splits=2, side=4, lengths="ragged"),
    dict(b=64, p=1024, s=136, hq=32, hkv=8, splits=2, side=16, lengths="short"),
    dict(b=64, p=1024, s=128, hq=32, hkv=8, splits=4, side=16, lengths="full", plen=1000),
    dict(b=64, p=1024, s=128, hq=32, hkv=8, splits=2, side=16, lengths="zero"),
    dict(b=256, p=1024, s=128, hq=32, hkv=8, splits=8, side=32, lengths="ragged", layout="cols"),
    dict(b=64, p=1024, s=136, hq=32, hkv=8, splits=2, side=16, lengths="short", layout="cols"),
]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--trials", type=int, default=5)
  ap.add_argument("--configs", default="", help="indices into CONFIGS (default: all)")
  ap.add_argument("--skip-check", action="store_true")
  ap.add_argument("--tag", default="")
  args = ap.parse_args()
  kind = jax.devices()[0].device_kind
  report = {"device": kind, "jax": jax.__version__, "checks": [], "timings": []}

  if not args.skip_check:
    for case in CHECKS:
      case = dict(case)
      try:
        case.update(check(case))
      except Exception as e:  # noqa: BLE001 -- reported
        case.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
      report["checks"].append(case)
      print("check", case, flush=True)

  picks = [int(i) for i in args.configs.split(",")] if args.configs else range(len(CONFIGS))
  for i in picks:
    name, b, p, s, hq, hkv, variants, fills = CONFIGS[i]
    tiles = hkv * b * hq // hkv // 128
    for fill in fills:
      row = dict(config=f"{name}:{b}:{p}:{s}", fill=fill, prefix_tiles=tiles)

      def make(seed, b=b, p=p, s=s, hq=hq, hkv=hkv, fill=fill):
        return (*make_inputs(jax.random.key(100 + seed), b, p, s, hq, hkv),
                jnp.full((b,), fill, jnp.int32))

      ops = {"shipped": lambda q, pk, pv, sk, sv, lens: shared_prefix_attention(
          q, pk, pv, sk, sv, suffix_lengths=lens, impl="auto")}
      for splits, side, layout in variants:
        ops[f"{splits}x{side}{layout[0]}"] = (
            lambda *xs, splits=splits, side=side, layout=layout: partitioned_attention(
                *xs, splits=splits, side_ctas=side, layout=layout)[0])
      set_bytes = timing.tree_bytes(jax.eval_shape(lambda: make(0)))
      res = timing.compare_ops(ops, make, n_sets=timing.sets_needed(set_bytes),
                               trials=args.trials)
      row.update({k: v for k, v in res.items() if not k.endswith("_kernels")})
      row["kernels"] = {k: v for k, v in res.items() if k.endswith("_kernels")}
      report["timings"].append(row)
      print("time", {k: v for k, v in row.items() if k != "kernels"}, flush=True)

  cell = lambda x: f"{x:.1f}" if isinstance(x, float) else str(x)[:60]
  lines = [f"device: {kind}; jax {jax.__version__}; device µs per call (splits x suffix CTAs: "
           "the partitioned launch's prefix key splits and suffix-role CTAs)", "",
           "| config | suffix keys | shipped | partitioned: splits x suffix CTAs | best vs shipped |",
           "|---|---:|---:|---|---:|"]
  for row in report["timings"]:
    vs = {k: v for k, v in row.items() if re.fullmatch(r"\d+x\d+[rc]", k)}
    best = min((v for v in vs.values() if isinstance(v, float)), default=float("nan"))
    sh = row.get("shipped")
    ratio = f"{sh / best:.2f}x" if isinstance(sh, float) else "-"
    lines.append(f"| {row['config']} | {row['fill']} | {cell(sh)} | "
                 + ", ".join(f"{k}: {cell(v)}" for k, v in vs.items()) + f" | {ratio} |")
  checks = report["checks"]
  lines += ["", f"exactness: {sum(c['ok'] for c in checks)} of {len(checks)} cases within 2e-2 "
            "of the float64 oracle"]
  table = "\n".join(lines)
  print("\n" + table)
  with open(os.path.join(args.out, f"partitioned{args.tag}.json"), "w") as f:
    json.dump(report, f, indent=1)
  with open(os.path.join(args.out, f"partitioned{args.tag}.md"), "w") as f:
    f.write(table + "\n")


if __name__ == "__main__":
  main()
