"""The TPU family's tuning choices, as a value (frozen, hashable: static under jit).

A :class:`TpuConfig` travels with the call (``shared_prefix_attention(..., config=TpuConfig())``)
into :mod:`pallas_kernels.tpu.dispatch`: the block sizes of an explicit ``block_sizes``, else the
per-chip heuristic of ``chip`` (:func:`pallas_kernels.tpu.common.block_sizes_for`, a function of
the :data:`pallas_kernels.tpu.common.CHIPS` table), else of the chip the program runs on.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from pallas_kernels.tpu.common import CHIPS, BlockSizes


@dataclasses.dataclass(frozen=True)
class TpuConfig:
  """The TPU family's choices (``impl="pallas:tpu"``).

  Attributes:
    chip: ``"v5e"``, ``"v5p"`` or ``"v6e"``: that chip's block sizes (e.g. when exporting for it
      from a CPU); None: the chip of the default backend, else v5e's (the smallest limits).
    block_sizes: explicit :class:`BlockSizes` (overrides ``chip``).
  """

  chip: Optional[str] = None
  block_sizes: Optional[BlockSizes] = None

  def __post_init__(self):
    if self.chip is not None and self.chip not in CHIPS:
      raise ValueError(f"TpuConfig: {self.chip=} must be None or one of {sorted(CHIPS)}")
    if self.block_sizes is not None and not isinstance(self.block_sizes, BlockSizes):
      raise ValueError(f"TpuConfig: {self.block_sizes=} must be None or a BlockSizes")
