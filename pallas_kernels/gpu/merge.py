"""The LSE merge of partial attention states as ONE Triton kernel.

Key splits (flash-decoding) leave ``n`` partial states per query row: ``out [n, R, D]``
(normalised over the split's keys) and natural-log ``lse [n, R]``. XLA merges them
(:func:`pallas_kernels.base.merge_states`) in two fusions, the weights then the weighted
sum: two launches that at decode sizes cost more than the bytes they move. Here one program
per tile of rows reads every
part's LSE, then every part's output once, and writes the merged output (any float dtype) and
LSE. Several stacks of parts (e.g. a kernel's splits and the splits of a prior state) are
merged in the same pass, without concatenating them.

Same arithmetic as :func:`pallas_kernels.base.merge_states` (float32; parts with
``lse = -inf`` weigh 0; rows without any part give ``(0, -inf)``, never NaN).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.base import merge_states
from pallas_kernels.device import DeviceInfo
from pallas_kernels.gpu import common, tuned

# Partial outputs are loaded before any arithmetic while they take at most this many elements
# per warp (32 lanes x 128 float32 registers).
PRELOAD_ELEMENTS_PER_WARP = 32 * 128


@dataclasses.dataclass(frozen=True)
class MergeConfig:
  tile_rows: int  # rows per program
  num_warps: int


def default_config(device: DeviceInfo) -> MergeConfig:
  """Small row tiles: the merge is latency-bound (:func:`pallas_kernels.gpu.tuned.tiles`)."""
  t = tuned.tiles(device, "merge", "any")
  return MergeConfig(tile_rows=t.block_m, num_warps=t.num_warps)


def _kernel(*refs, counts: tuple[int, ...], rows: int, head_dim: int, num_warps: int):
  n_parts = len(counts)
  in_refs, (o_ref, lse_ref) = refs[:2 * n_parts], refs[2 * n_parts:]
  tr, dp = o_ref.shape
  row = pl.program_id(0) * tr + jnp.arange(tr)
  row_ok = row < rows
  mask = row_ok[:, None]
  if dp != head_dim:
    mask = mask & (jnp.arange(dp) < head_dim)[None, :]

  def parts():
    for i, n in enumerate(counts):
      for j in range(n):
        jj = jnp.int32(j)  # a traced index: the interpreter's discharge rule needs one
        yield in_refs[2 * i].at[jj], in_refs[2 * i + 1].at[jj]

  lses = [plgpu.load(l_ref, mask=row_ok, other=-jnp.inf).astype(jnp.float32)
          for _, l_ref in parts()]
  # Every load issued up front where the tiles fit the registers: the kernel is latency-bound.
  preload = sum(counts) * tr * dp <= PRELOAD_ELEMENTS_PER_WARP * num_warps
  outs = [common.load(o_ref_, mask) for o_ref_, _ in parts()] if preload else None
  m = functools.reduce(jnp.maximum, lses)
  m = jnp.where(m == -jnp.inf, 0.0, m)  # no part: weights exp(-inf) = 0, not NaN
  acc = jnp.zeros((tr, dp), jnp.float32)
  denom = jnp.zeros((tr,), jnp.float32)
  for i, ((o_part, _), lse) in enumerate(zip(parts(), lses)):
    w = jnp.exp(lse - m)
    denom += w
    o = outs[i] if preload else common.load(o_part, mask)
    acc += w[:, None] * o.astype(jnp.float32)
  has = denom > 0
  safe = jnp.where(has, denom, 1.0)
  plgpu.store(o_ref, (acc / safe[:, None]).astype(o_ref.dtype), mask=mask)
  plgpu.store(lse_ref, jnp.where(has, m + jnp.log(safe), -jnp.inf), mask=row_ok)


def _call(*flat, counts, rows, head_dim, out_dtype, cfg: MergeConfig, interpret):
  tr = cfg.tile_rows
  dp = common.padded_head_dim(head_dim)
  in_specs = []
  for n in counts:
    in_specs += [pl.BlockSpec((n, tr, dp), lambda i: (0, i, 0)),
                 pl.BlockSpec((n, tr), lambda i: (0, i))]
  return pl.pallas_call(
      functools.partial(_kernel, counts=counts, rows=rows, head_dim=head_dim,
                        num_warps=cfg.num_warps),
      grid=(pl.cdiv(rows, tr),),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((tr, dp), lambda i: (i, 0)), pl.BlockSpec((tr,), lambda i: (i,))],
      out_shape=[jax.ShapeDtypeStruct((rows, head_dim), out_dtype),
                 jax.ShapeDtypeStruct((rows,), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
      interpret=interpret,
      name="hydragen_merge",
  )(*flat)


def merge_parts(stacks, *, out_dtype, config: MergeConfig, transposed_next: bool = False,
                interpret: bool | None = None):
  """Merges every part of every stack: ``stacks = [(out [n_i, ..., D], lse [n_i, ...]), ...]``
  with one shape ``[...]`` of rows across stacks.

  Returns ``out [..., D]`` in ``out_dtype`` and float32 natural-log ``lse [...]``. With
  ``interpret=None`` the kernel runs natively on CUDA and interpreted elsewhere.

  ``transposed_next``: the caller transposes the result next (the folded rows of several KV
  heads back to ``[B, Tq, Hq, D]``); XLA then merges, fused into that transpose, which is
  faster than the kernel plus the transpose.
  """
  if not stacks:
    raise ValueError("merge_parts: needs at least one stack of parts")
  lead = stacks[0][1].shape[1:]
  d = stacks[0][0].shape[-1]
  for o, l in stacks:
    if o.shape[1:] != (*lead, d) or l.shape[1:] != lead or o.shape[0] != l.shape[0]:
      raise ValueError(f"merge_parts: every stack must be out [n, {lead}, {d}] and lse "
                       f"[n, {lead}]; got {o.shape} and {l.shape}")
  rows = math.prod(lead)
  if rows == 0:
    return jnp.zeros((*lead, d), out_dtype), jnp.full(lead, -jnp.inf, jnp.float32)
  if transposed_next:
    out, lse = merge_states([o[j] for o, _ in stacks for j in range(o.shape[0])],
                            [l[j] for _, l in stacks for j in range(l.shape[0])])
    return out.astype(out_dtype), lse
  counts = tuple(int(l.shape[0]) for _, l in stacks)
  flat = []
  for o, l in stacks:  # contiguous reshapes: no copies
    flat += [o.reshape(o.shape[0], rows, d), l.reshape(l.shape[0], rows)]
  call = functools.partial(_call, counts=counts, rows=rows, head_dim=d, out_dtype=out_dtype,
                           cfg=config)
  out, lse = common.run(call, *flat, interpret=interpret)
  return out.reshape(*lead, d), lse.reshape(lead)
