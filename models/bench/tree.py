"""``hydragen bench tree``: hierarchical sharing in competitive programming (Hydragen Sec. 4.4).

The paper's Figure 7 setting (App. D.4): a few-shot prompt (~2,400 tokens) shared
by every sequence, N problems each with its own description, M candidate
solutions sampled per problem, 512 new tokens each. A batch holds ``b``
problems, i.e. ``b * M`` sequences. Modes, compared at equal batch:

* ``standard``: every sample holds its whole prompt in its own cache (no sharing);
* ``single-level``: the few-shot prompt is one shared segment; each problem's
  text is copied into the own cache of every one of its samples and attended
  per sample, with the sample's new tokens (the paper's single-level Hydragen);
* ``two-level``: the tree detected by :mod:`models.generation.sharing` from the prompts:
  the few-shot prompt once, each problem's text once (shared by its M samples).

and then single-level and two-level each at the largest batch a memory budget
allows (``--memory-gb``, default: the device's memory): two-level stores a
problem's text once instead of M times, so more problems fit in a batch.

Time per batch = prefill + decode of all new tokens, with compilation
excluded: each timed batch is prefilled (compiling), decoded one step
(compiling the loop) and then ``new_tokens - 1`` steps in ONE call of the same
program; decode time per batch = that call's time * new / (new - 1); the
prefill is timed by running it again (compiled). Total time for the N problems
= the measured batches plus the untimed ones at the mean of the measured full
batches; a last batch with fewer problems is always measured (``--timed-batches
0`` measures every batch; each batch's problem lengths differ, so each batch
compiles anew). Every point runs greedily and with the CLI's default sampling
(temperature 0.7, top-p 0.9; ``--sampling``): the ``sampling`` column. Random bf16 weights of a named preset drawn on the device. Points that do not
fit are reported as "x" (by the memory estimate, or an out-of-memory error).
Writes JSON, a Markdown table and a PNG like the paper's Figure 7.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import sys
import time

from models.bench import common
from models.bench import decode as bench_decode
from models.errors import UsageError

MODES = ("standard", "single-level", "two-level")
HEADROOM = 0.9  # of the budget: XLA's temporaries, fragmentation


HELP = ("Hierarchical sharing (Sec. 4.4): standard vs single- vs two-level Hydragen over a "
        "few-shot prompt and N problems x M samples.")


def configure(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default="llama-3-8b", help="a preset name (random weights)")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--impl", default="auto", help="attention implementation (jax_shared_attn impl)")
  p.add_argument("--shots", type=int, default=2400, help="tokens of the shared few-shot prompt")
  p.add_argument("--problems", type=int, default=120, help="N problems in the data set")
  p.add_argument("--problem-tokens", type=common.ints, default=[300, 700], metavar="MIN,MAX",
                 help="each problem's length, drawn uniformly (default 300,700)")
  p.add_argument("--samples", type=int, default=128, help="M samples per problem")
  p.add_argument("--new-tokens", type=int, default=512)
  p.add_argument("--batch", type=common.ints, default=[1, 2, 4, 8],
                 help="problems per batch to compare at equal batch (default 1,2,4,8)")
  p.add_argument("--modes", default=",".join(MODES))
  p.add_argument("--sampling", default=",".join(bench_decode.SAMPLINGS),
                 help="greedy, sampled (temperature 0.7, top-p 0.9: the CLI's default) or both "
                      "(default)")
  p.add_argument("--memory-gb", type=float, default=None,
                 help="memory budget (default: the device's memory: JAX's allocator limit on a "
                 "GPU, the host's RAM on a CPU)")
  p.add_argument("--no-max-batch", action="store_true",
                 help="skip the runs at the largest batch the budget allows")
  p.add_argument("--timed-batches", type=int, default=1,
                 help="batches timed per point (0: all), plus a smaller last batch; the "
                      "untimed ones count at the timed full batches' mean")
  p.add_argument("--min-shared-tokens", type=int, default=None,
                 help="sharing detection threshold (models.generation.sharing; default 16)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs/tree")
  p.add_argument("--no-progress", action="store_true")
  p.set_defaults(handler=_run)


# -- the data set and its batches -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Dataset:
  """Random token ids: the few-shot prompt and N problems (vocabulary ids >= 3)."""

  shots: list[int]
  problems: list[list[int]]

  @classmethod
  def draw(cls, vocab_size: int, shots: int, problems: int, lo: int, hi: int, seed: int):
    import numpy as np
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, problems)
    return cls(rng.integers(3, vocab_size, shots).tolist(),
               [rng.integers(3, vocab_size, int(n)).tolist() for n in lengths])

  def batches(self, b: int) -> list[list[list[int]]]:
    return [self.problems[i:i + b] for i in range(0, len(self.problems), b)]


def timed_batch_indices(sizes: list[int], timed_batches: int) -> list[int]:
  """The batches to time, given each batch's number of problems.

  The first ``timed_batches`` (0: all), and a last, smaller batch always: it
  runs at another batch size, so the full batches' mean would misstate it.
  """
  n = len(sizes)
  idx = list(range(n)) if timed_batches <= 0 else list(range(min(timed_batches, n)))
  if n > 1 and sizes[-1] < sizes[0] and n - 1 not in idx:
    idx.append(n - 1)
  return idx


def single_level_tree(shots, problems, samples: int):
  """The explicit tree the single-level mode prefills: the few-shot prompt, then each problem.

  (Prefilled like two-level, each problem once; :func:`make_state` then copies
  each problem's K/V into its samples' own caches and drops the problem level.)
  """
  from models.generation.prompt_tree import PromptTree
  return PromptTree(segments=((tuple(shots),), tuple(tuple(p[:-1]) for p in problems)),
                    parents=((-1,), (0,) * len(problems)),
                    leaves=tuple((1, i) for i in range(len(problems)) for _ in range(samples)),
                    last_tokens=tuple(p[-1] for p in problems for _ in range(samples)))


def two_level_tree(shots, problems, samples: int, min_shared_tokens=None):
  """The detected tree: the few-shot prompt once, then each problem once below it.

  (With one problem per batch the detection finds a single segment, few-shot
  prompt + problem, shared by its M samples: the same tokens, stored once.)
  """
  from models.generation.sharing import detect_sharing
  tree = detect_sharing([shots + p for p in problems], samples,
                        min_shared_tokens=min_shared_tokens)
  if tree.shared_tokens != len(shots) + sum(len(p) - 1 for p in problems):
    raise ValueError("hydragen bench tree: the detected tree does not store the few-shot prompt "
                     "once and each problem once; make --shots >= --min-shared-tokens (16)")
  return tree


@functools.lru_cache(maxsize=None)
def _own_cache_copier(capacity: int):
  """A jitted ``(k, v, node_of_seq) -> own k, v``: each sample's segment, padded to ``capacity``."""
  import jax
  import jax.numpy as jnp

  @jax.jit
  def copy(k, v, nodes):  # k, v: per layer [N, T, Hkv, D]; nodes: int32 [B]
    pad = ((0, 0), (0, capacity - k[0].shape[1]), (0, 0), (0, 0))
    return (tuple(jnp.pad(x[nodes], pad) for x in k), tuple(jnp.pad(x[nodes], pad) for x in v))

  return copy


