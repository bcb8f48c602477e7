"""Pieces shared by the GPU (Triton) kernels: layouts, lowering, online softmax."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.base import KernelMods, ScoreMods, row_variants

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MIN_DOT = 16  # tl.dot needs every dimension >= 16
# Bytes of K/V tiles prefetched by Triton's software pipeline ((num_stages - 1) x (K + V)
# tiles), which share a Hopper block's 227 KB of shared memory with the kernel's other
# buffers: the budget leaves room for them (256 KB, the segment kernel's float32 128 keys x
# 128 dims x 3 stages, does not run; test_default_configs_fit_the_shared_memory).
KV_STAGING_BYTES = 160 * 1024


def next_pow2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def padded_head_dim(d: int) -> int:
  """Triton blocks are powers of two; D = 80 runs as 128 with masked loads."""
  return max(MIN_DOT, next_pow2(d))


def kv_staging_bytes(block_n: int, head_dim: int, itemsize: int, num_stages: int) -> int:
  """Shared memory for the K and V tiles a ``num_stages`` pipeline keeps in flight."""
  return max(1, num_stages - 1) * 2 * block_n * padded_head_dim(head_dim) * itemsize


def fit_block_n(block_n: int, head_dim: int, itemsize: int, num_stages: int) -> int:
  """Halves ``block_n`` (not below 16) until the K/V staging fits :data:`KV_STAGING_BYTES`.

  The tuned 16-bit tiles fit; float32 inputs (twice the bytes per key) get shorter key steps
  where they would not.
  """
  while block_n > MIN_DOT and kv_staging_bytes(block_n, head_dim, itemsize,
                                                num_stages) > KV_STAGING_BYTES:
    block_n //= 2
  return block_n


def run(kernel_call: Callable, *args, interpret: bool | None):
  """Runs ``kernel_call(*args, interpret=...)`` natively on CUDA, interpreted elsewhere.

  With ``interpret=None`` the choice is made when lowering
  (``lax.platform_dependent``), so exporting for ``platforms=["cuda"]`` on a
  CPU machine lowers the real Triton kernel.
  """
  if interpret is not None:
    return kernel_call(*args, interpret=interpret)
  return lax.platform_dependent(
      *args, cuda=functools.partial(kernel_call, interpret=False),
      default=functools.partial(kernel_call, interpret=True))


def dot(a, b, trans_b: bool = False):
  """Tensor-core product with float32 accumulation; float32 inputs use IEEE (not TF32)."""
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return plgpu.dot(a, b, trans_b=trans_b, precision=precision)


def load(ref, mask):
  """Masked load with zeros where the mask is off (plain load without a mask)."""
  if mask is None:
    return plgpu.load(ref)
  return plgpu.load(ref, mask=mask, other=0.0)


@dataclasses.dataclass(frozen=True)
class Pages:
  """How a kernel finds one sequence's (or segment's) keys in a page pool: key ``j`` is row
  ``table[base + j // page_size] * page_size + j % page_size`` of the pool ``[pages *
  page_size, Dp]`` (one KV head's view). ``table_ref`` is the flat page table ``[N * width]``
  (``width`` pages per entry), ``base = entry * width``."""

  table_ref: Any
  base: Any
  page_size: int
  width: int


def load_pages(ref, start, block_n: int, mask, pages: Pages):
  """K or V rows of keys ``[start, start + block_n)`` read in place from a page pool ``ref
  [pages * page_size, Dp]`` through ``pages`` (one gathered load; keys past the table's width
  read its last entry and must be masked). ``mask`` as :func:`load`'s, broadcast to the tile."""
  keys = start + jnp.arange(block_n)
  slot = jnp.minimum(keys // pages.page_size, pages.width - 1)
  page = plgpu.load(pages.table_ref.at[pages.base + slot])
  rows = page * pages.page_size + keys % pages.page_size
  dp = ref.shape[-1]
  view = ref.at[rows[:, None], jnp.arange(dp)[None, :]]
  if mask is None:
    return plgpu.load(view)
  return plgpu.load(view, mask=jnp.broadcast_to(mask, (block_n, dp)), other=0.0)


def fold_rows(q: jax.Array, hkv: int) -> jax.Array:
  """``[B, Tq, Hq, D] -> [Hkv, B * Tq * G, D]``: sequence b's rows are contiguous."""
  b, t, hq, d = q.shape
  g = hq // hkv
  return q.reshape(b, t, hkv, g, d).transpose(2, 0, 1, 3, 4).reshape(hkv, b * t * g, d)


def seq_rows(q: jax.Array, hkv: int) -> jax.Array:
  """``[B, Tq, Hq, D] -> [B, Hkv, Tq * G, D]`` (sequence-major folded rows): a reshape when
  ``Tq == 1`` (decoding) or ``Hkv == 1``; inverse: :func:`unfold_seq_rows`."""
  b, t, hq, d = q.shape
  if t == 1 or hkv == 1:
    return q.reshape(b, hkv, t * hq // hkv, d)
  return jnp.moveaxis(q.reshape(b, t, hkv, hq // hkv, d), 2, 1).reshape(b, hkv, -1, d)


def unfold_rows(x: jax.Array, b: int, t: int) -> jax.Array:
  """Inverse of :func:`fold_rows` on ``[Hkv, R, ...]`` (out or lse)."""
  hkv, r = x.shape[:2]
  g = r // (b * t)
  rest = x.shape[2:]
  x = x.reshape(hkv, b, t, g, *rest)
  x = jnp.moveaxis(x, 0, 2)  # [B, T, Hkv, G, ...]
  return x.reshape(b, t, hkv * g, *rest)


def unfold_seq_rows(x: jax.Array, t: int) -> jax.Array:
  """``[B, Hkv, T * G, ...] -> [B, T, Hkv * G, ...]`` (sequence-major folded rows, out or lse):
  a reshape when ``T == 1`` (decoding) or ``Hkv == 1``, a transpose otherwise."""
  b, hkv, r = x.shape[:3]
  rest = x.shape[3:]
  if t == 1 or hkv == 1:
    return x.reshape(b, t, hkv * r // t, *rest)
  x = jnp.moveaxis(x.reshape(b, hkv, t, r // t, *rest), 1, 2)  # [B, T, Hkv, G, ...]
  return x.reshape(b, t, hkv * (r // t), *rest)


def online_softmax_step(carry, s, v, masked_s: bool):
  """One flash-attention step on base-2 scores ``s [M, N]`` (float32).

  ``carry = (acc [M, Dp] f32, m [M] base-2 running max, l [M] running sum)``.
  Rows whose scores are all -inf so far keep ``m = -inf`` and ``l = 0``; the
  subtraction uses 0 for them so no ``inf - inf`` NaN appears.
  """
  acc, m, l = carry
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked_s else m_new
  alpha = jnp.exp2(m - m_use)
  p = jnp.exp2(s - m_use[:, None])
  l = l * alpha + jnp.sum(p, axis=1)
  acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
  return acc, m_new, l


def finalize(acc, m, l):
  """Normalised output and natural-log LSE; rows without keys give (0, -inf)."""
  has = l > 0
  out = acc / jnp.where(has, l, 1.0)[:, None]
  lse = jnp.where(has, (m + jnp.log2(jnp.where(has, l, 1.0))) * LN2, -jnp.inf)
  return out, lse


class RowMods(NamedTuple):
  """Score variants for a kernel over folded query rows (:func:`fold_rows`): the static
  ``kind`` (a :class:`pallas_kernels.base.KernelMods`), each row's position ``pos`` (int32
  ``[R]``, in the keys' coordinates: query ``t`` of sequence b at ``offset[b] + t``; None
  where the kernel computes positions itself or none is needed) and each row's ALiBi slope
  ``slopes`` (float32 ``[Hkv, R]``, None without ALiBi)."""

  kind: KernelMods
  pos: Any = None
  slopes: Any = None


def row_mods(mods: Optional[ScoreMods], b: int, tq: int, hq: int, hkv: int,
             offset: Any = None) -> Optional[RowMods]:
  """``mods`` (slopes ``[B, Hq]``) over the rows of ``fold_rows(q [B, Tq, Hq, D], hkv)``;
  ``offset`` (int32 ``[B]``): a shared part's :func:`pallas_kernels.base.part_offsets`, giving
  the rows' positions (needed for ALiBi or a window)."""
  if mods is None:
    return None
  pos, slopes = row_variants(mods, b, tq, hq, hkv, offset)
  return RowMods(KernelMods.of(mods), pos, slopes)


def check_positions(fn: str, mods: RowMods) -> None:
  """A shared part's kernel needs its rows' positions for ALiBi or a window."""
  if (mods.kind.alibi or mods.kind.window is not None) and mods.pos is None:
    raise ValueError(f"{fn}: ALiBi or a window needs the rows' positions (row_mods with the "
                     f"part's offset, pallas_kernels.base.part_offsets)")


def modified_scores(s, kind: KernelMods, distance, slopes):
  """Float32 scaled scores ``s [M, N]`` (natural-log units) with the variants applied, in base
  2 (what :func:`online_softmax_step` takes), keys outside the window at ``-inf``."""
  s, visible = kind.apply(s, distance, None if slopes is None else slopes[:, None])
  s = s * LOG2E
  return s if visible is None else jnp.where(visible, s, -jnp.inf)
