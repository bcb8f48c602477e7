"""How fast can a few SMs do the suffix part of one decode step on their own? (device experiment)

  PYTHONPATH=. python3 tools/device/suffix_role.py --out $OUT

Why. ``tools/device/sm_partition.py`` (2026-11-24) bounds a role-partitioned launch -- some SMs
stream the suffixes while the others run the prefix product -- and finds that at issue 3's
headline (paper shape, B=1024 P=16K S=128) the prefix kernel's 128 CTAs leave 4 SMs idle, which
by the TMA-only streaming rate (~205 GB/s per SM) could read all 67 MB of suffix K/V in ~82 µs,
under the prefix's 104 µs: ~107 µs with a merge, 26x. That needs the 4 suffix SMs to do the
suffix attention at >= ~160 GB/s each, arithmetic included. This kernel is that suffix role
alone, so its rate can be measured before the two roles are put into one launch.

The kernel (Mosaic GPU, ``n_ctas`` CTAs of ``wgs`` warpgroups, no producer warpgroup): the query
rows, folded as ``[Hkv, R, D]`` (row ``b * G + g``), are cut into column groups of ``N =
max(16, G)`` rows (``N / G`` sequences; wgmma needs N >= 8 and the probabilities' tile >= 32
bytes wide). Each warpgroup takes an equal range of groups and, for each sequence of a group and
each ``block_s``-key block of its suffix, computes ``S^T = K Q_g^T`` (keys on wgmma's M side:
N / G times the useful products, 2 at G = 8), an online softmax over the keys (axis 0: a
cross-warp reduction through Mosaic GPU's one scratch area, so with several warpgroups their
softmax sections take turns round a ring of barriers), ``P^T`` to shared memory and ``O^T += V^T P^T``. Each
warpgroup loads its own K/V blocks (``stages`` slots, TMA) and query tiles (two slots). At a
group's end its normalised ``o^T [D, N]`` and natural-log LSE go out through shared memory.
Every sequence reads ``cdiv(longest length of the call, block_s)`` blocks (at least one; the
caller appends that count to the lengths, :meth:`SuffixRole.lengths`), keys past its own length
masked; the capacity need not be a multiple of ``block_s`` (TMA zero-fills reads past it),
only of 8 (the tiles' TMA transforms).

:func:`suffix_role_rows` (``--layout rows``, 2026-11-25) is the alternative with the query rows
on wgmma's M side: 64-row tiles of whole sequences, the others' rows masked, the softmax along
the rows inside each warp (no cross-warp reductions, no turn ring), ``P`` from registers, the
output in the prefix's row layout. Measured no faster per SM (~36-41 GB/s at G = 4 either way;
docs/results/2026-11-25-h100-oversubscribed): the per-unit chain of products and softmax is the
cost, not the reductions.

Checks the outputs against a float64 oracle (full and ragged lengths, G = 8 and G = 4), then
times the headline's suffix part (B=1024, S=128, Hkv=1, G=8; 67 MB; or ``--batch``, ``--suffix``,
``--kv-heads``, ``--group``) for several CTA counts and warpgroup/slot/block settings: device µs, GB/s and GB/s per SM. Writes ``suffix_role.json``/``.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_shared_attn.bench import timing
from jax_shared_attn.testing import lse_err, oracle_full, rel_err, tolerance
from pallas_kernels.gpu._common import unfold_rows

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Diagnostic builds (timing only, wrong outputs; read when tracing): comma-separated parts to
# leave out, of "no_s", "no_softmax", "no_pv" (suffix_role_rows) and "no_len" (both roles).
DIAG = os.environ.get("SUFFIX_ROLE_DIAG", "")


class SuffixRole(NamedTuple):
  """The suffix role for a kernel's CTAs: ``body(cta, w, len_ref, q_ref, k_ref, v_ref, o_ref,
  lse_ref)`` runs warpgroup ``w`` of suffix CTA ``cta`` (warpgroups ``w >= wgs`` return at
  once; ``cta`` in ``[0, n_ctas)``), ``len_ref`` holding :meth:`lengths`; ``out_types`` are
  ``o_ref``'s and ``lse_ref``'s."""
  body: Callable
  out_types: tuple
  wgs: int
  block_s: int
  capacity: int

  def lengths(self, suffix_lengths):
    """int32 ``[B + 1]``: the lengths, then the key blocks every sequence reads this call
    (those of the longest, at least one)."""
    lens = jnp.asarray(suffix_lengths, jnp.int32)
    most = -(-self.capacity // self.block_s)
    blocks = jnp.clip(lax.div(jnp.max(lens) + self.block_s - 1, self.block_s), 1, most)
    return jnp.concatenate([lens, blocks[None]])


def _units(*, lo, per: int, nb, held: int, tiles_per_head: int, tile_rows: int, stages: int,
           block_s: int, capacity: int, len_ref, refs, smem, bars):
  """A warpgroup's work in either role: its tiles ``lo, lo + 1, ...`` (``held`` of them) of
  ``tile_rows`` query rows (``per`` whole sequences each, ``tiles_per_head`` tiles per KV head),
  each sequence's ``nb`` key blocks; unit ``u`` is (held tile ``k``, sequence ``j`` of the tile,
  key block). Returns ``issue_q(k)`` (held tile ``k``'s queries into slot ``k % 2``),
  ``issue_kv(u)`` (unit ``u``'s K and V blocks into slot ``u % stages``) and ``begin(u,
  state)``, a unit's common start: at a tile's start the next tile's query load issued and this
  one's waited for, and the online-softmax state ``(o, m, l)`` reset; then the unit's K block
  waited for. ``begin`` returns the unit's ``(k, blk, j, head, rt, n_valid, slot, q_slot,
  end)`` (``rt``: the tile within its KV head; ``n_valid``: the sequence's suffix length;
  ``end``: the tile's last unit) and the state."""
  q_ref, k_ref, v_ref = refs
  q_smem, k_smem, v_smem = smem
  q_bar, k_bar, v_bar = bars
  i32 = jnp.int32

  def locate(u):
    k = lax.div(u, i32(per * nb))
    t = u - k * (per * nb)
    j = lax.div(t, i32(nb))
    return k, j, t - j * nb, t == 0, t == per * nb - 1

  def coords(k):
    t = lo + k
    head = lax.div(t, i32(tiles_per_head))
    return head, t - head * tiles_per_head

  def issue_q(k):
    head, rt = coords(k)
    slot = lax.rem(k, i32(2))
    plgpu.copy_gmem_to_smem(q_ref.at[head, pl.ds(rt * tile_rows, tile_rows)], q_smem.at[slot],
                            q_bar(slot))

  def issue_kv(u):
    k, j, blk, _, _ = locate(u)
    head, rt = coords(k)
    seq = rt * per + j
    slot = lax.rem(u, i32(stages))
    src = (seq, pl.ds(blk * block_s, block_s), head)
    plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot], k_bar(slot))
    plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot], v_bar(slot))

  def begin(u, state):
    o, m_s, l_s = state
    k, j, blk, start, end = locate(u)
    head, rt = coords(k)
    seq = rt * per + j
    n_valid = (jnp.int32(capacity) if "no_len" in DIAG
               else jnp.clip(len_ref[seq], 0, capacity))
    slot = lax.rem(u, i32(stages))
    q_slot = lax.rem(k, i32(2))

    @pl.when(start)
    def _():
      pl.when(k + 1 < held)(lambda: issue_q(k + 1))
      plgpu.barrier_wait(q_bar(q_slot))

    # A new tile's state starts here (arithmetic, not a select under a scalar predicate,
    # which jax 0.11's Mosaic GPU lowering rejects; o and l are finite).
    keep = jnp.where(start, 0.0, 1.0).astype(jnp.float32)
    o, l_s = o * keep, l_s * keep
    m_s = m_s + jnp.where(start, -jnp.inf, 0.0).astype(jnp.float32)
    plgpu.barrier_wait(k_bar(slot))
    return (k, blk, j, head, rt, n_valid, slot, q_slot, end), (o, m_s, l_s)

  return issue_q, issue_kv, begin


