"""Per-sequence (suffix) attention on GPUs (Pallas Triton), with the merge fused in.

One program per (sequence, KV head, row tile, key split) holds up to 64 of
that sequence's ``Tq * G`` query rows (all query heads of the KV head: GQA
folding; in decoding one tile holds them all) and streams only the
sequence's valid keys: blocks past ``kv_lengths[b]`` (and, when causal, past
the tile's last query position) are never loaded or computed. Causal inside
the suffix when ``Tq > 1`` (query i sits at ``kv_lengths[b] - Tq + i``).

With one key split, the prior states (the shared-prefix result, every key
split of it, and every tree level) are merged into the result in the
kernel's epilogue: each is read once and the final output is written once,
in the query dtype. With several splits (flash-decoding, for small batches)
the split partials and the priors are merged by LSE afterwards, in one more
kernel (:mod:`pallas_kernels.gpu.merge`).

Reference with the same signature: :func:`pallas_kernels.base.suffix_attention`.
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
from pallas_kernels.base import suffix_attention as suffix_attention_reference  # noqa: F401  (the reference of this kernel)
from pallas_kernels.device import DeviceInfo
from pallas_kernels.gpu import common, tuned
from pallas_kernels.gpu.merge import MergeConfig, merge_parts

MAX_ROWS = 64  # rows of a sequence held by one program (decode: Tq * G is small)
PREFILL_ROWS = 64  # row tile when Tq * G is larger (prefill, chunked prefill)


@dataclasses.dataclass(frozen=True)
class SuffixConfig:
  block_n: int  # keys per inner step
  splits: int  # key splits per sequence
  num_warps: int
  num_stages: int


def _suffix_tiles(device: DeviceInfo, rows: int, head_dim: int) -> tuned.Tiles:
  if rows <= 16:
    shape = "decode16"
  elif rows <= MAX_ROWS:
    shape = "decode64"
  else:
    shape = "prefill-" + tuned.head_dim_class(head_dim)
  return tuned.tiles(device, "suffix", shape)


def default_config(batch: int, kv_heads: int, capacity: int, head_dim: int, rows: int = 1, *,
                   device: DeviceInfo, itemsize: int = 2) -> SuffixConfig:
  """Decode (one tile of ``rows <= 64``): short key steps and few warps, which keep several
  programs per SM and skip less-than-a-block tails; prefill tiles: longer steps. The keys are
  split only when ``batch * kv_heads`` programs cannot fill ``device.cores`` SMs; shorter key
  steps where float32 tiles would not fit the shared memory (``itemsize``: bytes per K/V
  element). Tiles: :func:`pallas_kernels.gpu.tuned.tiles`.
  """
  decode = rows <= MAX_ROWS
  t = _suffix_tiles(device, rows, head_dim)
  block_n = common.fit_block_n(t.block_n, head_dim, itemsize, t.num_stages)
  programs = batch * kv_heads * (1 if decode else pl.cdiv(rows, PREFILL_ROWS))
  max_splits = max(1, pl.cdiv(capacity, block_n))
  num_sms = device.cores
  splits = 1 if programs >= num_sms else max(1, min(max_splits, pl.cdiv(2 * num_sms, programs)))
  splits = max(1, min(splits, pl.cdiv(capacity, t.min_steps * block_n)))
  return SuffixConfig(block_n, splits, num_warps=t.num_warps, num_stages=t.num_stages)


def _merge2(out, lse, p_out, p_lse):
  """Exact LSE merge of two row states (float32); (0, -inf) parts are ignored."""
  m = jnp.maximum(lse, p_lse)
  m = jnp.where(m == -jnp.inf, 0.0, m)
  w, w_p = jnp.exp(lse - m), jnp.exp(p_lse - m)
  denom = w + w_p
  has = denom > 0
  safe = jnp.where(has, denom, 1.0)
  out = (out * w[:, None] + p_out * w_p[:, None]) / safe[:, None]
  return out, jnp.where(has, m + jnp.log(safe), -jnp.inf)


def _kernel(len_ref, q_ref, k_ref, v_ref, *refs, scale: float, head_dim: int, rows: int,
            q_len: int, group: int, causal: bool, block_n: int,
            prior_splits: tuple[int, ...], lead: bool, page_size: int | None = None,
            width: int = 0, mods: KernelMods | None = None):
  # len_ref: [B] int32; q_ref: [Mp, Dp] (a tile of one sequence's rows for one KV head);
  # k_ref/v_ref: [S, Dp], or with ``page_size`` the pools [pages * page_size, Dp] followed by
  # the page table [B * width]; with ``lead``: lead_len_ref [1], lead_k_ref/lead_v_ref [P, Dp];
  # with ALiBi (``mods``): the rows' slopes [Mp]; then per prior: out [n, Mp, Dp], lse [n, Mp];
  # then o_ref, lse_ref.
  b, tile, split = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  pages = None
  if page_size is not None:
    pages = common.Pages(refs[0], b * width, page_size, width)
    refs = refs[1:]
  if lead:
    lead_len_ref, lead_k_ref, lead_v_ref = refs[:3]
    refs = refs[3:]
  slopes = None
  if mods is not None and mods.alibi:
    slopes = plgpu.load(refs[0], mask=tile * refs[0].shape[0] + jnp.arange(refs[0].shape[0])
                        < rows, other=0.0)
    refs = refs[1:]
  prior_refs = refs[:2 * len(prior_splits)]
  o_ref, lse_ref = refs[2 * len(prior_splits):]
  mp, dp = q_ref.shape
  row = tile * mp + jnp.arange(mp)  # row index within the sequence: t * G + g
  row_ok = row < rows
  d_mask = (jnp.arange(dp) < head_dim)[None, :] if dp != head_dim else None
  q_mask = row_ok[:, None] if d_mask is None else row_ok[:, None] & d_mask
  kv_len = len_ref[b]
  q = common.load(q_ref, q_mask if rows % mp or d_mask is not None else None)
  qk_scale = scale * common.LOG2E

  window = mods is not None and mods.window is not None

  def step(j, carry, masked, kref, vref, lo, hi, limit, paged, qpos):
    start = lo + j * block_n
    keys = start + jnp.arange(block_n)
    kv_mask = d_mask
    if masked:
      kv_mask = (keys < hi)[:, None] if d_mask is None else (keys < hi)[:, None] & d_mask
    if paged is None:
      k = common.load(kref.at[pl.ds(start, block_n), :], kv_mask)
      v = common.load(vref.at[pl.ds(start, block_n), :], kv_mask)
    else:
      k = common.load_pages(kref, start, block_n, kv_mask, paged)
      v = common.load_pages(vref, start, block_n, kv_mask, paged)
    if mods is None:
      s = common.dot(q, k, trans_b=True) * qk_scale
    else:  # qpos: each row's position in these keys' coordinates
      s = common.modified_scores(common.dot(q, k, trans_b=True) * scale, mods,
                                 qpos[:, None] - keys[None, :], slopes)
    if masked:
      visible = (keys < hi)[None, :]
      if limit is not None:
        visible = visible & (keys[None, :] <= limit[:, None])
      s = jnp.where(visible, s, -jnp.inf)
    return common.online_softmax_step(carry, s, v, masked_s=masked or window)

  # Each row's position among the own keys (query t at kv_len - q_len + t), and the tile's
  # first and last valid rows' positions.
  own_pos = kv_len - q_len + row // group
  own_first = kv_len - q_len + (tile * mp) // group
  own_last = kv_len - q_len + (jnp.minimum(tile * mp + mp, rows) - 1) // group

  def stream(carry, kref, vref, lo, hi, n_full, limit=None, paged=None, shift=0):
    """Keys [lo, hi) of one K/V: ``n_full`` unmasked blocks, then the masked rest. With
    variants the rows sit ``shift`` positions further in these keys' coordinates than among
    the own keys; a window keeps only the keys some row's window reaches, every block masked."""
    if window:
      first, last = mods.key_bounds(own_first + shift, own_last + shift)
      lo, hi, n_full = jnp.maximum(lo, first), jnp.minimum(hi, last), 0
    n_keys = jnp.maximum(hi - lo, 0)
    kw = dict(kref=kref, vref=vref, lo=lo, hi=hi, limit=limit, paged=paged,
              qpos=own_pos + shift)
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False, **kw), carry)
    return lax.fori_loop(n_full, pl.cdiv(n_keys, block_n),
                         functools.partial(step, masked=True, **kw), carry)

  carry = (jnp.zeros((mp, dp), jnp.float32), jnp.full((mp,), -jnp.inf, jnp.float32),
           jnp.zeros((mp,), jnp.float32))
  # This split's keys: [lo, lo + per_split) of the sequence's own keys, or, with ``lead``, of
  # the shared keys followed by its own (the shared K/V is read by every sequence). The splits
  # share the keys the sequence has, not the cache's capacity: early in a long generation
  # every split still has work.
  lead_len = lead_len_ref[0] if lead else 0
  splits = pl.num_programs(3)
  per_split = ((lead_len + kv_len + splits - 1) // splits + block_n - 1) // block_n * block_n
  lo = split * per_split
  hi = lo + per_split
  if lead:
    lead_hi = jnp.minimum(hi, lead_len)
    carry = stream(carry, lead_k_ref, lead_v_ref, lo, lead_hi,
                   jnp.maximum(lead_hi - lo, 0) // block_n, shift=lead_len)
    lo, hi = jnp.maximum(lo - lead_len, 0), jnp.maximum(hi - lead_len, 0)
  hi = jnp.minimum(hi, kv_len)
  limit = kv_len - q_len + row // group  # last visible key of each row (causal)
  visible_to_all = kv_len  # keys below it are seen by every row of the tile
  if causal:  # the tile's last row sees nothing past its position: stop there
    hi = jnp.minimum(hi, kv_len - q_len + (tile * mp + mp - 1) // group + 1)
    visible_to_all = kv_len - q_len + (tile * mp) // group + 1
  n_full = jnp.clip(jnp.minimum(hi, visible_to_all) - lo, 0, None) // block_n
  carry = stream(carry, k_ref, v_ref, lo, hi, n_full, limit if causal else None, pages)
  out, lse = common.finalize(*carry)
  # Fused LSE merge with the shared parts (every split of every prior), in registers.
  for i, n in enumerate(prior_splits):
    p_out_ref, p_lse_ref = prior_refs[2 * i], prior_refs[2 * i + 1]
    for j in range(n):
      jj = jnp.int32(j)
      p_out = common.load(p_out_ref.at[jj], q_mask).astype(jnp.float32)
      p_lse = plgpu.load(p_lse_ref.at[jj], mask=row_ok, other=-jnp.inf)
      out, lse = _merge2(out, lse, p_out, p_lse)
  plgpu.store(o_ref, out.astype(o_ref.dtype), mask=q_mask)
  plgpu.store(lse_ref, lse, mask=row_ok)


def _call(lengths, q_rows, k, v, *rest, scale, cfg: SuffixConfig, head_dim: int, q_len: int,
          group: int, causal: bool, out_dtype, lead: bool, interpret: bool,
          by_sequence: bool = False, q_by_sequence: bool = False,
          page_size: int | None = None, mods: KernelMods | None = None):
  # by_sequence: out [splits, B, Hkv, M, D] (lse [splits, B, Hkv, M]) instead of
  # [splits, Hkv, B, M, D]; with Tq = 1 that is [B, Hq, D] as it is: no transpose after.
  # q_by_sequence: q_rows is [B, Hkv, M, D] (with Tq = 1, q itself reshaped) instead of
  # [Hkv, B, M, D].
  # page_size: k and v are the pools [pages * page_size, Hkv, D] and the page table
  # [B * width] follows them; sequence b's key j is in its page j // page_size.
  if q_by_sequence:
    b, hkv, m, _ = q_rows.shape
  else:
    hkv, b, m, _ = q_rows.shape
  table, rest = (rest[:1], rest[1:]) if page_size is not None else ((), rest)
  width = table[0].shape[0] // b if table else 0
  s = width * page_size if table else k.shape[1]
  lead_args, rest = (rest[:3], rest[3:]) if lead else ((), rest)
  # with ALiBi: the rows' slopes, laid out as q_rows without D
  slope_args, priors = (rest[:1], rest[1:]) if mods is not None and mods.alibi else ((), rest)
  # Decode (few rows): one tile of all rows. Prefill (Tq * G rows): flash-attention row tiles.
  mp = max(common.MIN_DOT, common.next_pow2(m)) if m <= MAX_ROWS else PREFILL_ROWS
  tiles = pl.cdiv(m, mp)
  dp = common.padded_head_dim(head_dim)
  prior_splits = tuple(x.shape[0] for x in priors[::2])
  lead_dims = (b, hkv) if by_sequence else (hkv, b)
  kernel = functools.partial(
      _kernel, scale=scale, head_dim=head_dim, rows=m, q_len=q_len, group=group, causal=causal,
      block_n=cfg.block_n, prior_splits=prior_splits, lead=lead,
      page_size=page_size, width=width, mods=mods)
  if table:  # every program sees the whole pool of its KV head; rows come from the table
    kv_spec = pl.BlockSpec((k.shape[0], None, dp), lambda i, h, t, j: (0, h, 0))
  else:
    kv_spec = pl.BlockSpec((None, s, None, dp), lambda i, h, t, j: (i, 0, h, 0))
  in_specs = [pl.BlockSpec((b,), lambda i, h, t, j: (0,)),
              pl.BlockSpec((None, None, mp, dp),
                           (lambda i, h, t, j: (i, h, t, 0)) if q_by_sequence
                           else (lambda i, h, t, j: (h, i, t, 0))), kv_spec, kv_spec]
  if table:
    in_specs.append(pl.BlockSpec(table[0].shape, lambda i, h, t, j: (0,)))
  if lead:  # the shared K/V: the same block for every sequence
    lead_spec = pl.BlockSpec((lead_args[1].shape[0], None, dp), lambda i, h, t, j: (0, h, 0))
    in_specs += [pl.BlockSpec((1,), lambda i, h, t, j: (0,)), lead_spec, lead_spec]
  if slope_args:
    in_specs.append(pl.BlockSpec((None, None, mp), (lambda i, h, t, j: (i, h, t)) if q_by_sequence
                                 else (lambda i, h, t, j: (h, i, t))))
  for n in prior_splits:
    in_specs += [pl.BlockSpec((n, None, None, mp, dp), lambda i, h, t, j: (0, h, i, t, 0)),
                 pl.BlockSpec((n, None, None, mp), lambda i, h, t, j: (0, h, i, t))]
  return pl.pallas_call(
      kernel,
      grid=(b, hkv, tiles, cfg.splits),
      in_specs=in_specs,
      out_specs=[
          pl.BlockSpec((None, None, None, mp, dp),
                       (lambda i, h, t, j: (j, i, h, t, 0)) if by_sequence
                       else (lambda i, h, t, j: (j, h, i, t, 0))),
          pl.BlockSpec((None, None, None, mp),
                       (lambda i, h, t, j: (j, i, h, t)) if by_sequence
                       else (lambda i, h, t, j: (j, h, i, t))),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((cfg.splits, *lead_dims, m, head_dim), out_dtype),
          jax.ShapeDtypeStruct((cfg.splits, *lead_dims, m), jnp.float32),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name=("hydragen_flat_attention" if lead else
            "hydragen_paged_suffix_attention" if table else "hydragen_suffix_attention"),
  )(lengths, q_rows, k, v, *table, *lead_args, *slope_args, *priors)


def _slope_args(mods: common.RowMods | None, hkv: int, b: int, m: int, *, by_sequence: bool):
  """The suffix kernel's ALiBi operand: the rows' slopes ``[Hkv, B, M]`` (``by_sequence``:
  ``[B, Hkv, M]``), or none."""
  if mods is None or mods.slopes is None:
    return ()
  slopes = mods.slopes.reshape(hkv, b, m)
  return (jnp.swapaxes(slopes, 0, 1),) if by_sequence else (slopes,)


def suffix_rows(
    q_rows: jax.Array,  # [Hkv, B, M, D], M = Tq * G rows per sequence
    k: jax.Array,  # [B, S, Hkv, D], or with page_table the pool [pages, page_size, Hkv, D]
    v: jax.Array,  # the same shape as k
    lengths: jax.Array,  # int32 [B]
    priors: list[tuple[jax.Array, jax.Array]],  # [(out [n, Hkv, B, M, D], lse [n, Hkv, B, M])]
    *,
    q_len: int,
    causal: bool,
    scale: float,
    out_dtype,
    config: SuffixConfig,
    merge: MergeConfig,
    by_sequence: bool = False,
    page_table: jax.Array | None = None,  # int32 [B, O]: sequence b's pages in token order
    interpret: bool | None = None,
    mods: common.RowMods | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Suffix attention in the folded row layout, every prior state merged in.

  Returns ``out [Hkv, B, M, D]`` (``out_dtype``) and natural-log ``lse [Hkv, B, M]``; with
  ``by_sequence``, ``out [B, Hkv, M, D]`` and ``lse [B, Hkv, M]``: in decoding (``M = G``) that is
  ``[B, 1, Hq, D]`` reshaped, so the kernel writes the final layout (with one key split; with
  several, the merge writes it).

  With ``page_table``, ``k`` and ``v`` are page pools and sequence b's own key j is at page
  ``page_table[b, j // page_size]``, offset ``j % page_size``, read in place.

  ``mods``: score variants (:func:`pallas_kernels.gpu.common.row_mods`; the own keys' positions
  come from ``lengths``, as in :func:`pallas_kernels.base.suffix_attention`).
  """
  hkv, b, m, d = q_rows.shape
  page_size, table = None, ()
  if page_table is not None:
    page_size = k.shape[1]
    table = (jnp.asarray(page_table, jnp.int32).reshape(-1),)
    s = page_table.shape[1] * page_size
    k, v = (x.reshape((-1,) + x.shape[2:]) for x in (k, v))
  else:
    s = k.shape[1]
  group = m // q_len

  def layout(out, lse):  # [Hkv, B, ...] -> the layout asked for
    return (jnp.swapaxes(out, 0, 1), jnp.swapaxes(lse, 0, 1)) if by_sequence else (out, lse)

  if s == 0 or b == 0:  # no suffix keys: only the priors
    parts = [(o[j], l[j]) for o, l in priors for j in range(o.shape[0])]
    if not parts:
      return layout(jnp.zeros((hkv, b, m, d), out_dtype), jnp.full((hkv, b, m), -jnp.inf,
                                                                    jnp.float32))
    out, lse = merge_states([p[0] for p in parts], [p[1] for p in parts])
    return layout(out.astype(out_dtype), lse)
  cfg = config
  fused = cfg.splits == 1
  flat = [x for pr in priors for x in pr] if fused else []
  call = functools.partial(_call, scale=scale, cfg=cfg, head_dim=d, q_len=q_len, group=group,
                           causal=causal, out_dtype=out_dtype if fused else jnp.float32,
                           lead=False, by_sequence=by_sequence and fused, page_size=page_size,
                           mods=None if mods is None else mods.kind)
  slopes = _slope_args(mods, hkv, b, m, by_sequence=False)
  out, lse = common.run(call, jnp.asarray(lengths, jnp.int32), q_rows, k, v, *table, *slopes,
                         *flat, interpret=interpret)
  if fused:  # the kernel wrote the layout asked for
    return out[0], lse[0]
  # The splits and every prior state in one merge (XLA's, fused into the transpose, where the
  # caller or ``by_sequence`` transposes next).
  return layout(*merge_parts([(out, lse), *priors], out_dtype=out_dtype, config=merge,
                             transposed_next=hkv > 1, interpret=interpret))


def flat_config(batch: int, kv_heads: int, keys: int, head_dim: int, *, device: DeviceInfo,
                itemsize: int = 2) -> SuffixConfig:
  """Splits of the shared + own keys (``keys`` per sequence) for :func:`flat_rows`: about two
  programs per SM, each at least ``min_steps`` key steps (:func:`pallas_kernels.gpu.tuned.tiles`,
  ``("flat", "any")``)."""
  t = tuned.tiles(device, "flat", "any")
  block_n = common.fit_block_n(t.block_n, head_dim, itemsize, t.num_stages)
  programs = batch * kv_heads
  splits = max(1, min(pl.cdiv(2 * device.cores, programs), pl.cdiv(keys, t.min_steps * block_n)))
  return SuffixConfig(block_n, splits, num_warps=t.num_warps, num_stages=t.num_stages)


def flat_rows(
    q_rows: jax.Array,  # [Hkv, B, M, D] ([B, Hkv, M, D] with by_sequence), M = Tq * G <= MAX_ROWS
    shared_k: jax.Array,  # [P, Hkv, D]: keys every sequence sees first
    shared_v: jax.Array,  # [P, Hkv, D]
    shared_length,  # int32 scalar <= P
    k: jax.Array,  # [B, S, Hkv, D], S >= 1
    v: jax.Array,  # [B, S, Hkv, D]
    lengths: jax.Array,  # int32 [B]
    *,
    q_len: int,
    causal: bool,
    scale: float,
    out_dtype,
    config: SuffixConfig,
    merge: MergeConfig,
    by_sequence: bool = False,
    interpret: bool | None = None,
    mods: common.RowMods | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Attention of each sequence over the shared keys followed by its own, in ONE kernel.

  The small-batch path: each program streams one split of its sequence's shared-then-own
  keys, reading the shared K/V directly (every sequence reads it; at small batch it stays
  in L2), and the split partials are merged by LSE afterwards (the merge kernel). Where sharing the prefix
  product cannot pay (a few sequences), this replaces the prefix kernel + suffix kernel
  pair and their launch latencies. Causal inside the own keys when ``Tq > 1``; the shared
  keys are visible to every row. Returns ``out [Hkv, B, M, D]`` (``out_dtype``) and
  natural-log ``lse [Hkv, B, M]``.

  ``by_sequence``: rows in and out are sequence-major, ``q_rows [B, Hkv, M, D]`` and
  ``out [B, Hkv, M, D]``, ``lse [B, Hkv, M]``; in decoding (``M = G``) both are ``[B, 1, Hq, D]``
  reshaped, so no transpose runs before or after the kernel (and the split merge, in the merge
  kernel, writes the final layout).

  ``mods``: score variants (:func:`pallas_kernels.gpu.common.row_mods`); each sequence's context
  is the ``shared_length`` shared keys, then its own.
  """
  hkv, b, m, d = (q_rows.shape[1], q_rows.shape[0], *q_rows.shape[2:]) if by_sequence \
      else q_rows.shape
  if m > MAX_ROWS or k.shape[1] == 0 or shared_k.shape[0] == 0:
    raise ValueError(f"flat_rows: needs rows per sequence <= {MAX_ROWS} (got {m}) and non-empty "
                     f"shared ({shared_k.shape[0]}) and own ({k.shape[1]}) key buffers")
  cfg = config
  fused = cfg.splits == 1
  call = functools.partial(_call, scale=scale, cfg=cfg, head_dim=d, q_len=q_len,
                           group=m // q_len, causal=causal,
                           out_dtype=out_dtype if fused else jnp.float32, lead=True,
                           by_sequence=by_sequence, q_by_sequence=by_sequence,
                           mods=None if mods is None else mods.kind)
  out, lse = common.run(call, jnp.asarray(lengths, jnp.int32), q_rows, k, v,
                         jnp.reshape(jnp.asarray(shared_length, jnp.int32), (1,)), shared_k,
                         shared_v, *_slope_args(mods, hkv, b, m, by_sequence=by_sequence),
                         interpret=interpret)
  if fused:
    return out[0], lse[0]
  return merge_parts([(out, lse)], out_dtype=out_dtype, config=merge,
                     transposed_next=hkv > 1 and not by_sequence, interpret=interpret)


def suffix_attention(
    q: jax.Array,  # [B, Tq, Hq, D]
    k: jax.Array,  # [B, S, Hkv, D]
    v: jax.Array,  # [B, S, Hkv, D]
    *,
    kv_lengths: jax.Array,  # int32 [B]
    causal: bool,
    scale: float,
    prior: tuple[jax.Array, jax.Array] | None = None,
    config: SuffixConfig,
    merge: MergeConfig,
    interpret: bool | None = None,
    mods: ScoreMods | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Same signature and result as the reference (float32 out, natural-log lse), with the
  kernel's ``config`` and the split merge's ``merge`` (a plan's
  :func:`pallas_kernels.gpu.dispatch.plan_suffix`)."""
  b, tq, hq, d = q.shape
  hkv = k.shape[2]
  m = tq * (hq // hkv)
  priors = []
  if prior is not None:
    priors.append((common.fold_rows(prior[0].astype(jnp.float32), hkv).reshape(1, hkv, b, m, d),
                   common.fold_rows(prior[1][..., None], hkv).reshape(1, hkv, b, m)))
  out, lse = suffix_rows(common.fold_rows(q, hkv).reshape(hkv, b, m, d), k, v, kv_lengths, priors,
                         q_len=tq, causal=causal, scale=scale, out_dtype=jnp.float32, config=config,
                         merge=merge, by_sequence=True, interpret=interpret,
                         mods=common.row_mods(mods, b, tq, hq, hkv))
  return common.unfold_seq_rows(out, tq), common.unfold_seq_rows(lse, tq)
