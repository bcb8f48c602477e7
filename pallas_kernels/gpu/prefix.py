"""Batched prefix attention on GPUs (Pallas Triton): every query against one shared K/V.

Hydragen's inter-sequence batching (Sec. 3.2): the ``R = B * Tq * G`` query
rows of a KV head are the rows of one matrix product against the prefix, so
the prefix is streamed once per row tile (from L2 after the first tile) and
the products run on the tensor cores. The grid is
``(row tiles, key splits, KV heads)``; key splits (flash-decoding) fill the
GPU when there are few row tiles and are merged by LSE afterwards.

The pure-JAX reference with the same signature is
:func:`pallas_kernels.base.prefix_attention`. LSE is natural log.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.base import KernelMods
from pallas_kernels.base import prefix_attention as prefix_attention_reference  # noqa: F401  (the reference of this kernel)
from pallas_kernels.device import DeviceInfo
from pallas_kernels.gpu import common, tuned


@dataclasses.dataclass(frozen=True)
class PrefixConfig:
  """Tuning knobs of the prefix kernel (static)."""

  block_m: int  # query rows per program (>= 16, power of two)
  block_n: int  # keys per inner step
  splits: int  # key splits (programs along the keys)
  num_warps: int
  num_stages: int


def default_config(rows: int, kv_heads: int, prefix: int, head_dim: int, *, device: DeviceInfo,
                   itemsize: int = 2) -> PrefixConfig:
  """Large row tiles when the batch is large (tensor-core bound), split keys otherwise.

  A 128-row tile gives 128 FLOPs per byte of K/V streamed from L2; fewer rows
  make the kernel L2-bound, so rows per tile shrink only when there are few
  rows at all. Splits make ``tiles * splits * heads`` at least one wave of ``device.cores``
  programs. Tiles, warps and stages: :func:`pallas_kernels.gpu.tuned.tiles`.
  """
  t = tuned.tiles(device, "prefix", tuned.head_dim_class(head_dim))
  block_m = min(t.block_m, max(common.MIN_DOT, common.next_pow2(rows)))
  stages = t.num_stages
  block_n = common.fit_block_n(t.block_n, head_dim, itemsize, stages)
  tiles = pl.cdiv(rows, block_m) * kv_heads
  max_splits = max(1, pl.cdiv(prefix, t.min_steps * block_n))
  splits = max(1, min(max_splits, pl.cdiv(device.cores, tiles)))
  return PrefixConfig(block_m, block_n, splits, num_warps=t.num_warps, num_stages=stages)


def _kernel(len_ref, q_ref, k_ref, v_ref, *refs, scale: float, head_dim: int, block_n: int,
            keys_per_split: int, mods: KernelMods | None = None):
  # len_ref: [1] int32; q_ref: [block_m, Dp]; k_ref/v_ref: [P, Dp]; with ``mods``: the rows'
  # positions [block_m] (ALiBi or a window), then their slopes [block_m] (ALiBi); o_ref:
  # [block_m, Dp]; lse_ref: [block_m]
  o_ref, lse_ref = refs[-2:]
  split = pl.program_id(1)
  dp = q_ref.shape[-1]
  d_mask = (jnp.arange(dp) < head_dim)[None, :] if dp != head_dim else None
  kv_len = len_ref[0]
  lo = split * keys_per_split
  hi = jnp.minimum(lo + keys_per_split, kv_len)
  pos = slopes = None
  if mods is not None:
    extra = list(refs[:-2])
    if mods.window is not None or mods.alibi:
      pos = extra.pop(0)[...]
    if mods.alibi:
      slopes = extra.pop(0)[...]
    if mods.window is not None:  # only the keys some row's window reaches
      first, last = mods.key_bounds(jnp.min(pos), jnp.max(pos))
      lo, hi = jnp.maximum(lo, first), jnp.minimum(hi, last)
  n_keys = jnp.maximum(hi - lo, 0)
  q = common.load(q_ref, d_mask)
  qk_scale = scale * common.LOG2E  # scores in base 2 (exp2 is the hardware op)

  def step(j, carry, masked):
    start = lo + j * block_n
    keys = start + jnp.arange(block_n)
    kv_mask = (keys < hi)[:, None] if masked else None
    if d_mask is not None:
      kv_mask = d_mask if kv_mask is None else kv_mask & d_mask
    k = common.load(k_ref.at[pl.ds(start, block_n), :], kv_mask)
    v = common.load(v_ref.at[pl.ds(start, block_n), :], kv_mask)
    if mods is None:
      s = common.dot(q, k, trans_b=True) * qk_scale
    else:
      dist = None if pos is None else pos[:, None] - keys[None, :]
      s = common.modified_scores(common.dot(q, k, trans_b=True) * scale, mods, dist, slopes)
    if masked:
      s = jnp.where((keys < hi)[None, :], s, -jnp.inf)
    # A window can hide a whole step from some rows: their scores are all -inf.
    masked_s = mods is not None and mods.window is not None
    return common.online_softmax_step(carry, s, v, masked_s=masked_s)

  bm = q_ref.shape[0]
  carry = (jnp.zeros((bm, dp), jnp.float32), jnp.full((bm,), -jnp.inf, jnp.float32),
           jnp.zeros((bm,), jnp.float32))
  n_full = n_keys // block_n
  carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
  carry = lax.fori_loop(n_full, pl.cdiv(n_keys, block_n), functools.partial(step, masked=True),
                        carry)
  out, lse = common.finalize(*carry)
  plgpu.store(o_ref, out.astype(o_ref.dtype), mask=d_mask)
  lse_ref[...] = lse


def _call(kv_length, q_rows, k, v, *row_args, scale, cfg: PrefixConfig, head_dim: int,
          interpret: bool, mods: KernelMods | None = None):
  # row_args: with ``mods``, the rows' positions [R] and/or slopes [Hkv, R] (R padded as q_rows)
  hkv, r, dp = q_rows.shape  # r: a multiple of block_m; dp: a power of two
  p = k.shape[0]
  keys_per_split = pl.cdiv(pl.cdiv(p, cfg.splits), cfg.block_n) * cfg.block_n
  grid = (pl.cdiv(r, cfg.block_m), cfg.splits, hkv)
  kernel = functools.partial(_kernel, scale=scale, head_dim=head_dim, block_n=cfg.block_n,
                             keys_per_split=keys_per_split, mods=mods)
  row_specs = [pl.BlockSpec((cfg.block_m,), lambda i, s, h: (i,)) if x.ndim == 1 else
               pl.BlockSpec((None, cfg.block_m), lambda i, s, h: (h, i)) for x in row_args]
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[
          pl.BlockSpec((1,), lambda i, s, h: (0,)),
          pl.BlockSpec((None, cfg.block_m, dp), lambda i, s, h: (h, i, 0)),
          pl.BlockSpec((p, None, dp), lambda i, s, h: (0, h, 0)),
          pl.BlockSpec((p, None, dp), lambda i, s, h: (0, h, 0)),
          *row_specs,
      ],
      out_specs=[
          pl.BlockSpec((None, None, cfg.block_m, dp), lambda i, s, h: (s, h, i, 0)),
          pl.BlockSpec((None, None, cfg.block_m), lambda i, s, h: (s, h, i)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((cfg.splits, hkv, r, dp), jnp.float32),
          jax.ShapeDtypeStruct((cfg.splits, hkv, r), jnp.float32),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name="hydragen_prefix_attention",
  )(kv_length, q_rows, k, v, *row_args)


def _triton_rows(kv_length, q_rows, k, v, *row_args, scale, cfg: PrefixConfig, interpret: bool,
                 mods: KernelMods | None = None):
  hkv, r, d = q_rows.shape
  dp = common.padded_head_dim(d)
  if dp != d:  # blocks are powers of two: pad the (small) queries; K/V loads are masked
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, dp - d)))
  out, lse = _call(kv_length, q_rows, k, v, *row_args, scale=scale, cfg=cfg, head_dim=d,
                   interpret=interpret, mods=mods)
  return out[..., :d], lse


@functools.partial(jax.jit, static_argnames=("scale", "config"))
def _mosaic_rows(length, q, k, v, *, scale: float, config):
  """The Mosaic GPU kernel behind one stable jitted function: every call site with the same
  shapes and config (one per layer of a model) shares one lowering and one copy of the kernel
  in the compiled module (``test_mosaic_kernel_lowered_once_per_shape``)."""
  from pallas_kernels.gpu import prefix_mgpu as mg
  return mg.prefix_attention_rows_mgpu(q, k, v, length[0], scale=scale, config=config)


def prefix_attention_rows(
    q_rows: jax.Array,  # [Hkv, R, D]: all query rows of each KV head
    k: jax.Array,  # [P, Hkv, D]
    v: jax.Array,  # [P, Hkv, D]
    *,
    kv_length: jax.Array,  # int32 scalar
    scale: float,
    plan,
    interpret: bool | None = None,
    mods: common.RowMods | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Prefix attention on folded rows as ``plan`` says
  (:func:`pallas_kernels.gpu.dispatch.plan_prefix`); returns the per-split partial states.

  Returns ``out [splits, Hkv, R, D]`` (float32 from Triton, q's dtype from
  the Mosaic kernel) and natural-log float32 ``lse [splits, Hkv, R]``; merge
  the splits with :func:`pallas_kernels.gpu.merge.merge_parts` (or let the
  suffix kernel do it). A "mosaic" plan lowers the Hopper kernel for CUDA and
  the Triton kernel, interpreted, elsewhere.

  ``mods``: score variants over these rows (:func:`pallas_kernels.gpu.common.row_mods`, with the
  prefix's offset), applied by the Triton kernel (a "mosaic" plan takes none).
  """
  hkv, r, d = q_rows.shape
  if plan.kernel == "empty":
    return (jnp.zeros((1, hkv, r, d), jnp.float32), jnp.full((1, hkv, r), -jnp.inf, jnp.float32))
  length = jnp.reshape(jnp.asarray(kv_length, jnp.int32), (1,))
  cfg = plan.triton
  use_mosaic = plan.kernel == "mosaic"
  tile = 2 * plan.mosaic.block_q if use_mosaic else cfg.block_m
  # Only the (small) query rows are padded, to whole row tiles; K/V are never copied.
  r_pad = pl.cdiv(r, tile) * tile
  if r_pad != r:
    q_rows = jnp.pad(q_rows, ((0, 0), (0, r_pad - r), (0, 0)))
  row_args = ()
  if mods is not None:
    if use_mosaic:
      raise ValueError(f"prefix_attention_rows: the Mosaic GPU prefix kernel takes no score "
                       f"variants ({mods.kind}); plan the Triton kernel")
    common.check_positions("prefix_attention_rows", mods)
    pad = r_pad - r
    row_args = tuple(x for x in (
        None if mods.pos is None else jnp.pad(mods.pos, (0, pad), mode="edge"),
        None if mods.slopes is None else jnp.pad(mods.slopes, ((0, 0), (0, pad))))
        if x is not None)
  triton = functools.partial(_triton_rows, scale=scale, cfg=cfg,
                             mods=None if mods is None else mods.kind)
  if use_mosaic:
    native = functools.partial(_mosaic_rows, scale=scale, config=plan.mosaic)
    fallback = lambda n, q, k, v: tuple(
        x.astype(y) for x, y in zip(triton(n, q, k, v, interpret=True), (q.dtype, jnp.float32)))
    out, lse = jax.lax.platform_dependent(length, q_rows, k, v, cuda=native, default=fallback)
  else:
    out, lse = common.run(triton, length, q_rows, k, v, *row_args, interpret=interpret)
  if r_pad != r:
    out, lse = out[:, :, :r], lse[:, :, :r]
  return out, lse
