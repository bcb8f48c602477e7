"""``hydragen bench serve``: a load generator for the OpenAI server (docs/server.md).

Streams completions (token-id prompts, greedy, ``ignore_eos``: every request generates
``--output-tokens``) at Poisson arrival rates (``--rates``, requests/s; ``inf``: all at once)
or at a fixed number of clients each sending its next request when the last ends
(``--concurrency``), over one of two synthetic workloads:

* ``gsp``: SGLang's generated-shared-prefix: ``--groups`` system prompts of
  ``--system-tokens``, each under ``--prompts-per-group`` questions of ``--question-tokens``;
* ``system-prompt``: RelayAttention's workload: one system prompt of ``--system-tokens``
  before every request's question (``--question-tokens`` on average, from half to 1.5x).

Per point: output tokens/s, requests/s, time to first token (TTFT), time per output token
after the first (TPOT) and end-to-end latency, p50 and p99 (and means). Against ``--url``,
or an in-process server of ``--model`` (a path or a preset name: random weights) started once
per ``--cascade`` setting, so that cascade on and off run in one invocation. Each server is
warmed up first with the same workload at 1, 2, 4, ... ``--warmup`` requests at once (the
batch sizes of the device programs: they compile then). TPOT counts a device call's
``--decode-steps`` tokens as they arrive, together. Writes JSON, Markdown and a PNG; prints
the table last.

    PYTHONPATH=. python -m models.bench serve --model llama-3-8b --dataset system-prompt \\
        --system-tokens 2048 --rates 1,2,4,8,16 --cascade on,off --num-pages 16384
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
import time
from typing import Optional

import numpy as np

from models.bench import common
from models.errors import UsageError

HELP = "Load generator for hydragen serve: Poisson rates or fixed concurrency; TTFT, TPOT, p50/p99."
DATASETS = ("gsp", "system-prompt")


def configure(p: argparse.ArgumentParser) -> None:
  from models.bench.engine_flags import add_engine_arguments

  add_engine_arguments(p)
  p.add_argument("--url", default=None, help="a running server (default: start one in this "
                 "process for --model, once per --cascade setting)")
  p.add_argument("--cascade", default="on", help="in-process server: on, off or on,off")
  p.add_argument("--dataset", choices=DATASETS, default="system-prompt")
  p.add_argument("--rates", default=None, help="Poisson arrival rates, requests/s, comma-"
                 "separated ('inf': all at once); default: --concurrency, else 'inf'")
  p.add_argument("--concurrency", type=common.ints, default=None,
                 help="fixed numbers of clients (instead of --rates)")
  p.add_argument("--num-requests", type=int, default=128,
                 help="requests per point (system-prompt; gsp: groups x prompts per group)")
  p.add_argument("--system-tokens", type=int, default=2048)
  p.add_argument("--question-tokens", type=int, default=64)
  p.add_argument("--output-tokens", type=int, default=128)
  p.add_argument("--groups", type=int, default=8, help="gsp: system prompts")
  p.add_argument("--prompts-per-group", type=int, default=16, help="gsp: questions per group")
  p.add_argument("--warmup", type=int, default=64,
                 help="warm-up per server: 1, 2, 4, ... up to this many requests at once "
                 "(their programs compile; set it to the --max-running of the server)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs/serve")
  p.set_defaults(handler=_run)


# -- the workload ---------------------------------------------------------------------------------

def make_prompts(args, vocab: int, seed: int) -> list[list[int]]:
  """The dataset's prompts (token ids in [0, ``vocab``)), shuffled."""
  rng = np.random.default_rng(seed)
  ids = lambda n: rng.integers(0, vocab, n).tolist()
  q = args.question_tokens
  if args.dataset == "gsp":
    prompts = [system + ids(q) for system in (ids(args.system_tokens) for _ in range(args.groups))
               for _ in range(args.prompts_per_group)]
  else:
    system = ids(args.system_tokens)
    prompts = [system + ids(int(rng.integers(max(1, q // 2), q * 3 // 2 + 1)))
               for _ in range(args.num_requests)]
  rng.shuffle(prompts)
  return prompts


@dataclasses.dataclass
class Result:
  sent: float
  first: Optional[float] = None
  end: Optional[float] = None
  tokens: int = 0
  error: Optional[str] = None


async def _one(client, url: str, model: str, prompt: list[int], output_tokens: int) -> Result:
  body = dict(model=model, prompt=prompt, max_tokens=output_tokens, temperature=0.0,
              ignore_eos=True, stream=True, stream_options={"include_usage": True},
              return_token_ids=True)
  r = Result(time.perf_counter())
  try:
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
      if response.status_code != 200:
        r.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
        return r
      async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
          continue
        chunk = json.loads(line[6:])
        for choice in chunk["choices"]:
          if choice.get("token_ids"):
            r.first = r.first or time.perf_counter()
            r.tokens += len(choice["token_ids"])
    r.end = time.perf_counter()
  except Exception as e:  # noqa: BLE001 -- a failed request is counted, not fatal
    r.error = f"{type(e).__name__}: {e}"
  return r


async def run_load(url: str, model: str, prompts, output_tokens: int, *,
                   rate: Optional[float] = None, concurrency: Optional[int] = None,
                   seed: int = 0) -> tuple[list[Result], float]:
  """Sends ``prompts`` at Poisson ``rate`` (or with ``concurrency`` clients); the results and
  the wall time from the first send to the last answer."""
  import httpx

  limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
  async with httpx.AsyncClient(limits=limits, timeout=None) as client:
    start = time.perf_counter()
    if concurrency is not None:
      queue = list(reversed(prompts))
      results = []

      async def worker():
        while queue:
          results.append(await _one(client, url, model, queue.pop(), output_tokens))

      await asyncio.gather(*(worker() for _ in range(concurrency)))
    else:
      gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(prompts)) if (
          math.isfinite(rate)) else np.zeros(len(prompts))
      arrivals = start + np.cumsum(gaps) - gaps[0]

      async def at(t, prompt):
        await asyncio.sleep(max(0.0, t - time.perf_counter()))  # the arrival time itself
        return await _one(client, url, model, prompt, output_tokens)

      results = await asyncio.gather(*(at(t, p) for t, p in zip(arrivals, prompts)))
    return list(results), time.perf_counter() - start


def summarize(results: list[Result], wall: float) -> dict:
  ok = [r for r in results if r.error is None and r.first is not None]
  pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")
  ttft = [r.first - r.sent for r in ok]
  tpot = [(r.end - r.first) / (r.tokens - 1) for r in ok if r.tokens > 1]
  e2e = [r.end - r.sent for r in ok]
  tokens = sum(r.tokens for r in ok)
  row = dict(requests=len(results), completed=len(ok), failed=len(results) - len(ok),
             duration_s=wall, output_tok_s=tokens / wall, requests_per_s=len(ok) / wall)
  for name, xs in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
    row.update({f"{name}_p50_ms": pct(xs, 50) * 1e3, f"{name}_p99_ms": pct(xs, 99) * 1e3,
                f"{name}_mean_ms": (float(np.mean(xs)) if xs else float("nan")) * 1e3})
  errors = [r.error for r in results if r.error is not None]
  if errors:
    row["first_error"] = errors[0]
  return row


# -- points, servers, reports ----------------------------------------------------------------------

def _points(args) -> list[tuple[str, float]]:
  if args.concurrency and args.rates:
    raise UsageError("give --rates or --concurrency, not both")
  if args.concurrency:
    if min(args.concurrency) < 1:
      raise UsageError(f"--concurrency must be >= 1; got {args.concurrency}")
    return [("concurrency", c) for c in args.concurrency]
  try:
    rates = [float(x) for x in (args.rates or "inf").split(",") if x]
  except ValueError:
    raise UsageError(f"--rates: expected comma-separated numbers or inf; got {args.rates!r}")
  if not rates or any(not r > 0 for r in rates):
    raise UsageError(f"--rates must be > 0; got {args.rates!r}")
  return [("rate", r) for r in rates]


def _check(args) -> list[bool]:
  for name in ("num_requests", "system_tokens", "question_tokens", "output_tokens", "groups",
               "prompts_per_group"):
    if getattr(args, name) < 1:
      raise UsageError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
  if args.warmup < 0:
    raise UsageError(f"--warmup must be >= 0; got {args.warmup}")
  cascade = [c for c in args.cascade.split(",") if c]
  if not cascade or set(cascade) - {"on", "off"}:
    raise UsageError(f"--cascade: on, off or on,off; got {args.cascade!r}")
  if args.url is not None and len(cascade) > 1:
    raise UsageError("--cascade on,off needs the in-process server (no --url): a running "
                     "server has one setting")
  return [c == "on" for c in cascade]


def _server_info(url: str) -> tuple[str, int, int]:
  import httpx
  info = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
  return info["id"], info["max_model_len"], info.get("vocab_size", 256)


def run_series(args, url: str, points, label: str, stats=None) -> list[dict]:
  """Warm-up, then every point against ``url``."""
  model, context, vocab = _server_info(url)
  longest = args.system_tokens + args.question_tokens * 3 // 2 + 1 + args.output_tokens
  if longest > context:
    raise UsageError(f"prompts of up to {longest - args.output_tokens} tokens and "
                     f"--output-tokens {args.output_tokens} exceed the model's context {context}")
  if args.warmup:  # 1, 2, 4, ... requests at once: the batch sizes a point passes through
    warm, c = make_prompts(args, vocab, args.seed + 1), 1
    while c <= args.warmup:
      batch = (warm * (c // len(warm) + 1))[:c]
      results, _ = asyncio.run(run_load(url, model, batch, args.output_tokens, concurrency=c))
      refused = [r.error for r in results if r.error is not None and r.error.startswith("HTTP 4")]
      if refused:  # the server refuses this workload: every point would fail the same way
        raise UsageError(f"the server refused the workload's requests: {refused[0]}")
      c *= 2
  rows = []
  for kind, value in points:
    prompts = make_prompts(args, vocab, args.seed)
    before = stats() if stats else None
    results, wall = asyncio.run(run_load(
        url, model, prompts, args.output_tokens, seed=args.seed,
        rate=value if kind == "rate" else None,
        concurrency=int(value) if kind == "concurrency" else None))
    row = dict(cascade=label, **{kind: value}, **summarize(results, wall))
    if before is not None:  # the engine's own counters over the point
      after = stats()
      calls = after["decode_calls"] - before["decode_calls"]
      row["cascade_call_share"] = (after["cascade_calls"] - before["cascade_calls"]) / max(
          calls, 1)
      row["prefix_hit_rate"] = after["prefix_hit_rate"]
    rows.append(row)
    print(json.dumps(row), file=sys.stderr, flush=True)
  return rows


def _markdown(rows, info) -> str:
  cols = ["cascade", "rate", "concurrency", "completed", "output_tok_s", "requests_per_s",
          "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms",
          "e2e_p99_ms", "cascade_call_share"]
  cols = [c for c in cols if any(c in r for r in rows)]
  fmt = lambda v: (f"{v:.1f}" if abs(v) >= 10 or v == 0 else f"{v:.3f}") if isinstance(
      v, float) else str(v)
  lines = [f"hydragen serve, {info['model']} on {info['device']}, {info['dataset']} (system "
           f"{info['system_tokens']}, question {info['question_tokens']}, output "
           f"{info['output_tokens']} tokens), {info['date']}", "",
           "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    lines.append("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")
  return "\n".join(lines) + "\n"


def _plot(rows, path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  kind = "rate" if "rate" in rows[0] else "concurrency"
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
  for n, label in enumerate(sorted({r["cascade"] for r in rows})):
    rs = [r for r in rows if r["cascade"] == label]
    line = sorted((r for r in rs if math.isfinite(r[kind])), key=lambda r: r[kind])
    burst = [r for r in rs if not math.isfinite(r[kind])]  # all at once: at its measured rate
    color = f"C{n}"
    for ax, key, name in ((axes[0], "output_tok_s", "output tokens / s"),
                          (axes[1], "ttft_p50_ms", "TTFT p50 (ms)"),
                          (axes[2], "tpot_p50_ms", "TPOT p50 (ms)")):
      ax.plot([r[kind] for r in line], [r[key] for r in line], marker="o", color=color,
              label=f"cascade {label}")
      if burst:
        ax.plot([r["requests_per_s"] for r in burst], [r[key] for r in burst], marker="*",
                markersize=11, linestyle="none", color=color,
                label=f"cascade {label}, all at once (x: completed requests/s)")
      ax.set_xlabel("arrival rate (requests/s)" if kind == "rate" else "concurrent clients")
      ax.set_ylabel(name)
      ax.grid(alpha=0.3)
  axes[0].legend(fontsize=7)
  fig.suptitle(title, fontsize=9)
  common.save_png(fig, path)


def _run(args: argparse.Namespace) -> int:
  points, cascades = _points(args), _check(args)
  info = dict(dataset=args.dataset, system_tokens=args.system_tokens,
              question_tokens=args.question_tokens, output_tokens=args.output_tokens,
              groups=args.groups, prompts_per_group=args.prompts_per_group)
  rows = []
  if args.url is not None:
    model, _, _ = _server_info(args.url)
    info = common.stamp(model=model, url=args.url, **info)
    rows += run_series(args, args.url.rstrip("/"), points, "server")
  else:
    from models.bench.engine_flags import check_engine_args, engine_config, load_model
    from models.generation.settings import GenerationSettings
    from models.server.launch import ServerThread
    from models.serving import Engine

    check_engine_args(args)
    engine_config(args)
    model, tokenizer, name = load_model(args.model, args.dtype)
    info = common.stamp(model=name, dtype=str(model.config.dtype), impl=args.impl,
                        engine=dataclasses.asdict(engine_config(args)), **info)
    for on in cascades:
      config = engine_config(args, cascade=on)
      engine = Engine(model, tokenizer, config, GenerationSettings(impl=args.impl))
      server = ServerThread(lambda: (engine, name)).start()
      try:
        server.wait_ready()
        rows += run_series(args, server.url, points, "on" if on else "off", engine.stats)
      finally:
        server.stop()
      del engine, server
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, f"serve_{info['model']}_{args.dataset}")
  common.write_json(stem + ".json", info, rows)
  md = _markdown(rows, info)
  common.write_text(stem + ".md", md)
  _plot(rows, stem + ".png", md.splitlines()[0])
  print(md)
  return 0


def main(argv=None) -> int:
  """``python -m models.bench serve ...``."""
  p = argparse.ArgumentParser(prog="python -m models.bench serve", description=HELP)
  configure(p)
  args = p.parse_args(argv)
  return args.handler(args)
