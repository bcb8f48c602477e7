"""Llama-family decoding with shared-prefix (Hydragen) attention.

    >>> import models
    >>> model, tokenizer, config = models.from_pretrained("SmolLM2-135M-Instruct.Q4_1.gguf")
    >>> tokens = models.generate(model, tokenizer.encode("Hi"), num_samples=8, max_new_tokens=32)

Subpackages, one concern each: ``model`` (LlamaConfig and presets, RoPE, the NNX decoder),
``checkpoints`` (HF safetensors, GGUF, orbax; the tokenizer), ``generation`` (KV cache, prompt
tree, prefill + decode, sampling, the settings value), ``parallel`` (meshes, partition rules,
multi-process runs), ``training`` (GRPO), ``cli`` (the ``hydragen`` command) and ``bench``
(benchmarks; nothing in the library imports them). See docs/models.md.

The public names below are imported on first use (``import models`` imports no JAX: the
``hydragen`` command starts its work, e.g. reading stored programs ahead, before the rest loads).
"""

import importlib
import types

from models import _deprecated

_EXPORTS = {
    **{name: "models.model.config" for name in ("LlamaConfig", "RopeScaling", "PRESETS",
                                                 "preset")},
    **{name: "models.model.llama" for name in ("Llama", "random_init", "build", "flat_params")},
    "KVCache": "models.generation.cache", "SegmentLevel": "models.generation.cache",
    "PromptTree": "models.generation.prompt_tree", "detect_sharing": "models.generation.sharing",
    "SamplingParams": "models.generation.sampling", "SamplerConfig": "models.generation.sampling",
    "GenerationSettings": "models.generation.settings",
    **{name: "models.generation.loop" for name in ("generate", "prefill", "decode", "lower_decode",
                                                   "DecodeState", "PAD_ID", "ATTENTION_MODES")},
    "make_mesh": "models.parallel.sharding", "shard_model": "models.parallel.sharding",
    **{name: "models.checkpoints.loading" for name in ("from_pretrained", "save_pretrained",
                                                       "model_from_tensors", "Pretrained")},
    "Tokenizer": "models.checkpoints.tokenizer",
    "default_model_path": "models.checkpoints.default_model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'models' has no attribute {name!r}")


def __dir__():
  return __all__


class _Package(types.ModuleType):
  """``models`` itself: importing the old module ``models.generate`` (an alias) makes the
  import system bind it here, which would hide the function; that binding is ignored."""

  def __setattr__(self, name, value):
    if name == "generate" and isinstance(value, types.ModuleType):
      return
    super().__setattr__(name, value)


_deprecated.install()
importlib.import_module(__name__).__class__ = _Package
