"""Attention microbenchmark (Hydragen Sec. 4.2 / Figure 5): shared-prefix vs per-sequence.

One run measures the copy bandwidth and the matmul rate, then for each
configuration (one decode step, all suffixes full) times

* ``ours``: ``shared_prefix_attention(impl="auto")`` (the Pallas kernels on a GPU),
* ``split``: ours with the prefix and suffix kernels run one after the other (decoding with
  one prefix otherwise runs both in one kernel: on Hopper the Mosaic GPU one, and for few
  sequences the flat Triton one),
* ``triton``: the same with ``impl="pallas:triton"`` (no Hopper-specific kernel),
* ``xla``: the pure-JAX path of the same function,
* ``cudnn``: per-sequence ``jax.nn.dot_product_attention(implementation="cudnn")``
  over each sequence's duplicated K/V (the usual serving layout),
* ``pallas_decode``: JAX's Pallas ``decode_attention.gqa`` over the duplicated K/V,
* ``jax_pallas_hydragen``: Hydragen composed from JAX's own Pallas ops
  (``attention.mha`` over the folded prefix rows + ``decode_attention.gqa``
  over the suffixes + an XLA merge),

and reports the floor (:mod:`jax_shared_attn.iomodel`), the roofline fraction
``floor / ours`` and the speedups, as JSON, Markdown and a PNG plot.
Per-sequence runs that do not fit in memory are reported as "x".
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_shared_attn import shared_prefix_attention
from models.bench import common, timing
from jax_shared_attn.iomodel import AttentionShape
from jax_shared_attn.testing import rel_err

SHAPES = {  # name: (Hq, Hkv, D)
    "paper": (8, 1, 128),  # Hydragen's microbenchmark: CodeLlama-34b over 8 GPUs
    "llama-3-8b": (32, 8, 128),
}
IMPLS = ("ours", "split", "triton", "xla", "cudnn", "pallas_decode", "jax_pallas_hydragen")


def _inputs(shape: AttentionShape, dtype, seed: int):
  ks = jax.random.split(jax.random.key(seed), 5)
  b, p, s, hq, hkv, d = (shape.batch, shape.prefix, shape.suffix, shape.q_heads, shape.kv_heads,
                         shape.head_dim)
  q = jax.random.normal(ks[0], (b, 1, hq, d), dtype)
  pk = jax.random.normal(ks[1], (p, hkv, d), dtype)
  pv = jax.random.normal(ks[2], (p, hkv, d), dtype)
  sk = jax.random.normal(ks[3], (b, s, hkv, d), dtype)
  sv = jax.random.normal(ks[4], (b, s, hkv, d), dtype)
  return q, pk, pv, sk, sv


def _duplicated(shape: AttentionShape, dtype, seed: int, capacity: int):
  """Per-sequence layout: every sequence stores prefix + suffix (padded to ``capacity``)."""
  q, pk, pv, sk, sv = _inputs(shape, dtype, seed)
  b = shape.batch
  pad = capacity - shape.prefix - shape.suffix

  def full(p, s):
    x = jnp.concatenate([jnp.broadcast_to(p, (b,) + p.shape), s], axis=1)
    return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))

  return q, full(pk, sk), full(pv, sv)


VARIANTS = ("none", "softcap", "window", "alibi")


def parse_variant(spec: str) -> dict:
  """``--variant``: "none", "softcap:CAP", "window:KEYS" (each query sees the last KEYS keys)
  or "alibi" (slopes ``2 ** (-8 h / Hq)``): the score variant every op of the run applies, as
  ``shared_prefix_attention`` keywords (ALiBi's as ``{"alibi": True}``, the slopes made per
  shape)."""
  name, _, value = spec.partition(":")
  if name not in VARIANTS or (name in ("softcap", "window")) != bool(value):
    raise ValueError(f"--variant: {spec!r} is not none, softcap:CAP, window:KEYS or alibi")
  if name == "softcap":
    return {"softcap": float(value)}
  if name == "window":
    return {"local_window_size": int(value)}
  return {"alibi": True} if name == "alibi" else {}


def ours(impl: str = "auto", config=None, variant=None):
  """``shared_prefix_attention`` with ``impl``, ``config`` and ``variant`` (a
  :func:`parse_variant` dict) as an op of this benchmark: A/B two configs in one process with
  ``compare_variants({"a": ours(config=a), "b": ours(config=b)}, ...)`` (each config is its
  own trace)."""
  kw = dict(variant or {})

  def op(q, pk, pv, sk, sv):
    extra = dict(kw)
    if extra.pop("alibi", False):
      b, _, hq, _ = q.shape
      slopes = 2.0 ** (-8.0 * jnp.arange(1, hq + 1, dtype=jnp.float32) / hq)
      extra["alibi_slopes"] = jnp.broadcast_to(slopes, (b, hq))
    return shared_prefix_attention(q, pk, pv, sk, sv, impl=impl, config=config, **extra)
  return op


def _split_config():
  """Ours with the prefix and suffix kernels apart (neither the one-kernel decode path nor the
  small-batch flat kernel): the comparison that shows what running them in one kernel buys."""
  from jax_shared_attn import GpuConfig
  return GpuConfig(fused_decode=False, flat_max_shared_reads=0)


def _cudnn(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")


def _pallas_decode(kv_len, q, k, v):
  from jax.experimental.pallas.ops.gpu import decode_attention
  lens = jnp.full((q.shape[0],), kv_len, jnp.int32)
  return decode_attention.gqa(q[:, 0], k, v, kv_seq_len=lens)


def _jax_pallas_hydragen(q, pk, pv, sk, sv):
  """Hydragen from JAX's own Pallas ops: mha (prefix rows) + gqa (suffix) + XLA merge."""
  from jax.experimental.pallas.ops.gpu import attention, decode_attention
  from jax_shared_attn.merge import merge_states
  b, _, hq, d = q.shape
  p, hkv, _ = pk.shape
  g = hq // hkv
  rows = q.reshape(b, hkv, g, d).transpose(0, 2, 1, 3).reshape(1, b * g, hkv, d)
  out_p, lse2 = attention.mha(rows, pk[None], pv[None], None, sm_scale=d**-0.5,
                              return_residuals=True)  # lse2: base-2, [1, Hkv, B*G]
  out_p = out_p.reshape(b, g, hkv, d).transpose(0, 2, 1, 3).reshape(b, 1, hq, d)
  lse_p = (lse2[0] * math.log(2.0)).reshape(hkv, b, g).transpose(1, 0, 2).reshape(b, 1, hq)
  lens = jnp.full((b,), sk.shape[1], jnp.int32)
  splits = max(1, sk.shape[1] // 256)  # gqa needs >= 16 keys per split and whole blocks
  out_s, (l, m) = decode_attention.gqa(q[:, 0], sk, sv, kv_seq_len=lens, k_splits=splits,
                                       return_residuals=True)
  lse_s = (m + jnp.log(l))[:, None]
  out, _ = merge_states([out_p, out_s[:, None]], [lse_p, lse_s])
  return out.astype(q.dtype)


def parse_spec(spec: str) -> tuple[str, AttentionShape]:
  """``shape:B:P:S`` (shape ``paper`` / ``llama`` / a :data:`SHAPES` name) -> (shape, the
  configuration)."""
  name, b, p, s = spec.split(":")
  hq, hkv, d = SHAPES[{"llama": "llama-3-8b"}.get(name, name)]
  return name, AttentionShape(int(b), int(p), int(s), hq, hkv, d)


def _ragged_inputs(shape: AttentionShape, dtype, seed: int):
  """:func:`_inputs` plus random suffix lengths in [1, S] (int32 ``[B]``)."""
  lens = jax.random.randint(jax.random.key(seed + 7919), (shape.batch,), 1, shape.suffix + 1,
                            jnp.int32)
  return (*_inputs(shape, dtype, seed), lens)


def compare_variants(ops: dict, specs: str, *, trials: int, out_json: str | None = None,
                     ceilings: tuple[float, float] | None = None,
                     ragged: bool = False) -> list[dict]:
  """Development comparisons: each ``shape:B:P:S`` of ``specs`` (comma-separated; shape
  ``paper`` / ``llama`` / a :data:`SHAPES` name) timed for every op of ``ops`` on the same bf16
  inputs with :func:`timing.compare_ops` (outputs checked against the first op's). Writes the
  rows to ``out_json`` after each configuration, prints them, and ends with a Markdown table;
  ``ceilings`` (copy bytes/s, matmul FLOP/s) adds a floor column; ``ragged`` passes every op
  a sixth argument, random suffix lengths (:func:`_ragged_inputs`)."""
  rows = []
  for spec in specs.split(","):
    name, shape = parse_spec(spec)
    make = functools.partial(_ragged_inputs if ragged else _inputs, shape, jnp.bfloat16)
    n = timing.sets_needed(timing.tree_bytes(jax.eval_shape(lambda: make(0))))
    row = dict(shape=name, B=shape.batch, P=shape.prefix, S=shape.suffix)
    if ceilings:
      row["floor_us"] = shape.floor_s(*ceilings) * 1e6
    row.update(timing.compare_ops(ops, make, n_sets=n, trials=trials))
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if not k.endswith("_kernels")}), flush=True)
    if out_json:
      with open(out_json, "w") as f:
        json.dump(dict(info=common.stamp(), rows=rows), f, indent=1)
  cols = list(ops) + (["floor_us"] if ceilings else [])
  print("\n| shape | B | P | S | " + " | ".join(cols) + " |")
  print("|---|" + "---:|" * (3 + len(cols)))
  for r in rows:
    print(f"| {r['shape']} | {r['B']} | {r['P']} | {r['S']} | " + " | ".join(
        f"{r[c]:.1f}" if isinstance(r.get(c), float) else "err" for c in cols) + " |")
  return rows


