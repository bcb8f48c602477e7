"""Per-sequence (suffix) attention on TPU: ragged lengths, causal Tq > 1, fused LSE merge.

Each sequence attends to its own keys. The lengths travel by scalar prefetch
(``pltpu.PrefetchScalarGridSpec``) into SMEM, where the index maps read them:
a key block past the longest sequence of a grid step maps to the block already
in VMEM, so the pipeline issues no DMA for it, and its compute is skipped.
Inside a step, a sequence whose own length ends earlier skips its compute too.

A grid step holds ``block_batch`` sequences x ``block_heads`` KV heads x
``block_keys`` keys, sized so that a step moves about
``BlockSizes.suffix_step_bytes`` of K/V (decode steps are tiny: one query row
per query head, so per-step overhead, not the MXU, is what to amortise). Grid
``(Hkv / block_heads, B / block_batch, S / block_keys)``, semantics (parallel,
parallel, arbitrary): heads and sequences are split across the TensorCores of
megacore chips.

Layouts: K/V ``[B, Hkv, S, D]``; queries, prior, out and LSE ``[Hkv, B, Tq*G, .]``,
which is the prefix kernel's ``[Hkv, B*Tq*G, .]`` reshaped for free, so a prefix
result feeds this kernel with no copy (:mod:`pallas_kernels.tpu.shared`).

``prior`` (the shared-prefix result) is fused: it is the initial state of the
online softmax, ``(m, l, acc) = (lse_prior, 1, out_prior)``, so the final
``acc / l`` and ``m + log l`` are exactly the LSE merge of Hydragen Sec. 3.1
(Appendix A) without another pass over HBM.

Contents, side by side: kernel (:func:`_suffix_kernel`), ``pallas_call`` on
kernel-native arrays (:func:`suffix_attention_head_major`), the primitive with
the reference's signature (:func:`suffix_attention`) and its reference
(:data:`suffix_attention_reference` = :func:`pallas_kernels.base.suffix_attention`).
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

suffix_attention_reference = base.suffix_attention


def _suffix_kernel(
    lengths_ref,  # SMEM int32 [B_pad]: valid keys per sequence (scalar prefetch)
    block_length_ref,  # SMEM int32 [B_pad / block_batch]: longest sequence of each batch block
    q_ref,  # [block_heads, block_batch, rows, D], rows = (t, g) of Tq x G
    k_ref,  # [block_batch, block_heads, block_keys, D]
    v_ref,  # [block_batch, block_heads, block_keys, D]
    *refs,  # [slopes_ref,] [prior_out_ref, prior_lse_ref,] out_ref, lse_ref, m_ref, l_ref,
    # acc_ref (slopes/prior/out/scratch: [block_heads, block_batch, rows, D or 128], float32)
    scale: float, causal: bool, q_len: int, group: int, has_prior: bool,
    mods: Optional[base.KernelMods] = None,
):
  slopes_ref = None
  if mods is not None and mods.alibi:
    slopes_ref, refs = refs[0], refs[1:]
  if has_prior:
    prior_out_ref, prior_lse_ref, out_ref, lse_ref, m_ref, l_ref, acc_ref = refs
  else:
    out_ref, lse_ref, m_ref, l_ref, acc_ref = refs
  i, s = pl.program_id(1), pl.program_id(2)
  block_heads, block_batch, rows, _ = q_ref.shape
  block_keys = k_ref.shape[2]
  start = s * block_keys

  def for_each_pair(fn, when=None):
    """``fn(h, c)`` for every (KV head, sequence) of the step, on 2-D slices: heads
    unrolled, sequences in a loop (``when(c)``: a condition per sequence)."""

    def body(c, carry):
      def pairs():
        for h in range(block_heads):
          fn(h, c)

      if when is None:
        pairs()
      else:
        pl.when(when(c))(pairs)
      return carry

    lax.fori_loop(0, block_batch, body, 0)

  def state(h, c):
    return m_ref.at[h, c], l_ref.at[h, c], acc_ref.at[h, c]

  @pl.when(s == 0)
  def _init():
    if has_prior:
      for_each_pair(lambda h, c: common.init_state_from(*state(h, c), prior_out_ref[h, c],
                                                        prior_lse_ref[h, c]))
    else:
      common.init_state(m_ref, l_ref, acc_ref)

  def length_of(c):
    return lengths_ref[i * block_batch + c]

  def update(h, c):
    length = length_of(c)
    key = start + lax.broadcasted_iota(jnp.int32, (rows, block_keys), 1)
    valid = key < length
    # query t sits at position length - Tq + t.
    # lax.div (truncating) on non-negative rows: floor division lowers via sign(), which
    # Mosaic lowering resolves by querying the chip (impossible when exporting from a CPU).
    if causal or mods is not None:
      t = lax.div(lax.broadcasted_iota(jnp.int32, (rows, block_keys), 0), jnp.int32(group))
    if causal:
      valid = valid & (key <= length - q_len + t)
    row_mods = None
    if mods is not None:
      row_mods = (mods, length - q_len + t - key,
                  None if slopes_ref is None else common.lanes(slopes_ref[h, c], block_keys))
    common.update_state(q_ref[h, c], k_ref[c, h], v_ref[c, h], valid, *state(h, c),
                        scale=scale, mods=row_mods)

  def has_keys(c):
    """Sequence c has keys in this block (with a window: keys some query's window reaches)."""
    length = length_of(c)
    has = start < length
    if mods is not None and mods.window is not None:
      lo, hi = mods.key_bounds(length - q_len, length - 1)
      has = has & (start < hi) & (start + block_keys > lo)
    return has

  @pl.when(start < block_length_ref[i])  # some sequence of the step still has keys here
  def _blocks():
    for_each_pair(update, when=has_keys)

  @pl.when(s == pl.num_programs(2) - 1)
  def _finish():
    def store(h, c):
      out, lse = common.final_state(*state(h, c))
      out_ref[h, c] = out.astype(out_ref.dtype)
      lse_ref[h, c] = lse

    for_each_pair(store)


@dataclasses.dataclass(frozen=True)
class SuffixBlocks:
  batch: int  # sequences per grid step
  heads: int  # KV heads per grid step
  keys: int  # keys per block


def vmem_bytes(blocks: SuffixBlocks, rows: int, d: int, itemsize: int, has_prior: bool) -> int:
  """VMEM of one suffix grid step: double-buffered blocks, scratch and score temporaries."""
  rows8 = common.round_up(rows, common.ROW_ALIGN)
  pairs = blocks.batch * blocks.heads
  state = pairs * rows8 * (d + LANES) * 4  # one (out, lse) or (acc, m|l) set
  buffers = 2 * (pairs * (2 * blocks.keys * d * itemsize + rows8 * d * itemsize)
                 + state * (2 if has_prior else 1))
  scratch = state + pairs * rows8 * LANES * 4
  temps = 4 * rows8 * blocks.keys * 4
  return buffers + scratch + temps


def suffix_blocks(b: int, hkv: int, s: int, rows: int, d: int, itemsize: int,
                  block_sizes: BlockSizes, has_prior: bool = True) -> SuffixBlocks:
  """The heuristic: keys per block from ``suffix_keys``; then whole KV heads, then
  sequences, are packed into a step until it moves ~``suffix_step_bytes`` of K/V; keeps
  at least ``min_parallel_steps`` parallel steps (megacore) and the VMEM budget."""
  keys = common.balanced_block(s, block_sizes.suffix_keys)
  per_head = 2 * keys * d * itemsize  # K + V of one head of one sequence
  heads = max([h for h in range(1, hkv + 1)
               if hkv % h == 0 and h * per_head <= block_sizes.suffix_step_bytes] or [1])
  batch = max(1, min(b, block_sizes.suffix_step_bytes // (heads * per_head)))
  while common.cdiv(b, batch) * (hkv // heads) < block_sizes.min_parallel_steps:
    if batch > 1:
      batch = common.cdiv(batch, 2)
    elif heads > 1:
      heads = max(h for h in range(1, heads) if hkv % h == 0)
    else:
      break
  batch = common.cdiv(b, common.cdiv(b, batch))  # balanced: least batch padding
  blocks = SuffixBlocks(batch, heads, keys)
  while vmem_bytes(blocks, rows, d, itemsize, has_prior) > block_sizes.vmem_budget_bytes:
    if blocks.batch > 1:
      blocks = dataclasses.replace(blocks, batch=common.cdiv(blocks.batch, 2))
    elif blocks.heads > 1:
      blocks = dataclasses.replace(
          blocks, heads=max(h for h in range(1, blocks.heads) if hkv % h == 0))
    elif blocks.keys > common.ROW_ALIGN:
      blocks = dataclasses.replace(blocks, keys=common.round_up(blocks.keys // 2, common.ROW_ALIGN))
    else:
      break
  return blocks


def suffix_attention_head_major(
    q: jax.Array,  # [Hkv, B, rows, D]: rows (t, g); B % block_batch == 0; D % 128 == 0
    k: jax.Array,  # [B, Hkv, S, D]; S % block_keys == 0
    v: jax.Array,  # [B, Hkv, S, D]
    lengths: jax.Array,  # int32 [B] in [0, S]
    prior: Optional[Tuple[jax.Array, jax.Array]] = None,  # f32 [Hkv, B, rows, D], [.., 128]
    *,
    causal: bool,
    scale: float,
    q_len: int,
    blocks: SuffixBlocks,
    out_dtype=jnp.float32,
    vmem_limit_bytes: Optional[int] = None,
    interpret: Optional[bool] = None,
    mods: Optional[base.KernelMods] = None,
    slopes: Optional[jax.Array] = None,  # with ALiBi: f32 [Hkv, B, rows, 128] lane-replicated
):
  """The suffix kernel on kernel-native arrays (``mods``: score variants; the own keys'
  positions come from ``lengths``).

  Returns ``out [Hkv, B, rows, D]`` (``out_dtype``, float32 by default) and float32
  ``lse [Hkv, B, rows, 128]``: the natural-log log-sum-exp (merged with ``prior`` if
  given), replicated over the 128 lanes; ``(0, -inf)`` for rows with no visible key
  and no prior.
  """
  hkv, b, rows, d = q.shape
  s = k.shape[2]
  if k.shape[:2] != (b, hkv) or v.shape != k.shape:
    raise ValueError(f"suffix_attention_head_major: q {q.shape}, k {k.shape}, v {v.shape} must "
                     "be [Hkv, B, rows, D], [B, Hkv, S, D], [B, Hkv, S, D]")
  group = rows // q_len
  if b % blocks.batch or hkv % blocks.heads or s % blocks.keys or d % LANES:
    raise ValueError(f"suffix_attention_head_major: B={b}, Hkv={hkv}, S={s}, D={d} must be "
                     f"multiples of {blocks} and {LANES}")
  nb = b // blocks.batch
  grid = (hkv // blocks.heads, nb, s // blocks.keys)
  block_length = jnp.max(lengths.reshape(nb, blocks.batch), axis=1)

  def row_map(hh, i, j, lengths_ref, block_length_ref):
    return (hh, i, 0, 0)

  def kv_map(hh, i, j, lengths_ref, block_length_ref):
    return (i, hh, jnp.minimum(j, last_block(block_length_ref[i], blocks.keys)), 0)

  row_spec = pl.BlockSpec((blocks.heads, blocks.batch, rows, d), row_map)
  lse_spec = pl.BlockSpec((blocks.heads, blocks.batch, rows, LANES), row_map)
  kv_spec = pl.BlockSpec((blocks.batch, blocks.heads, blocks.keys, d), kv_map)
  in_specs = [row_spec, kv_spec, kv_spec]
  args = [lengths, block_length, q, k, v]
  if mods is not None and mods.alibi:
    in_specs.append(lse_spec)
    args.append(slopes)
  if prior is not None:
    in_specs += [row_spec, lse_spec]
    args += list(prior)
  state = (blocks.heads, blocks.batch, rows)
  kernel = functools.partial(_suffix_kernel, scale=scale, causal=causal, q_len=q_len, group=group,
                             has_prior=prior is not None, mods=mods)
  return common.suffix_call(kernel, args, grid=grid, in_specs=in_specs, row_spec=row_spec,
                            lse_spec=lse_spec, out_shape=(hkv, b, rows, d), state=state,
                            keys=s, q_itemsize=q.dtype.itemsize, kv_itemsize=q.dtype.itemsize,
                            out_dtype=out_dtype, has_prior=prior is not None,
                            vmem_limit_bytes=vmem_limit_bytes, name="hydragen_suffix_attention",
                            interpret=interpret)


def rows_blocks(q_rows, k, v, block_sizes: BlockSizes, has_prior: bool) -> Optional[SuffixBlocks]:
  """The blocks :func:`suffix_rows` runs ``q_rows [Hkv, B*Tq*G, D]`` against ``k, v [B, S, Hkv,
  D]`` with (None where no kernel runs: no rows or no keys); shapes and dtypes only."""
  hkv, r, d = q_rows.shape
  b, s = k.shape[:2]
  if b * r == 0 or s == 0:
    return None
  return suffix_blocks(b, hkv, s, r // b, common.round_up(d, LANES),
                       common.compute_dtype(q_rows, k, v).itemsize, block_sizes, has_prior)


def suffix_attention(
    q: jax.Array,  # [B, Tq, Hq, D]
    k: jax.Array,  # [B, S, Hkv, D]
    v: jax.Array,  # [B, S, Hkv, D]
    *,
    kv_lengths: jax.Array,  # int32 [B]
    causal: bool,
    scale: float,
    prior: Optional[Tuple[jax.Array, jax.Array]] = None,  # (out f32 [B,Tq,Hq,D], lse [B,Tq,Hq])
    block_sizes: BlockSizes,
    interpret: Optional[bool] = None,
    mods: Optional[base.ScoreMods] = None,  # variants (own keys: no offset needed)
):
  """Per-sequence attention over each sequence's own ragged K/V, on TPU.

  Same signature and semantics as :func:`pallas_kernels.base.suffix_attention`:
  keys past ``kv_lengths[b]`` are invisible; with ``causal`` query ``i`` sits at
  position ``kv_lengths[b] - Tq + i``. With ``prior`` (a partial result over other
  keys) the result is its exact LSE merge, fused into the kernel. Returns float32
  ``out [B, Tq, Hq, D]`` and float32 natural-log ``lse [B, Tq, Hq]``
  (``log(sum_j exp(scale * q . k_j))`` over all visible keys, prior's included);
  ``(0, -inf)`` for rows that see nothing.

  Example:
    >>> out, lse = suffix_attention(q, k, v, kv_lengths=lens, causal=True, scale=0.125)
  """
  b, tq, hq, _ = q.shape
  hkv = k.shape[2]
  state = None
  if prior is not None:
    state = (fold_rows(prior[0].astype(jnp.float32), hkv),
             fold_rows(prior[1].astype(jnp.float32)[..., None], hkv)[..., 0])
  q_rows = fold_rows(q, hkv)
  out, lse = suffix_rows(q_rows, k, v, kv_lengths, state, q_len=tq, causal=causal,
                         scale=scale, d_out=v.shape[-1],
                         blocks=rows_blocks(q_rows, k, v, block_sizes, state is not None),
                         vmem_limit_bytes=block_sizes.vmem_limit_bytes, interpret=interpret,
                         mods=variants(mods, b, tq, hq, hkv))
  return unfold_rows(out, b, tq, hq), unfold_rows(lse, b, tq, hq)


def suffix_rows(
    q_rows: jax.Array,  # [Hkv, B*Tq*G, D] (prefix.fold_rows), any float dtype
    k: jax.Array,  # [B, S, Hkv, D]
    v: jax.Array,  # [B, S, Hkv, D]
    kv_lengths: jax.Array,  # int32 [B]
    prior=None,  # (out f32 [Hkv, B*Tq*G, D or Dp], lse f32 [Hkv, B*Tq*G] or [.., 128])
    *,
    q_len: int,
    causal: bool,
    scale: float,
    d_out: int,
    out_dtype=jnp.float32,
    blocks: Optional[SuffixBlocks],
    vmem_limit_bytes: Optional[int] = None,
    interpret: Optional[bool] = None,
    mods=None,
):
  """The suffix kernel on folded query rows with ``blocks`` (:func:`rows_blocks`): pads, runs,
  slices; ``mods``: score variants over the rows (:func:`pallas_kernels.tpu.prefix.variants`).

  Returns ``out [Hkv, B*Tq*G, d_out]`` (``out_dtype``) and float32 natural-log
  ``lse [Hkv, B*Tq*G]``. A lane-replicated prior LSE (``[..., 128]``, as the prefix and
  segment kernels return it) is used as is.
  """
  hkv, r, d = q_rows.shape
  b, s = k.shape[:2]
  if b * r == 0:
    return jnp.zeros((hkv, r, d_out), out_dtype), jnp.full((hkv, r), -jnp.inf, jnp.float32)
  if s == 0:  # no own keys: the result is the prior (normalised), or nothing
    if prior is None:
      return jnp.zeros((hkv, r, d_out), out_dtype), jnp.full((hkv, r), -jnp.inf, jnp.float32)
    lse = prior[1] if prior[1].ndim == 2 else prior[1][..., 0]
    out = jnp.where((lse > -jnp.inf)[..., None], prior[0][..., :d_out], 0.0)
    return out.astype(out_dtype), lse
  rows = r // b
  dtype = common.compute_dtype(q_rows, k, v)
  dp = common.round_up(d, LANES)
  bp, sp = common.round_up(b, blocks.batch), common.round_up(s, blocks.keys)
  qr = common.pad_to(q_rows.astype(dtype).reshape(hkv, b, rows, d), (hkv, bp, rows, dp))
  kh = common.pad_to(jnp.swapaxes(k.astype(dtype), 1, 2), (bp, hkv, sp, dp))
  vh = common.pad_to(jnp.swapaxes(v.astype(dtype), 1, 2), (bp, hkv, sp, dp))
  lengths = common.pad_to(jnp.clip(jnp.asarray(kv_lengths, jnp.int32), 0, s), (bp,))
  state = None
  if prior is not None:
    p_out = common.pad_to(prior[0].astype(jnp.float32).reshape(hkv, b, rows, -1),
                          (hkv, bp, rows, dp))
    p_lse = prior[1].astype(jnp.float32)
    if p_lse.ndim == 2:
      p_lse = jnp.broadcast_to(p_lse[..., None], (hkv, r, LANES))
    p_lse = p_lse.reshape(hkv, b, rows, LANES)
    if bp > b:  # padding sequences: an empty prior
      p_lse = jnp.pad(p_lse, [(0, 0), (0, bp - b), (0, 0), (0, 0)], constant_values=-jnp.inf)
    state = (p_out, p_lse)
  slopes = None
  if mods is not None and mods[2] is not None:  # [Hkv, R] -> [Hkv, Bp, rows, 128]
    slopes = common.pad_to(mods[2].reshape(hkv, b, rows), (hkv, bp, rows))
    slopes = jnp.broadcast_to(slopes[..., None], (hkv, bp, rows, LANES))
  out, lse = suffix_attention_head_major(qr, kh, vh, lengths, state, causal=bool(causal),
                                         scale=scale, q_len=q_len, blocks=blocks,
                                         out_dtype=out_dtype,
                                         vmem_limit_bytes=vmem_limit_bytes,
                                         interpret=interpret, mods=mods and mods[0],
                                         slopes=slopes)
  return (out[:, :b, :, :d_out].reshape(hkv, r, d_out), lse[:, :b, :, 0].reshape(hkv, r))
