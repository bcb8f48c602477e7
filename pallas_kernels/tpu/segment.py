"""One level of a sharing tree on TPU: grouped (ragged) attention over N shared segments.

Hydragen Sec. 3.3: sequence ``b`` continues segment ``node_of_seq[b]``; each
segment is attended by the queries of all its sequences in one matrix product,
the segment read once per row tile. The rows (``Tq * G`` per sequence and KV
head) are sorted by segment, so each segment owns a contiguous row range
("group"), and the row space is cut into tiles of ``block_rows``. As in
megablox' grouped matmul, a tile that straddles a group boundary is *visited*
once per group it holds: visit ``v`` = (tile, group), ordered so that the
visits of one tile are consecutive and its output block stays in VMEM while
each visit writes the rows of its own group. The visit table, group ranges
and segment lengths travel by scalar prefetch; the index maps read the
segment id of the visit from SMEM. Sequences with ``node_of_seq == -1`` (and
the padding rows) form a last group with no keys: they come out ``(0, -inf)``.

Grid ``(Hkv, visits, key_blocks)`` with ``visits <= tiles + N`` (static),
semantics (parallel, arbitrary, arbitrary): revisited output tiles need the
visits in order, so only the head axis is split across megacore TensorCores.
Visits past the dynamic count repeat the last one's block indices (no DMA) and
do nothing.

Contents, side by side: kernel (:func:`_segment_kernel`), the visit table
(:func:`group_metadata`), ``pallas_call`` on kernel-native arrays
(:func:`segment_attention_head_major`), the primitive with the reference's
signature (:func:`segment_attention`) and its reference
(:data:`segment_attention_reference` = :func:`pallas_kernels.base.segment_attention`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import base
from pallas_kernels.tpu import common
from pallas_kernels.tpu.common import LANES, BlockSizes
from pallas_kernels.tpu.prefix import (fold_rows, last_block, prefix_blocks, row_operands,
                                       row_values, unfold_rows, variants)

segment_attention_reference = base.segment_attention


def _segment_kernel(
    visit_group_ref,  # SMEM int32 [V]: group of visit v (N = "no segment")
    visit_tile_ref,  # SMEM int32 [V]: row tile of visit v
    visit_active_ref,  # SMEM int32 [V]: 0 for the padding visits past the dynamic count
    group_start_ref,  # SMEM int32 [N + 1]: first sorted row of each group
    group_end_ref,  # SMEM int32 [N + 1]: one past its last row
    group_length_ref,  # SMEM int32 [N + 1]: valid keys of the group's segment (0 for N)
    q_ref,  # [block_rows, D]: sorted rows
    k_ref,  # [block_keys, D]: the visit's segment
    v_ref,  # [block_keys, D]
    *refs,  # with ``mods``: the sorted rows' positions and/or slopes [block_rows, 128]; then
    # out_ref [block_rows, D] float32 (revisited by the visits of one tile), lse_ref
    # [block_rows, 128] float32 (natural log, lane-replicated) and the scratch m_ref, l_ref
    # [block_rows, 128], acc_ref [block_rows, D] float32
    scale: float, chunk: int, mods: Optional[base.KernelMods] = None,
):
  out_ref, lse_ref, m_ref, l_ref, acc_ref = refs[-5:]
  row_mods = row_values(mods, refs[:-5])
  v, j = pl.program_id(1), pl.program_id(2)
  block_rows, block_keys = q_ref.shape[0], k_ref.shape[0]
  group = visit_group_ref[v]
  length = group_length_ref[group]
  active = visit_active_ref[v] > 0

  @pl.when(j == 0)
  def _init():
    common.init_state(m_ref, l_ref, acc_ref)

  # An inactive visit computes nothing: its "length" is 0.
  common.key_chunks(q_ref, k_ref, v_ref, j * block_keys, jnp.where(active, length, 0), chunk,
                    m_ref, l_ref, acc_ref, scale=scale, mods=row_mods)

  @pl.when(jnp.logical_and(active, j == pl.num_programs(2) - 1))
  def _finish():
    out, lse = common.final_state(m_ref, l_ref, acc_ref)
    first_row = visit_tile_ref[v] * block_rows
    lo, hi = group_start_ref[group], group_end_ref[group]

    def mine(shape):
      row = first_row + lax.broadcasted_iota(jnp.int32, shape, 0)
      return jnp.logical_and(row >= lo, row < hi)

    out_ref[...] = jnp.where(mine(out.shape), out, out_ref[...])
    lse_ref[...] = jnp.where(mine(lse.shape), lse, lse_ref[...])


class GroupMetadata(NamedTuple):
  order: jax.Array  # int32 [B]: sequences sorted by segment (stable; "no segment" last)
  visit_group: jax.Array  # int32 [V]
  visit_tile: jax.Array  # int32 [V]
  visit_active: jax.Array  # int32 [V]
  group_start: jax.Array  # int32 [N + 1]
  group_end: jax.Array  # int32 [N + 1]


def group_metadata(node_of_seq: jax.Array, num_segments: int, rows_per_seq: int,
                   block_rows: int) -> GroupMetadata:
  """The visit table for sequences ``node_of_seq`` (traced values are fine).

  Group ``n < N`` holds the rows of the sequences on segment ``n``; group ``N`` holds
  the sequences with no segment (any value outside ``[0, N)``) and the padding rows up
  to a whole number of tiles. ``V = tiles + N`` visits always suffice: the groups
  partition the tiles' rows, and every group boundary adds at most one visit.
  """
  n = num_segments
  b = node_of_seq.shape[0]
  tiles = common.cdiv(b * rows_per_seq, block_rows)
  node = node_of_seq.astype(jnp.int32)
  key = jnp.where((node >= 0) & (node < n), node, n)
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  counts = jnp.zeros((n + 1,), jnp.int32).at[key].add(1)
  end = jnp.cumsum(counts * rows_per_seq).at[n].set(tiles * block_rows).astype(jnp.int32)
  start = jnp.concatenate([jnp.zeros((1,), jnp.int32), end[:-1]])
  first, last = start // block_rows, (end - 1) // block_rows
  visits = jnp.where(end > start, last - first + 1, 0)
  cum = jnp.cumsum(visits)
  v = jnp.arange(tiles + n, dtype=jnp.int32)
  vv = jnp.minimum(v, cum[-1] - 1)  # padding visits repeat the last real one
  # compare_all: no while loop in the program (V x (N + 1) compares, tiny)
  group = jnp.searchsorted(cum, vv, side="right", method="compare_all").astype(jnp.int32)
  tile = first[group] + vv - (cum[group] - visits[group])
  return GroupMetadata(order, group, tile.astype(jnp.int32), (v < cum[-1]).astype(jnp.int32),
                       start, end)


def segment_attention_head_major(
    q: jax.Array,  # [Hkv, R, D]: rows sorted by group; R % block_rows == 0; D % 128 == 0
    k: jax.Array,  # [N, Hkv, T, D]; T % block_keys == 0
    v: jax.Array,  # [N, Hkv, T, D]
    group_length: jax.Array,  # int32 [N + 1]: valid keys per segment, then 0
    meta: GroupMetadata,
    *row_args,  # with ``mods``: the sorted rows' positions and/or slopes [Hkv, R, 128]
    scale: float,
    block_rows: int,
    block_keys: int,
    chunk: Optional[int] = None,
    vmem_limit_bytes: Optional[int] = None,
    interpret: Optional[bool] = None,
    mods: Optional[base.KernelMods] = None,
):
  """The grouped kernel on kernel-native arrays (``chunk``, ``mods`` and ``row_args`` as in
  the prefix kernel).

  Returns float32 ``out [Hkv, R, D]`` and ``lse [Hkv, R, 128]`` for the sorted rows:
  natural-log LSE replicated over the lanes; ``(0, -inf)`` for rows of group N.
  """
  hkv, rows, d = q.shape
  n, _, t, _ = k.shape
  if rows % block_rows or t % block_keys or d % LANES:
    raise ValueError(f"segment_attention_head_major: R={rows}, T={t}, D={d} must be multiples "
                     f"of block_rows={block_rows}, block_keys={block_keys} and {LANES}")
  visits = meta.visit_group.shape[0]
  grid = (hkv, visits, t // block_keys)

  def row_map(h, v, j, group, tile, active, start, end, length):
    return (h, tile[v], 0)

  def kv_map(h, v, j, group, tile, active, start, end, length):
    g = group[v]
    last = last_block(length[g], block_keys)
    blk = jnp.where(active[v] > 0, jnp.minimum(j, last), last)
    return (jnp.minimum(g, n - 1), h, blk, 0)

  row_spec = pl.BlockSpec((None, block_rows, d), row_map)
  lse_spec = pl.BlockSpec((None, block_rows, LANES), row_map)
  kv_spec = pl.BlockSpec((None, None, block_keys, d), kv_map)
  itemsize = q.dtype.itemsize
  cost = pl.CostEstimate(
      flops=4 * hkv * rows * t * d, transcendentals=hkv * rows * t,
      bytes_accessed=hkv * (rows * d * itemsize + visits * 2 * t * d * itemsize
                            + rows * (d + LANES) * 4))

  def build(interpret_value):
    return pl.pallas_call(
        functools.partial(_segment_kernel, scale=scale, chunk=chunk or block_keys, mods=mods),
        out_shape=(jax.ShapeDtypeStruct((hkv, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((hkv, rows, LANES), jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6, grid=grid,
            in_specs=[row_spec, kv_spec, kv_spec] + [lse_spec] * len(row_args),
            out_specs=[row_spec, lse_spec],
            scratch_shapes=[pltpu.VMEM((block_rows, LANES), jnp.float32),
                            pltpu.VMEM((block_rows, LANES), jnp.float32),
                            pltpu.VMEM((block_rows, d), jnp.float32)]),
        compiler_params=common.compiler_params(("parallel", "arbitrary", "arbitrary"),
                                               vmem_limit_bytes),
        cost_estimate=cost, interpret=interpret_value, name="hydragen_segment_attention")

  args = (meta.visit_group, meta.visit_tile, meta.visit_active, meta.group_start, meta.group_end,
          group_length, q, k, v, *row_args)
  return common.dispatch(build, args, interpret)


def segment_blocks(rows: int, num_segments: int, keys: int, d: int, itemsize: int,
                   block_sizes: BlockSizes) -> tuple[int, int, int]:
  """``(block_rows, block_keys, chunk)``: as the prefix's, but row tiles are sized to the mean
  group (rows / N), so a level with many small groups does not pay a prefix-sized
  tile per group."""
  return prefix_blocks(common.cdiv(rows, num_segments), keys, d, itemsize, block_sizes)


def rows_blocks(q_rows, k, v, block_sizes: BlockSizes) -> Optional[tuple[int, int, int]]:
  """The blocks :func:`segment_rows` runs ``q_rows [Hkv, R, D]`` against ``k, v [N, T, Hkv, D]``
  with (None where nothing runs: no rows or no keys); shapes and dtypes only."""
  rows, (n, t) = q_rows.shape[1], k.shape[:2]
  if rows == 0 or t == 0:
    return None
  dp = common.round_up(max(q_rows.shape[-1], v.shape[-1]), LANES)
  return segment_blocks(rows, n, t, dp, common.compute_dtype(q_rows, k, v).itemsize, block_sizes)


def segment_attention(
    q: jax.Array,  # [B, Tq, Hq, D]
    k: jax.Array,  # [N, T, Hkv, D]
    v: jax.Array,  # [N, T, Hkv, D]
    *,
    lengths: jax.Array,  # int32 [N]
    node_of_seq: jax.Array,  # int32 [B]; -1: the sequence has no segment at this level
    scale: float,
    block_sizes: BlockSizes,
    interpret: Optional[bool] = None,
    mods: Optional[base.ScoreMods] = None,  # variants, with the level's offset
):
  """One level of a sharing tree on TPU: sequence b attends to segment node_of_seq[b].

  Same signature and semantics as :func:`pallas_kernels.base.segment_attention`
  (non-causal): returns float32 ``out [B, Tq, Hq, D]`` and float32 natural-log
  ``lse [B, Tq, Hq] = log(sum_j exp(scale * q . k_j))`` over the first
  ``lengths[node_of_seq[b]]`` keys of the segment; ``(0, -inf)`` for sequences with
  ``node_of_seq == -1`` or an empty segment. Each segment is read once per row tile of
  its sequences, never copied per sequence.

  Example:
    >>> out, lse = segment_attention(q, k, v, lengths=jnp.array([9, 4]),
    ...                              node_of_seq=jnp.array([0, 0, 1, -1]), scale=0.125)
  """
  b, tq, hq = q.shape[:3]
  q_rows = fold_rows(q, k.shape[2])
  out, lse = segment_rows(q_rows, k, v, lengths, node_of_seq, scale=scale,
                          blocks=rows_blocks(q_rows, k, v, block_sizes),
                          vmem_limit_bytes=block_sizes.vmem_limit_bytes, interpret=interpret,
                          mods=variants(mods, b, tq, hq, k.shape[2], mods and mods.offset))
  return unfold_rows(out[..., :v.shape[-1]], b, tq, hq), unfold_rows(lse[..., 0], b, tq, hq)


def segment_rows(
    q_rows: jax.Array,  # [Hkv, B*Tq*G, D] (prefix.fold_rows), any float dtype
    k: jax.Array,  # [N, T, Hkv, D]
    v: jax.Array,  # [N, T, Hkv, D]
    lengths: jax.Array,  # int32 [N]
    node_of_seq: jax.Array,  # int32 [B]
    *,
    scale: float,
    blocks: Optional[tuple[int, int, int]],
    vmem_limit_bytes: Optional[int] = None,
    interpret: Optional[bool] = None,
    mods=None,
):
  """The grouped kernel on folded rows (sorted and unsorted here) with ``blocks =
  (block_rows, block_keys, chunk)`` (:func:`rows_blocks`), kernel layout out; ``mods``: score
  variants over the rows (:func:`pallas_kernels.tpu.prefix.variants`, the level's offset).

  Returns float32 ``out [Hkv, R, Dp]`` (zero lanes past D) and ``lse [Hkv, R, 128]``
  (natural log, lane-replicated) in the original row order.
  """
  hkv, rows, d = q_rows.shape
  n, t = k.shape[:2]
  b = node_of_seq.shape[0]
  dp = common.round_up(max(d, v.shape[-1]), LANES)
  if rows == 0 or t == 0:
    return (jnp.zeros((hkv, rows, dp), jnp.float32),
            jnp.full((hkv, rows, LANES), -jnp.inf, jnp.float32))
  dtype = common.compute_dtype(q_rows, k, v)
  rows_per_seq = rows // b
  block_rows, block_keys, chunk = blocks
  meta = group_metadata(jnp.asarray(node_of_seq), n, rows_per_seq, block_rows)
  qs = q_rows.astype(dtype).reshape(hkv, b, rows_per_seq, d)[:, meta.order]
  qs = common.pad_to(qs.reshape(hkv, rows, d), (hkv, common.round_up(rows, block_rows), dp))
  tp = common.round_up(t, block_keys)
  kh = common.pad_to(jnp.swapaxes(k.astype(dtype), 1, 2), (n, hkv, tp, dp))
  vh = common.pad_to(jnp.swapaxes(v.astype(dtype), 1, 2), (n, hkv, tp, dp))
  seg_len = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, t)
  group_length = jnp.concatenate([seg_len, jnp.zeros((1,), jnp.int32)])
  sorted_rows = (meta.order[:, None] * rows_per_seq + jnp.arange(rows_per_seq)).reshape(-1)
  row_args = row_operands(mods, rows, hkv, qs.shape[1], order=sorted_rows)
  out, lse = segment_attention_head_major(qs, kh, vh, group_length, meta, *row_args,
                                          scale=scale, block_rows=block_rows,
                                          block_keys=block_keys, chunk=chunk,
                                          vmem_limit_bytes=vmem_limit_bytes,
                                          interpret=interpret, mods=mods and mods[0])
  inverse = jnp.argsort(meta.order)

  def unsort(x):
    x = x[:, :rows].reshape(hkv, b, rows_per_seq, x.shape[-1])[:, inverse]
    return x.reshape(hkv, rows, x.shape[-1])

  return unsort(out), unsort(lse)