def make_state(model, mode: str, shots, problems, samples: int, new_tokens: int, *, impl: str,
               seed: int = 0, min_shared_tokens=None):
  """The decode state of one batch of problems for ``mode`` (prefill done)."""
  from models.generation.cache import KVCache
  from models.generation.loop import prefill

  if mode == "single-level":
    state = prefill(model, single_level_tree(shots, problems, samples),
                    max_new_tokens=new_tokens, impl=impl, seed=seed)
    few_shot, per_problem = state.cache.levels
    capacity = per_problem.k[0].shape[1] + new_tokens
    k, v = _own_cache_copier(capacity)(per_problem.k, per_problem.v, per_problem.node_of_seq)
    cache = KVCache((few_shot,), k, v, per_problem.context_lengths())
    return dataclasses.replace(state, cache=cache)
  tree = two_level_tree(shots, problems, samples, min_shared_tokens)
  return prefill(model, tree, max_new_tokens=new_tokens, impl=impl, seed=seed,
                 attention="standard" if mode == "standard" else "hydragen")


# -- memory ---------------------------------------------------------------------------------------

def kv_bytes(config, mode: str, problems: int, samples: int, shots: int, longest_problem: int,
             new_tokens: int) -> int:
  """Bytes of the decode state's KV cache (levels padded to the longest problem in the batch).

  A prompt's last token is fed at decode step 0, so a problem stores
  ``longest_problem - 1`` tokens. Equals ``make_state(...).cache.nbytes`` (tested).
  """
  from models.generation.cache import kv_bytes_per_token
  seqs, text = problems * samples, longest_problem - 1
  tokens = {"standard": seqs * (shots + text + new_tokens),
            "single-level": shots + seqs * (text + new_tokens),
            "two-level": shots + problems * text + seqs * new_tokens}[mode]
  return tokens * kv_bytes_per_token(config)


