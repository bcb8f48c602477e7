"""Per-sequence (suffix) attention on TPU over page pools: each sequence's own keys read in
place through its page table.

The contiguous suffix kernel (:mod:`pallas_kernels.tpu.suffix`) with the own keys stored in
pages ``[pages, page_size, Hkv, D]`` (a serving engine's KV cache): the page table travels by
scalar prefetch beside the lengths, and the K/V index maps pick each key block's physical
pages, so no page is gathered, padded or transposed. The pool is read as stored, reshaped
(free) to ``[pages, page_size, Hkv * D]``: a block is one page's ``[page_size, heads * D]``
slab, head h its lanes ``[h * D, (h + 1) * D)`` (whole lane tiles when ``D % 128 == 0``).
Everything else is the suffix kernel's: the fused prior, causal ``Tq > 1``, ragged lengths,
the score variants.

Contents, side by side: kernel (:func:`_paged_suffix_kernel`), blocks
(:func:`paged_blocks`), ``pallas_call`` on kernel-native arrays
(:func:`paged_suffix_head_major`), rows in and out (:func:`paged_suffix_rows`), the primitive
(:func:`paged_suffix_attention`) and its reference (:data:`paged_suffix_reference`: the
reference suffix attention on the gathered pages).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import base
from pallas_kernels.tpu import common
from pallas_kernels.tpu.common import LANES, BlockSizes
from pallas_kernels.tpu.prefix import fold_rows, last_block, unfold_rows, variants


def paged_suffix_reference(q, k_pages, v_pages, page_table, *, kv_lengths, causal, scale,
                           prior=None, mods=None):
  """:func:`pallas_kernels.base.suffix_attention` on the gathered pages."""
  return base.suffix_attention(q, base.gather_pages(k_pages, page_table),
                               base.gather_pages(v_pages, page_table), kv_lengths=kv_lengths,
                               causal=causal, scale=scale, prior=prior, mods=mods)


def _paged_suffix_kernel(
    lengths_ref,  # SMEM int32 [B]: valid own keys per sequence (scalar prefetch)
    table_ref,  # SMEM int32 [B * O]: sequence b's pages at [b * O, (b + 1) * O) (scalar prefetch)
    q_ref,  # [block_heads, rows, D] (the sequence's axis squeezed)
    *refs,  # k_refs (pages), v_refs (pages): [page_size, block_heads * D] each; then as
    # _suffix_kernel: [slopes_ref,] [prior_out_ref, prior_lse_ref,] out_ref, lse_ref, m_ref,
    # l_ref, acc_ref ([block_heads, rows, D or 128])
    scale: float, causal: bool, q_len: int, group: int, has_prior: bool, pages: int,
    mods: Optional[base.KernelMods] = None,
):
  k_refs, v_refs, refs = refs[:pages], refs[pages:2 * pages], refs[2 * pages:]
  slopes_ref = None
  if mods is not None and mods.alibi:
    slopes_ref, refs = refs[0], refs[1:]
  if has_prior:
    prior_out_ref, prior_lse_ref, out_ref, lse_ref, m_ref, l_ref, acc_ref = refs
  else:
    out_ref, lse_ref, m_ref, l_ref, acc_ref = refs
  b, j = pl.program_id(1), pl.program_id(2)
  block_heads, rows, d = q_ref.shape
  page_size = k_refs[0].shape[0]
  length = lengths_ref[b]

  def state(h):
    return m_ref.at[h], l_ref.at[h], acc_ref.at[h]

  @pl.when(j == 0)
  def _init():
    if has_prior:
      for h in range(block_heads):
        common.init_state_from(*state(h), prior_out_ref[h], prior_lse_ref[h])
    else:
      common.init_state(m_ref, l_ref, acc_ref)

  if causal or mods is not None:
    t = lax.div(lax.broadcasted_iota(jnp.int32, (rows, page_size), 0), jnp.int32(group))
  for p in range(pages):
    start = (j * pages + p) * page_size
    has = start < length
    if mods is not None and mods.window is not None:
      lo, hi = mods.key_bounds(length - q_len, length - 1)
      has = has & (start < hi) & (start + page_size > lo)

    @pl.when(has)
    def _page(p=p, start=start):
      key = start + lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
      valid = key < length
      if causal:  # query t sits at own position length - Tq + t
        valid = valid & (key <= length - q_len + t)
      for h in range(block_heads):
        lanes_h = slice(h * d, (h + 1) * d)  # head h of the page: a lane-aligned slice
        row_mods = None
        if mods is not None:
          row_mods = (mods, length - q_len + t - key,
                      None if slopes_ref is None else common.lanes(slopes_ref[h], page_size))
        q = q_ref[h]
        common.update_state(q, k_refs[p][:, lanes_h].astype(q.dtype),
                            v_refs[p][:, lanes_h].astype(q.dtype), valid, *state(h),
                            scale=scale, mods=row_mods)

  @pl.when(j == pl.num_programs(2) - 1)
  def _finish():
    for h in range(block_heads):
      out, lse = common.final_state(*state(h))
      out_ref[h] = out.astype(out_ref.dtype)
      lse_ref[h] = lse


@dataclasses.dataclass(frozen=True)
class PagedBlocks:
  heads: int  # KV heads per grid step: the page's lanes [h * D, (h + heads) * D)
  pages: int  # pages per grid step (one key block), each its own pipelined operand


def paged_heads_legal(heads: int, hkv: int, d: int) -> bool:
  """A ``[page_size, heads * D]`` block of the ``[pages, page_size, Hkv * D]`` pool obeys the
  Mosaic tiling rule: its lanes are a multiple of 128 or the whole minor dim."""
  return hkv % heads == 0 and (heads * d % LANES == 0 or heads == hkv)


def paged_vmem_bytes(blocks: PagedBlocks, page_size: int, rows: int, d: int, itemsize: int,
                     has_prior: bool) -> int:
  """VMEM of one paged suffix grid step: double-buffered pages and rows, scratch, temporaries."""
  rows8 = common.round_up(rows, common.ROW_ALIGN)
  state = blocks.heads * rows8 * (d + LANES) * 4
  pages = 2 * blocks.pages * common.round_up(page_size, common.ROW_ALIGN) * blocks.heads * d
  buffers = 2 * (pages * itemsize + blocks.heads * rows8 * d * itemsize
                 + state * (2 if has_prior else 1))
  scratch = state + blocks.heads * rows8 * LANES * 4
  temps = 4 * rows8 * page_size * 4
  return buffers + scratch + temps


def paged_blocks(b: int, hkv: int, page_size: int, own_pages: int, rows: int, d: int,
                 itemsize: int, block_sizes: BlockSizes, has_prior: bool = True) -> PagedBlocks:
  """The heuristic: pages per step up to ``suffix_keys`` keys (one page when pages are at
  least that long); then whole KV heads (the legal lane widths) until a step moves
  ~``suffix_step_bytes`` of K/V; keeps ``min_parallel_steps`` parallel steps and the VMEM
  budget."""
  pages = max(1, min(own_pages, block_sizes.suffix_keys // page_size))
  legal = [h for h in range(1, hkv + 1) if paged_heads_legal(h, hkv, d)]
  per_head = 2 * pages * page_size * d * itemsize
  heads = max([h for h in legal if h * per_head <= block_sizes.suffix_step_bytes] or [legal[0]])
  while b * (hkv // heads) < block_sizes.min_parallel_steps and heads > legal[0]:
    heads = max(h for h in legal if h < heads)
  blocks = PagedBlocks(heads, pages)
  while paged_vmem_bytes(blocks, page_size, rows, d, itemsize,
                         has_prior) > block_sizes.vmem_budget_bytes:
    if blocks.pages > 1:
      blocks = dataclasses.replace(blocks, pages=common.cdiv(blocks.pages, 2))
    elif blocks.heads > legal[0]:
      blocks = dataclasses.replace(blocks, heads=max(h for h in legal if h < blocks.heads))
    else:
      break
  return blocks


def paged_rows_blocks(q_rows, k_pages, page_table, block_sizes: BlockSizes,
                      has_prior: bool) -> Optional[PagedBlocks]:
  """The blocks :func:`paged_suffix_rows` runs ``q_rows [Hkv, B*Tq*G, D]`` against the pools
  ``[pages, page_size, Hkv, D]`` through ``page_table [B, O]`` with (None where no kernel
  runs: no rows or no own pages); shapes and dtypes only."""
  hkv, r, d = q_rows.shape
  b, o = page_table.shape
  if b * r == 0 or o == 0:
    return None
  return paged_blocks(b, hkv, k_pages.shape[1], o, r // b, d,
                      common.compute_dtype(q_rows, k_pages).itemsize, block_sizes, has_prior)


def paged_suffix_head_major(
    q: jax.Array,  # [Hkv, B, rows, D]: rows (t, g)
    k_pages: jax.Array,  # [pages, page_size, Hkv * D]: the pool as stored, heads on the lanes
    v_pages: jax.Array,  # [pages, page_size, Hkv * D]
    page_table: jax.Array,  # int32 [B, O]
    lengths: jax.Array,  # int32 [B] in [0, O * page_size]
    prior: Optional[Tuple[jax.Array, jax.Array]] = None,  # f32 [Hkv, B, rows, D], [.., 128]
    *,
    causal: bool,
    scale: float,
    q_len: int,
    blocks: PagedBlocks,
    out_dtype=jnp.float32,
    vmem_limit_bytes: Optional[int] = None,
    interpret: Optional[bool] = None,
    mods: Optional[base.KernelMods] = None,
    slopes: Optional[jax.Array] = None,  # with ALiBi: f32 [Hkv, B, rows, 128] lane-replicated
):
  """The paged suffix kernel: each sequence's own keys read in place from the pools.

  Grid ``(Hkv / heads, B, cdiv(O, pages))``, semantics (parallel, parallel, arbitrary). The
  page table travels by scalar prefetch; the index map of page operand ``p`` at key block ``j``
  picks the physical page ``page_table[b, j * pages + p]``, clamped to the sequence's last page
  holding a key (with a window, and at least its first page), so a page past the length
  (or before the window) maps to a block already in VMEM (no DMA) and its compute is skipped.
  The pool is read as stored, ``[pages, page_size, Hkv * D]`` (a free
  reshape of ``[pages, page_size, Hkv, D]``): a block is one page's ``[page_size, heads * D]``
  tile, head h its lanes ``[h * D, (h + 1) * D)``. Pages are read in their own dtype and
  converted to q's in VMEM.

  Returns ``out [Hkv, B, rows, D]`` (``out_dtype``) and float32 ``lse [Hkv, B, rows, 128]``,
  as :func:`pallas_kernels.tpu.suffix.suffix_attention_head_major`.
  """
  hkv, b, rows, d = q.shape
  _, page_size, width = k_pages.shape
  o = page_table.shape[1]
  if width != hkv * d or v_pages.shape != k_pages.shape or page_table.shape[0] != b:
    raise ValueError(f"paged_suffix_head_major: q {q.shape}, k_pages {k_pages.shape}, v_pages "
                     f"{v_pages.shape}, page_table {page_table.shape} must be [Hkv, B, rows, D], "
                     "[pages, page_size, Hkv * D] twice and [B, O]")
  if not paged_heads_legal(blocks.heads, hkv, d):
    raise ValueError(f"paged_suffix_head_major: blocks.heads={blocks.heads} must divide Hkv={hkv} "
                     f"with heads * D (D={d}) a multiple of {LANES}, or equal Hkv")
  group = rows // q_len
  ppb = blocks.pages
  grid = (hkv // blocks.heads, b, common.cdiv(o, ppb))

  def row_map(hh, i, j, lengths_ref, table_ref):
    return (hh, i, 0, 0)

  def page_map(p):
    def index(hh, i, j, lengths_ref, table_ref):
      length = lengths_ref[i]
      page = jnp.minimum(j * ppb + p, last_block(length, page_size))
      if mods is not None and mods.window is not None:
        # Pages wholly before the window repeat its first page: no DMA (their compute is
        # skipped). lax.div: truncating, on a non-negative scalar.
        lo, _ = mods.key_bounds(length - q_len, length - 1)
        page = jnp.maximum(page, lax.div(jnp.clip(lo, 0, o * page_size - 1), page_size))
      return (table_ref[i * o + page], 0, hh)
    return index

  row_spec = pl.BlockSpec((blocks.heads, None, rows, d), row_map)
  lse_spec = pl.BlockSpec((blocks.heads, None, rows, LANES), row_map)
  page_specs = [pl.BlockSpec((None, page_size, blocks.heads * d), page_map(p)) for p in range(ppb)]
  in_specs = [row_spec] + page_specs + page_specs
  args = [lengths, page_table.reshape(-1), q] + [k_pages] * ppb + [v_pages] * ppb
  if mods is not None and mods.alibi:
    in_specs.append(lse_spec)
    args.append(slopes)
  if prior is not None:
    in_specs += [row_spec, lse_spec]
    args += list(prior)
  state = (blocks.heads, rows)
  kernel = functools.partial(_paged_suffix_kernel, scale=scale, causal=causal, q_len=q_len,
                             group=group, has_prior=prior is not None, pages=ppb, mods=mods)
  return common.suffix_call(kernel, args, grid=grid, in_specs=in_specs, row_spec=row_spec,
                            lse_spec=lse_spec, out_shape=(hkv, b, rows, d), state=state,
                            keys=o * page_size, q_itemsize=q.dtype.itemsize,
                            kv_itemsize=k_pages.dtype.itemsize, out_dtype=out_dtype,
                            has_prior=prior is not None, vmem_limit_bytes=vmem_limit_bytes,
                            name="hydragen_paged_suffix_attention", interpret=interpret)


def paged_suffix_rows(
    q_rows: jax.Array,  # [Hkv, B*Tq*G, D] (prefix.fold_rows), any float dtype
    k_pages: jax.Array,  # [pages, page_size, Hkv, D]
    v_pages: jax.Array,  # [pages, page_size, Hkv, D]
    page_table: jax.Array,  # int32 [B, O]
    kv_lengths: jax.Array,  # int32 [B]
    prior=None,  # (out f32 [Hkv, B*Tq*G, D or Dp], lse f32 [Hkv, B*Tq*G] or [.., 128])
    *,
    q_len: int,
    causal: bool,
    scale: float,
    out_dtype=jnp.float32,
    blocks: Optional[PagedBlocks],
    vmem_limit_bytes: Optional[int] = None,
    interpret: Optional[bool] = None,
    mods=None,
):
  """:func:`pallas_kernels.tpu.suffix.suffix_rows` with the own keys in page pools, read in
  place (no gather, no pad, no transpose of K/V): ``blocks`` from :func:`paged_rows_blocks`.
  Returns ``out [Hkv, B*Tq*G, D]`` (``out_dtype``) and float32 natural-log
  ``lse [Hkv, B*Tq*G]``."""
  hkv, r, d = q_rows.shape
  b, o = page_table.shape
  page_size = k_pages.shape[1]
  if b * r == 0 or o == 0:
    empty = (jnp.zeros((hkv, r, d), jnp.float32), jnp.full((hkv, r, LANES), -jnp.inf))
    p_out, p_lse = empty if prior is None else prior
    lse = p_lse if p_lse.ndim == 2 else p_lse[..., 0]
    out = jnp.where((lse > -jnp.inf)[..., None], p_out[..., :d], 0.0)
    return out.astype(out_dtype), lse
  rows = r // b
  dtype = common.compute_dtype(q_rows, k_pages, v_pages)
  qr = q_rows.astype(dtype).reshape(hkv, b, rows, d)
  pool_shape = k_pages.shape[:2] + (hkv * d,)  # heads on the lanes: a free reshape
  lengths = jnp.clip(jnp.asarray(kv_lengths, jnp.int32), 0, o * page_size)
  state = None
  if prior is not None:
    p_out = prior[0][..., :d].astype(jnp.float32).reshape(hkv, b, rows, d)
    p_lse = prior[1].astype(jnp.float32)
    if p_lse.ndim == 2:
      p_lse = jnp.broadcast_to(p_lse[..., None], (hkv, r, LANES))
    state = (p_out, p_lse.reshape(hkv, b, rows, LANES))
  slopes = None
  if mods is not None and mods[2] is not None:  # [Hkv, R] -> [Hkv, B, rows, 128]
    slopes = jnp.broadcast_to(mods[2].reshape(hkv, b, rows)[..., None], (hkv, b, rows, LANES))
  out, lse = paged_suffix_head_major(
      qr, k_pages.reshape(pool_shape), v_pages.reshape(pool_shape),
      jnp.asarray(page_table, jnp.int32), lengths, state, causal=bool(causal), scale=scale,
      q_len=q_len, blocks=blocks, out_dtype=out_dtype, vmem_limit_bytes=vmem_limit_bytes,
      interpret=interpret, mods=mods and mods[0], slopes=slopes)
  return out.reshape(hkv, r, d), lse[..., 0].reshape(hkv, r)


def paged_suffix_attention(
    q: jax.Array,  # [B, Tq, Hq, D]
    k_pages: jax.Array,  # [pages, page_size, Hkv, D]
    v_pages: jax.Array,  # [pages, page_size, Hkv, D]
    page_table: jax.Array,  # int32 [B, O]
    *,
    kv_lengths: jax.Array,  # int32 [B]
    causal: bool,
    scale: float,
    prior: Optional[Tuple[jax.Array, jax.Array]] = None,  # (out f32 [B,Tq,Hq,D], lse [B,Tq,Hq])
    block_sizes: BlockSizes,
    interpret: Optional[bool] = None,
    mods: Optional[base.ScoreMods] = None,
):
  """:func:`pallas_kernels.tpu.suffix.suffix_attention` over own keys stored in pages:
  sequence b's keys are the first ``kv_lengths[b]`` tokens of its pages ``page_table[b]`` in
  the pools, read in place.

  Equals :data:`paged_suffix_reference`, the suffix attention on the gathered pages: float32
  ``out [B, Tq, Hq, D]`` and natural-log ``lse [B, Tq, Hq]``, ``prior`` merged in the kernel.
  """
  b, tq, hq, _ = q.shape
  hkv = k_pages.shape[2]
  state = None
  if prior is not None:
    state = (fold_rows(prior[0].astype(jnp.float32), hkv),
             fold_rows(prior[1].astype(jnp.float32)[..., None], hkv)[..., 0])
  q_rows = fold_rows(q, hkv)
  out, lse = paged_suffix_rows(
      q_rows, k_pages, v_pages, page_table, kv_lengths, state, q_len=tq, causal=causal,
      scale=scale, blocks=paged_rows_blocks(q_rows, k_pages, page_table, block_sizes,
                                            state is not None),
      vmem_limit_bytes=block_sizes.vmem_limit_bytes, interpret=interpret,
      mods=variants(mods, b, tq, hq, hkv))
  return unfold_rows(out, b, tq, hq), unfold_rows(lse, b, tq, hq)
