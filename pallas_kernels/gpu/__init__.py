"""GPU kernel family (Pallas Triton): any CUDA GPU; interpret mode elsewhere.

``prefix_attention``   batched prefix attention, rows = B * Tq * G per KV head
                       on the tensor cores, key splits for small batches.
``suffix_attention``   ragged per-sequence attention (flash-decoding splits for
                       small batches), with the prefix state merged in-kernel.
``segment_attention``  a tree level: rows grouped by segment in tiles.
"""

from __future__ import annotations

import functools

from jax_shared_attn.ops import AttentionOps
from pallas_kernels.gpu.prefix_attention import prefix_attention
from pallas_kernels.gpu.segment_attention import segment_attention
from pallas_kernels.gpu.suffix_attention import suffix_attention


def get_ops(interpret: bool | None = None) -> AttentionOps:
  """The Triton family; ``interpret=None`` picks native vs interpret mode at lowering."""
  return AttentionOps(
      "pallas:triton",
      functools.partial(prefix_attention, interpret=interpret),
      functools.partial(segment_attention, interpret=interpret),
      functools.partial(suffix_attention, interpret=interpret),
  )