@functools.lru_cache(maxsize=8)
def _weight_bytes(config) -> int:
  import numpy as np

  from models.model.llama import param_shapes
  return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
             for s in param_shapes(config).values())


def memory_needed(config, mode: str, problems: int, samples: int, shots: int,
                  longest_problem: int, new_tokens: int) -> int:
  """Weights + KV cache + the prefill's transient tree + logits: the estimate points must fit."""
  weights = _weight_bytes(config)
  kv = kv_bytes(config, mode, problems, samples, shots, longest_problem, new_tokens)
  # standard and single-level are built from the prefilled tree (few-shot + problems once).
  transient = 0 if mode == "two-level" else kv_bytes(config, "two-level", problems, 0, shots,
                                                    longest_problem, 0)
  logits = 2 * problems * samples * config.vocab_size * 4
  return weights + kv + transient + logits


def device_memory_bytes() -> int:
  """The accelerator's memory (JAX's allocator limit), or the host's RAM on a CPU."""
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def max_batch(config, mode: str, budget: int, num_problems: int, samples: int, shots: int,
              longest_problem: int, new_tokens: int) -> int:
  """The most problems per batch whose estimate fits in ``HEADROOM * budget`` (0: none)."""
  best = 0
  for b in range(1, num_problems + 1):
    if memory_needed(config, mode, b, samples, shots, longest_problem, new_tokens) > HEADROOM * budget:
      break
    best = b
  return best


# -- one point ------------------------------------------------------------------------------------

def run_point(model, data: Dataset, mode: str, b: int, *, samples: int, new_tokens: int,
              impl: str, budget: int, timed_batches: int = 1, seed: int = 0,
              min_shared_tokens=None, on_batch=None, sampling: str = "greedy") -> dict:
  """One (mode, problems per batch) point: time per batch, total time, tokens/s.

  ``sampling``: a key of :data:`models.bench.decode.SAMPLINGS`.
  """
  import jax

  from models.generation.loop import decode

  config = model.config
  batches = data.batches(b)
  longest = max(len(p) for p in data.problems)
  row = dict(mode=mode, sampling=sampling, problems_per_batch=b, sequences=b * samples,
             batches=len(batches))
  how = dict(impl=impl, **bench_decode.SAMPLINGS[sampling])
  need = memory_needed(config, mode, b, samples, len(data.shots), longest, new_tokens)
  row["est_GB"] = need / 1e9
  if need > HEADROOM * budget:
    row.update(total_s="x", tokens_per_s="x", why="memory estimate")
    return row
  timed = [batches[i] for i in timed_batch_indices([len(x) for x in batches], timed_batches)]
  per_batch, state = [], None
  try:
    for problems in timed:
      make = lambda: make_state(model, mode, data.shots, problems, samples, new_tokens,
                                impl=impl, seed=seed, min_shared_tokens=min_shared_tokens)
      t0 = time.perf_counter()
      state = jax.block_until_ready(make())
      row.setdefault("first_prefill_s", time.perf_counter() - t0)  # compiles
      row["kv_GB"] = state.cache.nbytes / 1e9
      t0 = time.perf_counter()
      state = jax.block_until_ready(decode(model, state, 1, **how))
      row.setdefault("compile_s", time.perf_counter() - t0)
      steps = new_tokens - 1
      t0 = time.perf_counter()
      state = jax.block_until_ready(decode(model, state, steps, **how))
      dt = time.perf_counter() - t0
      state = None
      gc.collect()
      t0 = time.perf_counter()
      state = jax.block_until_ready(make())  # compiled now: the prefill's own time
      prefill_s = time.perf_counter() - t0
      state = None
      decode_s = dt * new_tokens / steps
      per_batch.append(dict(problems=len(problems), prefill_s=prefill_s, decode_s=decode_s,
                            rate=len(problems) * samples * steps / dt))
      if on_batch is not None:
        on_batch()
  except Exception as e:  # noqa: BLE001 -- a point that cannot run is reported, not fatal
    if not common.is_oom(e):
      raise
    row.update(total_s="x", tokens_per_s="x", why="out of memory")
    return row
  finally:
    state = None
    gc.collect()
  # Per-batch figures are those of the full batches (b problems); every untimed batch is
  # full (a smaller last batch is always timed) and counts at their mean.
  full = [x for x in per_batch if x["problems"] == b] or per_batch
  mean = lambda key: sum(x[key] for x in full) / len(full)
  untimed = len(batches) - len(per_batch)
  row["timed"] = [{k: x[k] for k in ("problems", "prefill_s", "decode_s")} for x in per_batch]
  row.update(timed_batches=len(per_batch), prefill_s=mean("prefill_s"), decode_s=mean("decode_s"),
             batch_s=mean("prefill_s") + mean("decode_s"), tokens_per_s=mean("rate"))
  row["total_decode_s"] = sum(x["decode_s"] for x in per_batch) + untimed * mean("decode_s")
  row["total_s"] = row["total_decode_s"] + sum(x["prefill_s"] for x in per_batch) + \
      untimed * mean("prefill_s")
  return row


