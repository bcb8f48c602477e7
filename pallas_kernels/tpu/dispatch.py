"""Which blocks the TPU kernels run with: a pure function of the config, the device planned for
and the shapes (:func:`plan`), the one place the TPU family decides; the kernels execute its
result (:func:`pallas_kernels.tpu.shared.run_plan`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from pallas_kernels.device import DeviceInfo
from pallas_kernels.tpu import common, paged, prefix, segment, suffix
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
      (:func:`pallas_kernels.tpu.prefix.rows_blocks`), or the segment kernel's
      (:func:`pallas_kernels.tpu.segment.rows_blocks`) for a tree level; None where it has no
      rows or no keys (nothing runs).
    suffix_blocks: the suffix kernel's :class:`~pallas_kernels.tpu.suffix.SuffixBlocks`, or for
      a paged call the paged suffix kernel's :class:`~pallas_kernels.tpu.paged.PagedBlocks`
      (None where it has no keys or no rows).
    reasons: why, in words.
    path: "paged" for a plan of ``paged_attention`` (:func:`plan_paged`), None otherwise.
  """

  device: DeviceInfo
  chip: str
  block_sizes: BlockSizes
  prefix_blocks: tuple = ()
  suffix_blocks: object = None
  reasons: tuple[str, ...] = ()
  path: Optional[str] = None


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


def _block_sizes_and_reasons(config: TpuConfig, device: DeviceInfo):
  chip = chip_for(config, device)
  if config.block_sizes is not None:
    reasons = ["block sizes given by the config"]
  elif config.chip is not None:
    reasons = [f"block sizes of the config's chip {chip} (the per-chip heuristic)"]
  else:
    reasons = [f"block sizes of {chip}, the chip planned for ({device.device_kind}; v5e's "
               f"where it is no TPU)"]
  return chip, block_sizes(config, device), reasons


def plan(q, parts=(), suffix_k=None, *, device: DeviceInfo,
         config: Optional[TpuConfig] = None) -> TpuPlan:
  """The plan for ``q [B, Tq, Hq, D]``, shared ``parts`` (``(kind, k, ...)`` as the kernels take
  them; arrays or ``jax.ShapeDtypeStruct``) and ``suffix_k [B, S, Hkv, D]``."""
  config = TpuConfig() if config is None else config
  chip, bs, reasons = _block_sizes_and_reasons(config, device)
  b, tq, hq, d = q.shape
  hkv = suffix_k.shape[2] if suffix_k is not None else parts[0][1].shape[-2]
  # The kernels read q folded once, in the dtype of all the inputs (run_plan).
  dtype = common.compute_dtype(q, *([] if suffix_k is None else [suffix_k]),
                               *[p[1] for p in parts])
  rows = jax.ShapeDtypeStruct((hkv, b * tq * (hq // hkv), d), dtype)
  blocks = []
  for kind, k, v, *_ in parts:
    blocks.append((prefix if kind == "prefix" else segment).rows_blocks(rows, k, v, bs))
  if blocks:
    reasons.append(f"prefix/segment kernel (block_rows, block_keys, chunk) per part: {blocks}")
  sblocks = None
  if suffix_k is not None:
    sblocks = suffix.rows_blocks(rows, suffix_k, suffix_k, bs, bool(parts))
    reasons.append(f"suffix kernel: {sblocks}")
  return TpuPlan(device, chip, bs, tuple(blocks), sblocks, tuple(reasons))


def paged_levels(level_tables, k_pages):
  """The shared parts a paged call runs, as shapes: a level of one segment is a ``("prefix",
  k [P * page_size, Hkv, D], ...)`` part (its pages gathered once, read once for every query
  by the prefix kernel), a level of several a ``("segments", k [S, P * page_size, Hkv, D],
  ...)`` part (its pages gathered, for the segment kernel)."""
  ps, rest = k_pages.shape[1], tuple(k_pages.shape[2:])
  parts = []
  for table in level_tables:
    n, p = table.shape
    if n == 1:
      k = jax.ShapeDtypeStruct((p * ps,) + rest, k_pages.dtype)
      parts.append(("prefix", k, k, None, None))
    else:
      k = jax.ShapeDtypeStruct((n, p * ps) + rest, k_pages.dtype)
      parts.append(("segments", k, k, None, None))
  return parts


def plan_paged(q, level_tables, k_pages, page_table, *, device: DeviceInfo,
               config: Optional[TpuConfig] = None) -> TpuPlan:
  """The plan of ``paged_attention`` for ``q [B, Tq, Hq, D]``, the levels' page tables
  ``[S, P]`` (arrays or shapes), the pools ``k_pages [pages, page_size, Hkv, D]`` and the own
  pages ``page_table [B, O]``: the shared levels' kernels on their gathered pages
  (:func:`paged_levels`), each sequence's own pages read in place by the paged suffix kernel."""
  config = TpuConfig() if config is None else config
  chip, bs, reasons = _block_sizes_and_reasons(config, device)
  b, tq, hq, d = q.shape
  hkv = k_pages.shape[2]
  parts = paged_levels(level_tables, k_pages)
  dtype = common.compute_dtype(q, k_pages)
  rows = jax.ShapeDtypeStruct((hkv, b * tq * (hq // hkv), d), dtype)
  blocks = [(prefix if kind == "prefix" else segment).rows_blocks(rows, k, v, bs)
            for kind, k, v, _, _ in parts]
  if parts:
    reasons.append("shared levels: the pages of each gathered once (one segment: one copy "
                   "read by the prefix kernel for every query; several: the segment kernel), "
                   f"(block_rows, block_keys, chunk) per level: {blocks}")
  pblocks = paged.paged_rows_blocks(rows, k_pages, page_table, bs, bool(parts))
  reasons.append(f"own pages read in place by the paged suffix kernel (page table by scalar "
                 f"prefetch, {k_pages.shape[1]}-token pages): {pblocks}")
  return TpuPlan(device, chip, bs, tuple(blocks), pblocks, tuple(reasons), path="paged")
