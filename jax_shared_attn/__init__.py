"""Exact shared-prefix (Hydragen) attention for JAX.

Public API (see README.md and each docstring for the math and shapes):

* :func:`attention_with_lse`: attention returning the natural-log LSE.
* :func:`merge_attention_states`: exact n-way LSE merge of partial results.
* :func:`shared_prefix_attention`: one shared prefix + per-sequence suffixes.
* :class:`SharedLevel`, :func:`hierarchical_attention`: a tree of shared segments.
* :class:`PagedLevel`, :func:`paged_attention`: the same tree over page pools (a serving
  engine's KV cache), the pages read in place by the GPU kernels; forward only.
* :func:`sharded`, :class:`AttentionSharding`: any of the three above run per shard of a
  device mesh under ``shard_map`` (batch x heads blocks, no communication).
* :class:`GpuConfig`, :class:`TpuConfig`, :class:`XlaConfig` (``config=`` of the three): the
  kernel families' choices as values; :func:`explain`: the :class:`Plan` a call runs and why, for the
  :class:`DeviceInfo` it is planned for (docs/configuration.md).
"""

from jax_shared_attn.api import (PagedLevel, SharedLevel, attention_with_lse, explain,
                                 hierarchical_attention, paged_attention, shared_prefix_attention)
from jax_shared_attn.config import (BlockSizes, FusedDecodeOptions, GpuConfig,
                                    MosaicPrefixOptions, TpuConfig, XlaConfig)
from jax_shared_attn.dispatch import Plan
from jax_shared_attn.merge import merge_attention_states
from jax_shared_attn.ops import IMPLS, AttentionOps
from jax_shared_attn.sharding import AttentionSharding, sharded
from pallas_kernels.device import DeviceInfo

__all__ = ["AttentionOps", "AttentionSharding", "BlockSizes", "DeviceInfo", "FusedDecodeOptions",
           "GpuConfig", "IMPLS", "MosaicPrefixOptions", "PagedLevel", "Plan", "SharedLevel",
           "TpuConfig", "XlaConfig", "attention_with_lse", "explain", "hierarchical_attention",
           "merge_attention_states", "paged_attention", "shared_prefix_attention", "sharded"]
__version__ = "0.1.0"
