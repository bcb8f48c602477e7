"""Compiled memory of the XLA attention path: the temporaries of the forward and of ``jax.grad``
against the score tensor that the plain formula holds.

    hydragen bench memory --cases 16x512x2048,1x32768x0 --out runs/memory

A case ``BxTxP`` is B sequences of T query tokens each on a shared prompt of P tokens: the
prefill (causal) of B completions' last T tokens, ``shared_prefix_attention`` with suffixes of T
tokens; ``P = 0``: ``attention_with_lse`` over a prompt of T tokens alone (the prefill of a long
prompt). Heads, head dim and dtype are flags (Llama-3-8B's 32/8/128 and bfloat16 by default).
Every number comes from ``jax.jit(f).lower(...).compile().memory_analysis()`` on the default
backend: programs are compiled, nothing runs. Per case:

* ``scores``: the float32 scores ``B * T * Hq * keys * 4`` of the prefix (``P = 0``: of the
  prompt), the size of the whole-score formula's largest tensor;
* ``forward`` and ``grad``: temporaries of the XLA family (``impl="xla"``, ``XlaConfig`` tiles)
  for the output, and for the gradient of ``sum(out)`` with respect to every input;
* ``reference forward``: temporaries of the forward built from the reference formulas
  (:mod:`jax_shared_attn.reference`: whole score tensors), for comparison.

``--time R`` also times both forwards (median of R runs, seconds) where the reference's scores
take at most ``--time-max-gib``. Writes ``memory.json`` and ``memory.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Optional

from models.bench import common
from models.errors import UsageError

HELP = ("Compiled memory of the XLA attention path: forward and gradient temporaries against "
        "the score tensors (memory_analysis; nothing runs).")
GOAL = 0.25  # gradient temporaries / prefix scores at the case (16x512x2048)
DEFAULT_CASES = "16x512x2048,64x1x4096,1x8192x0,1x32768x0"
GIB = 2**30


def _cases(text: str) -> list[tuple[int, int, int]]:
  out = []
  for item in text.split(","):
    parts = item.strip().lower().split("x")
    try:
      b, t, p = (int(x) for x in parts)
    except ValueError:
      raise argparse.ArgumentTypeError(f"a case is BxTxP (e.g. 16x512x2048); got {item!r}") \
          from None
    if b < 1 or t < 1 or p < 0:
      raise argparse.ArgumentTypeError(f"a case needs B >= 1, T >= 1, P >= 0; got {item!r}")
    out.append((b, t, p))
  return out


def configure(p: argparse.ArgumentParser) -> None:
  p.add_argument("--cases", type=_cases, default=_cases(DEFAULT_CASES),
                 help=f"comma-separated BxTxP (default {DEFAULT_CASES})")
  p.add_argument("--q-heads", type=int, default=32)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  p.add_argument("--block-rows", type=int, default=None,
                 help="XlaConfig.block_rows (default: XlaConfig's)")
  p.add_argument("--block-keys", type=int, default=None,
                 help="XlaConfig.block_keys (default: XlaConfig's)")
  p.add_argument("--time", type=int, default=0, metavar="R",
                 help="also time both forwards, median of R runs (default 0: no timing)")
  p.add_argument("--time-max-gib", type=float, default=1.0,
                 help="time only cases whose reference scores take at most this (GiB)")
  p.add_argument("--out", default="runs/memory", help="directory for memory.json/.md")
  p.set_defaults(handler=_run)


def _temp_bytes(fn, *args) -> Optional[int]:
  """Temporaries of ``fn`` compiled for ``args`` (None where the backend does not say)."""
  import jax

  stats = jax.jit(fn).lower(*args).compile().memory_analysis()
  return None if stats is None else int(stats.temp_size_in_bytes)


def _functions(b: int, t: int, p: int, hq: int, hkv: int, d: int, dtype: str, config):
  """``(arguments, tiled forward, reference forward)`` of one case: the arguments are
  ``jax.ShapeDtypeStruct``s; each forward maps them to the float32 output."""
  import jax
  import jax.numpy as jnp

  from jax_shared_attn import attention_with_lse, reference, shared_prefix_attention

  dt = jnp.dtype(dtype)
  sd = jax.ShapeDtypeStruct
  scale = d**-0.5
  q, own = sd((b, t, hq, d), dt), sd((b, t, hkv, d), dt)
  lengths = lambda: jnp.full((b,), t, jnp.int32)
  if p == 0:
    args = (q, own, own)
    tiled = lambda q, k, v: attention_with_lse(q, k, v, causal=True, impl="xla",
                                               config=config)[0]
    ref = lambda q, k, v: reference.suffix_attention(q, k, v, kv_lengths=lengths(), causal=True,
                                                     scale=scale)[0]
  else:
    shared = sd((p, hkv, d), dt)
    args = (q, shared, shared, own, own)
    tiled = lambda q, pk, pv, sk, sv: shared_prefix_attention(q, pk, pv, sk, sv, causal=True,
                                                              impl="xla", config=config)
    ref = lambda q, pk, pv, sk, sv: reference.reference_shared_attention(
        q, [("prefix", pk, pv, jnp.int32(p), None)], sk, sv, kv_lengths=lengths(), causal=True,
        scale=scale)[0]
  return args, tiled, ref


def _median_s(fn, args, runs: int) -> float:
  import jax

  jitted = jax.jit(fn)
  jax.block_until_ready(jitted(*args))  # compiled and warm
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    jax.block_until_ready(jitted(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(b: int, t: int, p: int, *, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
            dtype: str = "bfloat16", config=None, time_runs: int = 0,
            time_max_gib: float = 1.0) -> dict:
  """One case's row: bytes of the scores and of each program's temporaries (and seconds)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  args, tiled, ref = _functions(b, t, p, q_heads, kv_heads, head_dim, dtype, config)
  loss = lambda *a: jnp.sum(tiled(*a).astype(jnp.float32))
  grad = jax.grad(loss, argnums=tuple(range(len(args))))
  scores = b * t * q_heads * (p or t) * 4
  row = dict(case=f"{b}x{t}x{p}", batch=b, tokens=t, prefix=p,
             function="attention_with_lse" if p == 0 else "shared_prefix_attention",
             scores_bytes=scores, forward_bytes=_temp_bytes(tiled, *args),
             grad_bytes=_temp_bytes(grad, *args), reference_forward_bytes=_temp_bytes(ref, *args))
  row["grad_over_scores"] = (None if row["grad_bytes"] is None
                             else row["grad_bytes"] / scores)
  if time_runs and scores <= time_max_gib * GIB:
    rng = np.random.default_rng(0)
    arrays = [jnp.asarray(rng.normal(size=a.shape), a.dtype) for a in args]
    row["forward_s"] = _median_s(tiled, arrays, time_runs)
    row["reference_forward_s"] = _median_s(ref, arrays, time_runs)
  return row