def suffix_role(*, hkv: int, r: int, d: int, batch: int, capacity: int, dtype, rows_per_seq: int,
                scale: float, n_ctas: int, wgs: int = 2, stages: int = 2,
                block_s: int = 64) -> SuffixRole:
  """The suffix role over ``q_rows [Hkv, R, D]`` and suffixes ``[B, S, Hkv, D]`` (module
  docstring), for a kernel whose suffix CTAs number ``n_ctas`` and have at least ``wgs``
  warpgroups on the axis ``"wg"``."""
  m = rows_per_seq
  n_cols = max(16, m)
  if r != batch * m or n_cols % m or r % n_cols or capacity < block_s or capacity % 8:
    raise ValueError(f"q_rows {(hkv, r, d)}, G {m}, suffix capacity {capacity} (a multiple of "
                     f"8, at least block_s {block_s})")
  per_group = n_cols // m
  groups = hkv * r // n_cols
  workers = n_ctas * wgs
  if groups % workers:
    raise ValueError(f"{groups} column groups do not divide over {n_ctas} x {wgs} warpgroups")
  if not 1 <= wgs <= 4:
    raise ValueError(f"wgs must be 1-4 (warpgroups of a CTA), got {wgs}")
  held = groups // workers  # groups per warpgroup
  row_groups = r // n_cols  # column groups per KV head
  qk_scale = scale * LOG2E

  def run(cta, w, len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, scoped):
    (q_smem2, k_smem2, v_smem2, pt_smem2, ot_smem2, l_smem2), (
        q_bar2, k_bar2, v_bar2, turns) = scoped
    worker = cta * wgs + w
    nb = len_ref[batch]  # key blocks per sequence this call (SuffixRole.lengths)
    unit_count = held * per_group * nb
    g_lo = worker * held
    q_smem, k_smem, v_smem = q_smem2.at[w], k_smem2.at[w], v_smem2.at[w]
    pt_smem, ot_smem, l_smem = pt_smem2.at[w], ot_smem2.at[w], l_smem2.at[w]
    q_bar = lambda slot: q_bar2.at[w * 2 + slot]  # flat barrier arrays, per warpgroup
    k_bar = lambda slot: k_bar2.at[w * stages + slot]
    v_bar = lambda slot: v_bar2.at[w * stages + slot]
    i32 = jnp.int32
    issue_q, issue_kv, begin = _units(
        lo=g_lo, per=per_group, nb=nb, held=held, tiles_per_head=row_groups, tile_rows=n_cols,
        stages=stages, block_s=block_s, capacity=capacity, len_ref=len_ref,
        refs=(q_ref, k_ref, v_ref), smem=(q_smem, k_smem, v_smem), bars=(q_bar, k_bar, v_bar))

    issue_q(i32(0))
    for s in range(stages):
      pl.when(s < unit_count)(functools.partial(issue_kv, i32(s)))
    if wgs > 1:  # the softmax turns go round the warpgroups, warpgroup 0 first
      pl.when(w == wgs - 1)(lambda: plgpu.barrier_arrive(turns.at[0]))

    def unit(u, carry):
      (k, blk, j, head, rg, n_valid, slot, q_slot, end), (o_t, m_s, l_s) = begin(u, carry)

      def compute_st(acc_ref):
        plgpu.wgmma(acc_ref, k_smem.at[slot], q_smem.at[q_slot].transpose((1, 0)))
        return acc_ref[...]

      st = pl.run_scoped(compute_st, plgpu.ACC((block_s, n_cols), jnp.float32))
      if wgs > 1:
        plgpu.barrier_wait(turns.at[w])
      keys = plgpu.broadcasted_iota(jnp.int32, (block_s, n_cols), 0, layout=plgpu.Layout.WGMMA)
      cols = plgpu.broadcasted_iota(jnp.int32, (block_s, n_cols), 1, layout=plgpu.Layout.WGMMA)
      col0 = j * m
      st = jnp.where(keys + blk * block_s < n_valid, st, -jnp.inf)
      st = jnp.where(cols >= col0, st, -jnp.inf)
      st = jnp.where(cols < col0 + m, st, -jnp.inf)
      m_new = jnp.maximum(m_s, st.max(axis=0) * qk_scale)
      m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp2(m_s - m_use)
      p_t = jnp.exp2(st * qk_scale - lax.broadcast_in_dim(m_use, st.shape, [1]))
      l_s = l_s * alpha + p_t.sum(axis=0)
      o_t = o_t * lax.broadcast_in_dim(alpha, o_t.shape, [1])
      if wgs > 1:
        plgpu.barrier_arrive(turns.at[lax.rem(w + 1, wgs)])
      pt_smem[...] = p_t.astype(dtype)  # wgmma's B operand lives in shared memory
      plgpu.commit_smem()
      plgpu.barrier_wait(v_bar(slot))

      def compute_pv(acc_ref):  # V^T P^T [D, N]
        plgpu.wgmma(acc_ref, v_smem.at[slot].transpose((1, 0)), pt_smem)
        return acc_ref[...]

      o_t = o_t + pl.run_scoped(compute_pv, plgpu.ACC((d, n_cols), jnp.float32))
      pl.when(u + stages < unit_count)(lambda: issue_kv(u + stages))

      @pl.when(end)
      def _write_group():
        has = l_s > 0
        safe = jnp.where(has, l_s, 1.0)
        plgpu.wait_smem_to_gmem(0)  # the previous group's tiles have left
        ot_smem[...] = (o_t / lax.broadcast_in_dim(safe, o_t.shape, [1])).astype(dtype)
        l_smem[...] = jnp.where(has, (m_new + jnp.log(safe) * (1 / LN2)) * LN2, -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(ot_smem, o_ref.at[g_lo + k])
        plgpu.copy_smem_to_gmem(l_smem, lse_ref.at[head, pl.ds(rg * n_cols, n_cols)])

      return o_t, m_new, l_s

    cols_layout = plgpu.Layout.WGMMA.reduce(0)
    lax.fori_loop(0, unit_count, unit, (
        plgpu.layout_cast(jnp.full((d, n_cols), 0, jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((n_cols,), -jnp.inf, jnp.float32), cols_layout),
        plgpu.layout_cast(jnp.full((n_cols,), 0, jnp.float32), cols_layout)))
    plgpu.wait_smem_to_gmem(0)

  def body(cta, w, len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    narrow = (plgpu.TilingTransform((8, n_cols)), plgpu.SwizzleTransform(2 * n_cols))

    def scoped(*args):
      pl.when(w < wgs)(lambda: run(cta, w, len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, args))

    pl.run_scoped(
        scoped,
        (plgpu.SMEM((wgs, 2, n_cols, d), dtype, transforms=(tiling, swizzle)),
         plgpu.SMEM((wgs, stages, block_s, d), dtype, transforms=(tiling, swizzle)),
         plgpu.SMEM((wgs, stages, block_s, d), dtype, transforms=narrow),
         plgpu.SMEM((wgs, block_s, n_cols), dtype, transforms=narrow),
         plgpu.SMEM((wgs, d, n_cols), dtype, transforms=narrow),
         plgpu.SMEM((wgs, n_cols), jnp.float32)),
        (plgpu.Barrier(num_barriers=2 * wgs), plgpu.Barrier(num_barriers=stages * wgs),
         plgpu.Barrier(num_barriers=stages * wgs), plgpu.Barrier(num_barriers=max(2, wgs))),
        collective_axes="wg",
    )

  out_types = (jax.ShapeDtypeStruct((groups, d, n_cols), dtype),
               jax.ShapeDtypeStruct((hkv, r), jnp.float32))
  return SuffixRole(body, out_types, wgs, block_s, capacity)


def suffix_role_rows(*, hkv: int, r: int, d: int, batch: int, capacity: int, dtype,
                     rows_per_seq: int, scale: float, n_ctas: int, wgs: int = 2,
                     stages: int = 2, block_s: int = 64) -> SuffixRole:
  """The suffix role with the query rows on wgmma's M side (:func:`suffix_role`'s alternative).

  A warpgroup takes row tiles of 64 query rows -- ``64 / G`` whole sequences of one KV head --
  and, for each sequence of a tile and each ``block_s``-key block of its suffix, computes
  ``S = Q K^T`` over the whole tile (64 rows for G useful ones: 64 / G times the useful
  products), masks every row but that sequence's to ``-inf``, runs the online softmax along
  the rows (within each warp: no cross-warp reduction, no shared scratch, so the warpgroups
  never wait for each other) and adds ``P V`` with ``P`` from registers. The tile's rows
  gather their own sequences' results in one accumulator, which goes out at the tile's end
  already in the prefix's row layout ``[Hkv, R, D]`` (no transposes before the merge). Blocks
  per sequence and masks as :func:`suffix_role`; ``R`` must be a multiple of 64."""
  m = rows_per_seq
  tile_rows = 64
  if (r != batch * m or tile_rows % m or r % tile_rows or capacity < block_s or capacity % 8
      or block_s % 64):
    raise ValueError(f"q_rows {(hkv, r, d)}, G {m}, suffix capacity {capacity} (a multiple of "
                     f"8, at least block_s {block_s}, a multiple of 64)")
  per_tile = tile_rows // m
  tiles = hkv * r // tile_rows
  workers = n_ctas * wgs
  if tiles % workers:
    raise ValueError(f"{tiles} row tiles do not divide over {n_ctas} x {wgs} warpgroups")
  if not 1 <= wgs <= 3:
    raise ValueError(f"wgs must be 1-3 (warpgroups of a CTA), got {wgs}")
  held = tiles // workers
  row_tiles = r // tile_rows  # per KV head
  qk_scale = scale * LOG2E

  def run(cta, w, len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, scoped):
    (q_smem2, k_smem2, v_smem2), (q_bar2, k_bar2, v_bar2) = scoped
    worker = cta * wgs + w
    nb = len_ref[batch]
    unit_count = held * per_tile * nb
    t_lo = worker * held
    q_smem, k_smem, v_smem = q_smem2.at[w], k_smem2.at[w], v_smem2.at[w]
    q_bar = lambda slot: q_bar2.at[w * 2 + slot]
    k_bar = lambda slot: k_bar2.at[w * stages + slot]
    v_bar = lambda slot: v_bar2.at[w * stages + slot]
    i32 = jnp.int32
    issue_q, issue_kv, begin = _units(
        lo=t_lo, per=per_tile, nb=nb, held=held, tiles_per_head=row_tiles, tile_rows=tile_rows,
        stages=stages, block_s=block_s, capacity=capacity, len_ref=len_ref,
        refs=(q_ref, k_ref, v_ref), smem=(q_smem, k_smem, v_smem), bars=(q_bar, k_bar, v_bar))

    issue_q(i32(0))
    for s_ in range(stages):
      pl.when(s_ < unit_count)(functools.partial(issue_kv, i32(s_)))
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def unit(u, carry):
      (_, blk, j, head, rt, n_valid, slot, q_slot, end), (acc, m_i, l_i) = begin(u, carry)

      def compute_s(acc_ref):
        plgpu.wgmma(acc_ref, q_smem.at[q_slot], k_smem.at[slot].transpose((1, 0)))
        return acc_ref[...]

      if "no_s" in DIAG:
        st = plgpu.layout_cast(jnp.full((tile_rows, block_s), 0.5, jnp.float32),
                               plgpu.Layout.WGMMA)
      else:
        st = pl.run_scoped(compute_s, plgpu.ACC((tile_rows, block_s), jnp.float32))
      rows = plgpu.broadcasted_iota(jnp.int32, st.shape, 0, layout=plgpu.Layout.WGMMA)
      keys = plgpu.broadcasted_iota(jnp.int32, st.shape, 1, layout=plgpu.Layout.WGMMA)
      st = jnp.where(keys + blk * block_s < n_valid, st * qk_scale, -jnp.inf)
      st = jnp.where(rows >= j * m, st, -jnp.inf)
      st = jnp.where(rows < j * m + m, st, -jnp.inf)
      if "no_softmax" in DIAG:
        m_new, p = m_i, st
      else:
        m_new = jnp.maximum(m_i, st.max(axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_i - m_use)
        p = jnp.exp2(st - lax.broadcast_in_dim(m_use, st.shape, [0]))
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      p16 = p.astype(dtype)
      plgpu.barrier_wait(v_bar(slot))

      def compute_pv(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

      if "no_pv" not in DIAG:
        acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
      pl.when(u + stages < unit_count)(lambda: issue_kv(u + stages))

      @pl.when(end)
      def _write_tile():
        # The tile's query buffer is done with (its last product has been waited for): the
        # normalised output goes out through it.
        has = l_i > 0
        safe = jnp.where(has, l_i, 1.0)
        q_out = q_smem.at[q_slot]
        q_out[...] = (acc / lax.broadcast_in_dim(safe, acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_out, o_ref.at[head, pl.ds(rt * tile_rows, tile_rows)])
        lse_ref[head, pl.ds(rt * tile_rows, tile_rows)] = jnp.where(
            has, (m_new + jnp.log(safe) * (1 / LN2)) * LN2, -jnp.inf)
        # The buffer is loaded again two tiles on: wait for the store before that.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      return acc, m_new, l_i

    lax.fori_loop(0, unit_count, unit, (
        plgpu.layout_cast(jnp.full((tile_rows, d), 0, jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((tile_rows,), -jnp.inf, jnp.float32), row_layout),
        plgpu.layout_cast(jnp.full((tile_rows,), 0, jnp.float32), row_layout)))
    plgpu.wait_smem_to_gmem(0)

  def body(cta, w, len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)

    def scoped(*args):
      pl.when(w < wgs)(lambda: run(cta, w, len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, args))

    pl.run_scoped(
        scoped,
        (plgpu.SMEM((wgs, 2, tile_rows, d), dtype, transforms=(tiling, swizzle)),
         plgpu.SMEM((wgs, stages, block_s, d), dtype, transforms=(tiling, swizzle)),
         plgpu.SMEM((wgs, stages, block_s, d), dtype, transforms=(tiling, swizzle))),
        (plgpu.Barrier(num_barriers=2 * wgs), plgpu.Barrier(num_barriers=stages * wgs),
         plgpu.Barrier(num_barriers=stages * wgs)),
        collective_axes="wg",
    )

  out_types = (jax.ShapeDtypeStruct((hkv, r, d), dtype),
               jax.ShapeDtypeStruct((hkv, r), jnp.float32))
  return SuffixRole(body, out_types, wgs, block_s, capacity)


def suffix_rows_mgpu(q_rows, suffix_k, suffix_v, suffix_lengths, *, rows_per_seq: int,
                     scale: float, n_ctas: int, wgs: int = 2, stages: int = 2,
                     block_s: int = 64, layout: str = "cols"):
  """``q_rows [Hkv, R, D]`` (``R = B * G``), suffixes ``[B, S, Hkv, D]``, lengths int32 ``[B]``
  -> ``o_t [Hkv * R / N, D, N]`` (``layout="cols"``: :func:`suffix_role`; ``"rows"``:
  :func:`suffix_role_rows` and ``o [Hkv, R, D]``), normalised, in q's dtype, and natural-log
  ``lse [Hkv, R]``: the suffix role alone, on ``n_ctas`` CTAs of ``wgs`` warpgroups."""
  hkv, r, d = q_rows.shape
  batch, capacity = suffix_k.shape[:2]
  role = ROLES[layout](hkv=hkv, r=r, d=d, batch=batch, capacity=capacity, dtype=q_rows.dtype,
                       rows_per_seq=rows_per_seq, scale=scale, n_ctas=n_ctas, wgs=wgs,
                       stages=stages, block_s=block_s)

  def entry(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
    role.body(lax.axis_index("cta"), lax.axis_index("wg"), len_ref, q_ref, k_ref, v_ref, o_ref,
              lse_ref)

  return plgpu.kernel(
      entry,
      out_type=list(role.out_types),
      grid=(n_ctas,),
      grid_names=("cta",),
      num_threads=wgs,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(role.lengths(suffix_lengths), q_rows, suffix_k, suffix_v)


ROLES = {"cols": suffix_role, "rows": suffix_role_rows}


def unfold(o_t, hkv: int, r: int, layout: str = "cols"):
  """The role's output as ``[Hkv, R, D]`` (``o_t [Hkv * R / N, D, N]`` for ``"cols"``)."""
  if layout == "rows":
    return o_t
  groups, d, n = o_t.shape
  return jnp.swapaxes(o_t, 1, 2).reshape(hkv, r, d)


def compare(o_t, lse, q_rows, sk, sv, lens, *, scale: float, layout: str = "cols") -> dict:
  """The suffix role's outputs against the project's float64 oracle of full attention, as
  ``[B, 1, Hq, D]``: max-abs relative error < 2e-2, the norm error within the dtype's
  tolerance, LSEs within 2e-2 with the same -inf rows (``ok``)."""
  hkv, r, _ = q_rows.shape
  b = sk.shape[0]
  ref_o, ref_l = oracle_full(unfold_rows(q_rows, b, 1), sk, sv, kv_lengths=lens, scale=scale)
  out = np.asarray(unfold_rows(unfold(o_t, hkv, r, layout), b, 1), np.float64)
  lse = np.asarray(unfold_rows(lse, b, 1), np.float64)
  err = float(np.abs(out - ref_o).max() / np.abs(ref_o).max())
  rel, lerr = rel_err(out, ref_o), lse_err(lse, ref_l)
  return dict(err=err, rel_err=rel, lse_err=lerr,
              ok=bool(err < 2e-2 and rel < tolerance(q_rows.dtype) and lerr < 2e-2))


def inputs(key, b, s, hkv, g, d, dtype=jnp.bfloat16):
  ks = jax.random.split(key, 3)
  return (jax.random.normal(ks[0], (hkv, b * g, d), dtype),
          jax.random.normal(ks[1], (b, s, hkv, d), dtype),
          jax.random.normal(ks[2], (b, s, hkv, d), dtype))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--ctas", default="4,8,16,32,64,128")
  ap.add_argument("--variants", default="1x2x64,1x4x64,2x1x64,2x2x64",
                  help="warpgroups x K/V slots x keys per block")
  ap.add_argument("--batch", type=int, default=1024)
  ap.add_argument("--suffix", type=int, default=128)
  ap.add_argument("--kv-heads", type=int, default=1)
  ap.add_argument("--group", type=int, default=8, help="query heads per KV head (G)")
  ap.add_argument("--trials", type=int, default=5)
  ap.add_argument("--skip-check", action="store_true")
  ap.add_argument("--layout", default="cols", choices=sorted(ROLES))
  args = ap.parse_args()
  kind = jax.devices()[0].device_kind
  variants = [tuple(int(x) for x in v.split("x")) for v in args.variants.split(",")]
  report = {"device": kind, "jax": jax.__version__, "checks": [], "timings": []}
  d = 128

  # 1. Exactness against the float64 oracle (bf16: 2e-2 relative, the project's bound).
  if not args.skip_check:
    # (B, capacity, Hkv, G, CTAs, lengths: "full", "ragged" in [0, S] or "short" in [0, 40])
    for (b, s, hkv, g, n_ctas, ragged) in [
        (64, 128, 1, 8, 4, "full"), (64, 128, 1, 8, 2, "ragged"), (32, 192, 2, 4, 2, "ragged"),
        (128, 64, 1, 8, 8, "ragged"), (64, 256, 1, 8, 4, "ragged"), (64, 136, 8, 4, 4, "short")]:
      for wgs, stages, block_s in variants:
        if s < block_s:
          continue
        q, sk, sv = inputs(jax.random.key(b + s + g), b, s, hkv, g, d)
        top = dict(full=s, ragged=s, short=min(s, 40))[ragged]
        lens = (jnp.full((b,), s, jnp.int32) if ragged == "full" else
                jax.random.randint(jax.random.key(7), (b,), 0, top + 1, jnp.int32))
        scale = d ** -0.5
        case = dict(b=b, s=s, hkv=hkv, g=g, ctas=n_ctas, ragged=ragged, wgs=wgs, stages=stages,
                    block_s=block_s)
        try:
          o_t, lse = jax.jit(functools.partial(
              suffix_rows_mgpu, rows_per_seq=g, scale=scale, n_ctas=n_ctas, wgs=wgs,
              stages=stages, block_s=block_s, layout=args.layout))(q, sk, sv, lens)
          case.update(compare(o_t, lse, q, sk, sv, lens, scale=scale, layout=args.layout))
        except Exception as e:  # noqa: BLE001 -- reported
          case.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        report["checks"].append(case)
        print("check", case, flush=True)

  # 2. Throughput at the headline's suffix part.
  b, s, hkv, g = args.batch, args.suffix, args.kv_heads, args.group
  nbytes = 2 * b * s * hkv * d * 2
  scale = d ** -0.5

  def make(i):
    return (*inputs(jax.random.key(100 + i), b, s, hkv, g, d), jnp.full((b,), s, jnp.int32))

  n_sets = timing.sets_needed(nbytes)
  for n_ctas in [int(c) for c in args.ctas.split(",")]:
    for wgs, stages, block_s in variants:
      row = dict(ctas=n_ctas, wgs=wgs, stages=stages, block_s=block_s, mb=nbytes / 1e6)
      try:
        op = functools.partial(suffix_rows_mgpu, rows_per_seq=g, scale=scale, n_ctas=n_ctas,
                               wgs=wgs, stages=stages, block_s=block_s, layout=args.layout)
        res = timing.measure(op, make, n_sets=n_sets, trials=args.trials)
        us = res["seconds"] * 1e6
        row.update(us=us, gbps=nbytes / us / 1e3, gbps_per_sm=nbytes / us / 1e3 / n_ctas)
      except Exception as e:  # noqa: BLE001 -- reported
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      report["timings"].append(row)
      print("time", row, flush=True)

  lines = [f"device: {kind}; jax {jax.__version__}; suffix part of B={b} S={s} Hkv={hkv} G={g} "
           f"D={d} ({nbytes / 1e6:.0f} MB of K/V), device µs (GB/s, GB/s per SM)", "",
           "| CTAs | " + " | ".join(f"{w} wg x {st} slots x {bs} keys" for w, st, bs in variants)
           + " |",
           "|---:|" + "---:|" * len(variants)]
  for n_ctas in [int(c) for c in args.ctas.split(",")]:
    cells = []
    for v in variants:
      row = next(r for r in report["timings"]
                 if (r["ctas"], r["wgs"], r["stages"], r["block_s"]) == (n_ctas, *v))
      cells.append(f"{row['us']:.1f} ({row['gbps']:.0f}, {row['gbps_per_sm']:.0f})" if "us" in row
                   else "err")
    lines.append(f"| {n_ctas} | " + " | ".join(cells) + " |")
  checks = report["checks"]
  lines += ["", f"exactness: {sum(c['ok'] for c in checks)} of {len(checks)} cases within 2e-2 "
            "of the float64 oracle" + ("" if all(c["ok"] for c in checks) else
                                       " -- FAILURES in suffix_role.json")]
  table = "\n".join(lines)
  print("\n" + table)
  tag = f"_b{b}_s{s}_h{hkv}_g{g}" if (b, s, hkv, g) != (1024, 128, 1, 8) else ""
  tag += "_rows" if args.layout == "rows" else ""
  # Diagnostic builds get their own files (their runs overwrote one another before 2026-11-25).
  tag += "_diag-" + DIAG.replace(",", "-") if DIAG else ""
  with open(os.path.join(args.out, f"suffix_role{tag}.json"), "w") as f:
    json.dump(report, f, indent=1)
  with open(os.path.join(args.out, f"suffix_role{tag}.md"), "w") as f:
    f.write(table + "\n")


if __name__ == "__main__":
  main()
