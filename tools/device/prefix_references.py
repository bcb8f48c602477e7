"""The prefix product alone: our Mosaic GPU prefix kernel against the fused attention kernels that
ship with the stack (cuDNN's, through ``jax.nn.dot_product_attention``, and JAX's own Mosaic GPU
``attention_mgpu``), on the same H100 (device experiment).

  PYTHONPATH=. python3 tools/device/prefix_references.py --out $OUT [--specs paper:1024:16384]
      [--suffixes 128,512] [--splits 4,8,16] [--render prefix_references.json]

Question: how fast can the prefix part of issue 3's headline (B x G = 8192 query rows against
16,384 shared keys, one KV head, D 128, non-causal) run on this GPU with a state-of-the-art fused
attention kernel? Its FLOPs are 4 x rows x P x D; the floor of the benchmark divides them by the
rate of a large square bf16 matmul, which a kernel with a softmax between its two products and a
128-deep first product may not reach. Ops (profiler device time, rotated inputs):

- ``ours``: ``prefix_attention_rows_mgpu`` with the shipped ``default_config`` (its key splits;
  the splits are not merged here, as in the one kernel's split outputs);
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` with the 8192 rows as
  1024 tokens x 8 query heads against one KV head (GQA, as the model has them);
- ``cudnn_1h``: the same rows as 8192 tokens of one head;
- ``cudnn_ks`` / ``jax_mgpu_ks``: the keys cut in k parts run as a batch of k, k being our
  kernel's key splits at the shape (2 at B = 1024: named ``_2s`` in the results of 2026-11-24),
  so that these kernels, which have no key splits, get as many CTAs as ours (128 for the 132
  SMs); q comes repeated k times in the input set (since 2026-11-25: the time is the kernel's,
  where the results of 2026-11-24 gave the kernel's beside a total with the repeat); the parts'
  outputs are not merged: timing only, like ``ours``'s splits;
- ``jax_mgpu``: ``jax.experimental.pallas.ops.gpu.attention_mgpu.attention`` (block_q 64,
  block_kv 128, two stages: the configuration our kernel started from).

Prints device µs, TFLOP/s and the fraction of the run's measured matmul rate; writes
``prefix_references.json`` and ``.md``. Outputs of the unsplit ops are checked against ours
merged over its splits.

The reach table (issue 3's roofline goal, since 2026-11-25): for each spec and each suffix
length of ``--suffixes``, the floor of the whole attention call (``AttentionShape.floor_s`` with
the copy bandwidth and matmul rate measured in the same run, as the benchmark computes it), the
time the goal allows (floor / 0.8), and the fastest attention kernel alone on the prefix
product (each op's longest kernel in the profile, so that a reference's input preparation does
not count against it). Where that prefix kernel alone exceeds the allowance, no design built on
these kernels can meet the goal at that row, whatever its suffixes and merge cost.
``--render JSON`` recomputes the reach of a saved run without measuring.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp

from jax_shared_attn import merge_attention_states
from jax_shared_attn.bench import timing
from jax_shared_attn.bench.attention import parse_spec
from jax_shared_attn.iomodel import AttentionShape
from jax_shared_attn.testing import rel_err
from pallas_kernels.gpu import prefix_attention_mgpu as mg

DEFAULT_SPECS = "paper:1024:16384,paper:1024:4096"
OPS = ("ours", "cudnn", "cudnn_1h", "cudnn_ks", "jax_mgpu", "jax_mgpu_ks")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--specs", default=DEFAULT_SPECS)
  ap.add_argument("--trials", type=int, default=5)
  ap.add_argument("--ops", default="", help="comma-separated subset of the ops (default: all)")
  ap.add_argument("--suffixes", default="128,512",
                  help="suffix lengths S for the reach table (the floor of the whole call)")
  ap.add_argument("--goal", type=float, default=0.8, help="roofline fraction the goal asks for")
  ap.add_argument("--splits", default="",
                  help="comma-separated key split counts to run every spec at (ours' splits, the "
                  "references' key parts); default: ours' default_config")
  ap.add_argument("--render", metavar="JSON",
                  help="measure nothing: recompute the reach of a saved run's prefix_references.json "
                  "(with --suffixes and --goal) and write both files to --out")
  args = ap.parse_args()
  suffixes = [int(x) for x in args.suffixes.split(",") if x]
  if args.render:
    with open(args.render) as f:
      report = json.load(f)
    report.update(goal=args.goal, suffixes=suffixes)
    write(report, args.out)
    return
  from jax.experimental.pallas.ops.gpu import attention_mgpu as jam
  # The ceiling (a CPU run only checks the script: its matmul rate is not worth the minutes).
  on_gpu = jax.default_backend() == "gpu"
  rate = timing.matmul_rate() if on_gpu else timing.matmul_rate(n=512)
  bw = timing.copy_bandwidth() if on_gpu else timing.copy_bandwidth(n_bytes=2**22)
  kind = jax.devices()[0].device_kind
  print(f"device {kind}, jax {jax.__version__}, bf16 matmul {rate / 1e12:.0f} TFLOP/s, "
        f"copy {bw / 1e9:.0f} GB/s", flush=True)
  rows = []
  for spec, want in [(spec, k) for spec in args.specs.split(",")
                     for k in ([int(x) for x in args.splits.split(",")] if args.splits else [0])]:
    _, shape = parse_spec(spec + ":0")
    b, p, hq, hkv, d = shape.batch, shape.prefix, shape.q_heads, shape.kv_heads, shape.head_dim
    if hkv != 1:
      raise ValueError(f"--specs {spec}: the references fold the rows of one KV head; this "
                       f"shape has {hkv}")
    r, g = b * hq, hq
    flops = 4 * r * p * d
    scale = d ** -0.5
    cfg = mg.default_config(r, hkv, p, d)
    if want:
      cfg = dataclasses.replace(cfg, splits=want)
    tune = jam.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2)

    parts = cfg.splits
    part = p // parts
    if p % parts:
      raise ValueError(f"--specs {spec}: P ({p}) is not a multiple of our splits ({parts})")

    def make(i, dtype=jnp.bfloat16, tiled=False):
      """Input set i in bf16 (in f16: the same values, cast; bf16 values fit f16 here); with
      ``tiled``, q repeated once per key part ([parts, R, D]) for the ``_ks`` ops."""
      ks = jax.random.split(jax.random.key(i), 3)
      q, k, v = (jax.random.normal(key, (n, d), jnp.bfloat16).astype(dtype)
                 for key, n in zip(ks, (r, p, p)))
      return (jnp.tile(q[None], (parts, 1, 1)) if tiled else q), k, v
    ops = {
        "ours": lambda q, k, v: mg.prefix_attention_rows_mgpu(
            q[None], k[:, None], v[:, None], jnp.int32(p), scale=scale, config=cfg),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            q.reshape(1, b, g, d), k[None, :, None], v[None, :, None], scale=scale,
            implementation="cudnn"),
        "cudnn_1h": lambda q, k, v: jax.nn.dot_product_attention(
            q[None, :, None], k[None, :, None], v[None, :, None], scale=scale,
            implementation="cudnn"),
        "cudnn_ks": lambda qt, k, v: jax.nn.dot_product_attention(
            qt.reshape(parts, b, g, d), k.reshape(parts, part, 1, d),
            v.reshape(parts, part, 1, d), scale=scale, implementation="cudnn"),
        # attention_mgpu takes float16 only (its scratch buffers are f16; its inputs are the same
        # values cast to f16) and applies no score scale: q is pre-scaled (one small fusion).
        "jax_mgpu": lambda q, k, v: jam.attention(
            (q * scale).astype(q.dtype)[None, :, None], k[None, :, None], v[None, :, None], tune),
        "jax_mgpu_ks": lambda qt, k, v: jam.attention(
            (qt * scale).astype(qt.dtype)[:, :, None], k.reshape(parts, part, 1, d),
            v.reshape(parts, part, 1, d), tune),
    }
    assert tuple(ops) == OPS
    row = {"spec": spec, "rows": r, "p": p, "d": d, "flops": flops, "ours_config": str(cfg),
           "parts": parts}
    n_sets = timing.sets_needed(2 * p * d * 2 + r * d * 2)
    ref = None
    for name, op in ops.items():
      if args.ops and name not in args.ops.split(","):
        continue
      mk = functools.partial(make, dtype=jnp.float16 if name.startswith("jax_mgpu")
                             else jnp.bfloat16, tiled=name.endswith("_ks"))
      try:
        res = timing.measure(op, mk, n_sets=n_sets, trials=args.trials)
        us = res["seconds"] * 1e6
        row[name] = us
        row[f"{name}_tflops"] = flops / us / 1e6
        if "breakdown" in res:
          row[f"{name}_kernels"] = res["breakdown"]["kernels"]
        out = jax.jit(op)(*mk(0))
        if name == "ours":
          out, lse = out  # [splits, 1, R, D], [splits, 1, R]: merged over the splits
          ref = merge_attention_states(list(out[:, 0]), list(lse[:, 0]))[0].astype(jnp.float32)
        elif ref is not None and not name.endswith("_ks"):
          row[f"err_{name}"] = rel_err(jnp.asarray(out, jnp.float32).reshape(r, d), ref)
      except Exception as e:  # noqa: BLE001 -- a reference that cannot run is reported
        row[name] = f"err: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
      print(spec, name, row[name] if isinstance(row[name], str) else
            f"{row[name]:.1f} us ({row[f'{name}_tflops']:.0f} TFLOP/s)", flush=True)
    rows.append(row)
  report = {"device": kind, "jax": jax.__version__, "matmul_rate": rate, "copy_bandwidth": bw,
            "goal": args.goal, "suffixes": suffixes, "rows": rows}
  write(report, args.out)


def kernel_us(row: dict, name: str) -> float | None:
  """Op ``name``'s attention kernel alone: its longest kernel where the profiler listed them
  (a reference's input preparation -- cuDNN's memset, ``attention_mgpu``'s pre-scaled q -- is
  not held against it), else the op's device time; None where it did not run."""
  if not isinstance(row.get(name), float):
    return None
  kernels = row.get(f"{name}_kernels")
  return max(k["us"] for k in kernels) if kernels else row[name]


