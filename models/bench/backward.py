"""Attention forward + backward at GRPO shapes: one prompt, G completions, teacher forcing.

Each configuration is a prompt of P tokens and G completions of C tokens
(Llama-3-8B attention: 32 query heads, 8 KV heads, D = 128, bf16 by default).
Three ways to compute the attention of every token and its gradient
(loss ``<out, dO>`` with random cotangents), each in one jitted program:

* ``per_seq``: each completion as a whole sequence (prompt copied, P + C
  tokens), causal, through ``jax.nn.dot_product_attention(implementation=
  "cudnn")`` (on a CPU the ``"xla"`` implementation stands in, and the
  column says so);
* ``ours``: the prompt's causal self-attention once (the same per-sequence
  kernel, batch 1), then ``shared_prefix_attention(impl="auto")`` of the G*C
  completion queries over the shared prompt K/V and their own causal K/V:
  backward from the merged residuals (on a GPU cuDNN's flash-attention backward per part,
  ``GpuConfig.backward = "cudnn"``); ``ours_completions_us`` is the shared-prefix call alone,
  ``ours_fwd_us`` ours' forward alone;
* ``ours_triton_bwd``: ours with the Triton backward kernels (``GpuConfig(backward="triton")``;
  GPU only);
* ``xla``: the same decomposition on ``impl="xla"``;
* ``ours_xla_bwd``: ours with the chunked XLA backward instead of the Pallas
  backward kernels (the forward kernels unchanged; GPU only).

Reported: time (profiler device time on a GPU, host clock on a CPU), the
compiled program's memory (arguments + outputs + temporaries, from
``memory_analysis``), the floor (bytes over the measured copy bandwidth, FLOPs
over the measured matmul rate, the larger, both measured in the run), and
the gradients' agreement with the per-sequence path.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_shared_attn import GpuConfig, shared_prefix_attention
from models.bench import common, timing
from jax_shared_attn.testing import rel_err

HEADS = (32, 8, 128)  # Llama-3-8B: Hq, Hkv, D
DEFAULT_CONFIGS = "16:2048:512,8:1024:256,64:1024:256,32:2048:1024,16:4096:512"
IMPLS = ("ours", "per_seq", "xla", "ours_xla_bwd", "ours_triton_bwd")
BWD_FACTOR = 3.5  # forward 2 products, backward 5 (S recomputed, dV, dP, dQ, dK)


def parse_configs(text: str) -> list[tuple[int, int, int]]:
  """``"G:P:C,..."`` (completions, prompt tokens, completion tokens)."""
  out = []
  for item in text.split(","):
    parts = item.split(":")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
      raise ValueError(f"--configs: each entry is G:P:C with positive ints; got {item!r}")
    out.append(tuple(int(p) for p in parts))
  return out


def _inputs(g, p, c, heads, dtype, seed):
  hq, hkv, d = heads
  ks = jax.random.split(jax.random.key(seed), 8)
  r = lambda k, s: jax.random.normal(k, s, dtype)
  return (r(ks[0], (1, p, hq, d)), r(ks[1], (1, p, hkv, d)), r(ks[2], (1, p, hkv, d)),
          r(ks[3], (g, c, hq, d)), r(ks[4], (g, c, hkv, d)), r(ks[5], (g, c, hkv, d)),
          r(ks[6], (1, p, hq, d)), r(ks[7], (g, c, hq, d)))


def _duplicated(g, p, c, heads, dtype, seed):
  """The per-sequence layout of the same tokens: the prompt copied into every sequence; the
  prompt rows' cotangent split over the copies so that the loss is the same."""
  qp, kp, vp, qc, kc, vc, dop, doc = _inputs(g, p, c, heads, dtype, seed)
  cat = lambda a, b: jnp.concatenate([jnp.broadcast_to(a, (g,) + a.shape[1:]), b], axis=1)
  return cat(qp, qc), cat(kp, kc), cat(vp, vc), cat((dop / g).astype(dtype), doc)