def markdown(rows: list, info: dict) -> str:
  mib = lambda x: "" if x is None else f"{x / 2**20:,.1f}"
  timed = any("forward_s" in r for r in rows)
  lines = [f"XLA path memory on {info['device']} ({info['backend']}), jax {info['jax']}, "
           f"{info['date']}: {info['q_heads']}/{info['kv_heads']} heads, D {info['head_dim']}, "
           f"{info['dtype']}, tiles {info['tiles']}. Temporaries of the compiled programs "
           "(memory_analysis), MiB; scores: the float32 scores of the prefix (P = 0: of the "
           "prompt).", "",
           "| case BxTxP | function | scores | forward | grad | grad / scores | "
           "reference forward |" + (" forward s | reference s |" if timed else ""),
           "|---|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if timed else "")]
  for r in rows:
    ratio = "" if r["grad_over_scores"] is None else f"{r['grad_over_scores']:.3f}"
    line = (f"| {r['case']} | {r['function']} | {mib(r['scores_bytes'])} | "
            f"{mib(r['forward_bytes'])} | {mib(r['grad_bytes'])} | {ratio} | "
            f"{mib(r['reference_forward_bytes'])} |")
    if timed:
      fmt = lambda x: "" if x is None else f"{x:.4f}"
      line += f" {fmt(r.get('forward_s'))} | {fmt(r.get('reference_forward_s'))} |"
    lines.append(line)
  lines += ["", f"Goal: grad / scores <= {GOAL} at 16x512x2048 (the gradient within a quarter of "
            "the prefix scores)."]
  return "\n".join(lines) + "\n"


def run_memory_bench(cases, *, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                     dtype: str = "bfloat16", block_rows: Optional[int] = None,
                     block_keys: Optional[int] = None, time_runs: int = 0,
                     time_max_gib: float = 1.0, out: Optional[str] = None) -> tuple[list, dict]:
  """Every case's row, and the report's info; with ``out``, memory.json/.md written there."""
  import dataclasses

  from jax_shared_attn import XlaConfig

  if q_heads % kv_heads:
    raise UsageError(f"--q-heads ({q_heads}) must be a multiple of --kv-heads ({kv_heads})")
  tiles = {k: v for k, v in (("block_rows", block_rows), ("block_keys", block_keys))
           if v is not None}
  try:
    config = XlaConfig(**tiles)
  except ValueError as e:
    raise UsageError(str(e)) from None
  info = common.stamp(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                      tiles=str(config), config=dataclasses.asdict(config))
  rows = []
  for b, t, p in cases:
    rows.append(measure(b, t, p, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                        dtype=dtype, config=config, time_runs=time_runs,
                        time_max_gib=time_max_gib))
    if out:
      os.makedirs(out, exist_ok=True)
      common.write_json(os.path.join(out, "memory.json"), info, rows)
      common.write_text(os.path.join(out, "memory.md"), markdown(rows, info))
  return rows, info


def _run(args: argparse.Namespace) -> int:
  rows, info = run_memory_bench(args.cases, q_heads=args.q_heads, kv_heads=args.kv_heads,
                                head_dim=args.head_dim, dtype=args.dtype,
                                block_rows=args.block_rows, block_keys=args.block_keys,
                                time_runs=args.time, time_max_gib=args.time_max_gib,
                                out=args.out)
  print(markdown(rows, info))
  return 0


if __name__ == "__main__":  # python -m models.bench.memory [flags]
  parser = argparse.ArgumentParser(prog="python -m models.bench.memory", description=HELP)
  configure(parser)
  args = parser.parse_args()
  try:
    sys.exit(args.handler(args))
  except UsageError as e:
    print(f"{parser.prog}: error: {e}", file=sys.stderr)
    sys.exit(2)
