"""``hydragen bench engine``: the serving engine on offline workloads, cascade on and off.

Workloads (token ids drawn at random; every request runs to its ``max_tokens``, EOS ignored):

* ``relay`` (RelayAttention's): ``--requests`` requests, each a system prompt of
  ``--system-prompt`` tokens shared by all, then its own user input of ``--input`` tokens,
  answered with ``--output`` tokens; all submitted at once.
* ``rollouts`` (RL sampling): ``--prompts`` prompts of ``--prompt-len`` tokens x ``--samples``
  samples, each sample's ``max_tokens`` drawn in ``--output-range``.

Modes, each run in this process on the same model and requests:

* ``cascade``: the engine as it ships (shared segments read once per step);
* ``no-cascade``: prefix pages cached and stored once, but every sequence reads them as its
  own keys (what vLLM and SGLang do in decode);
* ``no-sharing``: no prefix cache (each request stores and reads its own prompt);
* ``static``: :func:`models.generate` on batches of ``--static-batch`` sequences (default
  ``--max-running``; prompts known up front; every batch decodes to its longest sample, and its
  cache holds that many tokens for every sequence, so a smaller batch may be all that fits).

Each engine mode first serves the workload under other seeds (compiling its programs), then
the workload again, timed on the host clock: requests/s, generated tokens/s, decode calls, and
the attention floors of one decode step at the batch the engine ran (per-sequence reads vs
cascade; :class:`pallas_kernels.base.AttentionShape`, this run's copy bandwidth and matmul
rate), and the XLA compiles left in the timed run (0 when the warm-up covered every shape).
Writes JSON, Markdown and a plot.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

from models.bench import common

HELP = "The serving engine on offline workloads: cascade vs no cascade vs no sharing vs static."
MODES = ("cascade", "no-cascade", "no-sharing", "static")


def configure(d: argparse.ArgumentParser) -> None:
  d.add_argument("--model", default="llama-3-8b", help="a preset name (random weights)")
  d.add_argument("--workload", default="relay", choices=("relay", "rollouts"))
  d.add_argument("--requests", type=int, default=1000, help="relay: requests")
  d.add_argument("--system-prompt", type=int, default=2048, help="relay: shared tokens")
  d.add_argument("--input", type=int, default=64, help="relay: user tokens per request")
  d.add_argument("--output", type=int, default=128, help="relay: tokens per answer")
  d.add_argument("--prompts", type=int, default=64, help="rollouts: prompts")
  d.add_argument("--samples", type=int, default=16, help="rollouts: samples per prompt")
  d.add_argument("--prompt-len", type=int, default=1024, help="rollouts: tokens per prompt")
  d.add_argument("--output-range", type=common.ints, default=[64, 1024],
                 help="rollouts: max_tokens drawn uniformly in [lo, hi]")
  d.add_argument("--modes", default=",".join(MODES))
  d.add_argument("--max-running", type=int, default=1024)
  d.add_argument("--static-batch", type=int, default=0,
                 help="static: sequences per generate call (0: --max-running)")
  d.add_argument("--page-size", type=int, default=16)
  d.add_argument("--num-pages", type=int, default=0, help="0: what the device memory allows")
  d.add_argument("--decode-steps", type=int, default=16)
  d.add_argument("--prefill-ticks", type=int, default=1,
                 help="decode after at most this many prefilling ticks (EngineConfig)")
  d.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                 help="the layers under one lax.scan (EngineConfig.scan_layers; default: when "
                 "they run the same code, except on a GPU)")
  d.add_argument("--max-prefill-tokens", type=int, default=4096)
  d.add_argument("--batch-buckets", type=common.ints, default=None,
                 help="decode batch buckets (default: 64, x4 up to --max-running)")
  d.add_argument("--level-buckets", type=common.ints, default=[1, 2],
                 help="shared levels per decode step")
  d.add_argument("--segment-buckets", type=common.ints, default=[1, 2, 4],
                 help="shared segments per level (one per prompt the running samples share)")
  d.add_argument("--page-buckets", type=common.ints, default=None,
                 help="pages per shared segment (default: powers of two)")
  d.add_argument("--own-page-buckets", type=common.ints, default=None,
                 help="own pages per sequence (default: powers of two)")
  d.add_argument("--profile", action="store_true",
                 help="after each engine mode's timed run, serve the workload once more under "
                 "the profiler: device time by kernel category and the busiest kernels "
                 "(``profile`` in the JSON; none on a CPU, whose trace has no device plane)")
  d.add_argument("--profile-top", type=int, default=16,
                 help="with --profile: how many of the busiest kernels the JSON lists")
  d.add_argument("--dtype", default="bfloat16", help="weights, activations and page pools")
  d.add_argument("--impl", default="auto")
  d.add_argument("--seed", type=int, default=0)
  d.add_argument("--out", default="runs/engine")
  d.set_defaults(handler=_run)


def requests_of(args, vocab: int):
  """The workload's requests (token ids, deterministic in ``args.seed``)."""
  import numpy as np

  from models.serving import Request

  rng = np.random.default_rng(args.seed)
  ids = lambda n: [int(t) for t in rng.integers(1, vocab, n)]
  if args.workload == "relay":
    system = ids(args.system_prompt)
    return [Request(system + ids(args.input), max_tokens=args.output, ignore_eos=True, seed=i)
            for i in range(args.requests)]
  lo, hi = args.output_range
  out = []
  for i in range(args.prompts):
    prompt = ids(args.prompt_len)
    for j in range(args.samples):  # one request per sample: each its own max_tokens
      out.append(Request(prompt, max_tokens=int(rng.integers(lo, hi + 1)), ignore_eos=True,
                         seed=i * args.samples + j))
  return out