def _self_attention(impl):
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                      implementation=impl)


def per_seq_op(impl):
  attend = _self_attention(impl)

  def op(q, k, v, do):
    _, pull = jax.vjp(attend, q, k, v)
    return pull(do)

  return op


def _xla_backward(qc, kp, vp, kc, vc, causal, impl):
  """shared_prefix_attention's decomposition with the family's forward kernels and the chunked
  XLA backward (BackwardConfig(kernels="xla"))."""
  from jax_shared_attn import backward as bw
  from jax_shared_attn import ops as ops_lib
  ops = ops_lib.differentiable(ops_lib.resolve(impl, "bench"), bw.BackwardConfig(kernels="xla"))
  parts = [("prefix", kp, vp, jnp.asarray(kp.shape[0], jnp.int32), None)]
  lens = jnp.full((qc.shape[0],), kc.shape[1], jnp.int32)
  out, _ = ops.shared_attention(qc, parts, kc, vc, kv_lengths=lens, causal=causal,
                                scale=qc.shape[-1] ** -0.5)
  return out.astype(qc.dtype)


def ours_op(impl, prompt_impl, xla_backward=False, config=None, forward_only=False):
  """Gradients (dq, dk, dv of the prompt, then of the completions) of the decomposition (or,
  ``forward_only``, its outputs)."""
  attend = _self_attention(prompt_impl)
  shared = functools.partial(_xla_backward, impl=impl) if xla_backward else functools.partial(
      shared_prefix_attention, impl=impl, config=config)

  def fwd(qp, kp, vp, qc, kc, vc):
    return attend(qp, kp, vp), shared(qc, kp[0], vp[0], kc, vc, causal=True)

  def op(qp, kp, vp, qc, kc, vc, dop, doc):
    if forward_only:
      return fwd(qp, kp, vp, qc, kc, vc)
    return jax.vjp(fwd, qp, kp, vp, qc, kc, vc)[1]((dop, doc))

  return op


def completions_op(impl):
  """The shared-prefix call alone: gradients of the completions' attention."""

  def fwd(kp, vp, qc, kc, vc):
    return shared_prefix_attention(qc, kp[0], vp[0], kc, vc, causal=True, impl=impl)

  def op(qp, kp, vp, qc, kc, vc, dop, doc):
    return jax.vjp(fwd, kp, vp, qc, kc, vc)[1](doc)

  return op


def floors(g, p, c, heads, itemsize, bandwidth, rate) -> dict:
  """Floors of the decomposition and of the per-sequence layout (causal FLOPs, fwd + bwd)."""
  hq, hkv, d = heads
  per_pair = 4 * hq * d * BWD_FACTOR
  ours_flops = per_pair * (p * p / 2 + g * c * (p + c / 2))
  seq_flops = per_pair * g * (p + c) ** 2 / 2
  token_bytes = itemsize * d * (4 * hq + 4 * hkv)  # q, out, dO, dq and k, v, dk, dv
  ours_bytes = token_bytes * (p + g * c)
  seq_bytes = token_bytes * g * (p + c)
  ours = max(ours_bytes / bandwidth, ours_flops / rate)
  seq = max(seq_bytes / bandwidth, seq_flops / rate)
  # floor_ratio: the speedup over per_seq that the floors allow (both paths at their floor)
  return dict(floor_us=ours * 1e6, per_seq_floor_us=seq * 1e6, floor_ratio=seq / ours,
              ours_gflop=ours_flops / 1e9, per_seq_gflop=seq_flops / 1e9)


def compiled(op, args):
  """The compiled program and its arguments + outputs + temporaries (None where unavailable)."""
  exe = jax.jit(op).lower(*args).compile()
  try:
    m = exe.memory_analysis()
    return exe, int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes)
  except Exception:  # noqa: BLE001 -- a backend without the analysis
    return exe, None


