"""One level of a sharing tree on GPUs (Pallas Triton): grouped prefix attention.

A level holds N shared segments; sequence b continues segment
``node_of_seq[b]`` (-1: none). The query rows are sorted by segment and cut
into row tiles that never cross a segment (a grouped, "megablox"-style
layout): tile t carries the id of its segment, and the kernel streams only
that segment's valid keys. Each segment is therefore one batched matrix
product over all the queries that share it, with at most one partial tile
per segment of padding. Grid: ``(tiles, KV heads)``.

Reference with the same signature: :func:`pallas_kernels.base.segment_attention`.
LSE is natural log.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.base import KernelMods, ScoreMods, merge_states
from pallas_kernels.base import segment_attention as segment_attention_reference  # noqa: F401  (the reference of this kernel)
from pallas_kernels.device import DeviceInfo
from pallas_kernels.gpu import common, tuned


@dataclasses.dataclass(frozen=True)
class SegmentConfig:
  block_m: int
  block_n: int
  num_warps: int
  num_stages: int
  splits: int = 1  # key splits per segment: partial states merged by the caller


def with_key_splits(cfg: SegmentConfig, rows: int, segments: int, kv_heads: int, keys: int, *,
                    device: DeviceInfo, min_steps: int = 4) -> SegmentConfig:
  """``cfg`` with the segments' keys split so that about two programs run per SM: the row
  tiles alone (``~rows / block_m + segments`` per KV head) cannot fill the machine when few
  queries share a long segment. Each split keeps at least ``min_steps`` key steps."""
  programs = (pl.cdiv(rows, cfg.block_m) + segments) * kv_heads
  splits = max(1, min(pl.cdiv(2 * device.cores, programs),
                      keys // (min_steps * cfg.block_n)))
  return dataclasses.replace(cfg, splits=splits)


def default_config(rows: int, segments: int, head_dim: int, itemsize: int = 2, *,
                   device: DeviceInfo) -> SegmentConfig:
  """Tiles sized to the average number of rows per segment (16 up to the tuned ``block_m``);
  key steps sized to the shared memory (``itemsize``: bytes per K/V element); the tuned warps
  for full tiles, 4 for smaller ones (:func:`pallas_kernels.gpu.tuned.tiles`)."""
  t = tuned.tiles(device, "segment", tuned.head_dim_class(head_dim))
  avg = max(1, rows // max(1, segments))
  block_m = min(t.block_m, max(common.MIN_DOT, common.next_pow2(avg)))
  block_n = common.fit_block_n(t.block_n, head_dim, itemsize, t.num_stages)
  return SegmentConfig(block_m, block_n, num_warps=t.num_warps if block_m >= t.block_m else 4,
                       num_stages=t.num_stages)


def _kernel(tile_node_ref, len_ref, q_ref, k_ref, v_ref, *refs, scale: float, head_dim: int,
            block_n: int, page_size: int | None, width: int, keys_per_split: int | None,
            mods: KernelMods | None = None):
  # tile_node_ref: [tiles] int32; len_ref: [N]; q_ref: [block_m, Dp]; k_ref/v_ref: [N, T, Dp],
  # or with ``page_size`` the pools [pages * page_size, Dp] and refs[0] the page table [N * width];
  # with ``mods``: the rows' positions [block_m] (ALiBi or a window) and slopes [block_m] (ALiBi)
  o_ref, lse_ref = refs[-2:]
  extra = list(refs[1 if page_size else 0:-2])
  tile = pl.program_id(0)
  node = tile_node_ref[tile]
  bm, dp = q_ref.shape
  d_ok = jnp.arange(dp) < head_dim
  kv_len = jnp.where(node >= 0, len_ref[jnp.maximum(node, 0)], 0)
  seg = jnp.maximum(node, 0)
  pages = common.Pages(refs[0], seg * width, page_size, width) if page_size else None
  q = common.load(q_ref, d_ok[None, :])
  qk_scale = scale * common.LOG2E
  pos = slopes = None
  if mods is not None:
    if mods.window is not None or mods.alibi:
      pos = extra.pop(0)[...]
    if mods.alibi:
      slopes = extra.pop(0)[...]
  window = mods is not None and mods.window is not None

  def step(j, carry, masked):
    start = j * block_n
    keys = start + jnp.arange(block_n)
    kv_mask = d_ok[None, :] & (keys < kv_len)[:, None] if masked else d_ok[None, :]
    if pages is None:
      k = common.load(k_ref.at[seg, pl.ds(start, block_n), :], kv_mask)
      v = common.load(v_ref.at[seg, pl.ds(start, block_n), :], kv_mask)
    else:
      k = common.load_pages(k_ref, start, block_n, kv_mask, pages)
      v = common.load_pages(v_ref, start, block_n, kv_mask, pages)
    if mods is None:
      s = common.dot(q, k, trans_b=True) * qk_scale
    else:
      dist = None if pos is None else pos[:, None] - keys[None, :]
      s = common.modified_scores(common.dot(q, k, trans_b=True) * scale, mods, dist, slopes)
    if masked:
      s = jnp.where((keys < kv_len)[None, :], s, -jnp.inf)
    return common.online_softmax_step(carry, s, v, masked_s=window)

  carry = (jnp.zeros((bm, dp), jnp.float32), jnp.full((bm,), -jnp.inf, jnp.float32),
           jnp.zeros((bm,), jnp.float32))
  if window:  # only the key blocks some row's window reaches, every one masked
    first, last = mods.key_bounds(jnp.min(pos), jnp.max(pos))
    b_lo, b_hi = jnp.maximum(first, 0) // block_n, pl.cdiv(jnp.minimum(last, kv_len), block_n)
    if keys_per_split is not None:  # this program's key split
      lo = pl.program_id(2) * (keys_per_split // block_n)
      b_lo, b_hi = jnp.maximum(b_lo, lo), jnp.minimum(b_hi, lo + keys_per_split // block_n)
    carry = lax.fori_loop(b_lo, jnp.maximum(b_lo, b_hi), functools.partial(step, masked=True),
                          carry)
  elif keys_per_split is None:
    n_full = kv_len // block_n
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(n_full, pl.cdiv(kv_len, block_n),
                          functools.partial(step, masked=True), carry)
  else:  # this program's key split: blocks [lo, hi) of the segment's valid keys
    lo = pl.program_id(2) * (keys_per_split // block_n)
    n_blocks = pl.cdiv(jnp.clip(kv_len - lo * block_n, 0, keys_per_split), block_n)
    n_full = jnp.clip(kv_len // block_n - lo, 0, n_blocks)
    carry = lax.fori_loop(lo, lo + n_full, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(lo + n_full, lo + n_blocks, functools.partial(step, masked=True),
                          carry)
  out, lse = common.finalize(*carry)
  plgpu.store(o_ref, out.astype(o_ref.dtype), mask=d_ok[None, :])
  lse_ref[...] = lse


def _call(tile_node, lengths, q_tiles, k, v, *rest, scale, cfg: SegmentConfig, head_dim: int,
          page_size: int | None, interpret: bool, mods: KernelMods | None = None):
  # rest: the page table where ``page_size``, then the tiles' positions [tiles, bm] and slopes
  # [Hkv, tiles, bm] where ``mods`` has them
  table, row_args = (rest[:1], rest[1:]) if page_size else ((), rest)
  hkv, tiles, bm, dp = q_tiles.shape
  n = lengths.shape[0]
  width = table[0].shape[0] // n if table else 0
  capacity = width * page_size if table else k.shape[1]
  keys_per_split = None
  if cfg.splits > 1:
    keys_per_split = pl.cdiv(pl.cdiv(capacity, cfg.splits), cfg.block_n) * cfg.block_n
  kernel = functools.partial(_kernel, scale=scale, head_dim=head_dim, block_n=cfg.block_n,
                             page_size=page_size, width=width, keys_per_split=keys_per_split,
                             mods=mods)
  if cfg.splits == 1:  # grid (tiles, Hkv): the programs of the unsplit kernel as they were
    grid, ix = (tiles, hkv), lambda f: (lambda i, h: f(i, h, 0))
    out_shape = [(hkv, tiles, bm, dp), (hkv, tiles, bm)]
    o_block, o_map = (None, None, bm, dp), lambda i, h, j: (h, i, 0, 0)
    l_block, l_map = (None, None, bm), lambda i, h, j: (h, i, 0)
  else:  # grid (tiles, Hkv, splits): one partial state per split
    grid, ix = (tiles, hkv, cfg.splits), lambda f: f
    out_shape = [(cfg.splits, hkv, tiles, bm, dp), (cfg.splits, hkv, tiles, bm)]
    o_block, o_map = (None, None, None, bm, dp), lambda i, h, j: (j, h, i, 0, 0)
    l_block, l_map = (None, None, None, bm), lambda i, h, j: (j, h, i, 0)
  if page_size is None:
    kv_spec = pl.BlockSpec((n, k.shape[1], None, dp), ix(lambda i, h, j: (0, 0, h, 0)))
  else:  # the pools as [pages * page_size, Hkv, D]: rows are found through the table
    kv_spec = pl.BlockSpec((k.shape[0], None, dp), ix(lambda i, h, j: (0, h, 0)))
  table_specs = [pl.BlockSpec(table[0].shape, ix(lambda i, h, j: (0,)))] if table else []
  row_specs = [pl.BlockSpec((None, bm), ix(lambda i, h, j: (i, 0))) if x.ndim == 2 else
               pl.BlockSpec((None, None, bm), ix(lambda i, h, j: (h, i, 0))) for x in row_args]
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[
          pl.BlockSpec((tiles,), ix(lambda i, h, j: (0,))),
          pl.BlockSpec((n,), ix(lambda i, h, j: (0,))),
          pl.BlockSpec((None, None, bm, dp), ix(lambda i, h, j: (h, i, 0, 0))),
          kv_spec, kv_spec, *table_specs, *row_specs,
      ],
      out_specs=[pl.BlockSpec(o_block, ix(o_map)), pl.BlockSpec(l_block, ix(l_map))],
      out_shape=[jax.ShapeDtypeStruct(out_shape[0], jnp.float32),
                 jax.ShapeDtypeStruct(out_shape[1], jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name="hydragen_paged_segment_attention" if table else "hydragen_segment_attention",
  )(tile_node, lengths, q_tiles, k, v, *table, *row_args)


def tile_layout(node_of_seq: jax.Array, n: int, rows_per_seq: int, block_m: int):
  """Grouped row-tile layout of one level (pure index arithmetic, O(B) work).

  Returns ``(tile_node [tiles], gather [tiles * block_m], slot_of_row [B * rows_per_seq])``:
  the segment of each tile (-1: unused tile), the original row feeding each
  tile slot (-1: padding), and the tile slot holding each original row (-1:
  the row's sequence has no segment). ``tiles = cdiv(B * rows_per_seq, block_m) + n``
  is a static bound: each segment wastes at most one partial tile.
  """
  b = node_of_seq.shape[0]
  node = jnp.where((node_of_seq >= 0) & (node_of_seq < n), node_of_seq, -1)
  sort_key = jnp.where(node < 0, n, node)
  order = jnp.argsort(sort_key, stable=True)  # sequences grouped by segment
  rank = jnp.argsort(order)  # position of each sequence in that order
  counts = jnp.zeros((n,), jnp.int32).at[sort_key].add(1, mode="drop")
  seg_rows = counts * rows_per_seq
  seg_row_start = jnp.cumsum(seg_rows) - seg_rows
  seg_tiles = pl.cdiv(seg_rows, block_m)
  seg_tile_start = jnp.cumsum(seg_tiles) - seg_tiles
  tiles = pl.cdiv(b * rows_per_seq, block_m) + n

  t = jnp.arange(tiles)
  tile_node = jnp.searchsorted(jnp.cumsum(seg_tiles), t, side="right").astype(jnp.int32)
  used = tile_node < n
  tile_node_c = jnp.minimum(tile_node, n - 1)
  local = t - seg_tile_start[tile_node_c]
  first_row = seg_row_start[tile_node_c] + local * block_m  # sorted-row index of slot 0
  rows_in_tile = jnp.clip(seg_rows[tile_node_c] - local * block_m, 0, block_m)
  slot = jnp.arange(block_m)
  sorted_row = first_row[:, None] + slot[None, :]
  valid = used[:, None] & (slot[None, :] < rows_in_tile[:, None])
  seq = order[jnp.clip(sorted_row // rows_per_seq, 0, b - 1)]
  gather = jnp.where(valid, seq * rows_per_seq + sorted_row % rows_per_seq, -1).reshape(-1)

  r = jnp.arange(b * rows_per_seq)
  seq_of_row = r // rows_per_seq
  row_node = node[seq_of_row]
  row_node_c = jnp.maximum(row_node, 0)
  within = rank[seq_of_row] * rows_per_seq + r % rows_per_seq - seg_row_start[row_node_c]
  slot_of_row = (seg_tile_start[row_node_c] + within // block_m) * block_m + within % block_m
  slot_of_row = jnp.where(row_node >= 0, slot_of_row, -1)
  return jnp.where(used, tile_node, -1), gather, slot_of_row


def segment_rows(
    q_rows: jax.Array,  # [Hkv, B * M, D], M = Tq * G rows per sequence
    k: jax.Array,  # [N, T, Hkv, D], or with page_table the pool [pages, page_size, Hkv, D]
    v: jax.Array,  # the same shape as k
    *,
    rows_per_seq: int,
    lengths: jax.Array,  # int32 [N]
    node_of_seq: jax.Array,  # int32 [B]
    scale: float,
    config: SegmentConfig,
    page_table: jax.Array | None = None,  # int32 [N, P]: segment n's pages in token order
    interpret: bool | None = None,
    mods: common.RowMods | None = None,
) -> tuple[jax.Array, jax.Array]:
  """One tree level in the folded row layout: float32 ``out [splits, Hkv, R, D]``, ``lse
  [splits, Hkv, R]``, one partial state per key split (``config.splits``) to merge by LSE.

  With ``page_table``, ``k`` and ``v`` are page pools and segment n's token j is at page
  ``page_table[n, j // page_size]``, offset ``j % page_size``: the kernel reads the pages in
  place (one gathered load per key step). ``mods``: score variants over these rows
  (:func:`pallas_kernels.gpu.common.row_mods`, with the level's offset)."""
  hkv, r, d = q_rows.shape
  if page_table is None:
    n, t = k.shape[:2]
    page_size, table = None, ()
  else:
    n, t = page_table.shape[0], page_table.shape[1] * k.shape[1]
    page_size, table = k.shape[1], (jnp.asarray(page_table, jnp.int32).reshape(-1),)
    k, v = (x.reshape((-1,) + x.shape[2:]) for x in (k, v))
  b = node_of_seq.shape[0]
  if t == 0 or r == 0:
    return (jnp.zeros((config.splits, hkv, r, d), jnp.float32),
            jnp.full((config.splits, hkv, r), -jnp.inf, jnp.float32))
  cfg = config
  dp = common.padded_head_dim(d)
  tile_node, gather, slot_of_row = tile_layout(node_of_seq, n, rows_per_seq, cfg.block_m)
  tiles = tile_node.shape[0]
  rows = jnp.pad(q_rows, ((0, 0), (0, 1), (0, dp - d)))  # row R is the zero row for padding
  q_tiles = rows[:, jnp.where(gather >= 0, gather, b * rows_per_seq)]
  q_tiles = q_tiles.reshape(hkv, tiles, cfg.block_m, dp)
  row_args = ()
  if mods is not None:  # the rows' positions and slopes, laid out as the tiles
    common.check_positions("segment_rows", mods)
    src = gather.reshape(tiles, cfg.block_m)
    src = jnp.where(src >= 0, src, jnp.maximum(src[:, :1], 0))  # padding: the tile's first row
    row_args = tuple(x for x in (
        None if mods.pos is None else mods.pos[src],
        None if mods.slopes is None else mods.slopes[:, src]) if x is not None)
  call = functools.partial(_call, scale=scale, cfg=cfg, head_dim=d, page_size=page_size,
                           mods=None if mods is None else mods.kind)
  out, lse = common.run(call, tile_node, jnp.asarray(lengths, jnp.int32), q_tiles, k, v, *table,
                         *row_args, interpret=interpret)
  splits = cfg.splits
  has = slot_of_row >= 0
  idx = jnp.maximum(slot_of_row, 0)
  out = jnp.where(has[None, None, :, None], out.reshape(splits, hkv, -1, dp)[:, :, idx, :d], 0.0)
  lse = jnp.where(has[None, None, :], lse.reshape(splits, hkv, -1)[:, :, idx], -jnp.inf)
  return out, lse


def segment_attention(
    q: jax.Array,  # [B, Tq, Hq, D]
    k: jax.Array,  # [N, T, Hkv, D]
    v: jax.Array,  # [N, T, Hkv, D]
    *,
    lengths: jax.Array,  # int32 [N]
    node_of_seq: jax.Array,  # int32 [B]
    scale: float,
    config: SegmentConfig | None = None,
    interpret: bool | None = None,
    mods: ScoreMods | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Same signature and result as the reference: float32 out, natural-log lse."""
  b, tq, hq, d = q.shape
  hkv = k.shape[2]
  rows = None if mods is None else common.row_mods(mods, b, tq, hq, hkv, offset=mods.offset)
  out, lse = segment_rows(common.fold_rows(q, hkv), k, v, rows_per_seq=tq * (hq // hkv),
                          lengths=lengths, node_of_seq=node_of_seq, scale=scale, config=config,
                          interpret=interpret, mods=rows)
  out, lse = merge_states(list(out), list(lse)) if config.splits > 1 else (out[0], lse[0])
  return common.unfold_rows(out, b, tq), common.unfold_rows(lse, b, tq)
