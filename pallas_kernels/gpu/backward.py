"""Backward kernels of one attention part on GPUs (Pallas Triton), from merged residuals.

FlashAttention's backward restricted to one part's keys, with the row's
MERGED LSE ``L`` and ``delta = rowsum(dO * O) - dL`` supplied from outside
(JAX's ``ops/gpu/attention.py`` backward needs q and kv of one length, base-2
residuals of its own forward and no length mask, so it cannot take them):

* ``dkv`` kernel, grid ``(Z, key tiles, Hkv)``: one key tile, all row tiles
  streamed, ``dV = P^T dO``, ``dK = scale * dS^T Q`` accumulated in registers:
  a shared segment's dK/dV is one reduction over every row that reads it;
* ``dq`` kernel, grid ``(Z, row tiles, Hkv)``: one row tile, all key tiles
  streamed, ``dQ = scale * dS K``.

with ``P = exp(scale * q.k - L)``, ``dS = P * (dO V^T - delta)``. Rows are
folded as in the forward: ``[Z, Hkv, R, D]`` (``Z = 1``, ``R = B * Tq * G``
for a shared part; ``Z = B``, ``R = Tq * G`` for the suffixes). Visibility:

* ``"segments"``: row r sees key j iff ``row_seg[r] == key_seg[j]`` (a prefix
  is one segment; keys past a segment's length carry -2, rows of sequences
  without a segment -1); tiles where no row meets a key are skipped;
* ``"suffix"``: row r (query ``t = r // G``) of sequence z sees key j iff
  ``j < len[z]`` and, causal, ``j <= len[z] - Tq + t``.

The pure-JAX reference is :func:`jax_shared_attn.backward.part_grads`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu import common


@dataclasses.dataclass(frozen=True)
class BackwardKernelConfig:
  """Tiles of both kernels (powers of two, >= 16) and Triton's launch knobs."""

  block_rows: int = 64
  block_keys: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_rows", "block_keys"):
      val = getattr(self, name)
      if val < common.MIN_DOT or val & (val - 1):
        raise ValueError(f"BackwardKernelConfig: {name} must be a power of two >= "
                         f"{common.MIN_DOT}; got {val}")


def default_config(head_dim: int) -> BackwardKernelConfig:
  """64 x 64 tiles (two float32 accumulators of 64 x D in registers), 32 x 32 for D > 128."""
  if head_dim > 128:
    return BackwardKernelConfig(32, 32, num_warps=4)
  return BackwardKernelConfig(64, 64, num_warps=4 if head_dim <= 64 else 8)