def run_config(g, p, c, heads, dtype, impls, ceilings, trials, per_seq_impl) -> dict:
  row = dict(G=g, P=p, C=c, Hq=heads[0], Hkv=heads[1], D=heads[2])
  row.update(floors(g, p, c, heads, jnp.dtype(dtype).itemsize, *ceilings))
  make = lambda i: _inputs(g, p, c, heads, dtype, i)
  make_dup = lambda i: _duplicated(g, p, c, heads, dtype, i)
  n_sets = timing.sets_needed(timing.tree_bytes(jax.eval_shape(lambda: make(0))), max_sets=4)
  ops = {}
  if "ours" in impls:
    ops["ours"] = (ours_op("auto", per_seq_impl), make)
    ops["ours_completions"] = (completions_op("auto"), make)
    ops["ours_fwd"] = (ours_op("auto", per_seq_impl, forward_only=True), make)
  if "per_seq" in impls:
    ops["per_seq"] = (per_seq_op(per_seq_impl), make_dup)
  if "xla" in impls:
    ops["xla"] = (ours_op("xla", "xla"), make)
  if "ours_xla_bwd" in impls and jax.default_backend() != "cpu":
    ops["ours_xla_bwd"] = (ours_op("auto", per_seq_impl, xla_backward=True), make)
  if "ours_triton_bwd" in impls and jax.default_backend() == "gpu":
    ops["ours_triton_bwd"] = (ours_op("auto", per_seq_impl, config=GpuConfig(backward="triton")),
                              make)
  grads = {}
  for name, (op, mk) in ops.items():
    try:
      m = timing.measure(op, mk, n_sets=n_sets, trials=trials)
      row[f"{name}_us"] = m["seconds"] * 1e6
      row["timing"] = m["method"]
      exe, row[f"{name}_bytes"] = compiled(op, mk(0))
      if name not in ("ours_completions", "ours_fwd"):
        grads[name] = exe(*mk(0))
    except Exception as e:  # noqa: BLE001 -- a path that cannot run this shape is reported
      oom = "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()
      row[f"{name}_us"] = "x" if oom else "err"
      row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  if "ours" in grads:
    dqp, dkp, dvp, dqc, dkc, dvc = (np.asarray(x, np.float32) for x in grads["ours"])
    if "per_seq" in grads:  # the prompt's gradient is the sum over its copies
      sq, sk, sv = (np.asarray(x, np.float32) for x in grads["per_seq"])
      row["err_per_seq"] = max(rel_err(sq[:, p:], dqc), rel_err(sk[:, p:], dkc),
                               rel_err(sv[:, p:], dvc), rel_err(sq[:, :p].sum(0), dqp[0]),
                               rel_err(sk[:, :p].sum(0), dkp[0]), rel_err(sv[:, :p].sum(0), dvp[0]))
    if "ours_triton_bwd" in grads:
      row["err_triton_bwd"] = max(rel_err(np.asarray(x, np.float32), y) for x, y in
                                  zip(grads["ours_triton_bwd"], (dqp, dkp, dvp, dqc, dkc, dvc)))
    if "xla" in grads:
      row["err_xla"] = max(rel_err(np.asarray(x, np.float32), y) for x, y in
                           zip(grads["xla"], (dqp, dkp, dvp, dqc, dkc, dvc)))
    us = row.get("ours_us")
    if isinstance(us, float):
      row["roofline"] = row["floor_us"] / us
      for base in ("per_seq", "xla"):
        if isinstance(row.get(f"{base}_us"), float):
          row[f"speedup_vs_{base}"] = row[f"{base}_us"] / us
      if row.get("ours_bytes") and row.get("per_seq_bytes"):
        row["memory_ratio"] = row["ours_bytes"] / row["per_seq_bytes"]
  return row


def _fmt(x, digits=1):
  if isinstance(x, float):
    return f"{x:.{digits}f}" if abs(x) < 1e4 else f"{x:.0f}"
  if isinstance(x, int) and x > 2**20:
    return f"{x / 2**20:.0f} MiB"
  return "" if x is None else str(x)


