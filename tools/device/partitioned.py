"""A role-partitioned launch, first cut: the prefix product and the suffix attention on separate
SMs of ONE Mosaic GPU kernel, then an XLA merge (device experiment for issue 3).

  PYTHONPATH=. python3 tools/device/partitioned.py --out $OUT

One launch of :func:`pallas_kernels.gpu.prefix_attention_mgpu.prefix_attention_rows_mgpu`
with ``side=``: its usual grid ``(Hkv, row tiles, splits)`` runs the prefix product, and
``Hkv x extra x splits`` more CTAs run the suffix role of ``tools/device/suffix_role.py``
(transposed products, two warpgroups; the producer warpgroup idles in them). No persistent
scheduling yet: every prefix CTA takes one row tile and one key split, so the configuration picks
the prefix splits and the suffix CTAs so that both fit the 132 SMs at once. The parts -- the
prefix's splits and the suffix part -- are merged by LSE in XLA.
``tools/partition_bound.py`` bounds what this design can reach
(docs/results/2026-11-24-h100-sm-partition).

Checks the result against the float64 oracle of full attention (Llama-3-8B and paper head
layouts, full and ragged suffixes), then times it against the shipped path
(``shared_prefix_attention(impl="auto")``) on the same inputs in one process.
Writes ``partitioned.json`` / ``.md``.
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
import numpy as np

from jax_shared_attn import merge_attention_states, shared_prefix_attention
from jax_shared_attn.bench import timing
from jax_shared_attn.testing import lse_err, oracle_attention, rel_err, tolerance
from pallas_kernels.gpu import prefix_attention_mgpu as mg
from pallas_kernels.gpu._common import fold_rows, unfold_rows

_spec = importlib.util.spec_from_file_location(
    "suffix_role", pathlib.Path(__file__).with_name("suffix_role.py"))
suffix_role = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suffix_role)

# (name, B, P, S, Hq, Hkv, prefix splits, extra row tiles for the suffix role, chunk: sequences
# per launch, 0 = the whole batch in one)
CONFIGS = [("llama", 256, 4096, 128, 32, 8, 1, 8, 0), ("llama", 256, 4096, 512, 32, 8, 1, 8, 0),
           ("llama", 128, 4096, 128, 32, 8, 2, 4, 0), ("llama", 64, 16384, 128, 32, 8, 4, 2, 0),
           ("llama", 256, 16384, 128, 32, 8, 1, 8, 0), ("paper", 256, 4096, 128, 8, 1, 4, 16, 0),
           ("llama", 512, 4096, 128, 32, 8, 1, 8, 256), ("llama", 1024, 4096, 128, 32, 8, 1, 8, 256),
           ("llama", 1024, 1024, 128, 32, 8, 1, 8, 256)]


def _parts(q, pk, pv, sk, sv, lens, *, splits: int, extra: int, wgs: int = 2, stages: int = 1,
           block_s: int = 128, scale: float | None = None, prefix_length=None):
  """One partitioned launch: the prefix's split parts ``out [splits, Hkv, R, D]``, ``lse``, and
  the suffix part ``[Hkv, R, D]`` with its LSE (rows folded per KV head). ``prefix_length``:
  valid prefix keys (default: the whole buffer)."""
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
  role = suffix_role.suffix_role(hkv=hkv, r=r, d=d, batch=b, capacity=capacity, dtype=q.dtype,
                                 rows_per_seq=g, scale=scale, n_ctas=hkv * extra * splits,
                                 wgs=wgs, stages=stages, block_s=block_s)

  def body(cta, w, q_ref, len_ref, k_ref, v_ref, o_ref, lse_ref):
    role.body(cta, w, len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref)

  out, lse, o_t, lse_s = mg.prefix_attention_rows_mgpu(
      q_rows, pk, pv, jnp.asarray(prefix_length, jnp.int32), scale=scale, config=cfg,
      side=(extra, body, (role.lengths(lens), sk, sv), role.out_types))
  suffix_out = jnp.swapaxes(o_t, 1, 2).reshape(hkv, r, d)
  return out, lse, suffix_out, lse_s


def partitioned_attention(q, pk, pv, sk, sv, lens, *, splits: int, extra: int, **kw):
  """``q [B, 1, Hq, D]``, prefix ``[P, Hkv, D]``, suffixes ``[B, S, Hkv, D]``, lengths ``[B]``
  -> ``out [B, 1, Hq, D]`` (q's dtype) and ``lse [B, 1, Hq]``; ``kw`` as :func:`_parts`."""
  parts = _parts(q, pk, pv, sk, sv, lens, splits=splits, extra=extra, **kw)
  return _merge(*parts, q.shape[0], q.dtype)


def _merge(out, lse, suffix_out, lse_s, b: int, dtype):
  """The prefix's split parts and the suffix part merged by LSE (XLA), unfolded to
  ``[B, 1, Hq, D]`` and ``[B, 1, Hq]``."""
  merged, mlse = merge_attention_states([*out, suffix_out], [*lse, lse_s])
  return unfold_rows(merged.astype(dtype), b, 1), unfold_rows(mlse, b, 1)


def partitioned_attention_chunked(q, pk, pv, sk, sv, lens, *, chunk: int, splits: int,
                                  extra: int, **kw):
  """:func:`partitioned_attention`'s kernel over the batch in chunks of ``chunk`` sequences (one
  launch each: every launch's prefix and suffix CTAs fit the SMs at once, which a whole batch
  of 512 or 1024 does not without persistent scheduling), the parts of all chunks merged in one
  XLA merge. Same arguments and results."""
  b = q.shape[0]
  if b % chunk:
    raise ValueError(f"batch ({b}) must be a multiple of chunk ({chunk})")
  outs, lses, souts, slses = [], [], [], []
  for c in range(b // chunk):
    sl = slice(c * chunk, (c + 1) * chunk)
    out, lse, so, sl_ = _parts(q[sl], pk, pv, sk[sl], sv[sl], lens[sl], splits=splits,
                               extra=extra, **kw)
    outs.append(out), lses.append(lse), souts.append(so), slses.append(sl_)
  cat = lambda xs, axis: jnp.concatenate(xs, axis=axis)
  return _merge(cat(outs, 2), cat(lses, 2), cat(souts, 1), cat(slses, 1), b, q.dtype)


def make_inputs(key, b, p, s, hq, hkv, d=128, dtype=jnp.bfloat16):
  ks = jax.random.split(key, 5)
  return (jax.random.normal(ks[0], (b, 1, hq, d), dtype),
          jax.random.normal(ks[1], (p, hkv, d), dtype),
          jax.random.normal(ks[2], (p, hkv, d), dtype),
          jax.random.normal(ks[3], (b, s, hkv, d), dtype),
          jax.random.normal(ks[4], (b, s, hkv, d), dtype))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--trials", type=int, default=5)
  ap.add_argument("--configs", default="", help="indices into CONFIGS (default: all)")
  ap.add_argument("--skip-check", action="store_true")
  args = ap.parse_args()
  kind = jax.devices()[0].device_kind
  report = {"device": kind, "jax": jax.__version__, "checks": [], "timings": []}

  if not args.skip_check:  # exactness against the float64 oracle of full attention
    for (b, p, s, hq, hkv, splits, extra, ragged, chunk) in [
        (64, 1024, 128, 32, 8, 1, 2, False, 0), (64, 1024, 128, 32, 8, 2, 1, True, 0),
        (64, 1024, 256, 8, 1, 2, 4, True, 0), (128, 1024, 128, 32, 8, 1, 2, True, 64),
        (64, 1024, 136, 32, 8, 1, 2, "short", 0)]:
      q, pk, pv, sk, sv = make_inputs(jax.random.key(b + p + s + hkv), b, p, s, hq, hkv)
      top = min(s, 40) if ragged == "short" else s  # "short": decoding's partly filled caches
      lens = (jax.random.randint(jax.random.key(3), (b,), 0, top + 1, jnp.int32) if ragged
              else jnp.full((b,), s, jnp.int32))
      case = dict(b=b, p=p, s=s, hq=hq, hkv=hkv, splits=splits, extra=extra, ragged=ragged,
                  chunk=chunk)
      try:
        fn = (functools.partial(partitioned_attention_chunked, chunk=chunk) if chunk
              else partitioned_attention)
        out, lse = jax.jit(functools.partial(fn, splits=splits, extra=extra))(
            q, pk, pv, sk, sv, lens)
        ctx_k = [np.concatenate([np.asarray(pk), np.asarray(sk[i, :int(lens[i])])]) for i in
                 range(b)]
        ctx_v = [np.concatenate([np.asarray(pv), np.asarray(sv[i, :int(lens[i])])]) for i in
                 range(b)]
        ref_o, ref_l = oracle_attention(np.asarray(q, np.float64), ctx_k, ctx_v)
        out = np.asarray(out, np.float64)
        err = float(np.abs(out - ref_o).max() / np.abs(ref_o).max())
        lerr = lse_err(lse, ref_l)
        case.update(err=err, rel_err=rel_err(out, ref_o), lse_err=lerr,
                    ok=bool(err < 2e-2 and rel_err(out, ref_o) < tolerance(q.dtype)
                            and lerr < 2e-2))
      except Exception as e:  # noqa: BLE001 -- reported
        case.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
      report["checks"].append(case)
      print("check", case, flush=True)

  picks = [int(i) for i in args.configs.split(",")] if args.configs else range(len(CONFIGS))
  for i in picks:
    name, b, p, s, hq, hkv, splits, extra, chunk = CONFIGS[i]
    per_launch = chunk or b
    row = dict(config=f"{name}:{b}:{p}:{s}", splits=splits, extra=extra, chunk=chunk,
               prefix_ctas=hkv * (per_launch * hq // hkv // 128) * splits,
               suffix_ctas=hkv * extra * splits)

    def make(seed, b=b, p=p, s=s, hq=hq, hkv=hkv):
      return (*make_inputs(jax.random.key(100 + seed), b, p, s, hq, hkv),
              jnp.full((b,), s, jnp.int32))

    ops = {
        "shipped": lambda q, pk, pv, sk, sv, lens: shared_prefix_attention(
            q, pk, pv, sk, sv, suffix_lengths=lens, impl="auto"),
        "partitioned": (
            (lambda *xs, splits=splits, extra=extra: partitioned_attention(
                *xs, splits=splits, extra=extra)[0]) if not chunk else
            (lambda *xs, splits=splits, extra=extra, chunk=chunk: partitioned_attention_chunked(
                *xs, chunk=chunk, splits=splits, extra=extra)[0])),
    }
    set_bytes = timing.tree_bytes(jax.eval_shape(lambda: make(0)))
    try:
      res = timing.compare_ops(ops, make, n_sets=timing.sets_needed(set_bytes),
                               trials=args.trials)
      row.update({k: v for k, v in res.items() if not k.endswith("_kernels")})
      row["kernels"] = {k: v for k, v in res.items() if k.endswith("_kernels")}
    except Exception as e:  # noqa: BLE001 -- reported
      row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    report["timings"].append(row)
    print("time", {k: v for k, v in row.items() if k != "kernels"}, flush=True)

  lines = [f"device: {kind}; jax {jax.__version__}; device µs", "",
           "| config | prefix CTAs + suffix CTAs | shipped | partitioned | partitioned vs shipped (rel.) |",
           "|---|---|---:|---:|---:|"]
  for row in report["timings"]:
    sh, pa = row.get("shipped"), row.get("partitioned")
    cell = lambda x: f"{x:.1f}" if isinstance(x, float) else str(row.get("error", x))[:80]
    launches = f" x {int(row['config'].split(':')[1]) // row['chunk']} launches" if row["chunk"] else ""
    lines.append(f"| {row['config']} | {row['prefix_ctas']} + {row['suffix_ctas']}{launches} | {cell(sh)} | "
                 f"{cell(pa)} | {row.get('err_partitioned', float('nan')):.1e} |")
  checks = report["checks"]
  lines += ["", f"exactness: {sum(c['ok'] for c in checks)} of {len(checks)} cases within 2e-2 "
            "of the float64 oracle"]
  table = "\n".join(lines)
  print("\n" + table)
  with open(os.path.join(args.out, "partitioned.json"), "w") as f:
    json.dump(report, f, indent=1)
  with open(os.path.join(args.out, "partitioned.md"), "w") as f:
    f.write(table + "\n")


if __name__ == "__main__":
  main()
