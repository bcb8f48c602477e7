"""``hydragen bench decode``: end-to-end decode throughput (Hydragen Figures 1, 4 and 6).

Runs the Llama decoder with random bf16 weights of a named shape and
measures decode-only throughput (prefill excluded, paper App. D.1) for the
attention modes

* ``hydragen``: the prompt's K/V stored once, attended by all samples' queries at once;
* ``standard``: every sample holds the whole prompt in its own cache (the paper's
  FlashAttention baseline);
* ``none``: attention skipped (the throughput ceiling; q/k/v/o projections kept).

Sweeps: ``batch`` (Figure 1: batch 32..1024 at a 2048-token prompt),
``prefix`` (Figure 4: prompt 1K..16K at batch 1024), ``document`` (Figure 6:
one long shared document and many short questions, time per batch of
questions). Each point: prefill, one decode step (compiles), up to 5 one-step calls
each timed to its result (their median: ``one_step_call_ms``), then the remaining steps in
ONE call of the same compiled program; tokens/s = batch * steps / time of that call.
``call_overhead_ms`` (a one-step call less a step of the long call) is what a call costs
beyond its step; the long call's step time shows that no host round-trip happens per token.
Points that do not fit in memory are reported as "x". Every point runs greedily and with
the CLI's default sampling (temperature 0.7, top-p 0.9; ``--sampling``): ``vs_greedy`` and
``sampler_share`` say what sampling costs a step (with ``--profile-steps``, also from the device
time per step). Writes JSON, a Markdown table and PNG plots.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

from models.bench import common
from models.errors import UsageError

MODES = ("hydragen", "standard", "none")
# Decoding greedily and with the CLI's default sampling (hydragen generate: temperature 0.7, top-p 0.9).
SAMPLINGS = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.7, top_p=0.9)}
ONE_STEP_CALLS = 5  # one-step calls timed at each point (at most new_tokens - 3)
SWEEPS = {
    "batch": dict(batch=[32, 64, 128, 256, 512, 1024], prefix=[2048]),
    "prefix": dict(batch=[1024], prefix=[1024, 2048, 4096, 8192, 16384]),
    "document": dict(batch=[64, 256, 1024], prefix=[20480]),
}


HELP = "End-to-end decode throughput: hydragen vs standard vs none."


def configure(d: argparse.ArgumentParser) -> None:
  d.add_argument("--model", default="llama-3-8b", help="a preset name (random weights)")
  d.add_argument("--sweep", default="batch", choices=sorted(SWEEPS))
  d.add_argument("--batch", type=common.ints, help="override the sweep's batch sizes")
  d.add_argument("--prefix", type=common.ints, help="override the sweep's prompt lengths")
  d.add_argument("--new-tokens", type=int, default=128)
  d.add_argument("--question-tokens", type=int, default=32, help="document sweep: tokens per question")
  d.add_argument("--modes", default=",".join(MODES))
  d.add_argument("--sampling", default=",".join(SAMPLINGS),
                 help="greedy, sampled (temperature 0.7, top-p 0.9: the CLI's default) or both "
                      "(default): every point runs once per choice")
  d.add_argument("--dtype", default="bfloat16")
  d.add_argument("--impl", default="auto", help="attention implementation (jax_shared_attn impl)")
  d.add_argument("--profile-steps", type=int, default=0,
                 help="after each timed run, profile this many more steps: device time per step "
                      "by kernel category (attention, matmul, ...) in the JSON and Markdown")
  d.add_argument("--profile-top", type=int, default=12,
                 help="with --profile-steps: how many of the busiest kernels the JSON lists")
  d.add_argument("--out", default="runs/decode")
  d.add_argument("--no-progress", action="store_true")
  d.set_defaults(handler=_run)


def _device_bytes() -> int:
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  return int(stats.get("bytes_limit", 0)) or 64 * 2**30


def _estimate_bytes(config, mode: str, batch: int, prefix: int, suffix: int) -> int:
  """Weights + KV cache + logits: a lower bound used to skip hopeless points."""
  from models.generation.cache import kv_bytes_per_token
  from models.model.llama import param_shapes
  import numpy as np
  weights = sum(int(np.prod(s.shape)) for s in param_shapes(config).values()) * 2
  per_token = kv_bytes_per_token(config)
  if mode == "hydragen":
    cache = (prefix + batch * suffix) * per_token
  elif mode == "standard":
    cache = batch * (prefix + suffix) * per_token
  else:
    cache = 0
  return weights + cache + batch * config.vocab_size * 4 * 2


def device_random_init(config, seed: int = 0, std: float = 0.02):
  """Random weights drawn on the device, one small jitted draw per parameter shape.

  (One jitted program initialising a whole large model is slow for XLA to
  compile; per-shape draws compile a handful of tiny programs.)
  """
  import functools

  import jax
  import jax.numpy as jnp

  from models.model.llama import build, param_shapes

  @functools.partial(jax.jit, static_argnums=(1, 2))
  def draw(key, shape, dtype):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

  key = jax.random.key(seed)
  dtype = config.param_dtype
  params = {}
  for i, (path, spec) in enumerate(sorted(param_shapes(config).items())):
    if path.endswith("norm.weight"):
      params[path] = jnp.ones(spec.shape, dtype)
    else:
      params[path] = draw(jax.random.fold_in(key, i), tuple(spec.shape), dtype)
  return build(config, params)


def run_point(model, mode: str, batch: int, prefix: int, new_tokens: int, *, impl: str,
              question_tokens: int = 0, seed: int = 0, profile_steps: int = 0,
              profile_top: int = 12, sampling: str = "greedy") -> dict:
  """One (mode, batch, prompt) point; see the module docstring for the method.

  ``profile_steps > 0``: after the timed run, that many more steps run under
  the profiler (the cache is sized for them) and the row gets their device
  time per step by kernel category and the ``profile_top`` busiest kernels (``profile``).
  ``sampling``: a key of :data:`SAMPLINGS`.
  """
  import jax
  import numpy as np

  from models.generation.loop import decode, prefill

  config = model.config
  row = dict(mode=mode, sampling=sampling, batch=batch, prefix=prefix, new_tokens=new_tokens)
  how = dict(impl=impl, **SAMPLINGS[sampling])
  if new_tokens < 4:
    raise ValueError("--new-tokens must be >= 4 (compile, one step, a timed run)")
  suffix = question_tokens + new_tokens
  need = _estimate_bytes(config, mode, batch, prefix, suffix)
  row["est_GB"] = need / 1e9
  if need > 0.95 * _device_bytes():
    row["tokens_per_s"] = "x"
    return row
  rng = np.random.default_rng(seed)
  doc = rng.integers(3, config.vocab_size, size=prefix).tolist()
  if question_tokens:  # one shared document, a distinct question per sequence (2 levels)
    prompts = [doc + rng.integers(3, config.vocab_size, size=question_tokens).tolist()
               for _ in range(batch)]
    num_samples = 1
  else:
    prompts, num_samples = doc, batch
  state = None
  try:
    t0 = time.perf_counter()
    state = prefill(model, prompts, num_samples=num_samples,
                    max_new_tokens=new_tokens + profile_steps, attention=mode, impl=impl,
                    seed=seed)
    jax.block_until_ready(state)
    row["prefill_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = jax.block_until_ready(decode(model, state, 1, **how))
    row["compile_s"] = time.perf_counter() - t0
    calls = []  # one-step calls, each timed to its result: a call's cost, fixed part included
    for _ in range(min(ONE_STEP_CALLS, new_tokens - 3)):
      t0 = time.perf_counter()
      state = jax.block_until_ready(decode(model, state, 1, **how))
      calls.append((time.perf_counter() - t0) * 1e3)
    row["one_step_call_ms"] = float(np.median(calls))
    steps = new_tokens - 1 - len(calls)
    t0 = time.perf_counter()
    state = jax.block_until_ready(decode(model, state, steps, **how))
    dt = time.perf_counter() - t0
    row.update(steps=steps, decode_s=dt, step_ms=dt / steps * 1e3,
               tokens_per_s=batch * steps / dt)
    row["call_overhead_ms"] = row["one_step_call_ms"] - row["step_ms"]
    if question_tokens:
      row["s_per_batch"] = new_tokens * dt / steps  # answering the batch of questions
    if profile_steps:
      from models.bench import profile

      holder = [state]

      def run():
        holder[0] = jax.block_until_ready(decode(model, holder[0], profile_steps, **how))

      events = profile.device_events(run)
      state = holder[0]
      if events:
        row["profile"] = profile.breakdown(events, per=profile_steps, top=profile_top)
  except Exception as e:  # noqa: BLE001 -- a point that cannot run is reported, not fatal
    if not common.is_oom(e):
      raise
    row["tokens_per_s"] = "x"
  finally:
    del state
    gc.collect()
  return row


def add_ratios(rows) -> None:
  """Ratios at the same point: against the ceiling, the baseline, and greedy decoding.

  ``sampler_share``: the part of a sampled step that greedy decoding does not
  spend, ``1 - step_ms(greedy) / step_ms(sampled)`` (``sampler_share_profiled``:
  the same from the profiler's device time per step). ``sampler_kernels_share``: the device
  time the "other" kernels (where the sampler's reductions, sorts and fusions fall) take in a
  sampled step beyond a greedy one, over the sampled step: the sampler's own kernels, without
  the run-to-run variation of the matrix products that the two shares above count in.
  """
  by = {(r["mode"], r.get("sampling", "greedy"), r["batch"], r["prefix"]): r for r in rows}
  for r in rows:
    key = (r.get("sampling", "greedy"), r["batch"], r["prefix"])
    for base in ("none", "standard"):
      other = by.get((base, *key), {}).get("tokens_per_s")
      if isinstance(r.get("tokens_per_s"), float) and isinstance(other, float) and r["mode"] != base:
        r[f"vs_{base}"] = r["tokens_per_s"] / other
    if r.get("sampling") != "sampled":
      continue
    greedy = by.get((r["mode"], "greedy", r["batch"], r["prefix"]), {})
    if isinstance(r.get("tokens_per_s"), float) and isinstance(greedy.get("tokens_per_s"), float):
      r["vs_greedy"] = r["tokens_per_s"] / greedy["tokens_per_s"]
      r["sampler_share"] = 1 - greedy["step_ms"] / r["step_ms"]
    if "profile" in r and "profile" in greedy:
      busy = r["profile"]["busy_us"]
      r["sampler_share_profiled"] = 1 - greedy["profile"]["busy_us"] / busy
      other = [p["profile"]["by_category_us"].get("other", 0.0) for p in (r, greedy)]
      r["sampler_kernels_share"] = (other[0] - other[1]) / busy


def _plot(rows, sweep: str, path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  x_key = {"batch": "batch", "prefix": "prefix", "document": "batch"}[sweep]
  y_key = "s_per_batch" if sweep == "document" else "tokens_per_s"
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  lines = [(m, s) for m in MODES for s in SAMPLINGS if any(
      r["mode"] == m and r.get("sampling", "greedy") == s for r in rows)]
  for (mode, sampling), style in zip(lines, ("o-", "o:", "s--", "s:", "^-.", "^:")):
    # a point that did not fit has only tokens_per_s == "x" (no time per batch)
    pts = sorted((r[x_key], r.get(y_key, r["tokens_per_s"])) for r in rows
                 if r["mode"] == mode and r.get("sampling", "greedy") == sampling)
    label = mode if len(SAMPLINGS) == 1 else f"{mode}, {sampling}"
    ok = [(x, y) for x, y in pts if isinstance(y, float)]
    if ok:
      ax.plot(*zip(*ok), style, label=label)
    bad = [x for x, y in pts if y == "x"]
    if bad:
      ax.plot(bad, [0] * len(bad), "rx", markersize=9, label=f"{label}: does not fit")
  ax.set_xscale("log", base=2)
  ax.set_xlabel({"batch": "batch size", "prefix": "shared prompt length",
                 "document": "questions in the batch"}[sweep])
  ax.set_ylabel("seconds per batch (decode)" if sweep == "document" else "decode tokens / s")
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend()
  common.save_png(fig, path)


def _markdown(rows, info) -> str:
  cols = ["mode", "sampling", "batch", "prefix", "new_tokens", "tokens_per_s", "step_ms",
          "one_step_call_ms", "call_overhead_ms", "s_per_batch", "vs_none", "vs_standard",
          "vs_greedy", "sampler_share", "prefill_s", "compile_s"]
  cols = [c for c in cols if any(c in r for r in rows)]
  fmt = lambda v: f"{v:.1f}" if isinstance(v, float) and abs(v) >= 10 else (
      f"{v:.3f}" if isinstance(v, float) else str(v))
  lines = [f"{info['model']} ({info['dtype']}, random weights) on {info['device']}, jax "
           f"{info['jax']}, {info['date']}; decode only, prefill excluded.", "",
           "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    lines.append("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")
  profiled = [r for r in rows if "profile" in r]
  if profiled:  # device time per step by kernel category (the profiler's, --profile-steps)
    cats = sorted({c for r in profiled for c in r["profile"]["by_category_us"]})
    pcols = ["mode", "sampling", "batch", "prefix", "device_ms_per_step"] + [
        f"{c}_ms" for c in cats] + ["sampler_share_profiled", "sampler_kernels_share"]
    lines += ["", "Device time per decode step by kernel category (profiler, ms):", "",
              "| " + " | ".join(pcols) + " |", "|" + "---|" * len(pcols)]
    for r in profiled:
      p = r["profile"]
      vals = [r["mode"], r.get("sampling", "greedy"), r["batch"], r["prefix"], p["busy_us"] / 1e3]
      vals += [p["by_category_us"].get(c, 0.0) / 1e3 for c in cats]
      vals += [r.get("sampler_share_profiled", ""), r.get("sampler_kernels_share", "")]
      lines.append("| " + " | ".join(fmt(v) for v in vals) + " |")
  return "\n".join(lines) + "\n"


def _run(args: argparse.Namespace) -> int:
  import jax
  from tqdm.auto import tqdm

  from models.model.config import preset

  if args.profile_steps < 0:
    raise UsageError(f"--profile-steps must be >= 0; got {args.profile_steps}")
  if args.profile_top < 1:
    raise UsageError(f"--profile-top must be >= 1; got {args.profile_top}")
  modes = args.modes.split(",")
  bad = set(modes) - set(MODES)
  if bad:
    raise UsageError(f"--modes: unknown {sorted(bad)}; choose from {MODES}")
  sweep = SWEEPS[args.sweep]
  batches = args.batch or sweep["batch"]
  prefixes = args.prefix or sweep["prefix"]
  questions = args.question_tokens if args.sweep == "document" else 0
  longest = max(prefixes) + questions + args.new_tokens + args.profile_steps + 1
  config = preset(args.model)
  # Random weights: the context limit of the named checkpoint is not a property of the shape.
  config = config.replace(dtype=args.dtype,
                          max_position_embeddings=max(config.max_position_embeddings, longest))
  os.makedirs(args.out, exist_ok=True)
  t0 = time.perf_counter()
  model = device_random_init(config, seed=0)
  print(f"random {args.model} weights on {jax.devices()[0].device_kind} in "
        f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
  info = common.stamp(model=args.model, dtype=args.dtype, sweep=args.sweep, impl=args.impl)
  samplings = [x for x in args.sampling.split(",") if x]
  bad = set(samplings) - set(SAMPLINGS)
  if bad or not samplings:
    raise UsageError(f"--sampling: unknown {sorted(bad)}; choose from {', '.join(SAMPLINGS)}")
  points = [(m, b, p, s) for p in prefixes for b in batches for m in modes for s in samplings]
  rows = []
  stem = os.path.join(args.out, f"decode_{args.model}_{args.sweep}")
  for mode, b, p, sampling in tqdm(points, desc=f"decode {args.sweep}", disable=args.no_progress,
                         file=sys.stderr):
    rows.append(run_point(model, mode, b, p, args.new_tokens, impl=args.impl,
                          question_tokens=questions, profile_steps=args.profile_steps,
                          profile_top=args.profile_top, sampling=sampling))
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    common.write_json(stem + ".json", info, rows)
  add_ratios(rows)
  common.write_json(stem + ".json", info, rows)
  md = _markdown(rows, info)
  common.write_text(stem + ".md", md)
  _plot(rows, args.sweep, stem + ".png",
        f"{args.model} decode, {info['device']}, {info['date']} ({args.sweep} sweep)")
  print(md)
  return 0
