"""GPU kernel family (Pallas): Triton kernels for any CUDA GPU, Mosaic GPU on Hopper.

The entry points (``shared.py``; :func:`get_ops` binds them):

``prefix_attention``   batched prefix attention, rows = B * Tq * G per KV head
                       on the tensor cores (Triton ``tl.dot``, or on Hopper a
                       wgmma/TMA Mosaic GPU kernel), key splits for small batches.
``suffix_attention``   ragged per-sequence attention (flash-decoding splits for
                       small batches) that merges the shared parts in-kernel.
``segment_attention``  a tree level: rows grouped by segment in tiles.
``shared_attention``   the whole decomposition in the folded row layout (``shared.py``); on
                       Hopper, decoding with one shared prefix runs prefix and suffixes in ONE
                       Mosaic GPU kernel (``shared_mgpu``).
``paged_attention``    the decomposition over page pools (the serving engine's cache): the
                       segment and suffix kernels read the pages in place.
``sampler.py``         not attention: the top-p draw's passes over the logits in one kernel
                       (noise, candidates, sums; used by ``models.generation.sampling``).
``config.py``          :class:`GpuConfig`, the choices a call passes (static under jit).
``dispatch.py``        the plan of a call (:class:`~pallas_kernels.gpu.dispatch.GpuPlan`: every
                       kernel and its config), a pure function of shapes, config and the
                       :class:`~pallas_kernels.device.DeviceInfo` planned for;
                       ``shared.run_plan`` executes it.
``tuned.py``           the kernels' tuned tiles, by device kind and shape.
"""

from __future__ import annotations

import functools

from pallas_kernels.base import AttentionOps
from pallas_kernels.device import DeviceInfo
from pallas_kernels.gpu.config import FusedDecodeOptions, GpuConfig, MosaicPrefixOptions

# The entry points live in pallas_kernels.gpu.shared; importing this package (for its config,
# e.g. from a CPU-only program) does not load the Triton and Mosaic GPU stacks.
__all__ = ["AttentionOps", "FusedDecodeOptions", "GpuConfig", "MosaicPrefixOptions", "get_ops"]


def get_ops(interpret: bool | None = None, mosaic: bool = False,
            config: GpuConfig | None = None, *, device: DeviceInfo | None = None,
            plan=None) -> AttentionOps:
  """The GPU family; ``mosaic`` uses the Hopper kernels where they apply, ``config`` the
  choices of :class:`GpuConfig` (None: its defaults), planned for ``device`` (None: the
  default GPU, else :data:`pallas_kernels.device.DEFAULT_KIND`'s).

  ``plan`` (a :class:`~pallas_kernels.gpu.dispatch.GpuPlan` of one call's shapes): the
  ``shared_attention`` (or, for a "suffix" plan, ``suffix_attention``) entry executes it as it
  is; the other entries plan each call themselves. ``interpret=None`` picks native vs
  interpret mode when lowering.
  """
  from pallas_kernels.gpu.shared import (paged_attention, prefix_attention, segment_attention,
                                         shared_attention, suffix_attention)

  if config is not None and not isinstance(config, GpuConfig):
    raise TypeError(f"pallas_kernels.gpu.get_ops: config must be a GpuConfig or None; got "
                    f"{type(config).__name__}")
  config = GpuConfig() if config is None else config
  if device is None:
    device = plan.device if plan is not None else DeviceInfo.for_target("gpu")
  name = "pallas:mosaic_gpu" if mosaic else "pallas:triton"
  bind = functools.partial
  suffix_plan = plan if plan is not None and plan.path == "suffix" else None
  paged_plan = plan if plan is not None and plan.path == "paged" else None
  shared_plan = plan if plan is not None and plan.path not in ("suffix", "paged") else None
  return AttentionOps(
      name,
      bind(prefix_attention, device=device, mosaic=mosaic, config=config, interpret=interpret),
      bind(segment_attention, device=device, interpret=interpret),
      bind(suffix_attention, device=device, plan=suffix_plan, interpret=interpret),
      bind(shared_attention, device=device, mosaic=mosaic, config=config, plan=shared_plan,
           interpret=interpret),
      bind(paged_attention, device=device, plan=paged_plan, interpret=interpret),
  )
