"""``hydragen bench sampler``: time per call of the next-token sampler, sort-based vs ours.

For each ``B x V`` shape, each logit distribution and each sampling setting,
times :func:`models.generation.sampling.sample_reference` (a full sort per row) and
:func:`models.generation.sampling.sample` under each sampler configuration, with
:func:`models.bench.timing.measure` (one jitted program over
rotating input sets; the profiler's device time on a GPU, the host clock on
a CPU), and checks that every variant draws the reference's tokens.

Distributions: ``flat`` (standard normal logits: the top-p 0.9 nucleus is most
of the vocabulary, as with random weights) and ``peaked`` (normal x 8: a few
tokens, as a trained model's usually are). Logits in each of ``--dtypes``
(the Llama model hands the sampler float32). ``read_us``, the floor: one read of
the logits (a row maximum). Writes JSON and a Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from models.bench import common
from models.errors import UsageError

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "t0.7": dict(temperature=0.7),
    "t0.7 p0.9": dict(temperature=0.7, top_p=0.9),
    "t0.7 k50 p0.9": dict(temperature=0.7, top_k=50, top_p=0.9),
}
SCALES = {"flat": 1.0, "peaked": 8.0}


def _shapes(text: str) -> list[tuple[int, int]]:
  try:
    return [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",") if s]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected BxV[,BxV...]; got {text!r}") from None


HELP = "Per-call time of the sampler: the sort-based reference vs ours."


def configure(p: argparse.ArgumentParser) -> None:
  p.add_argument("--shapes", type=_shapes, default=[(1024, 128256), (256, 128256), (1024, 49152)],
                 help="BxV,... (default 1024x128256,256x128256,1024x49152)")
  p.add_argument("--settings", default=",".join(SETTINGS),
                 help=f"comma-separated, of {', '.join(SETTINGS)}")
  p.add_argument("--distributions", default=",".join(SCALES), help="flat,peaked")
  p.add_argument("--dtypes", default="float32", help="logits dtypes: float32,bfloat16")
  p.add_argument("--configs", default="default,search:15,candidates:64+1024,chunk:128",
                 help="sampler configurations: default (the backend's), search:W (threshold "
                      "search only, W trial thresholds per pass), candidates:K (K candidates, "
                      "then the search), chunk:G[/F] (the chunked paths, chunks of G, F score "
                      "candidates, e.g. 15 or 6+15, the default), kernel:T (chunk:128 with "
                      "top-p alone's first F through the Pallas kernel, T tokens per step, "
                      "whatever the batch)")
  p.add_argument("--no-reference", action="store_true", help="skip the sorting reference")
  p.add_argument("--trials", type=int, default=7)
  p.add_argument("--out", default="runs/sampler")
  p.set_defaults(handler=_run)


def parse_config(text: str):
  from models.generation.sampling import SamplerConfig, default_sampler_config
  import jax
  kind, _, value = text.partition(":")
  try:
    if kind == "default":
      return default_sampler_config(jax.default_backend())
    if kind == "search":
      return SamplerConfig(candidates=0, search_width=int(value))
    if kind == "candidates":
      return SamplerConfig(candidates=tuple(int(k) for k in value.split("+")))
    if kind == "chunk":
      g, _, f = value.partition("/")
      return SamplerConfig(candidates=0, search_width=15, chunk=int(g),
                           score_candidates=tuple(int(n) for n in (f or "6+15").split("+")))
    if kind == "kernel":  # the GPU default, whatever the batch
      gpu = default_sampler_config("gpu")
      return dataclasses.replace(gpu, kernel=True, kernel_min_batch=1,
                                 kernel_tile=int(value or gpu.kernel_tile))
  except ValueError as e:
    raise UsageError(f"--configs {text!r}: {e}") from None
  raise UsageError(f"--configs: unknown {text!r}; use default, search:W, candidates:K, "
                   "chunk:G[/F] or kernel:T")


def run_row(shape, distribution: str, setting: str, variants: dict, trials: int,
            dtype: str = "float32") -> dict:
  """One (shape, distribution, setting): microseconds per call of each variant, tokens checked."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from models.bench import timing
  from models.generation.sampling import SamplingParams, sampling_keys

  b, v = shape
  params = SamplingParams(**SETTINGS[setting])
  n_sets = timing.sets_needed(b * v * 4) if jax.default_backend() != "cpu" else 1

  def make_inputs(i):
    logits = SCALES[distribution] * jax.random.normal(jax.random.key(i), (b, v), jnp.float32)
    return logits.astype(dtype), sampling_keys(jnp.uint32(i), jnp.arange(b, dtype=jnp.int32), jnp.int32(0))

  row = dict(batch=b, vocab=v, dtype=dtype, distribution=distribution, setting=setting)
  read = timing.measure(lambda l, k: jnp.max(l, axis=-1), make_inputs, n_sets=n_sets,
                        trials=trials, warmup=1)
  row["read_us"] = read["seconds"] * 1e6
  logits, keys = make_inputs(0)
  if not params.greedy:
    kept = jnp.isfinite(jax.jit(lambda l: _filter_reference(l, params))(logits))
    row["kept_mean"] = float(jnp.mean(jnp.sum(kept, axis=-1)))
  expected = None
  for name, fn in variants.items():
    op = lambda l, k, fn=fn: fn(l, k, params)
    try:
      res = timing.measure(op, make_inputs, n_sets=n_sets, trials=trials, warmup=1)
      row[f"{name}_us"] = res["seconds"] * 1e6
      tokens = np.asarray(jax.jit(op)(logits, keys))
      if expected is None:
        expected = tokens
      elif not np.array_equal(tokens, expected):
        row[f"{name}_mismatches"] = int(np.sum(tokens != expected))
    except Exception as e:  # noqa: BLE001 -- a variant that cannot run is reported
      row[f"{name}_us"] = f"err: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
  ref = row.get("reference_us")
  for name in variants:
    if name != "reference" and isinstance(ref, float) and isinstance(row.get(f"{name}_us"), float):
      row[f"{name}_speedup"] = ref / row[f"{name}_us"]
  return row