def _device_memory() -> int:
  stats = jax.devices()[0].memory_stats() or {}
  return int(stats.get("bytes_limit", 16 * 2**30))


def run_config(shape: AttentionShape, impls, dtype, ceilings, trials: int,
               variant: dict | None = None) -> dict:
  """One configuration's row. With a ``variant`` only ours, split, triton and xla run (the
  per-sequence baselines do not apply it)."""
  if variant:
    impls = set(impls) & {"ours", "split", "triton", "xla"}
  row = dict(B=shape.batch, P=shape.prefix, S=shape.suffix, Hq=shape.q_heads, Hkv=shape.kv_heads,
             D=shape.head_dim)
  bw, rate = ceilings
  row["floor_us"] = shape.floor_s(bw, rate) * 1e6
  row["per_seq_floor_us"] = shape.per_sequence_floor_s(bw, rate) * 1e6
  on_gpu = jax.default_backend() == "gpu"
  mem = _device_memory()
  shared_set = timing.tree_bytes(jax.eval_shape(lambda: _inputs(shape, dtype, 0)))
  outputs = {}

  def timed(name, op, make, set_bytes):
    if set_bytes > 0.45 * mem:
      row[f"{name}_us"] = "x"  # does not fit, as the paper's "x"
      return
    n = min(timing.sets_needed(set_bytes), max(1, int(0.45 * mem // max(1, set_bytes))))
    try:
      m = timing.measure(op, make, n_sets=n, trials=trials)
      row[f"{name}_us"] = m["seconds"] * 1e6
      row[f"{name}_wall_us"] = m["wall_s"] * 1e6
      row["timing"] = m["method"]
      if "breakdown" in m:
        row[f"{name}_kernels"] = m["breakdown"]["kernels"]
      if "profile_error" in m:
        row[f"{name}_profile_error"] = m["profile_error"]
      outputs[name] = jax.jit(op)(*make(0))
    except Exception as e:  # a baseline that cannot run this shape is reported, not fatal
      if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
        row[f"{name}_us"] = "x"
      else:
        row[f"{name}_us"] = "err"
        row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"

  make_shared = functools.partial(_inputs, shape, dtype)
  if "ours" in impls:
    timed("ours", ours("auto", variant=variant), make_shared, shared_set)
  if on_gpu and "split" in impls:
    timed("split", ours("auto", _split_config(), variant), make_shared, shared_set)
  if on_gpu and "triton" in impls:
    timed("triton", ours("pallas:triton", variant=variant), make_shared, shared_set)
  if "xla" in impls:
    timed("xla", ours("xla", variant=variant), make_shared, shared_set)
  if on_gpu and "jax_pallas_hydragen" in impls:
    timed("jax_pallas_hydragen", _jax_pallas_hydragen, make_shared, shared_set)
  ctx = shape.prefix + shape.suffix
  dup_set = 2 * shape.batch * ctx * shape.kv_heads * shape.head_dim * jnp.dtype(dtype).itemsize
  if on_gpu and "cudnn" in impls:
    make = functools.partial(_duplicated, shape, dtype, capacity=ctx)
    timed("cudnn", _cudnn, make, dup_set)
  if on_gpu and "pallas_decode" in impls:
    cap = -(-ctx // 2048) * 2048  # gqa's default 16 splits x 128-key blocks
    make = functools.partial(_duplicated, shape, dtype, capacity=cap)
    timed("pallas_decode", functools.partial(_pallas_decode, ctx), make, dup_set * cap / ctx)

  if isinstance(row.get("ours_us"), float):
    row["roofline"] = row["floor_us"] / row["ours_us"]
    for base in ("cudnn", "pallas_decode", "jax_pallas_hydragen", "xla"):
      if isinstance(row.get(f"{base}_us"), float):
        row[f"speedup_vs_{base}"] = row[f"{base}_us"] / row["ours_us"]
    per_seq = [row[f"{b}_us"] for b in ("cudnn", "pallas_decode")
               if isinstance(row.get(f"{b}_us"), float)]
    if per_seq:
      row["speedup_vs_best_per_seq"] = min(per_seq) / row["ours_us"]
  if "ours" in outputs:  # fast must also be right: compare every output with ours
    ref = np.asarray(outputs["ours"], np.float32).reshape(shape.batch, -1)
    for name, out in outputs.items():
      if name != "ours":
        row[f"err_{name}"] = rel_err(np.asarray(out, np.float32).reshape(shape.batch, -1), ref)
  return row


def _fmt(x, digits=1):
  if isinstance(x, float):
    return f"{x:.{digits}f}" if x < 1e4 else f"{x:.0f}"
  return str(x) if x is not None else ""


def to_markdown(rows, info) -> str:
  cols = [("B", 0), ("P", 0), ("S", 0), ("Hq", 0), ("Hkv", 0), ("D", 0), ("floor_us", 1),
          ("ours_us", 1), ("roofline", 2), ("split_us", 1), ("triton_us", 1), ("cudnn_us", 1), ("pallas_decode_us", 1),
          ("jax_pallas_hydragen_us", 1), ("xla_us", 1), ("speedup_vs_cudnn", 1),
          ("speedup_vs_best_per_seq", 1), ("ours_wall_us", 1)]
  method = {r.get("timing") for r in rows} - {None}
  clock = ("device time from the profiler (kernel busy time per call); ours_wall_us is the host "
           "clock's" if method == {"profiler"} else "host clock (median per call)")
  variant = info.get("variant", "none")
  head = (f"Device: {info['device']} ({info['backend']}), jax {info['jax']}, {info['date']}"
          + ("" if variant == "none" else f", score variant {variant}") + "; "
          f"copy bandwidth {info['bandwidth_GBps']:.0f} GB/s, bf16 matmul "
          f"{info['matmul_TFLOPs']:.0f} TFLOP/s (measured in this run). Times: {clock}.\n\n")
  lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    lines.append("| " + " | ".join(_fmt(r.get(c), dg) for c, dg in cols) + " |")
  return head + "\n".join(lines) + "\n"


def plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  shapes = sorted({(r["Hq"], r["Hkv"], r["D"]) for r in rows})
  fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 8), squeeze=False)
  for j, sh in enumerate(shapes):
    sub = [r for r in rows if (r["Hq"], r["Hkv"], r["D"]) == sh]
    for p, s in sorted({(r["P"], r["S"]) for r in sub}):
      pts = sorted((r["B"], r) for r in sub if r["P"] == p and r["S"] == s)
      bs = [b for b, _ in pts]
      for ax, key in ((axes[0, j], "speedup_vs_cudnn"), (axes[1, j], "roofline")):
        ys = [r.get(key) if isinstance(r.get(key), float) else np.nan for _, r in pts]
        ax.plot(bs, ys, marker="o", label=f"P={p}, S={s}")
    axes[0, j].set_title(f"Hq={sh[0]}, Hkv={sh[1]}, D={sh[2]}: speedup over per-sequence cuDNN")
    axes[1, j].set_title("roofline fraction (floor / ours)")
    for ax in axes[:, j]:
      ax.set_xscale("log", base=2)
      ax.set_xlabel("batch size")
      ax.grid(alpha=0.3)
    if any(isinstance(r.get("speedup_vs_cudnn"), float) for r in sub):
      axes[0, j].set_yscale("log")
    axes[1, j].set_ylim(0, 1.05)
    axes[0, j].legend(fontsize=7)
  common.save_png(fig, path)


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m models.bench attention",
                               description=__doc__.splitlines()[0])
  ap.add_argument("--batch", default="16,64,256,1024")
  ap.add_argument("--prefix", default="1024,4096,16384")
  ap.add_argument("--suffix", default="128,512")
  ap.add_argument("--shapes", default="paper,llama-3-8b", help=f"from {sorted(SHAPES)}")
  ap.add_argument("--impls", default=",".join(IMPLS))
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--variant", default="none",
                  help="none, softcap:CAP, window:KEYS or alibi: the score variant of every op "
                       "(then only ours, split, triton and xla run)")
  ap.add_argument("--trials", type=int, default=7)
  ap.add_argument("--out", default="runs/attention")
  ap.add_argument("--ceiling-bytes", type=int, default=2 * 2**30,
                  help="buffer size for the copy-bandwidth ceiling")
  ap.add_argument("--matmul-n", type=int, default=8192)
  args = ap.parse_args(argv)
  ints = lambda s: [int(x) for x in s.split(",") if x]
  dtype = jnp.dtype(args.dtype)
  impls = set(args.impls.split(","))
  unknown = impls - set(IMPLS)
  if unknown:
    ap.error(f"--impls: unknown {sorted(unknown)}; choose from {IMPLS}")
  for name in args.shapes.split(","):
    if name not in SHAPES:
      ap.error(f"--shapes: unknown {name!r}; choose from {sorted(SHAPES)}")
  try:
    variant = parse_variant(args.variant)
  except ValueError as e:
    ap.error(str(e))
  os.makedirs(args.out, exist_ok=True)
  from tqdm import tqdm

  info = common.stamp(variant=args.variant)
  bw = timing.copy_bandwidth(args.ceiling_bytes)
  rate = timing.matmul_rate(args.matmul_n, dtype)
  info.update(bandwidth_GBps=bw / 1e9, matmul_TFLOPs=rate / 1e12)
  print(f"{info['device']}: copy {bw / 1e9:.0f} GB/s, matmul {rate / 1e12:.0f} TFLOP/s",
        file=sys.stderr)
  configs = [AttentionShape(b, p, s, *SHAPES[name], itemsize=dtype.itemsize)
             for name in args.shapes.split(",")
             for p, s, b in itertools.product(ints(args.prefix), ints(args.suffix), ints(args.batch))]
  rows = []
  for shape in tqdm(configs, desc="attention configs", file=sys.stderr):
    rows.append(run_config(shape, impls, dtype, (bw, rate), args.trials, variant))
    with open(os.path.join(args.out, "attention.json"), "w") as f:
      json.dump({"info": info, "rows": rows}, f, indent=1)
  md = to_markdown(rows, info)
  with open(os.path.join(args.out, "attention.md"), "w") as f:
    f.write(md)
  plot(rows, os.path.join(args.out, "attention.png"))
  print(md)
  return rows


if __name__ == "__main__":
  main()