def reach(report: dict) -> None:
  """Sets ``report["reach"]``: per spec and suffix length, the floor of the whole call (the run's
  ceilings), the time the goal allows, and the fastest attention kernel alone on the prefix over
  every op and split count the spec ran at (``best_prefix``: ``op/k``). Rows' old ``reach``
  entries (runs before --splits) are dropped."""
  report["reach"] = []
  for row in report["rows"]:
    row.pop("reach", None)
  for spec in dict.fromkeys(row["spec"] for row in report["rows"]):
    _, shape = parse_spec(spec + ":0")
    times = {f"{n}/{row['parts']}": t for row in report["rows"] if row["spec"] == spec
             for n in OPS if (t := kernel_us(row, n)) is not None}
    if not times:
      continue
    best = min(times, key=times.get)
    for s_len in report["suffixes"]:
      floor = AttentionShape(shape.batch, shape.prefix, s_len, shape.q_heads, shape.kv_heads,
                             shape.head_dim).floor_s(report["copy_bandwidth"],
                                                     report["matmul_rate"]) * 1e6
      allowed = floor / report["goal"]
      report["reach"].append(dict(spec=spec, s=s_len, floor_us=floor, allowed_us=allowed,
                                  best_prefix=best, best_prefix_us=times[best],
                                  prefix_over_allowed=times[best] / allowed))


