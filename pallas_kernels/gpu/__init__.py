"""GPU kernel family (Pallas): Triton kernels for any CUDA GPU, Mosaic GPU on Hopper.

``prefix_attention``   batched prefix attention, rows = B * Tq * G per KV head
                       on the tensor cores (Triton ``tl.dot``, or on Hopper a
                       wgmma/TMA Mosaic GPU kernel), key splits for small batches.
``suffix_attention``   ragged per-sequence attention (flash-decoding splits for
                       small batches) that merges the shared parts in-kernel.
``segment_attention``  a tree level: rows grouped by segment in tiles.
``shared_attention``   the whole decomposition in the folded row layout (``shared.py``); on
                       Hopper, decoding with one shared prefix runs prefix and suffixes in ONE
                       Mosaic GPU kernel (``shared_mgpu``).
``sampler.py``         not attention: the top-p draw's passes over the logits in one kernel
                       (noise, candidates, sums; used by ``models.sampling``).
``config.py``          :class:`GpuConfig`, the choices a call passes (static under jit).
``dispatch.py``        which kernels run a call: a pure function of shapes and config.
"""

from __future__ import annotations

import functools

from pallas_kernels.gpu.config import FusedDecodeOptions, GpuConfig, MosaicPrefixOptions
from pallas_kernels.gpu.segment import segment_attention
from pallas_kernels.gpu.shared import prefix_attention, shared_attention
from pallas_kernels.gpu.suffix import suffix_attention
from pallas_kernels.base import AttentionOps

__all__ = ["AttentionOps", "FusedDecodeOptions", "GpuConfig", "MosaicPrefixOptions", "get_ops",
           "prefix_attention", "segment_attention", "shared_attention", "suffix_attention"]


def get_ops(interpret: bool | None = None, mosaic: bool = False,
            config: GpuConfig | None = None) -> AttentionOps:
  """The GPU family; ``mosaic`` uses the Hopper kernels where they apply, ``config`` the
  choices of :class:`GpuConfig` (None: its defaults).

  ``interpret=None`` picks native vs interpret mode when lowering.
  """
  if config is not None and not isinstance(config, GpuConfig):
    raise TypeError(f"pallas_kernels.gpu.get_ops: config must be a GpuConfig or None; got "
                    f"{type(config).__name__}")
  config = GpuConfig() if config is None else config
  name = "pallas:mosaic_gpu" if mosaic else "pallas:triton"
  return AttentionOps(
      name,
      functools.partial(prefix_attention, mosaic=mosaic, config=config, interpret=interpret),
      functools.partial(segment_attention, interpret=interpret),
      functools.partial(suffix_attention, interpret=interpret),
      functools.partial(shared_attention, mosaic=mosaic, config=config, interpret=interpret),
  )
