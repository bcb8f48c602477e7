"""Exact shared-prefix (Hydragen) attention for JAX.

Public API (see README.md and each docstring for the math and shapes):

* :func:`attention_with_lse`: attention returning the natural-log LSE.
* :func:`merge_attention_states`: exact n-way LSE merge of partial results.
* :func:`shared_prefix_attention`: one shared prefix + per-sequence suffixes.
* :class:`SharedLevel`, :func:`hierarchical_attention`: a tree of shared segments.
* :func:`sharded`, :class:`AttentionSharding`: any of the three above run per shard of a
  device mesh under ``shard_map`` (batch x heads blocks, no communication).
* :class:`GpuConfig`, :class:`TpuConfig` (``config=`` of the three): the kernel families'
  choices as values; :func:`explain`: the plan a call runs and why (docs/configuration.md).

Names are imported on first use (so that the kernels, which import the reference, never load
the API and its dispatch).
"""

import importlib

_EXPORTS = {
    "SharedLevel": "api",
    "attention_with_lse": "api",
    "explain": "api",
    "hierarchical_attention": "api",
    "shared_prefix_attention": "api",
    "Plan": "dispatch",
    "merge_attention_states": "merge",
    "AttentionOps": "ops",
    "IMPLS": "ops",
    "AttentionSharding": "sharding",
    "sharded": "sharding",
    "BlockSizes": "config",
    "FusedDecodeOptions": "config",
    "GpuConfig": "config",
    "MosaicPrefixOptions": "config",
    "TpuConfig": "config",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'jax_shared_attn' has no attribute {name!r}")
  value = getattr(importlib.import_module(f"jax_shared_attn.{_EXPORTS[name]}"), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))