# -- reports --------------------------------------------------------------------------------------

def summarize(rows) -> list[str]:
  """Two-level against single-level, per sampling: at equal batch, and each at its largest batch."""
  samplings = list(dict.fromkeys(r.get("sampling", "greedy") for r in rows))
  lines = []
  for sampling in samplings:
    part = [r for r in rows if r.get("sampling", "greedy") == sampling]
    prefix = f"{sampling}: " if len(samplings) > 1 else ""
    lines += [prefix + line for line in _summarize(part)]
  return lines


def _summarize(rows) -> list[str]:
  ok = lambda r: isinstance(r.get("total_s"), float)
  by = {(r["mode"], r["problems_per_batch"]): r for r in rows if ok(r)}
  less = lambda two, single: (f"{100 * abs(1 - two / single):.1f}% "
                              f"{'less' if two <= single else 'more'} time")
  lines = []
  for (mode, b), r in sorted(by.items(), key=lambda kv: kv[0][1]):
    single = by.get(("single-level", b))
    if mode == "two-level" and single:
      r["vs_single_level"] = single["total_s"] / r["total_s"]
      lines.append(f"equal batch ({b} problem(s), {r['sequences']} sequences): two-level takes "
                   f"{less(r['total_s'], single['total_s'])} than single-level (paper: 18% less)")
  at_max = {r["mode"]: r for r in rows if ok(r) and r.get("at_max_batch")}
  two, single = at_max.get("two-level"), at_max.get("single-level")
  if two and single:
    lines.append(f"each at the largest batch that fits: two-level ({two['problems_per_batch']} "
                 f"problems) takes {less(two['total_s'], single['total_s'])} than single-level "
                 f"({single['problems_per_batch']}) (paper: 55% less in all)")
  return lines


