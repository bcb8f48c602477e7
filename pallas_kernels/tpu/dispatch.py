"""Which block sizes the TPU kernels run with: a pure function of the config, the device planned
for and the shapes (:func:`plan`), the one place the TPU family decides; the kernels execute its
result (:func:`pallas_kernels.tpu.shared.shared_attention` with ``block_sizes`` of the plan)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from pallas_kernels.device import DeviceInfo
from pallas_kernels.tpu import common
from pallas_kernels.tpu.common import BlockSizes
from pallas_kernels.tpu.config import TpuConfig


@dataclasses.dataclass(frozen=True)
class TpuPlan:
  """The TPU family's plan for one call.

  Attributes:
    device: the device planned for.
    chip: whose block sizes (``CHIPS`` key).
    block_sizes: the :class:`BlockSizes` every kernel of the call reads.
    prefix_blocks: per shared part, the prefix kernel's ``(block_rows, block_keys, chunk)``
      (:func:`pallas_kernels.tpu.prefix.prefix_blocks`), or the segment kernel's
      (:func:`pallas_kernels.tpu.segment.segment_blocks`) for a tree level.
    suffix_blocks: the suffix kernel's :class:`~pallas_kernels.tpu.suffix.SuffixBlocks`
      (None where it has no keys or no rows).
    reasons: why, in words.
  """

  device: DeviceInfo
  chip: str
  block_sizes: BlockSizes
  prefix_blocks: tuple = ()
  suffix_blocks: object = None
  reasons: tuple[str, ...] = ()


def chip_for(config: Optional[TpuConfig], device: DeviceInfo) -> str:
  """The config's chip, else the one ``device`` is (v5e's where it is no TPU)."""
  if config is not None and config.chip is not None:
    return config.chip
  return common.chip_of_device_kind(device.device_kind if device.platform == "tpu" else "")


def block_sizes(config: Optional[TpuConfig], device: DeviceInfo) -> BlockSizes:
  """The block sizes a call runs with (explicit, else the chip's heuristic)."""
  if config is not None and config.block_sizes is not None:
    return config.block_sizes
  return common.block_sizes_for(chip_for(config, device))


def plan(q, parts=(), suffix_k=None, *, device: DeviceInfo,
         config: Optional[TpuConfig] = None) -> TpuPlan:
  """The plan for ``q [B, Tq, Hq, D]``, shared ``parts`` (``(kind, k, ...)`` as the kernels take
  them; arrays or ``jax.ShapeDtypeStruct``) and ``suffix_k [B, S, Hkv, D]``."""
  from pallas_kernels.tpu.prefix import prefix_blocks
  from pallas_kernels.tpu.segment import segment_blocks
  from pallas_kernels.tpu.suffix import suffix_blocks
  config = TpuConfig() if config is None else config
  chip = chip_for(config, device)
  bs = block_sizes(config, device)
  if config.block_sizes is not None:
    reasons = ["block sizes given by the config"]
  elif config.chip is not None:
    reasons = [f"block sizes of the config's chip {chip} (the per-chip heuristic)"]
  else:
    reasons = [f"block sizes of {chip}, the chip planned for ({device.device_kind}; v5e's "
               f"where it is no TPU)"]
  b, tq, hq, d = q.shape
  rows = b * tq * hq  # every KV head's rows: B * Tq * G
  blocks = []
  for kind, k, v, *_ in parts:
    hkv = k.shape[-2]
    itemsize = common.compute_dtype(q, k).itemsize
    dp = common.round_up(max(d, v.shape[-1]), common.LANES)
    if kind == "prefix":
      blocks.append(prefix_blocks(rows // hkv, k.shape[0], dp, itemsize, bs))
    else:
      blocks.append(segment_blocks(rows // hkv, k.shape[0], k.shape[1], dp, itemsize, bs))
  if blocks:
    reasons.append(f"prefix/segment kernel (block_rows, block_keys, chunk) per part: {blocks}")
  sblocks = None
  if suffix_k is not None and suffix_k.shape[1] and b * tq * hq:
    hkv = suffix_k.shape[2]
    itemsize = common.compute_dtype(q, suffix_k, *[p[1] for p in parts]).itemsize
    sblocks = suffix_blocks(b, hkv, suffix_k.shape[1], tq * (hq // hkv),
                            common.round_up(d, common.LANES), itemsize, bs, bool(parts))
    reasons.append(f"suffix kernel: {sblocks}")
  return TpuPlan(device, chip, bs, tuple(blocks), sblocks, tuple(reasons))