def _filter_reference(logits, params):
  from models.generation.sampling import filter_logits_reference
  return filter_logits_reference(logits, params)


def _markdown(rows, info, names) -> str:
  cols = ["batch", "vocab", "dtype", "distribution", "setting", "kept_mean", "read_us"]
  cols += [f"{n}_us" for n in names]
  cols += [f"{n}_speedup" for n in names if n != "reference"]
  cols = [c for c in cols if any(c in r for r in rows)]
  fmt = lambda x: (f"{x:.1f}" if abs(x) >= 10 else f"{x:.3f}") if isinstance(x, float) else str(x)
  lines = [f"Sampler per call (microseconds) on {info['device']}, jax {info['jax']}, {info['date']}; "
           f"{info['method']}; read = one read of the logits (the floor). "
           f"Configurations: {info['configs']}.", "",
           "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
  bad = [r for r in rows if any(k.endswith("_mismatches") for k in r)]
  lines += ["", "Every variant drew the reference's tokens." if not bad else
            f"Token mismatches in {len(bad)} rows (see the JSON)."]
  return "\n".join(lines) + "\n"


def _run(args: argparse.Namespace) -> int:
  import jax

  from models.generation.sampling import sample, sample_reference

  settings = [s for s in args.settings.split(",") if s]
  dists = [d for d in args.distributions.split(",") if d]
  dtypes = [d for d in args.dtypes.split(",") if d]
  if sorted(set(dtypes) - {"float32", "bfloat16"}):
    raise UsageError(f"--dtypes: unknown {sorted(set(dtypes) - {'float32', 'bfloat16'})}; "
                     "choose from float32, bfloat16")
  for name, chosen, known in (("--settings", settings, SETTINGS), ("--distributions", dists, SCALES)):
    bad = sorted(set(chosen) - set(known))
    if bad:
      raise UsageError(f"{name}: unknown {bad}; choose from {', '.join(known)}")
  if args.trials < 1:
    raise UsageError(f"--trials must be >= 1; got {args.trials}")
  variants = {} if args.no_reference else {"reference": sample_reference}
  configs = {}
  for text in (c for c in args.configs.split(",") if c):
    config = parse_config(text)
    configs[text] = config
    variants[text] = lambda l, k, p, config=config: sample(l, k, p, config)
  os.makedirs(args.out, exist_ok=True)
  info = common.stamp(
      method="profiler device time" if jax.default_backend() != "cpu" else "host clock",
              configs={k: str(v) for k, v in configs.items()})
  rows = []
  stem = os.path.join(args.out, "sampler")
  for shape in args.shapes:
    for dtype in dtypes:
      for dist in dists:
        for setting in settings:
          rows.append(run_row(shape, dist, setting, variants, args.trials, dtype))
          print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
          common.write_json(stem + ".json", info, rows)
  md = _markdown(rows, info, list(variants))
  common.write_text(stem + ".md", md)
  print(md)
  return 0
