"""Exact shared-prefix (Hydragen) attention for JAX.

Public API (see README.md and each docstring for the math and shapes):

* :func:`attention_with_lse`: attention returning the natural-log LSE.
* :func:`merge_attention_states`: exact n-way LSE merge of partial results.
* :func:`shared_prefix_attention`: one shared prefix + per-sequence suffixes.
* :class:`SharedLevel`, :func:`hierarchical_attention`: a tree of shared segments.
* :func:`sharded`, :class:`AttentionSharding`: any of the three above run per shard of a
  device mesh under ``shard_map`` (batch x heads blocks, no communication).
"""

from jax_shared_attn.api import (SharedLevel, attention_with_lse, hierarchical_attention,
                                 shared_prefix_attention)
from jax_shared_attn.merge import merge_attention_states
from jax_shared_attn.ops import IMPLS, AttentionOps
from jax_shared_attn.sharding import AttentionSharding, sharded

__all__ = [
    "AttentionOps",
    "AttentionSharding",
    "IMPLS",
    "SharedLevel",
    "attention_with_lse",
    "hierarchical_attention",
    "merge_attention_states",
    "shared_prefix_attention",
    "sharded",
]
__version__ = "0.1.0"
