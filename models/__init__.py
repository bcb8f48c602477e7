"""Llama-family decoding with shared-prefix (Hydragen) attention.

    >>> import models
    >>> model, tokenizer, config = models.from_pretrained("SmolLM2-135M-Instruct.Q4_1.gguf")
    >>> tokens = models.generate(model, tokenizer.encode("Hi"), num_samples=8, max_new_tokens=32)

Modules (one job each): ``config`` (LlamaConfig, presets), ``rope``, ``llama`` (the NNX
decoder), ``cache`` (shared segments stored once + per-sequence K/V), ``prompt_tree`` (where
sharing occurs), ``sharing`` (automatic detection: a radix tree over the prompts), ``sampling``, ``generate`` (prefill + one jitted decode loop), ``loading``
(HF safetensors, GGUF, orbax), ``tokenizer``, ``cli`` (the ``hydragen`` command).
See docs/models.md. Names are imported on first use, except ``generate``: the function
shares its name with its module, so it is bound here, at import, to win over the submodule
attribute that importing ``models.generate`` sets.
"""

import importlib

from models.generate import generate  # noqa: E402  (the function, not the module)

_EXPORTS = {
    "LlamaConfig": "models.config", "RopeScaling": "models.config", "PRESETS": "models.config",
    "preset": "models.config",
    "Llama": "models.llama", "random_init": "models.llama", "build": "models.llama",
    "flat_params": "models.llama",
    "KVCache": "models.cache", "SegmentLevel": "models.cache",
    "PromptTree": "models.prompt_tree", "detect_sharing": "models.sharing",
    "SamplingParams": "models.sampling",
    **{name: "models.generate" for name in ("prefill", "decode", "lower_decode", "DecodeState",
                                            "PAD_ID", "ATTENTION_MODES")},
    "make_mesh": "models.sharding", "shard_model": "models.sharding",
    "from_pretrained": "models.loading", "save_pretrained": "models.loading",
    "model_from_tensors": "models.loading", "Pretrained": "models.loading",
    "Tokenizer": "models.tokenizer",
}

__all__ = sorted([*_EXPORTS, "generate"])


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'models' has no attribute {name!r}")


def __dir__():
  return __all__
