"""Shared-prefix attention on TPU: all queries of all sequences against ONE K/V sequence.

Hydragen Sec. 3.2 (inter-sequence batching): for each KV head the ``B * Tq * G``
query rows that read it are the rows of one matrix product against the prefix
keys, so the prefix is streamed from HBM once per row block (once in all when
the rows fit one block) instead of once per sequence, and the products run on
the MXU as matrix-matrix products. Keys stream in blocks through an online
softmax held in float32 VMEM scratch; blocks past ``kv_length`` are neither
fetched (the index map repeats the last needed block, so the pipeline issues no
DMA) nor computed.

Grid ``(Hkv, row_blocks, key_blocks)``, semantics (parallel, parallel,
arbitrary): heads and row blocks are split across the TensorCores of megacore
chips; the key axis carries the softmax state.

Contents, side by side: the kernel body (:func:`_prefix_kernel`), its
``pallas_call`` on head-major arrays (:func:`prefix_attention_head_major`), the
primitive with the reference's signature (:func:`prefix_attention`) and the
reference it must equal (:data:`prefix_attention_reference`, i.e.
:func:`pallas_kernels.base.prefix_attention`).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import base
from pallas_kernels.tpu import common
from pallas_kernels.tpu.common import LANES, ROW_ALIGN, BlockSizes

prefix_attention_reference = base.prefix_attention


def _prefix_kernel(
    length_ref,  # SMEM int32 [1]: valid prefix keys (scalar prefetch)
    q_ref,  # [block_rows, D]
    k_ref,  # [block_keys, D]
    v_ref,  # [block_keys, D]
    *refs,  # with ``mods``: the rows' positions (int32) and/or slopes (float32), each
    # [block_rows, 128] lane-replicated; then out_ref [block_rows, D] float32, lse_ref
    # [block_rows, 128] float32 (lane-replicated natural-log LSE) and the scratch m_ref,
    # l_ref [block_rows, 128], acc_ref [block_rows, D] float32
    scale: float, chunk: int, mods: Optional[base.KernelMods] = None,
):
  out_ref, lse_ref, m_ref, l_ref, acc_ref = refs[-5:]
  row_mods = row_values(mods, refs[:-5])
  j = pl.program_id(2)
  block_keys = k_ref.shape[0]
  length = length_ref[0]

  @pl.when(j == 0)
  def _init():
    common.init_state(m_ref, l_ref, acc_ref)

  common.key_chunks(q_ref, k_ref, v_ref, j * block_keys, length, chunk, m_ref, l_ref, acc_ref,
                    scale=scale, mods=row_mods)

  @pl.when(j == pl.num_programs(2) - 1)
  def _finish():
    out, lse = common.final_state(m_ref, l_ref, acc_ref)
    out_ref[...] = out
    lse_ref[...] = lse


def row_values(mods: Optional[base.KernelMods], refs):
  """``(kind, pos, slopes)`` for :func:`pallas_kernels.tpu.common.key_chunks` from the row
  operands ``refs`` a kernel got for ``mods`` (None without variants)."""
  if mods is None:
    return None
  refs = list(refs)
  pos = refs.pop(0)[...] if mods.alibi or mods.window is not None else None
  slopes = refs.pop(0)[...] if mods.alibi else None
  return mods, pos, slopes


def row_operands(mods, rows: int, hkv: int, rows_pad: int, order=None):
  """The row operands of the prefix and segment kernels for ``mods = (kind, pos [R], slopes
  [Hkv, R])`` (:func:`pallas_kernels.base.row_variants`): lane-replicated ``[Hkv, rows_pad,
  128]`` arrays, rows permuted by ``order`` (``[R]``) where given; padding rows repeat the last
  row (their results are dropped)."""
  if mods is None:
    return ()
  kind, pos, slopes = mods
  if (kind.alibi or kind.window is not None) and pos is None:
    raise ValueError("tpu kernels: ALiBi or a window needs the rows' positions "
                     "(pallas_kernels.base.row_variants with the part's offset)")
  out = []
  for x in (pos if kind.alibi or kind.window is not None else None,
            slopes if kind.alibi else None):
    if x is None:
      continue
    x = jnp.broadcast_to(x, (hkv, rows))
    if order is not None:
      x = x[:, order]
    x = jnp.pad(x, ((0, 0), (0, rows_pad - rows)), mode="edge")
    out.append(jnp.broadcast_to(x[..., None], (hkv, rows_pad, LANES)))
  return tuple(out)


def last_block(length, block: int):
  """Index of the last block holding a valid key (0 when there is none)."""
  return jnp.maximum(pl.cdiv(length, block) - 1, 0)


def prefix_attention_head_major(
    q: jax.Array,  # [Hkv, R, D]: rows (b, t, g) of KV head h; R % block_rows == 0
    k: jax.Array,  # [Hkv, P, D]; P % block_keys == 0; D % 128 == 0
    v: jax.Array,  # [Hkv, P, D]
    kv_length: jax.Array,  # int32 [1], in [0, P]
    *row_args,  # with ``mods``: the rows' positions and/or slopes [Hkv, R, 128]
    scale: float,
    block_rows: int,
    block_keys: int,
    chunk: Optional[int] = None,
    vmem_limit_bytes: Optional[int] = None,
    interpret: Optional[bool] = None,
    mods: Optional[base.KernelMods] = None,
):
  """The prefix kernel on kernel-native arrays (``chunk``: keys per matrix product,
  dividing ``block_keys``; default the whole block; ``mods`` and ``row_args``: score
  variants, :func:`row_operands`).

  Returns float32 ``out [Hkv, R, D]`` and ``lse [Hkv, R, 128]``: the natural-log
  log-sum-exp of the scaled scores, replicated over the 128 lanes (take
  ``[..., 0]``); rows with no visible key are ``(0, -inf)``.
  """
  hkv, rows, d = q.shape
  p = k.shape[1]
  if k.shape != (hkv, p, d) or v.shape != k.shape:
    raise ValueError(f"prefix_attention_head_major: q {q.shape}, k {k.shape}, v {v.shape} "
                     "must be [Hkv, R, D], [Hkv, P, D], [Hkv, P, D]")
  if rows % block_rows or p % block_keys or d % LANES:
    raise ValueError(f"prefix_attention_head_major: R={rows}, P={p}, D={d} must be multiples "
                     f"of block_rows={block_rows}, block_keys={block_keys} and {LANES}")
  grid = (hkv, rows // block_rows, p // block_keys)

  def kv_map(h, i, j, length_ref):
    return (h, jnp.minimum(j, last_block(length_ref[0], block_keys)), 0)

  row_spec = pl.BlockSpec((None, block_rows, d), lambda h, i, j, length_ref: (h, i, 0))
  lse_spec = pl.BlockSpec((None, block_rows, LANES), lambda h, i, j, length_ref: (h, i, 0))
  kv_spec = pl.BlockSpec((None, block_keys, d), kv_map)
  itemsize = q.dtype.itemsize
  cost = pl.CostEstimate(
      flops=4 * hkv * rows * p * d, transcendentals=hkv * rows * p,
      bytes_accessed=hkv * (rows * d * itemsize + grid[1] * 2 * p * d * itemsize
                            + rows * (d + LANES) * 4))

  def build(interpret_value):
    return pl.pallas_call(
        functools.partial(_prefix_kernel, scale=scale, chunk=chunk or block_keys, mods=mods),
        out_shape=(jax.ShapeDtypeStruct((hkv, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((hkv, rows, LANES), jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=grid,
            in_specs=[row_spec, kv_spec, kv_spec] + [lse_spec] * len(row_args),
            out_specs=[row_spec, lse_spec],
            scratch_shapes=[pltpu.VMEM((block_rows, LANES), jnp.float32),
                            pltpu.VMEM((block_rows, LANES), jnp.float32),
                            pltpu.VMEM((block_rows, d), jnp.float32)]),
        compiler_params=common.compiler_params(("parallel", "parallel", "arbitrary"),
                                               vmem_limit_bytes),
        cost_estimate=cost, interpret=interpret_value, name="hydragen_prefix_attention")

  return common.dispatch(build, (kv_length, q, k, v, *row_args), interpret)


def vmem_bytes(block_rows: int, block_keys: int, chunk: int, d: int, itemsize: int) -> int:
  """VMEM of one prefix/segment grid step: double-buffered q, k, v, out, lse blocks, the
  float32 state scratch and ~3 float32 ``rows x chunk`` temporaries (s, p, p's cast)."""
  buffers = 2 * (block_rows * d * itemsize + 2 * block_keys * d * itemsize
                 + block_rows * (d + LANES) * 4)
  scratch = block_rows * (d + 2 * LANES) * 4
  return buffers + scratch + 3 * block_rows * chunk * 4


def prefix_blocks(rows: int, keys: int, d: int, itemsize: int,
                  block_sizes: BlockSizes) -> tuple[int, int, int]:
  """``(block_rows, block_keys, chunk)`` for ``rows`` query rows and ``keys`` keys.

  Balanced blocks of at most ``prefix_rows x prefix_keys``; a block of several chunks
  is a multiple of the chunk. While a step's VMEM estimate exceeds the budget: halve the
  chunk (down to 128), then the keys, then the rows.
  """
  max_rows, max_keys, chunk = (block_sizes.prefix_rows, block_sizes.prefix_keys,
                               min(block_sizes.compute_keys, block_sizes.prefix_keys))
  while True:
    block_rows = common.balanced_block(rows, max_rows)
    if keys <= chunk:
      block_keys = c = common.balanced_block(keys, chunk)
    else:
      block_keys, c = common.balanced_block(keys, max_keys, align=chunk), chunk
    if vmem_bytes(block_rows, block_keys, c, d, itemsize) <= block_sizes.vmem_budget_bytes:
      return block_rows, block_keys, c
    if chunk > 128:
      chunk //= 2
    elif max_keys > 128:
      max_keys //= 2
    elif max_rows > ROW_ALIGN:
      max_rows = common.round_up(max_rows // 2, ROW_ALIGN)
    else:
      return block_rows, block_keys, c


def fold_rows(q: jax.Array, hkv: int) -> jax.Array:
  """``[B, Tq, Hq, D] -> [Hkv, B*Tq*G, D]``: rows (b, t, g) of each KV head."""
  b, tq, hq, d = q.shape
  g = hq // hkv
  return q.reshape(b * tq, hkv, g, d).transpose(1, 0, 2, 3).reshape(hkv, b * tq * g, d)


def unfold_rows(x: jax.Array, b: int, tq: int, hq: int) -> jax.Array:
  """Inverse of :func:`fold_rows` for ``[Hkv, B*Tq*G, ...]`` -> ``[B, Tq, Hq, ...]``."""
  hkv = x.shape[0]
  g = hq // hkv
  rest = x.shape[2:]
  x = x.reshape(hkv, b * tq, g, *rest)
  x = jnp.moveaxis(x, 0, 1)  # [B*Tq, Hkv, G, ...]
  return x.reshape(b, tq, hkv * g, *rest)


def prefix_attention(
    q: jax.Array,  # [B, Tq, Hq, D]
    k: jax.Array,  # [P, Hkv, D]
    v: jax.Array,  # [P, Hkv, D]
    *,
    kv_length: jax.Array,  # int32 scalar: the first kv_length keys are valid
    scale: float,
    block_sizes: BlockSizes,
    interpret: Optional[bool] = None,
    mods: Optional[base.ScoreMods] = None,  # variants, with the prefix's offset
):
  """Attention of every query against one shared K/V sequence (non-causal), on TPU.

  Same signature and semantics as :func:`pallas_kernels.base.prefix_attention`:
  returns float32 ``out [B, Tq, Hq, D]`` and float32 natural-log
  ``lse [B, Tq, Hq] = log(sum_j exp(scale * q . k_j))`` over the first ``kv_length``
  keys; ``(0, -inf)`` where there is none. GQA: the ``G = Hq // Hkv`` query heads of a
  KV head and all ``B * Tq`` queries are the rows of one product; the prefix is
  never broadcast to the batch.

  Example:
    >>> out, lse = prefix_attention(q, pk, pv, kv_length=jnp.int32(100), scale=0.125)
  """
  b, tq, hq = q.shape[:3]
  q_rows = fold_rows(q, k.shape[1])
  blocks = rows_blocks(q_rows, k, v, block_sizes)
  out, lse = prefix_rows(q_rows, k, v, kv_length, scale=scale, blocks=blocks,
                         vmem_limit_bytes=block_sizes.vmem_limit_bytes, interpret=interpret,
                         mods=variants(mods, b, tq, hq, k.shape[1], mods and mods.offset))
  return unfold_rows(out[..., :v.shape[-1]], b, tq, hq), unfold_rows(lse[..., 0], b, tq, hq)


def variants(mods: Optional[base.ScoreMods], b: int, tq: int, hq: int, hkv: int, offset=None):
  """``mods`` as the kernels take them over folded rows: ``(kind, pos [R], slopes [Hkv, R])``
  (:func:`pallas_kernels.base.row_variants`; ``offset``: a shared part's), None without."""
  if mods is None:
    return None
  return (base.KernelMods.of(mods),) + base.row_variants(mods, b, tq, hq, hkv, offset)


def rows_blocks(q_rows, k, v, block_sizes: BlockSizes) -> Optional[tuple[int, int, int]]:
  """The blocks :func:`prefix_rows` runs ``q_rows [Hkv, R, D]`` against ``k, v [P, Hkv, D]``
  with (None where nothing runs: no rows or no keys); shapes and dtypes only."""
  rows, p = q_rows.shape[1], k.shape[0]
  if rows == 0 or p == 0:
    return None
  dp = common.round_up(max(q_rows.shape[-1], v.shape[-1]), LANES)
  return prefix_blocks(rows, p, dp, common.compute_dtype(q_rows, k, v).itemsize, block_sizes)


def prefix_rows(
    q_rows: jax.Array,  # [Hkv, R, D] (fold_rows), any float dtype
    k: jax.Array,  # [P, Hkv, D]
    v: jax.Array,  # [P, Hkv, D]
    kv_length: jax.Array,  # int32 scalar
    *,
    scale: float,
    blocks: Optional[tuple[int, int, int]],
    vmem_limit_bytes: Optional[int] = None,
    interpret: Optional[bool] = None,
    mods=None,
):
  """The prefix kernel on folded query rows with ``blocks = (block_rows, block_keys, chunk)``
  (:func:`rows_blocks`), results left in kernel layout; ``mods``: score variants over the
  rows (:func:`variants`, with the prefix's offset).

  Returns float32 ``out [Hkv, R, Dp]`` (``Dp`` = D rounded up to 128 lanes; the extra
  lanes are 0) and ``lse [Hkv, R, 128]``: natural log, replicated over the lanes, as the
  suffix kernel takes its prior.
  """
  hkv, rows, d = q_rows.shape
  p = k.shape[0]
  dp = common.round_up(max(d, v.shape[-1]), LANES)
  if rows == 0 or p == 0:
    return (jnp.zeros((hkv, rows, dp), jnp.float32),
            jnp.full((hkv, rows, LANES), -jnp.inf, jnp.float32))
  dtype = common.compute_dtype(q_rows, k, v)
  block_rows, block_keys, chunk = blocks
  qh = common.pad_to(q_rows.astype(dtype), (hkv, common.round_up(rows, block_rows), dp))
  pp = common.round_up(p, block_keys)
  kh = common.pad_to(k.astype(dtype).transpose(1, 0, 2), (hkv, pp, dp))
  vh = common.pad_to(v.astype(dtype).transpose(1, 0, 2), (hkv, pp, dp))
  length = jnp.clip(jnp.asarray(kv_length, jnp.int32), 0, p).reshape(1)
  row_args = row_operands(mods, rows, hkv, qh.shape[1])
  out, lse = prefix_attention_head_major(qh, kh, vh, length, *row_args, scale=scale,
                                         block_rows=block_rows, block_keys=block_keys,
                                         chunk=chunk, vmem_limit_bytes=vmem_limit_bytes,
                                         interpret=interpret, mods=mods and mods[0])
  return out[:, :rows], lse[:, :rows]
