"""Shared prefix and per-sequence suffixes in ONE Hopper kernel (Pallas Mosaic GPU).

The split kernels run one after the other: the batched prefix product is
compute-bound and the suffix pass memory-bound, so neither hides the other and the sum sits
well above ``max(FLOPs / rate, bytes / bandwidth)``. Here every CTA of
:mod:`pallas_kernels.gpu.prefix_mgpu`'s design (two consumer
warpgroups of 64 query rows, one TMA producer warpgroup) continues, after the
prefix's K/V blocks, with the suffix K/V of the sequences its 128 rows belong
to, in the same online softmax: the producer streams the suffix bytes while
the tensor cores are busy, and the result is final (no merge pass) when the
CTA runs every step.

Decoding only (``Tq == 1``: ``G`` rows per sequence, ``64 % G == 0``). In a
suffix step each consumer warpgroup takes ``block_s`` (64) keys of ONE of its
own sequences -- the two halves of a K/V slot, each with its own barrier -- and
multiplies them against its 64 rows, masking the rows of its other sequences:
the tensor cores do ``64 / G`` times the suffix's useful FLOPs, which they have
to spare while the suffix bytes stream (at the paper's shape, G = 8, the
suffix FLOPs are ~1/16 of the prefix's). The CTA streams ``cdiv(longest
suffix of its sequences, block_s)`` blocks of each of its sequences (keys past
a sequence's length are masked; sequences decoding from one prompt have equal
lengths). The dispatcher uses it for ``G >= 8`` (:data:`MAX_WASTE`).

Key splits (flash-decoding, when the row tiles do not fill the SMs) cut the CTA's
step list -- prefix blocks then suffix steps -- into ranges of equal step counts, or (with
few splits and a long prefix, :func:`spreads`) each take an equal share of the prefix blocks
and of the suffix steps, running the suffix steps as one run among the prefix blocks from a
position that varies over the CTAs, so that the suffix reads (HBM) are spread over the
kernel's run instead of coming in one burst at its end (:func:`step_ranges`); the splits'
partial states are merged by LSE afterwards, or (``FusedConfig.cluster_merge``) inside the
kernel: the splits of a row tile are one thread-block cluster,
and once every consumer warpgroup of the cluster is done with its K/V slots (a cluster barrier)
each warpgroup's 64 rows are merged by one CTA of the cluster -- warpgroup w's by split w -- to
which the other splits' warpgroup w push their normalised rows and LSEs
(``plgpu.async_store_smem``: ``st.async`` into the peer CTA's shared memory, completing on its
barrier; the receive tiles alias the K/V slots); it merges them in registers and writes the
final rows. With two splits the two CTAs exchange one tile each and each merges and stores half
the rows.

Keys and values past ``kv_length`` / ``suffix_lengths[b]`` (inside the buffers)
are multiplied by a zero probability: they must be finite, which the model's
zero-initialised caches guarantee (this is also true of the prefix kernel's
last block).

The plan -- :class:`FusedConfig`, :func:`default_config` and the options it reads, the step
lists (:func:`step_ranges`) and the barrier protocol (:func:`arrivals`, :func:`waits`) -- lives
in :mod:`pallas_kernels.gpu.shared_mgpu_plan`, pure scalar arithmetic that the CPU tests
emulate; this module holds the kernel and its wrapper.

Reference: :func:`pallas_kernels.base.prefix_attention` merged with
:func:`pallas_kernels.base.suffix_attention`. LSE is natural log.
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu import common
from pallas_kernels.gpu.merge import MergeConfig, merge_parts
from pallas_kernels.gpu.prefix_mgpu import empty_state, store_result
from pallas_kernels.gpu.shared_mgpu_plan import (
    CTA_ROWS, LSE_COLS, MAX_CLUSTER_SPLITS, FusedConfig, cluster_merge_fits,
    is_suffix, prefix_block, step_ranges, suffix_step, waits)

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Registers per thread of the consumer and producer warpgroups (three warpgroups, 384 threads:
# 2 * 232 + 40 <= 512 of the 65,536 a CTA may hold over 128 threads' worth; setmaxnreg.inc waits
# for registers the others give back, so more would hang). These are the setmaxnreg values at
# run time; ptxas compiles the whole kernel under the launch's cap (168 registers at 384
# threads; MOSAIC_GPU_DUMP_PTXAS=1 shows it spills none).
REGS = (232, 40)

_LOAD_NEEDS_IDX = (inspect.signature(plgpu.load).parameters["idx"].default
                   is inspect.Parameter.empty)


def load_tile(ref, layout):
  """``plgpu.load`` of a whole shared-memory ref in ``layout`` (jax 0.10 needs the index
  argument, which jax 0.11 deprecates in favour of ``ref.at[...]``)."""
  return plgpu.load(ref, (), layout=layout) if _LOAD_NEEDS_IDX else plgpu.load(ref, layout=layout)


def fused_rows_mgpu(q_rows, k, v, kv_length, suffix_k, suffix_v, suffix_lengths, *,
                    rows_per_seq: int, scale: float, config: FusedConfig):
  """``q_rows [Hkv, R, D]`` (R a multiple of 128; rows ``b * G + g``, padding past ``B * G``),
  prefix ``k, v [P, Hkv, D]``, ``kv_length`` int32 ``[1]``, suffixes ``[B, S, Hkv, D]``,
  ``suffix_lengths`` int32 ``[B]``.

  Returns ``out [splits, Hkv, R, D]`` in q's dtype and natural-log ``lse [splits, Hkv, R]``
  (one split, merged, with ``cluster_merge``).
  """
  hkv, r, d = q_rows.shape
  p = k.shape[0]
  batch, capacity = suffix_k.shape[:2]
  dtype = q_rows.dtype
  cfg = config
  block_q, block_kv, block_s = cfg.block_q, cfg.block_kv, cfg.block_s
  m = rows_per_seq
  if r % CTA_ROWS:
    raise ValueError(f"rows ({r}) must be a multiple of {CTA_ROWS}")
  if block_q % m or 2 * block_s != block_kv:
    raise ValueError(f"rows_per_seq ({m}) must divide {block_q}, and block_s ({block_s}) must "
                     f"be half of block_kv ({block_kv})")
  clustered = cfg.cluster_merge
  if clustered and not cluster_merge_fits(cfg, d, jnp.dtype(dtype).itemsize):
    raise ValueError(f"cluster_merge needs 2 <= splits <= {MAX_CLUSTER_SPLITS}, row suffix "
                     f"steps and room for the receive tiles in the K/V slots; got {cfg}")
  seqs_per_wg = block_q // m
  seqs_per_cta = 2 * seqs_per_wg
  prefix_blocks = p // block_kv
  tiles = r // CTA_ROWS  # row tiles per KV head
  steps_buf = cfg.max_concurrent_steps
  qk_scale = scale * LOG2E

  def kernel(len_ref, slen_ref, tmax_ref, q_ref, k_ref, v_ref, sk_ref, sv_ref, out_ref, lse_ref,
             *rest):
    (scoped,) = rest
    head = lax.axis_index("heads")
    tile = lax.axis_index("q_seq")
    split = lax.axis_index("split")
    smem_buffers, buffer_barriers, consumed_barriers, schedule_barrier = scoped[:4]
    wg_idx = lax.axis_index("wg")
    if clustered:  # the receive tiles alias the K/V slots (used once every step is done)
      qo_smem2, ((k_smem, v_smem), (recv_o, recv_l)) = smem_buffers
      recv_barrier, done_barrier = scoped[4]
    else:
      qo_smem2, k_smem, v_smem = smem_buffers
    # Per slot: K and V landed (prefix steps, and warpgroup 0's half of suffix steps); warpgroup
    # 1's half of suffix steps; the query tiles.
    k_barriers, v_barriers, k1_barriers, v1_barriers, q_barriers = buffer_barriers
    k_consumed_barriers, v_consumed_barriers = consumed_barriers

    # The CTA's step list: the prefix's valid blocks, then suffix steps in which each
    # warpgroup takes block_s keys of one of ITS sequences (the two halves of a K/V slot), as
    # many blocks per sequence as the longest of the CTA's sequences needs.
    kv_len = jnp.minimum(len_ref[0], p)
    seq0 = tile * seqs_per_cta
    # The longest suffix of the CTA's sequences: independent loads of each (their latencies
    # overlap), or reduced by XLA beforehand (one load here, but a kernel launch there).
    if tmax_ref is None:
      max_len = functools.reduce(jnp.maximum, [
          jnp.where(seq0 + i < batch, slen_ref[jnp.minimum(seq0 + i, batch - 1)], 0)
          for i in range(seqs_per_cta)])
    else:
      max_len = tmax_ref[tile]
    max_len = jnp.clip(max_len, 0, capacity)
    ranges = step_ranges(kv_len, max_len, split, tile * cfg.splits + split,
                         prefix_blocks=prefix_blocks, block_kv=block_kv, block_s=block_s,
                         seqs_per_wg=seqs_per_wg, splits=cfg.splits, spread=cfg.spread_suffix,
                         ctas=tiles * cfg.splits)
    steps, o, n_s, n_pf = ranges.steps, ranges.o, ranges.n_s, ranges.n_pf

    def suffix_coords(i, w: int):
      """Sequence (of warpgroup w) and key block of local step i (a suffix step)."""
      j, blk = suffix_step(i, ranges)
      return seq0 + w * seqs_per_wg + j, j, blk

    def perform_schedule_barrier():
      plgpu.barrier_arrive(schedule_barrier)
      plgpu.barrier_wait(schedule_barrier)

    def consumer(w: int):
      """Warpgroup w's rows (static w: static halves of the suffix slots)."""
      plgpu.set_max_registers(REGS[0], action="increase")
      qo_smem = qo_smem2.at[w]
      q_base = tile * CTA_ROWS + w * block_q

      bars = dict(k=k_barriers, v=v_barriers, k1=k1_barriers, v1=v1_barriers)

      def wait_on(kind: str, suffix: bool, slot):
        """Waits on the K ("k") or V ("v") barriers of a prefix or suffix step, as :func:`waits`
        says."""
        for name in waits(w, suffix):
          if name[0] == kind:
            plgpu.barrier_wait(bars[name].at[slot])

      def slot_of(i):
        """The K/V slot of local step i."""
        return lax.rem(i, jnp.array(steps_buf, i.dtype))

      def wait_for(kind: str, i, slot):
        """:func:`wait_on` for local step i, whose kind is known only when the kernel runs."""
        if w == 0:
          wait_on(kind, False, slot)
        else:
          suffix = is_suffix(i, ranges)
          pl.when(~suffix)(lambda: wait_on(kind, False, slot))
          pl.when(suffix)(lambda: wait_on(kind, True, slot))

      wait_k = functools.partial(wait_for, "k")

      plgpu.copy_gmem_to_smem(q_ref.at[head, pl.ds(q_base, block_q)], qo_smem, q_barriers.at[w])
      plgpu.barrier_wait(q_barriers.at[w])
      acc, m_i, l_i = empty_state(block_q, d)

      @pl.when(steps > 0)
      def _():
        wait_k(jnp.int32(0), 0)

      if w == 1:
        perform_schedule_barrier()

      def kv_loop(i, carry, kind: str):
        acc, m_i, l_i = carry
        slot = slot_of(i)
        if kind == "suffix":  # this warpgroup's half of the slot
          half = pl.ds(w * block_s, block_s)
          k_tile, v_tile, n_keys = k_smem.at[slot, half], v_smem.at[slot, half], block_s
          # Issued before the product: the length load's latency hides behind it.
          seq, j, blk = suffix_coords(i, w)
          n_valid = jnp.where(seq < batch, slen_ref[jnp.minimum(seq, batch - 1)], 0)
        else:
          k_tile, v_tile, n_keys = k_smem.at[slot], v_smem.at[slot], block_kv

        def compute_qk(acc_ref):
          plgpu.wgmma(acc_ref, qo_smem, k_tile.transpose((1, 0)))
          perform_schedule_barrier()
          return acc_ref[...]

        qk = pl.run_scoped(compute_qk, plgpu.ACC((block_q, n_keys), jnp.float32))
        plgpu.barrier_arrive(k_consumed_barriers.at[slot])
        if kind == "prefix_last":
          cols = plgpu.broadcasted_iota(jnp.int32, (block_q, n_keys), 1, layout=plgpu.Layout.WGMMA)
          qk = jnp.where(cols + prefix_block(i, ranges) * block_kv < kv_len, qk, -jnp.inf)
        elif kind == "suffix":
          cols = plgpu.broadcasted_iota(jnp.int32, (block_q, n_keys), 1, layout=plgpu.Layout.WGMMA)
          qk = jnp.where(cols + blk * block_s < n_valid, qk, -jnp.inf)
          rows = plgpu.broadcasted_iota(jnp.int32, (block_q, n_keys), 0, layout=plgpu.Layout.WGMMA)
          first = j * m  # this sequence's rows within the warpgroup's
          qk = jnp.where(rows >= first, qk, -jnp.inf)
          qk = jnp.where(rows < first + m, qk, -jnp.inf)
        m_ij = jnp.maximum(m_i, qk.max(axis=1) * qk_scale)
        # Rows without a visible key so far keep m = -inf: subtract 0 instead (no inf - inf).
        m_use = m_ij if kind == "prefix" else jnp.where(m_ij == -jnp.inf, 0.0, m_ij)
        alpha = jnp.exp2(m_i - m_use)
        m_i = m_ij
        p_ = jnp.exp2(qk * qk_scale - lax.broadcast_in_dim(m_use, qk.shape, [0]))
        acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
        l_i *= alpha
        p16 = p_.astype(dtype)
        l_i += p_.sum(axis=1)
        acc, l_i, m_i, p16 = lax.optimization_barrier((acc, l_i, m_i, p16))
        plgpu.barrier_arrive(schedule_barrier)  # done with the softmax
        wait_on("v", kind == "suffix", slot)
        plgpu.barrier_wait(schedule_barrier)  # wait until the tensor cores are free

        def compute_pv(acc_ref):
          plgpu.wgmma(acc_ref, p16, v_tile)
          wait_step = i + 1
          next_slot = slot_of(wait_step)
          pl.when(wait_step < steps)(lambda: wait_k(wait_step, next_slot))

        acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_consumed_barriers.at[slot])
        return acc, m_i, l_i

      # The steps in order (StepRanges): unmasked prefix blocks, the suffix steps, the other
      # unmasked prefix blocks, the masked last prefix block.
      prefix = functools.partial(kv_loop, kind="prefix")
      carry = lax.fori_loop(0, o, prefix, (acc, m_i, l_i))
      carry = lax.fori_loop(o, o + n_s, functools.partial(kv_loop, kind="suffix"), carry)
      carry = lax.fori_loop(o + n_s, n_s + n_pf, prefix, carry)
      acc, m_i, l_i = lax.fori_loop(n_s + n_pf, steps,
                                    functools.partial(kv_loop, kind="prefix_last"), carry)
      if w == 0:
        perform_schedule_barrier()

      # A split without visible keys gives (0, -inf). The LSE goes from registers (as the prefix
      # kernel's): no staging tile, which lets three K/V slots fit (:func:`smem_bytes`).
      rows = pl.ds(q_base, block_q)
      if clustered:
        merge_in_cluster(w, acc, m_i, l_i, qo_smem, rows)
        return
      store_result(acc, m_i, l_i, qo_smem, out_ref.at[split, head, rows],
                   lse_ref.at[split, head, rows], dtype=dtype)

    def merge_in_cluster(w: int, acc, m_i, l_i, qo_smem, rows):
      """Warpgroup w's epilogue with ``cluster_merge``: the rows of warpgroup w are merged by
      split w (exact LSE merge) and stored there; the other splits push theirs to it."""
      has = l_i > 0
      safe_l = jnp.where(has, l_i, 1.0)
      lse = jnp.where(has, (m_i + jnp.log(safe_l) * (1 / LN2)) * LN2, -jnp.inf)
      # Every consumer warpgroup of the cluster is past its last step: every CTA's K/V slots,
      # where its receive tiles live, are free.
      plgpu.barrier_arrive(done_barrier)
      plgpu.barrier_wait(done_barrier)

      @pl.when(split != w)
      def _send():  # into the owner's receive tile of this split (senders in split order)
        dst = dict(cluster_idx=jnp.int32(w), cluster_dim="split")
        j = split - (split > w).astype(split.dtype)
        out = acc / lax.broadcast_in_dim(safe_l, acc.shape, [0])
        plgpu.async_store_smem(out.astype(dtype), recv_o.at[j], recv_barrier, **dst)
        plgpu.async_store_smem(lax.broadcast_in_dim(lse, (block_q, LSE_COLS), [0]),
                               recv_l.at[j], recv_barrier, **dst)

      @pl.when(split == w)
      def _merge():
        plgpu.barrier_wait(recv_barrier)
        # The LSEs first, then one output tile at a time into the sum (registers: the sum and
        # one tile, as in the loop).
        lses = [lse] + [jnp.max(load_tile(recv_l.at[j], plgpu.Layout.WGMMA), axis=1)
                        for j in range(cfg.splits - 1)]
        top = functools.reduce(jnp.maximum, lses)
        top = jnp.where(top == -jnp.inf, 0.0, top)  # rows no split has keys for: (0, -inf)
        weights = [jnp.exp(l - top) for l in lses]
        merged = acc * lax.broadcast_in_dim(weights[0] / safe_l, acc.shape, [0])
        for j in range(cfg.splits - 1):
          o_j = load_tile(recv_o.at[j], plgpu.Layout.WGMMA).astype(jnp.float32)
          merged += o_j * lax.broadcast_in_dim(weights[j + 1], acc.shape, [0])
        # As an unnormalised state (sum, base-2 max, total): store_result divides and logs.
        store_result(merged, top * LOG2E, functools.reduce(jnp.add, weights), qo_smem,
                     out_ref.at[0, head, rows], lse_ref.at[0, head, rows], dtype=dtype)

    pl.when(wg_idx == 0)(functools.partial(consumer, 0))
    pl.when(wg_idx == 1)(functools.partial(consumer, 1))

    @pl.when(wg_idx == 2)
    def _memory_wg():
      plgpu.set_max_registers(REGS[1], action="decrease")

      def issue(i, slot, which: str):
        """Loads local step i into the slot."""
        src_pre, src_suf = (k_ref, sk_ref) if which == "k" else (v_ref, sv_ref)
        smem = (k_smem if which == "k" else v_smem).at[slot]
        bars = (k_barriers, k1_barriers) if which == "k" else (v_barriers, v1_barriers)
        suffix = is_suffix(i, ranges)

        @pl.when(~suffix)
        def _prefix():
          blk = prefix_block(i, ranges)
          plgpu.copy_gmem_to_smem(src_pre.at[pl.ds(blk * block_kv, block_kv), head], smem,
                                  bars[0].at[slot])

        @pl.when(suffix)
        def _suffix():
          for w in (0, 1):  # each warpgroup's sequence into its half of the slot
            seq, _, blk = suffix_coords(i, w)
            plgpu.copy_gmem_to_smem(
                src_suf.at[jnp.minimum(seq, batch - 1), pl.ds(blk * block_s, block_s), head],
                smem.at[pl.ds(w * block_s, block_s)], bars[w].at[slot])

      for i in range(steps_buf):
        @pl.when(i < steps)
        def _first(i=i):
          issue(jnp.int32(i), i, "k")
          issue(jnp.int32(i), i, "v")

      @pl.loop(0, jnp.maximum(steps - steps_buf, 0))
      def _kv_loop(i):
        step = i + steps_buf
        slot = lax.rem(i, jnp.array(steps_buf, i.dtype))
        plgpu.barrier_wait(k_consumed_barriers.at[slot])
        issue(step, slot, "k")
        plgpu.barrier_wait(v_consumed_barriers.at[slot])
        issue(step, slot, "v")

  def entry(len_ref, slen_ref, *refs):
    if cfg.tile_max_in_kernel:
      refs = (None, *refs)
    tmax_ref, q_ref, k_ref, v_ref, sk_ref, sv_ref, out_ref, lse_ref = refs
    compute_wgs = 2
    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    qo_scratch = plgpu.SMEM((compute_wgs, block_q, d), dtype, transforms=(tiling, swizzle))
    k_scratch = plgpu.SMEM((steps_buf, block_kv, d), dtype, transforms=(tiling, swizzle))
    v_scratch = plgpu.SMEM((steps_buf, block_kv, d), dtype, transforms=(tiling, swizzle))
    buffers, extra = [qo_scratch, k_scratch, v_scratch], []
    if clustered:  # receive tiles in the K/V slots' memory; their barrier; the cluster barrier
      peers = cfg.splits - 1
      lse_t = (plgpu.TilingTransform((8, LSE_COLS)), plgpu.SwizzleTransform(4 * LSE_COLS))
      buffers = [qo_scratch, plgpu.RefUnion(
          (k_scratch, v_scratch),
          (plgpu.SMEM((peers, block_q, d), dtype, transforms=(tiling, swizzle)),
           plgpu.SMEM((peers, block_q, LSE_COLS), jnp.float32, transforms=lse_t)))]
      extra = [(plgpu.Barrier(num_arrivals=2 * peers),
                plgpu.ClusterBarrier(collective_axes=("split",), num_arrivals=compute_wgs))]
    pl.run_scoped(
        lambda *args: kernel(len_ref, slen_ref, tmax_ref, q_ref, k_ref, v_ref, sk_ref, sv_ref,
                             out_ref, lse_ref, args),
        buffers,
        (plgpu.Barrier(num_barriers=steps_buf),) * 4 + (plgpu.Barrier(num_barriers=compute_wgs),),
        (plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=steps_buf),) * 2,
        plgpu.Barrier(num_arrivals=compute_wgs),
        *extra,
        collective_axes="wg",
    )

  out_splits = 1 if clustered else cfg.splits
  out_shape = [jax.ShapeDtypeStruct((out_splits, hkv, r, d), dtype),
               jax.ShapeDtypeStruct((out_splits, hkv, r), jnp.float32)]
  length = jnp.reshape(jnp.asarray(kv_length, jnp.int32), (1,))
  lens = jnp.asarray(suffix_lengths, jnp.int32)
  tile_max = () if cfg.tile_max_in_kernel else (
      jnp.pad(lens, (0, tiles * seqs_per_cta - batch)).reshape(tiles, seqs_per_cta).max(1),)
  if clustered:  # the splits of a row tile: one cluster
    mesh = dict(grid=(hkv, r // CTA_ROWS), grid_names=("heads", "q_seq"), cluster=(cfg.splits,),
                cluster_names=("split",))
  else:
    mesh = dict(grid=(hkv, r // CTA_ROWS, cfg.splits), grid_names=("heads", "q_seq", "split"))
  outs = plgpu.kernel(
      entry,
      out_type=out_shape,
      **mesh,
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(length, lens, *tile_max, q_rows, k, v, suffix_k, suffix_v)
  return outs


@functools.partial(jax.jit, static_argnames=("rows_per_seq", "scale", "config"))
def _fused_jit(q_rows, k, v, kv_length, suffix_k, suffix_v, suffix_lengths, *, rows_per_seq,
               scale, config):
  """One stable jitted function: the layers of a model share one lowering and one kernel copy."""
  return fused_rows_mgpu(q_rows, k, v, kv_length, suffix_k, suffix_v, suffix_lengths,
                         rows_per_seq=rows_per_seq, scale=scale, config=config)


def fused_decode(q, k, v, kv_length, suffix_k, suffix_v, suffix_lengths, *, scale: float,
                 config: FusedConfig, merge: MergeConfig):
  """Prefix + suffix attention, merged, for one decode step: ``q [B, 1, Hq, D]``, prefix
  ``k, v [P, Hkv, D]``, suffixes ``[B, S, Hkv, D]`` -> ``out [B, 1, Hq, D]`` (q's dtype) and
  natural-log ``lse [B, 1, Hq]``. Native CUDA only (no interpret mode).

  Key splits not merged inside the kernel (``cluster_merge``) are merged after it: the merge
  kernel with one KV head; with several, XLA fused into the transpose back from the folded rows.
  """
  b, tq, hq, d = q.shape
  hkv = k.shape[1]
  if tq != 1 or hq % hkv:
    raise ValueError(f"fused_decode: q must be [B, 1, Hq, D] with Hq a multiple of Hkv "
                     f"({hkv}); got {q.shape}")
  g = hq // hkv
  r = b * g
  cfg = config
  q_rows = common.fold_rows(q, hkv)
  r_pad = pl.cdiv(r, CTA_ROWS) * CTA_ROWS
  if r_pad != r:
    q_rows = jnp.pad(q_rows, ((0, 0), (0, r_pad - r), (0, 0)))
  length = jnp.reshape(jnp.asarray(kv_length, jnp.int32), (1,))
  outs = _fused_jit(q_rows, k, v, length, suffix_k, suffix_v,
                    jnp.asarray(suffix_lengths, jnp.int32), rows_per_seq=g, scale=float(scale),
                    config=cfg)
  out, lse = outs
  if out.shape[0] > 1:  # exact LSE merge of the key splits (splits without keys: (0, -inf))
    out, lse = merge_parts([(out, lse)], out_dtype=q.dtype, config=merge,
                           transposed_next=hkv > 1, interpret=False)
  else:
    out, lse = out[0], lse[0]
  return common.unfold_rows(out[:, :r], b, 1), common.unfold_rows(lse[:, :r], b, 1)