def _markdown(rows, info, summary) -> str:
  cols = ["mode", "sampling", "problems_per_batch", "sequences", "at_max_batch", "total_s", "batch_s",
          "decode_s", "prefill_s", "tokens_per_s", "vs_single_level", "kv_GB", "est_GB",
          "timed_batches", "batches", "compile_s"]
  cols = [c for c in cols if any(c in r for r in rows)]
  fmt = lambda v: f"{v:.1f}" if isinstance(v, float) and abs(v) >= 10 else (
      f"{v:.3g}" if isinstance(v, float) else ("" if v is None else str(v)))
  lines = [f"{info['model']} ({info['dtype']}, random weights) on {info['device']}, jax "
           f"{info['jax']}, {info['date']}: few-shot {info['shots']} tokens, {info['problems']} "
           f"problems of {info['problem_tokens'][0]}-{info['problem_tokens'][1]} tokens, "
           f"{info['samples']} samples each, {info['new_tokens']} new tokens; memory budget "
           f"{info['budget_GB']:.3g} GB. total_s: all problems (prefill + decode, compilation "
           "excluded).", "",
           "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    lines.append("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")
  if summary:
    lines += [""] + [f"* {s}" for s in summary]
  return "\n".join(lines) + "\n"


def _plot(rows, path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  top = max([r["total_s"] for r in rows if isinstance(r.get("total_s"), float)], default=1.0)
  for i, (mode, style) in enumerate(zip(MODES, ("s--", "o-", "^-"))):
    color = f"C{i}"
    pts = sorted((r["problems_per_batch"], r["total_s"]) for r in rows if r["mode"] == mode)
    ok = [(x, y) for x, y in pts if isinstance(y, float)]
    if ok:
      ax.plot(*zip(*ok), style, color=color, label=mode)
    for r in rows:
      if r["mode"] == mode and r.get("at_max_batch") and isinstance(r.get("total_s"), float):
        ax.plot([r["problems_per_batch"]], [r["total_s"]], "*", color=color, markersize=14)
        ax.annotate(f"largest batch: {r['problems_per_batch']}",
                    (r["problems_per_batch"], r["total_s"]), textcoords="offset points",
                    xytext=(6, 6), fontsize=7)
    bad = [x for x, y in pts if y == "x"]
    if bad:  # does not fit: an x in the mode's colour on the axis
      ax.plot(bad, [0.02 * top] * len(bad), "x", color=color, markersize=9, mew=2,
              label=f"{mode}: does not fit")
  ax.set_xscale("log", base=2)
  ax.set_ylim(bottom=0)
  ax.set_xlabel("problems per batch")
  ax.set_ylabel("time for all problems (s)")
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend()
  common.save_png(fig, path)


def _run(args: argparse.Namespace) -> int:
  import jax
  from tqdm.auto import tqdm

  from models.model.config import preset

  modes = args.modes.split(",")
  bad = set(modes) - set(MODES)
  if bad:
    raise UsageError(f"--modes: unknown {sorted(bad)}; choose from {MODES}")
  samplings = [x for x in args.sampling.split(",") if x]
  bad = set(samplings) - set(bench_decode.SAMPLINGS)
  if bad or not samplings:
    raise UsageError(f"--sampling: unknown {sorted(bad)}; choose from "
                         f"{', '.join(bench_decode.SAMPLINGS)}")
  if len(args.problem_tokens) not in (1, 2):
    raise UsageError("--problem-tokens must be MIN,MAX (or one length)")
  lo, hi = args.problem_tokens[0], args.problem_tokens[-1]
  if not 2 <= lo <= hi:
    raise UsageError("--problem-tokens must satisfy 2 <= MIN <= MAX")
  if args.new_tokens < 2 or args.samples < 1 or args.problems < 1 or args.shots < 1:
    raise UsageError("--new-tokens >= 2, --samples, --problems, --shots >= 1")
  config = preset(args.model)
  longest = args.shots + hi + args.new_tokens
  config = config.replace(dtype=args.dtype,
                          max_position_embeddings=max(config.max_position_embeddings, longest))
  data = Dataset.draw(config.vocab_size, args.shots, args.problems, lo, hi, args.seed)
  budget = int(args.memory_gb * 1e9) if args.memory_gb else device_memory_bytes()
  os.makedirs(args.out, exist_ok=True)
  t0 = time.perf_counter()
  model = bench_decode.device_random_init(config, seed=args.seed)
  device = jax.devices()[0].device_kind
  print(f"random {args.model} weights on {device} in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr, flush=True)
  info = common.stamp(model=args.model, dtype=args.dtype, impl=args.impl, shots=args.shots,
                      problems=args.problems, problem_tokens=[lo, hi], samples=args.samples,
                      new_tokens=args.new_tokens, budget_GB=budget / 1e9,
                      timed_batches=args.timed_batches, seed=args.seed)
  points = [(m, b) for b in sorted({min(b, args.problems) for b in args.batch}) for m in modes]
  at_max = set()
  if not args.no_max_batch:
    for mode in ("single-level", "two-level"):
      if mode in modes:
        b = max_batch(config, mode, budget, args.problems, args.samples, args.shots, hi,
                      args.new_tokens)
        info[f"max_batch_{mode}"] = b
        if b:
          at_max.add((mode, b))
          if (mode, b) not in points:
            points.append((mode, b))
  points = [(m, b, s) for s in samplings for m, b in points]
  n_batches = lambda b: len(timed_batch_indices([len(x) for x in data.batches(b)],
                                                 args.timed_batches))
  rows = []
  stem = os.path.join(args.out, f"tree_{args.model}")
  with tqdm(total=sum(n_batches(b) for _, b, _ in points), desc="bench tree", unit="batch",
            disable=args.no_progress, file=sys.stderr) as bar:
    for mode, b, sampling in points:
      bar.set_postfix_str(f"{mode} b={b} {sampling}")
      row = run_point(model, data, mode, b, samples=args.samples, new_tokens=args.new_tokens,
                      impl=args.impl, budget=budget, timed_batches=args.timed_batches,
                      seed=args.seed, min_shared_tokens=args.min_shared_tokens,
                      on_batch=lambda: bar.update(1), sampling=sampling)
      row["at_max_batch"] = (mode, b) in at_max
      if row["total_s"] == "x":
        bar.update(n_batches(b))
      rows.append(row)
      tqdm.write(json.dumps(row), file=sys.stderr)
      common.write_json(stem + ".json", info, rows)
  summary = summarize(rows)
  common.write_json(stem + ".json", info, rows, summary=summary)
  md = _markdown(rows, info, summary)
  common.write_text(stem + ".md", md)
  for i, sampling in enumerate(samplings):  # the first sampling's plot keeps the plain name
    _plot([r for r in rows if r["sampling"] == sampling],
          stem + (".png" if i == 0 else f"_{sampling}.png"),
          f"{args.model}: {args.problems} problems x {args.samples} samples, {sampling}, "
          f"{info['device']}, {info['date']}")
  print(md)
  return 0
