"""Which block sizes the TPU kernels run with: a pure function of the config, the chip and the
shapes (:func:`plan`), the one place the TPU family decides; the kernels execute its result."""

from __future__ import annotations

import dataclasses
from typing import Optional

from pallas_kernels.tpu import common
from pallas_kernels.tpu.common import BlockSizes
from pallas_kernels.tpu.config import TpuConfig


@dataclasses.dataclass(frozen=True)
class TpuPlan:
  """The TPU family's plan for one call.

  Attributes:
    chip: whose block sizes (``CHIPS`` key).
    block_sizes: the :class:`BlockSizes` every kernel of the call reads.
    prefix_blocks: per shared prefix part, the prefix kernel's ``(block_rows, block_keys,
      chunk)`` (:func:`pallas_kernels.tpu.prefix.prefix_blocks`).
    reasons: why, in words.
  """

  chip: str
  block_sizes: BlockSizes
  prefix_blocks: tuple = ()
  reasons: tuple[str, ...] = ()


def chip_for(config: Optional[TpuConfig] = None, device_kind: Optional[str] = None) -> str:
  """The config's chip, else the one ``device_kind`` names, else the default backend's."""
  if config is not None and config.chip is not None:
    return config.chip
  if device_kind is not None:
    return common.chip_of_device_kind(device_kind)
  return common.detect_chip()


def block_sizes(config: Optional[TpuConfig] = None,
                device_kind: Optional[str] = None) -> BlockSizes:
  """The block sizes a call runs with (explicit, else the chip's heuristic)."""
  if config is not None and config.block_sizes is not None:
    return config.block_sizes
  return common.block_sizes_for(chip_for(config, device_kind))


def plan(q, parts=(), suffix_k=None, *, config: Optional[TpuConfig] = None,
         device_kind: Optional[str] = None) -> TpuPlan:
  """The plan for ``q [B, Tq, Hq, D]``, shared ``parts`` (``(kind, k, ...)`` as the kernels take
  them; arrays or ``jax.ShapeDtypeStruct``) and ``suffix_k [B, S, Hkv, D]``."""
  from pallas_kernels.tpu.prefix import prefix_blocks
  config = TpuConfig() if config is None else config
  chip = chip_for(config, device_kind)
  bs = block_sizes(config, device_kind)
  if config.block_sizes is not None:
    reasons = ["block sizes given by the config"]
  elif config.chip is not None:
    reasons = [f"block sizes of the config's chip {chip} (the per-chip heuristic)"]
  else:
    reasons = [f"block sizes of {chip}, the chip the call runs on (v5e's where unknown)"]
  b, tq, hq, d = q.shape
  blocks = []
  for kind, k, *_ in parts:
    if kind == "prefix":
      hkv = k.shape[1]
      dtype = common.compute_dtype(q, k)
      dp = common.round_up(d, common.LANES)
      blocks.append(prefix_blocks(b * tq * (hq // hkv), k.shape[0], dp, dtype.itemsize, bs))
  if blocks:
    reasons.append(f"prefix kernel (block_rows, block_keys, chunk) per prefix part: {blocks}")
  return TpuPlan(chip, bs, tuple(blocks), tuple(reasons))