def _dot(a, b, trans_a=False, trans_b=False):
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def _visible(mode, row_info, key_info, rows, keys, z, *, lens_ref, causal, group, tq):
  if mode == "segments":
    return row_info[:, None] == key_info[None, :]
  n = lens_ref[z]
  ok = keys[None, :] < n
  if causal:
    ok = ok & (keys[None, :] <= n - tq + rows[:, None] // group)
  return ok


def _tile(q, k, v, do, lse2, delta, mask, *, qk_scale):
  """P and dS of one tile (float32); lse2 is the base-2 merged LSE (+inf: no key)."""
  s = _dot(q, k, trans_b=True) * qk_scale
  p = jnp.where(mask, jnp.exp2(s - lse2[:, None]), 0.0)
  dp = _dot(do, v, trans_b=True)
  return p, p * (dp - delta[:, None])


def _dkv_kernel(lens_ref, row_info_ref, key_info_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref,
                v_ref, dk_ref, dv_ref, *, mode, causal, group, tq, scale, block_rows, sparse):
  z, kt = pl.program_id(0), pl.program_id(1)
  bk, dp = k_ref.shape
  keys = kt * bk + jnp.arange(bk)
  k, v = plgpu.load(k_ref), plgpu.load(v_ref)
  key_info = key_info_ref[...]
  n_rows = q_ref.shape[0] // block_rows
  vis = functools.partial(_visible, mode, lens_ref=lens_ref, causal=causal, group=group, tq=tq)

  def body(i, carry):
    sl = pl.ds(i * block_rows, block_rows)
    row_info = row_info_ref[sl]
    rows = i * block_rows + jnp.arange(block_rows)
    mask = vis(row_info, key_info, rows, keys, z)

    def work(carry):
      dk, dv = carry
      q, do = plgpu.load(q_ref.at[sl, :]), plgpu.load(do_ref.at[sl, :])
      p, ds = _tile(q, k, v, do, lse_ref[sl], delta_ref[sl], mask,
                    qk_scale=scale * common.LOG2E)
      dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
      dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)
      return dk, dv

    if not sparse:
      return work(carry)
    return lax.cond(jnp.max(mask.astype(jnp.int32)) > 0, work, lambda c: c, carry)

  lo = 0
  if mode == "suffix":  # rows that see no key of this tile (past the length, causal) skipped
    n = lens_ref[z]
    first_t = jnp.maximum(kt * bk - (n - tq), 0) if causal else 0
    lo = jnp.where(kt * bk < n, jnp.minimum(first_t * group // block_rows, n_rows), n_rows)
  zeros = jnp.zeros((bk, dp), jnp.float32)
  dk, dv = lax.fori_loop(lo, n_rows, body, (zeros, zeros))
  plgpu.store(dk_ref, (dk * scale).astype(dk_ref.dtype))
  plgpu.store(dv_ref, dv.astype(dv_ref.dtype))


def _dq_kernel(lens_ref, row_info_ref, key_info_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref,
               v_ref, dq_ref, *, mode, causal, group, tq, scale, block_keys, sparse):
  z, rt = pl.program_id(0), pl.program_id(1)
  br, dp = q_ref.shape
  rows = rt * br + jnp.arange(br)
  q, do = plgpu.load(q_ref), plgpu.load(do_ref)
  lse2, delta, row_info = lse_ref[...], delta_ref[...], row_info_ref[...]
  n_keys = k_ref.shape[0] // block_keys
  vis = functools.partial(_visible, mode, lens_ref=lens_ref, causal=causal, group=group, tq=tq)

  def body(j, dq):
    sl = pl.ds(j * block_keys, block_keys)
    keys = j * block_keys + jnp.arange(block_keys)
    mask = vis(row_info, key_info_ref[sl], rows, keys, z)

    def work(dq):
      k, v = plgpu.load(k_ref.at[sl, :]), plgpu.load(v_ref.at[sl, :])
      _, ds = _tile(q, k, v, do, lse2, delta, mask, qk_scale=scale * common.LOG2E)
      return dq + _dot(ds.astype(k.dtype), k)

    if not sparse:
      return work(dq)
    return lax.cond(jnp.max(mask.astype(jnp.int32)) > 0, work, lambda d: d, dq)

  hi = n_keys
  if mode == "suffix":  # key tiles past the length, or past the tile's last causal query
    n = lens_ref[z]
    last = jnp.minimum(n, n - tq + (rt * br + br - 1) // group + 1) if causal else n
    hi = jnp.clip(pl.cdiv(last, block_keys), 0, n_keys)
  dq = lax.fori_loop(0, hi, body, jnp.zeros((br, dp), jnp.float32))
  plgpu.store(dq_ref, (dq * scale).astype(dq_ref.dtype))


def _pad(x, axis, size, value=0):
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def _calls(lens, row_info, key_info, q, do, lse2, delta, k, v, *, mode, causal, group, tq, scale,
           cfg, sparse, interpret):
  z, h, rp, dp = q.shape
  kp = k.shape[1]
  br, bk = cfg.block_rows, cfg.block_keys
  static = dict(mode=mode, causal=causal, group=group, tq=tq, scale=scale, sparse=sparse)
  params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
  all_rows = [
      pl.BlockSpec((z,), lambda *_: (0,)),
      pl.BlockSpec((None, rp), lambda zi, t, hi: (zi, 0)),
      pl.BlockSpec((None, kp), lambda zi, t, hi: (zi, 0)),
  ]
  full_rows = pl.BlockSpec((None, None, rp, dp), lambda zi, t, hi: (zi, hi, 0, 0))
  full_vec = pl.BlockSpec((None, None, rp), lambda zi, t, hi: (zi, hi, 0))
  key_tile = pl.BlockSpec((None, bk, None, dp), lambda zi, t, hi: (zi, t, hi, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, block_rows=br, **static),
      grid=(z, kp // bk, h),
      in_specs=all_rows[:1] + [all_rows[1], pl.BlockSpec((None, bk), lambda zi, t, hi: (zi, t)),
                               full_rows, full_rows, full_vec, full_vec, key_tile, key_tile],
      out_specs=[key_tile, key_tile],
      out_shape=[jax.ShapeDtypeStruct((z, kp, h, dp), jnp.float32)] * 2,
      compiler_params=params, interpret=interpret, name="hydragen_backward_dkv",
  )(lens, row_info, key_info, q, do, lse2, delta, k, v)
  row_tile = pl.BlockSpec((None, None, br, dp), lambda zi, t, hi: (zi, hi, t, 0))
  vec_tile = pl.BlockSpec((None, None, br), lambda zi, t, hi: (zi, hi, t))
  full_keys = pl.BlockSpec((None, kp, None, dp), lambda zi, t, hi: (zi, 0, hi, 0))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, block_keys=bk, **static),
      grid=(z, rp // br, h),
      in_specs=all_rows[:1] + [pl.BlockSpec((None, br), lambda zi, t, hi: (zi, t)), all_rows[2],
                               row_tile, row_tile, vec_tile, vec_tile, full_keys, full_keys],
      out_specs=row_tile,
      out_shape=jax.ShapeDtypeStruct((z, h, rp, dp), jnp.float32),
      compiler_params=params, interpret=interpret, name="hydragen_backward_dq",
  )(lens, row_info, key_info, q, do, lse2, delta, k, v)
  return dq, dk, dv


def part_grads(q, do, lse, delta, k, v, *, scale: float, row_seg=None, key_seg=None,
               lengths=None, causal: bool = False, group: int = 1, tq: int = 1,
               sparse: bool = False, config: BackwardKernelConfig,
               interpret: bool | None = None):
  """dQ, dK, dV of one part (float32), same contract as the XLA ``part_grads``.

  ``q, do [Z, H, R, D]``; ``lse, delta`` float32 ``[Z, H, R]`` (natural-log
  merged LSE, -inf for rows with no key); ``k, v [Z, K, H, D]``. Give
  ``row_seg [R], key_seg [K]`` (int32, ``"segments"`` visibility; ``sparse``
  skips tiles where no row meets a key) or ``lengths [Z]`` with ``causal``,
  ``group`` (G) and ``tq`` (``"suffix"`` visibility). ``config``: the planned tiles
  (:func:`default_config`), clamped to the part's rows and keys.
  """
  z, h, r, d = q.shape
  nk = k.shape[1]
  if r == 0 or nk == 0:
    return (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
            jnp.zeros(v.shape, jnp.float32))
  mode = "segments" if row_seg is not None else "suffix"
  dp = common.padded_head_dim(d)
  br = min(config.block_rows, max(common.MIN_DOT, common.next_pow2(r)))
  bk = min(config.block_keys, max(common.MIN_DOT, common.next_pow2(nk)))
  cfg = dataclasses.replace(config, block_rows=br, block_keys=bk)
  rp, kp = pl.cdiv(r, br) * br, pl.cdiv(nk, bk) * bk
  lse2 = jnp.where(jnp.isfinite(lse), lse * common.LOG2E, jnp.inf)
  pad_rows = lambda x, value=0: _pad(_pad(x, 2, rp, value), 3, dp) if x.ndim == 4 else _pad(
      x, 2, rp, value)
  q, do = pad_rows(q), pad_rows(do.astype(q.dtype))
  lse2, delta = pad_rows(lse2, jnp.inf), pad_rows(delta.astype(jnp.float32))
  k, v = (_pad(_pad(x, 1, kp), 3, dp) for x in (k, v.astype(k.dtype)))
  if mode == "segments":
    row_info = _pad(row_seg.astype(jnp.int32)[None], 1, rp, -1)
    key_info = _pad(key_seg.astype(jnp.int32)[None], 1, kp, -2)
    lens = jnp.zeros((z,), jnp.int32)
  else:
    row_info = jnp.zeros((z, rp), jnp.int32)
    key_info = jnp.zeros((z, kp), jnp.int32)
    lens = lengths.astype(jnp.int32)
  call = functools.partial(_calls, mode=mode, causal=causal, group=group, tq=tq, scale=scale,
                           cfg=cfg, sparse=sparse)
  dq, dk, dv = common.run(call, lens, row_info, key_info, q, do, lse2, delta, k, v,
                           interpret=interpret)
  return dq[:, :, :r, :d], dk[:, :nk, :, :d], dv[:, :nk, :, :d]