def _engine_config(args, mode: str, config):
  from models.serving import EngineConfig

  num_pages = args.num_pages or _pages_that_fit(config, args.page_size)
  buckets = tuple(args.batch_buckets or _buckets(args.max_running))
  tuple_or_none = lambda v: tuple(v) if v else None
  return EngineConfig(page_size=args.page_size, num_pages=num_pages,
                      max_running=args.max_running, max_prefill_tokens=args.max_prefill_tokens,
                      decode_steps=args.decode_steps, prefill_ticks=args.prefill_ticks,
                      scan_layers=args.scan_layers, cascade=mode == "cascade",
                      prefix_caching=mode != "no-sharing", batch_buckets=buckets,
                      prefill_buckets=_pow2_up_to(args.max_prefill_tokens),
                      level_buckets=tuple(args.level_buckets),
                      segment_buckets=tuple(args.segment_buckets),
                      page_buckets=tuple_or_none(args.page_buckets),
                      own_page_buckets=tuple_or_none(args.own_page_buckets))


def _pow2_up_to(n: int) -> tuple[int, ...]:
  """Prefill chunk buckets: powers of two from 64, then ``n``."""
  out = [b for b in (2 ** i for i in range(6, 30)) if b < n]
  return tuple(out) + (n,)


def _buckets(n: int) -> tuple[int, ...]:
  out, b = [], 64
  while b < n:
    out.append(b)
    b *= 4
  return tuple(out) + (n,)