COLUMNS = [("G", 0), ("P", 0), ("C", 0), ("floor_us", 1), ("ours_us", 1), ("roofline", 2),
           ("ours_fwd_us", 1), ("ours_completions_us", 1), ("ours_triton_bwd_us", 1),
           ("per_seq_us", 1), ("per_seq_floor_us", 1), ("xla_us", 1), ("ours_xla_bwd_us", 1),
           ("speedup_vs_per_seq", 2), ("floor_ratio", 2), ("ours_bytes", 0),
           ("per_seq_bytes", 0), ("memory_ratio", 3), ("err_per_seq", 4)]


def to_markdown(rows, info) -> str:
  method = {r.get("timing") for r in rows} - {None}
  clock = "device time (profiler)" if method == {"profiler"} else "host clock (median per call)"
  head = (f"Device: {info['device']} ({info['backend']}), jax {info['jax']}, {info['date']}; "
          f"copy {info['bandwidth_GBps']:.0f} GB/s, {info['dtype']} matmul "
          f"{info['matmul_TFLOPs']:.0f} TFLOP/s (measured in this run); per-sequence path: "
          f"jax.nn.dot_product_attention(implementation={info['per_seq_impl']!r}). Heads "
          f"{info['heads']}. Times: {clock}, forward + backward. Bytes: compiled arguments + "
          f"outputs + temporaries.\n\n")
  lines = ["| " + " | ".join(c for c, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  for r in rows:
    lines.append("| " + " | ".join(_fmt(r.get(c), dg) for c, dg in COLUMNS) + " |")
  return head + "\n".join(lines) + "\n"


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m models.bench backward",
                               description=__doc__.splitlines()[0])
  ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="G:P:C,... (completions, prompt "
                  "tokens, completion tokens)")
  ap.add_argument("--heads", default=",".join(map(str, HEADS)), help="Hq,Hkv,D")
  ap.add_argument("--impls", default=",".join(IMPLS))
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--trials", type=int, default=5)
  ap.add_argument("--out", default="runs/backward")
  ap.add_argument("--ceiling-bytes", type=int, default=2 * 2**30)
  ap.add_argument("--matmul-n", type=int, default=8192)
  args = ap.parse_args(argv)
  try:
    configs = parse_configs(args.configs)
  except ValueError as e:
    ap.error(str(e))
  heads = tuple(int(x) for x in args.heads.split(","))
  if len(heads) != 3 or heads[0] % heads[1]:
    ap.error(f"--heads: Hq,Hkv,D with Hq a multiple of Hkv; got {args.heads!r}")
  impls = set(args.impls.split(","))
  if impls - set(IMPLS):
    ap.error(f"--impls: unknown {sorted(impls - set(IMPLS))}; choose from {IMPLS}")
  dtype = jnp.dtype(args.dtype)
  per_seq_impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
  os.makedirs(args.out, exist_ok=True)
  info = common.stamp()
  bw = timing.copy_bandwidth(args.ceiling_bytes)
  rate = timing.matmul_rate(args.matmul_n, dtype)
  info.update(bandwidth_GBps=bw / 1e9, matmul_TFLOPs=rate / 1e12, dtype=dtype.name,
              per_seq_impl=per_seq_impl, heads=list(heads))
  rows = []
  for g, p, c in configs:  # files rewritten after every row: a cut-off run keeps its rows
    row = run_config(g, p, c, heads, dtype, impls, (bw, rate), args.trials, per_seq_impl)
    rows.append(row)
    print(json.dumps(row), file=sys.stderr)
    with open(os.path.join(args.out, "backward.json"), "w") as f:
      json.dump({"info": info, "rows": rows}, f, indent=1)
    md = to_markdown(rows, info)
    with open(os.path.join(args.out, "backward.md"), "w") as f:
      f.write(md)
  print(md)
  return rows


if __name__ == "__main__":
  main()
