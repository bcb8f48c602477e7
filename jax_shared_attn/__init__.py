"""Exact shared-prefix (Hydragen) attention for JAX.

Public API (see README.md and each docstring for the math and shapes):

* :func:`attention_with_lse`: attention returning the natural-log LSE.
* :func:`merge_attention_states`: exact n-way LSE merge of partial results.
* :func:`shared_prefix_attention`: one shared prefix + per-sequence suffixes.
* :class:`SharedLevel`, :func:`hierarchical_attention`: a tree of shared segments.
"""

from jax_shared_attn.api import (SharedLevel, attention_with_lse, hierarchical_attention,
                                 shared_prefix_attention)
from jax_shared_attn.merge import merge_attention_states
from jax_shared_attn.ops import IMPLS, AttentionOps

__all__ = [
    "AttentionOps",
    "IMPLS",
    "SharedLevel",
    "attention_with_lse",
    "hierarchical_attention",
    "merge_attention_states",
    "shared_prefix_attention",
]
__version__ = "0.1.0"