def _pages_that_fit(config, page_size: int) -> int:
  """Pages for 70% of the device memory left after the weights."""
  import jax

  stats = jax.devices()[0].memory_stats() or {}
  free = int(stats.get("bytes_limit", 8 * 2**30)) - int(stats.get("bytes_in_use", 0))
  per_page = (2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim
              * config.param_dtype.itemsize)
  return max(64, int(0.7 * free) // per_page)


def _warmup(requests):
  """The workload itself under other seeds: a run over it compiles every program the timed run
  needs (the timed run's ``compiles`` counts those it still compiled)."""
  import dataclasses
  return [dataclasses.replace(r, seed=r.seed + 10**6) for r in requests]


def run_engine(model, args, mode: str, requests) -> dict:
  from models.generation.settings import GenerationSettings
  from models.serving import Engine

  engine = Engine(model, None, _engine_config(args, mode, model.config),
                  GenerationSettings(impl=args.impl))
  t0 = time.perf_counter()
  engine.generate(_warmup(requests))
  warm_s = time.perf_counter() - t0
  print(f"[{mode}] warm-up {warm_s:.1f} s", file=sys.stderr, flush=True)
  engine.reset()
  before = engine.stats()
  with common.counting_compiles() as compiles:
    t0 = time.perf_counter()
    outputs = engine.generate(requests)
    seconds = time.perf_counter() - t0
  stats = engine.stats()
  tokens = sum(len(s.token_ids) for o in outputs for s in o.samples)
  row = dict(mode=mode, seconds=seconds, warmup_s=warm_s, requests_per_s=len(requests) / seconds,
             tokens_per_s=tokens / seconds, tokens=tokens, compiles=len(compiles),
             decode_calls=stats.get("decode_calls", 0) - before.get("decode_calls", 0),
             # the rows the decode calls ran per token generated (>= 1: padded rows, and a
             # row's steps after it finished within a call)
             row_steps_per_token=((stats["decode_row_steps"] - before["decode_row_steps"])
                                  / max(1, tokens)),
             prefix_hit_rate=stats.get("prefix_hit_rate"), preemptions=stats.get("preemptions"))
  if args.profile:  # the same run again, under the profiler (it slows the host)
    from models.bench import profile

    engine.reset()
    events = profile.device_events(lambda e=engine: e.generate(requests))
    if events:
      row["profile"] = profile.breakdown(events, top=args.profile_top)
  del engine
  gc.collect()  # the pool is freed before the next mode sizes its own
  return row


def run_static(model, args, requests) -> dict:
  import jax

  from models.generation.loop import generate
  from models.generation.settings import GenerationSettings

  settings = GenerationSettings(impl=args.impl)
  size = args.static_batch or args.max_running
  batches = [requests[i:i + size] for i in range(0, len(requests), size)]

  def one(batch):
    prompts = [list(r.prompt) for r in batch]
    longest = max(r.max_tokens for r in batch)
    return generate(model, prompts, num_samples=1, max_new_tokens=longest, settings=settings,
                    seed=args.seed)

  # One batch of each shape compiles every program: the batch size, its longest sample (the
  # decode loop's length) and its prompts' lengths.
  shapes = {(len(b), max(r.max_tokens for r in b), tuple(sorted(len(r.prompt) for r in b))): b
            for b in batches}
  for batch in shapes.values():
    jax.block_until_ready(one(batch))
  with common.counting_compiles() as compiles:
    t0 = time.perf_counter()
    for batch in batches:
      jax.block_until_ready(one(batch))
    seconds = time.perf_counter() - t0
  tokens = sum(r.max_tokens for r in requests)  # useful tokens (a batch decodes to its longest)
  row_steps = sum(len(b) * max(r.max_tokens for r in b) for b in batches)
  return dict(mode="static", batch=size, seconds=seconds, requests_per_s=len(requests) / seconds,
              tokens_per_s=tokens / seconds, tokens=tokens, compiles=len(compiles),
              row_steps_per_token=row_steps / tokens)


def floors(args, config, bw: float, rate: float) -> dict:
  """One decode step's attention floors (all layers) at ``max_running`` sequences."""
  from pallas_kernels.base import AttentionShape

  if args.workload == "relay":
    shared, own = args.system_prompt, args.input + args.output // 2
  else:
    shared, own = args.prompt_len, sum(args.output_range) // 4
  shape = AttentionShape(args.max_running, shared, own, config.num_heads, config.num_kv_heads,
                         config.head_dim)
  layers = config.num_layers
  off = shape.per_sequence_floor_s(bw, rate) * layers
  on = shape.floor_s(bw, rate) * layers
  # The whole step: the weights read once, their products for every sequence (the input
  # embedding is a lookup, not a product), and the attention above.
  weights = config.num_params * config.param_dtype.itemsize
  products = 2 * (config.num_params - (0 if config.tie_word_embeddings else
                                       config.vocab_size * config.hidden_size))
  step_flops = products * args.max_running + shape.flops() * layers
  step_off = max((weights + shape.per_sequence_bytes() * layers) / bw, step_flops / rate)
  step_on = max((weights + shape.shared_bytes() * layers) / bw, step_flops / rate)
  return dict(batch=args.max_running, shared=shared, own=own,
              no_cascade_GB=shape.per_sequence_bytes() * layers / 1e9,
              cascade_GB=shape.shared_bytes() * layers / 1e9,
              cascade_TFLOP=shape.flops() * layers / 1e12,
              floor_no_cascade_ms=off * 1e3, floor_cascade_ms=on * 1e3, floor_ratio=off / on,
              weights_GB=weights / 1e9, step_TFLOP=step_flops / 1e12,
              step_floor_no_cascade_ms=step_off * 1e3, step_floor_cascade_ms=step_on * 1e3,
              step_floor_ratio=step_off / step_on)


def _run(args: argparse.Namespace) -> int:
  import jax

  from models.bench import timing
  from models.bench.decode import device_random_init
  from models.model.config import preset
  from models.serving.device import scan_by_default

  os.makedirs(args.out, exist_ok=True)
  config = preset(args.model).replace(dtype=args.dtype)
  t0 = time.perf_counter()
  model = device_random_init(config, seed=0)
  print(f"model {args.model}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
  requests = requests_of(args, config.vocab_size)
  bw, rate = timing.ceilings()
  info = common.stamp(model=args.model, dtype=args.dtype, workload=args.workload, impl=args.impl,
                      requests=len(requests), max_running=args.max_running,
                      page_size=args.page_size, decode_steps=args.decode_steps,
                      prefill_ticks=args.prefill_ticks,
                      scan_layers=(scan_by_default(config, jax.default_backend())
                                   if args.scan_layers is None else args.scan_layers),
                      bandwidth_GBps=bw / 1e9, matmul_TFLOPs=rate / 1e12,
                      floors=floors(args, config, bw, rate),
                      **({"system_prompt": args.system_prompt, "input": args.input,
                          "output": args.output} if args.workload == "relay" else
                         {"prompts": args.prompts, "samples": args.samples,
                          "prompt_len": args.prompt_len, "output_range": args.output_range}))
  rows = []
  for mode in args.modes.split(","):
    if mode not in MODES:
      raise SystemExit(f"--modes: {mode!r} is not one of {MODES}")
    row = run_static(model, args, requests) if mode == "static" else \
        run_engine(model, args, mode, requests)
    rows.append(row)
    print(json.dumps(row), flush=True)
    common.write_json(os.path.join(args.out, f"engine-{args.workload}.json"), info, rows)
  text = _markdown(rows, info)
  common.write_text(os.path.join(args.out, f"engine-{args.workload}.md"), text)
  _plot(rows, info, os.path.join(args.out, f"engine-{args.workload}.png"))
  print(text)
  return 0


def _markdown(rows, info) -> str:
  f = info["floors"]
  base = {r["mode"]: r for r in rows}
  head = (f"Engine, {info['workload']} workload, {info['model']} (random {info['dtype']}), "
          f"{info['device']}, {info['date']}: {info['requests']} requests, max running "
          f"{info['max_running']}, pages of {info['page_size']}, {info['decode_steps']} decode "
          f"steps per call, a decode call at least every {info.get('prefill_ticks', 1)} "
          f"prefilling ticks{', layers under one scan' if info.get('scan_layers') else ''}. "
          f"Attention floors of one decode step at {f['batch']} sequences ({f['shared']} shared "
          f"+ ~{f['own']} own tokens): no cascade {f['no_cascade_GB']:.0f} GB, "
          f"{f['floor_no_cascade_ms']:.1f} ms; cascade {f['cascade_GB']:.0f} GB and "
          f"{f['cascade_TFLOP']:.1f} TFLOP, {f['floor_cascade_ms']:.1f} ms: ratio "
          f"{f['floor_ratio']:.2f}. The whole step (with {f['weights_GB']:.1f} GB of weights "
          f"and {f['step_TFLOP']:.1f} TFLOP): {f['step_floor_no_cascade_ms']:.1f} ms against "
          f"{f['step_floor_cascade_ms']:.1f} ms, a ratio of {f['step_floor_ratio']:.2f}.\n\n"
          "| mode | seconds | requests/s | tokens/s | vs no-sharing | vs no-cascade | compiles | "
          "decode row steps a token |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|\n")
  lines = []
  for r in rows:
    ns = base.get("no-sharing", {}).get("tokens_per_s")
    nc = base.get("no-cascade", {}).get("tokens_per_s")
    ratio = lambda x: f"{r['tokens_per_s'] / x:.2f}" if x else "-"
    rows_a_token = r.get("row_steps_per_token")
    lines.append(f"| {r['mode']} | {r['seconds']:.1f} | {r['requests_per_s']:.2f} | "
                 f"{r['tokens_per_s']:.0f} | {ratio(ns)} | {ratio(nc)} | "
                 f"{r.get('compiles', '-')} | "
                 f"{'-' if rows_a_token is None else f'{rows_a_token:.2f}'} |")
  text = head + "\n".join(lines) + "\n"
  profiled = [r for r in rows if "profile" in r]
  if profiled:  # where each mode's device time went (--profile)
    text += ("\nDevice time of one more run of the workload under the profiler (s; streams "
             "overlap, so the categories may sum past the busy time). Attention a step: the "
             "attention's time (prefill included) over the decode steps run, beside the "
             "step's attention floor at the full batch:\n\n"
             "| mode | busy | attention | matmul | copy | other | attention a step (ms) | "
             "its floor (ms) | busiest kernels (calls) |\n"
             "|---|---:|---:|---:|---:|---:|---:|---:|---|\n")
    for r in profiled:
      p = r["profile"]
      cat = {k: v / 1e6 for k, v in p["by_category_us"].items()}
      busiest = ", ".join(f"{k['name'][:40]} ({k['count']:.0f})" for k in p["kernels"][:3])
      step, floor = _attention_a_step(r, info)
      text += (f"| {r['mode']} | {p['busy_us'] / 1e6:.2f} | {cat.get('attention', 0):.2f} | "
               f"{cat.get('matmul', 0):.2f} | {cat.get('copy', 0):.2f} | "
               f"{cat.get('other', 0):.2f} | {step:.2f} | {floor:.2f} | {busiest} |\n")
    nc = base.get("no-cascade", {})
    if info["workload"] == "relay" and "profile" in nc:
      step, floor = _attention_a_step(nc, info)
      if step < floor:  # every step runs (about) the full batch in this workload
        text += (f"\nNo-cascade's attention took {step:.2f} ms a step, {floor / step:.2f}x "
                 f"faster than its bytes allow at {info['bandwidth_GBps']:.0f} GB/s: its "
                 "sequences share the same prefix pages, and the cache between HBM and the "
                 "cores serves them after the first read, so its floor (and the floors' ratio) "
                 "does not bound it.\n")
  return text


def _attention_a_step(row, info) -> tuple[float, float]:
  """``(measured, floor)`` in ms: a profiled row's attention time over its decode steps, and
  the attention floor of one step of its mode at the full batch (``floors``)."""
  steps = max(1, row["decode_calls"] * info["decode_steps"])
  measured = row["profile"]["by_category_us"].get("attention", 0) / 1e3 / steps
  f = info["floors"]
  return measured, f["floor_no_cascade_ms" if row["mode"] != "cascade" else "floor_cascade_ms"]


def _plot(rows, info, path: str) -> None:
  """Tokens/s per mode, a bar each."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 3.6))
  ax.bar([r["mode"] for r in rows], [r["tokens_per_s"] for r in rows], color="tab:blue")
  ax.set_ylabel("generated tokens/s")
  ax.set_title(f"{info['workload']}, {info['model']}, {info['device']}", fontsize=9)
  common.save_png(fig, path)
