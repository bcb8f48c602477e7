"""Backward kernels of one attention part on TPU (Mosaic), from merged residuals.

The TPU twin of :mod:`pallas_kernels.gpu.backward` (same math, same
visibility modes, same contract as :func:`jax_shared_attn.backward.part_grads`):

* ``dkv`` kernel, grid ``(Z, Hkv, key blocks, row blocks)`` (parallel x3,
  arbitrary): dK/dV of one key block accumulated in float32 VMEM scratch over
  every row block, so a shared segment's dK/dV is one reduction over all rows;
* ``dq`` kernel, grid ``(Z, Hkv, row blocks, key blocks)``: dQ of one row block
  accumulated over the key blocks.

Arrays are head-major (``[Z, Hkv, R, D]``, ``[Z, Hkv, K, D]``) with D padded
to 128 lanes; the merged LSE and ``delta`` are replicated over 128 lanes like
the forward kernels' LSE; per-row and per-key ids are int32 ``[Z, R, 128]``
and ``[Z, 1, K]``. Blocks of 128 keys x ``block_rows`` rows.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu import common
from pallas_kernels.tpu.common import LANES, NT_DIMS

BLOCK_KEYS = LANES


def _mask(mode, row_info, key_info, i, j, z, lens_ref, *, causal, group, tq, br, bk):
  if mode == "segments":
    return row_info[:, :1] == key_info
  rows = i * br + lax.broadcasted_iota(jnp.int32, (br, bk), 0)
  keys = j * bk + lax.broadcasted_iota(jnp.int32, (br, bk), 1)
  n = lens_ref[z]
  ok = keys < n
  if causal:
    ok = ok & (keys <= n - tq + lax.div(rows, jnp.int32(group)))  # rows >= 0: no floor fixup
  return ok


def _tile_visible(mode, i, j, z, lens_ref, *, causal, group, tq, br, bk):
  """False where no row of row block i sees a key of key block j (suffix mode: past the
  length or past the block's last causal query); always True for segments."""
  if mode == "segments":
    return True
  n = lens_ref[z]
  ok = j * bk < n
  if causal:
    ok = jnp.logical_and(ok, j * bk <= n - tq + lax.div(i * br + br - 1, jnp.int32(group)))
  return ok


def _tile(q, k, v, do, lse, delta, mask, *, scale, prec):
  s = lax.dot_general(q, k, NT_DIMS, precision=prec, preferred_element_type=jnp.float32) * scale
  p = jnp.where(mask, jnp.exp(s - lse), 0.0)
  dp = lax.dot_general(do, v, NT_DIMS, precision=prec, preferred_element_type=jnp.float32)
  return p, p * (dp - delta)


def _dkv_kernel(lens_ref, row_info_ref, key_info_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref,
                v_ref, dk_ref, dv_ref, dk_acc, dv_acc, *, mode, scale, prec, **vis):
  z, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(i == 0)
  def _init():
    dk_acc[...] = jnp.zeros_like(dk_acc)
    dv_acc[...] = jnp.zeros_like(dv_acc)

  @pl.when(_tile_visible(mode, i, j, z, lens_ref, **vis))
  def _accumulate():
    reps = (1, k_ref.shape[0] // LANES)
    mask = _mask(mode, row_info_ref[...], key_info_ref[...], i, j, z, lens_ref, **vis)
    q, do = q_ref[...], do_ref[...]
    p, ds = _tile(q, k_ref[...], v_ref[...], do, jnp.tile(lse_ref[...], reps),
                  jnp.tile(delta_ref[...], reps), mask, scale=scale, prec=prec)
    dv_acc[...] += lax.dot(p.T.astype(do.dtype), do, precision=prec,
                           preferred_element_type=jnp.float32)
    dk_acc[...] += lax.dot(ds.T.astype(q.dtype), q, precision=prec,
                           preferred_element_type=jnp.float32)

  @pl.when(i == pl.num_programs(3) - 1)
  def _store():
    dk_ref[...] = dk_acc[...] * scale
    dv_ref[...] = dv_acc[...]


def _dq_kernel(lens_ref, row_info_ref, key_info_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref,
               v_ref, dq_ref, dq_acc, *, mode, scale, prec, **vis):
  z, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    dq_acc[...] = jnp.zeros_like(dq_acc)

  @pl.when(_tile_visible(mode, i, j, z, lens_ref, **vis))
  def _accumulate():
    reps = (1, k_ref.shape[0] // LANES)
    mask = _mask(mode, row_info_ref[...], key_info_ref[...], i, j, z, lens_ref, **vis)
    k = k_ref[...]
    _, ds = _tile(q_ref[...], k, v_ref[...], do_ref[...], jnp.tile(lse_ref[...], reps),
                  jnp.tile(delta_ref[...], reps), mask, scale=scale, prec=prec)
    dq_acc[...] += lax.dot(ds.astype(k.dtype), k, precision=prec,
                           preferred_element_type=jnp.float32)

  @pl.when(j == pl.num_programs(3) - 1)
  def _store():
    dq_ref[...] = dq_acc[...] * scale


def _calls(lens, row_info, key_info, q, do, lse, delta, k, v, *, interpret, mode, scale, br,
           **vis):
  z, h, rp, dp = q.shape
  kp = k.shape[2]
  bk = BLOCK_KEYS
  prec = common.precision(q.dtype)
  kw = dict(mode=mode, scale=scale, prec=prec, br=br, bk=bk, **vis)
  # index maps take (z, h, a, b, lens_ref); dkv: a = key block, b = row block; dq: swapped
  def specs(rows_of, keys_of):
    r = lambda zi, hi, a, b, _: rows_of(a, b)
    c = lambda zi, hi, a, b, _: keys_of(a, b)
    return [
        pl.BlockSpec((None, br, LANES), lambda zi, hi, a, b, _: (zi, r(zi, hi, a, b, _), 0)),
        pl.BlockSpec((None, 1, bk), lambda zi, hi, a, b, _: (zi, 0, c(zi, hi, a, b, _))),
        pl.BlockSpec((None, None, br, dp), lambda zi, hi, a, b, _: (zi, hi, r(zi, hi, a, b, _), 0)),
        pl.BlockSpec((None, None, br, dp), lambda zi, hi, a, b, _: (zi, hi, r(zi, hi, a, b, _), 0)),
        pl.BlockSpec((None, None, br, LANES),
                     lambda zi, hi, a, b, _: (zi, hi, r(zi, hi, a, b, _), 0)),
        pl.BlockSpec((None, None, br, LANES),
                     lambda zi, hi, a, b, _: (zi, hi, r(zi, hi, a, b, _), 0)),
        pl.BlockSpec((None, None, bk, dp), lambda zi, hi, a, b, _: (zi, hi, c(zi, hi, a, b, _), 0)),
        pl.BlockSpec((None, None, bk, dp), lambda zi, hi, a, b, _: (zi, hi, c(zi, hi, a, b, _), 0)),
    ]

  args = (lens, row_info, key_info, q, do, lse, delta, k, v)
  sem = ("parallel", "parallel", "parallel", "arbitrary")

  def build_dkv(interp):
    key_out = pl.BlockSpec((None, None, bk, dp), lambda zi, hi, a, b, _: (zi, hi, a, 0))
    return pl.pallas_call(
        functools.partial(_dkv_kernel, **kw),
        out_shape=[jax.ShapeDtypeStruct((z, h, kp, dp), jnp.float32)] * 2,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(z, h, kp // bk, rp // br),
            in_specs=specs(lambda a, b: b, lambda a, b: a), out_specs=[key_out, key_out],
            scratch_shapes=[pltpu.VMEM((bk, dp), jnp.float32)] * 2),
        compiler_params=common.compiler_params(sem), interpret=interp,
        name="hydragen_backward_dkv")

  def build_dq(interp):
    row_out = pl.BlockSpec((None, None, br, dp), lambda zi, hi, a, b, _: (zi, hi, a, 0))
    return pl.pallas_call(
        functools.partial(_dq_kernel, **kw),
        out_shape=jax.ShapeDtypeStruct((z, h, rp, dp), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(z, h, rp // br, kp // bk),
            in_specs=specs(lambda a, b: a, lambda a, b: b), out_specs=row_out,
            scratch_shapes=[pltpu.VMEM((br, dp), jnp.float32)]),
        compiler_params=common.compiler_params(sem), interpret=interp,
        name="hydragen_backward_dq")

  dk, dv = common.dispatch(build_dkv, args, interpret)
  dq = common.dispatch(build_dq, args, interpret)
  return dq, dk, dv


def part_grads(q, do, lse, delta, k, v, *, scale: float, row_seg=None, key_seg=None,
               lengths=None, causal: bool = False, group: int = 1, tq: int = 1,
               block_rows: int, interpret: Optional[bool] = None):
  """dQ, dK, dV of one part (float32): the contract of
  :func:`jax_shared_attn.backward.part_grads` (``[Z, H, R, D]`` rows, ``[Z, K, H, D]`` keys);
  ``block_rows``: the planned row tile (:data:`pallas_kernels.tpu.tuned.BACKWARD_BLOCK_ROWS`)."""
  z, h, r, d = q.shape
  nk = k.shape[1]
  if r == 0 or nk == 0:
    return (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
            jnp.zeros(v.shape, jnp.float32))
  mode = "segments" if row_seg is not None else "suffix"
  br = min(block_rows, common.round_up(r, common.ROW_ALIGN))
  rp, kp, dp = common.round_up(r, br), common.round_up(nk, BLOCK_KEYS), common.round_up(d, LANES)
  dt = q.dtype
  q, do = (common.pad_to(x.astype(dt), (z, h, rp, dp)) for x in (q, do))
  k, v = (common.pad_to(jnp.swapaxes(x.astype(dt), 1, 2), (z, h, kp, dp)) for x in (k, v))
  wide = lambda x, fill: jnp.broadcast_to(
      jnp.pad(x, ((0, 0), (0, 0), (0, rp - r)), constant_values=fill)[..., None],
      (z, h, rp, LANES))
  lse = wide(jnp.where(jnp.isfinite(lse), lse, jnp.inf).astype(jnp.float32), jnp.inf)
  delta = wide(delta.astype(jnp.float32), 0.0)
  if mode == "segments":
    rs = jnp.pad(row_seg.astype(jnp.int32), (0, rp - r), constant_values=-1)
    row_info = jnp.broadcast_to(rs[None, :, None], (1, rp, LANES))
    key_info = jnp.pad(key_seg.astype(jnp.int32), (0, kp - nk), constant_values=-2)[None, None]
    lens = jnp.zeros((z,), jnp.int32)
  else:
    row_info = jnp.zeros((z, rp, LANES), jnp.int32)
    key_info = jnp.zeros((z, 1, kp), jnp.int32)
    lens = lengths.astype(jnp.int32)
  dq, dk, dv = _calls(lens, row_info, key_info, q, do, lse, delta, k, v, interpret=interpret,
                      mode=mode, scale=scale, br=br, causal=causal, group=group, tq=tq)
  return (dq[:, :, :r, :d], jnp.swapaxes(dk, 1, 2)[:, :nk, :, :d],
          jnp.swapaxes(dv, 1, 2)[:, :nk, :, :d])