def render(report: dict) -> str:
  rate = report["matmul_rate"]
  names = [n for n in OPS if any(n in row for row in report["rows"])]
  lines = [f"device: {report['device']}; jax {report['jax']}; bf16 matmul rate "
           f"{rate / 1e12:.0f} TFLOP/s; device µs (TFLOP/s, fraction of the matmul rate)", "",
           "| spec | rows x keys | k | " + " | ".join(names) + " |",
           "|---|---|---:|" + "---:|" * len(names)]
  for row in report["rows"]:
    cells = []
    for n in names:
      us = row.get(n)
      cells.append(f"{us:.1f} ({row[f'{n}_tflops']:.0f}, {row[f'{n}_tflops'] * 1e12 / rate:.2f})"
                   if isinstance(us, float) else str(us))
    lines.append(f"| {row['spec']} | {row['rows']} x {row['p']} | {row['parts']} | "
                 + " | ".join(cells) + " |")
  lines += ["", f"Reach of the roofline goal (>= {report['goal']} of the floor of the whole call; "
            f"copy {report['copy_bandwidth'] / 1e9:.0f} GB/s): the fastest attention kernel above "
            "on the prefix product alone (the op's longest kernel) against the time the goal "
            "allows for the whole call", "",
            "| spec | S | floor µs | allowed µs | fastest prefix kernel alone µs (op/k) | "
            "prefix / allowed |", "|---|---:|---:|---:|---:|---:|"]
  for x in report["reach"]:
    mark = " (out of reach)" if x["prefix_over_allowed"] > 1 else ""
    lines.append(f"| {x['spec']} | {x['s']} | {x['floor_us']:.1f} | {x['allowed_us']:.1f} | "
                 f"{x['best_prefix_us']:.1f} ({x['best_prefix']}) | "
                 f"{x['prefix_over_allowed']:.2f}{mark} |")
  return "\n".join(lines)


def write(report: dict, out: str) -> None:
  """Computes the reach, prints the tables and writes ``prefix_references.json`` and ``.md``."""
  reach(report)
  table = render(report)
  print("\n" + table)
  with open(os.path.join(out, "prefix_references.json"), "w") as f:
    json.dump(report, f, indent=1)
  with open(os.path.join(out, "prefix_references.md"), "w") as f:
    f.write(table + "\n")


if __name__ == "__main__":
  main()
