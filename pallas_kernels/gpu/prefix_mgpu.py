"""Batched prefix attention for Hopper GPUs (Pallas Mosaic GPU: wgmma + TMA).

The same function as :mod:`pallas_kernels.gpu.prefix` (reference:
:func:`pallas_kernels.base.prefix_attention`), written for the H100/H200's
tensor cores the way FlashAttention-3 is: per CTA, two consumer warpgroups
each own ``block_q`` query rows and run ``wgmma`` on K/V tiles that a third,
producer warpgroup streams into shared memory with TMA, ``max_concurrent_steps``
deep; a schedule barrier makes the two consumers alternate between the
tensor cores and the softmax. With ``MosaicPrefixConfig.overlap`` (the default
for 128-key steps at D = 128) a consumer also overlaps its own softmax with its
previous step's ``P V`` product, and the two consumers pass a turn to issue
products instead of meeting at a barrier (FlashAttention-3's intra-warpgroup
overlap and ping-pong). Adapted from JAX's
``pallas/ops/gpu/attention_mgpu.py`` (forward pass) with: the score scale,
the prefix length as a runtime value (blocks past it are never loaded; the
last one is masked), key splits as a grid axis (flash-decoding for small
batches), bf16 as well as f16 scratch buffers, natural-log LSE, and
``(0, -inf)`` for splits without keys.

Constraints (checked by :func:`supported`; otherwise the Triton kernel runs):
bf16/f16, ``D % 64 == 0``, ``P`` a multiple of :func:`alignment` (128; 64 for
D = 256). A step size that does not divide ``P`` reads its last block past the
buffer (TMA fills it with zeros; the length mask drops it). Rows are padded to
whole tiles by the wrapper. The LSE is stored from registers (no shared-memory
staging: that is what lets two 192-key stages fit). There is no interpret mode
for Mosaic GPU: the kernel is lowered in CI with
``jax.export(platforms=["cuda"])`` and checked against the oracle on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.device import DeviceInfo
from pallas_kernels.gpu.config import MosaicPrefixOptions

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class MosaicPrefixConfig:
  block_q: int = 64  # rows per consumer warpgroup (the CTA holds 2 * block_q rows)
  block_kv: int = 128
  max_concurrent_steps: int = 2
  splits: int = 1
  # FlashAttention-3's intra-warpgroup overlap: a consumer issues the scores of step j and the
  # product P_{j-1} V_{j-1} back to back and runs step j's softmax while the latter is on the
  # tensor cores (:func:`_overlapped_consumer`).
  overlap: bool = False


WIDE_BLOCK_KV = 192  # 2 stages of 192-key K and V tiles + q: 224 KiB of the 227 KiB of shared memory
SMEM_LIMIT = 227 * 1024  # bytes of shared memory a Hopper CTA may use
# Barriers and the alignment of the swizzled tiles (both Mosaic GPU kernels): a little more than
# Mosaic GPU counts beyond the tiles of the three-slot one-kernel decode path.
SMEM_RESERVE = 3 * 1024


def smem_bytes(cfg: "MosaicPrefixConfig", head_dim: int, itemsize: int = 2) -> int:
  """Shared memory of the kernel's buffers (query tiles and the K and V slots; the LSE is
  stored from registers), plus the reserve for barriers and alignment."""
  tiles = (2 * cfg.block_q + 2 * cfg.max_concurrent_steps * cfg.block_kv) * head_dim * itemsize
  return tiles + SMEM_RESERVE


def alignment(head_dim: int) -> int:
  """Prefix-buffer multiple the kernel is dispatched for (``ops.segment_alignment``)."""
  return 64 if head_dim > 128 else 128


def supported(dtype, head_dim: int, prefix: int) -> bool:
  """Any step size runs over such a prefix: a last block past the buffer is zero-filled by TMA
  and masked."""
  return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and head_dim % 64 == 0 and head_dim <= 256 and prefix > 0
          and prefix % alignment(head_dim) == 0)


def default_config(rows: int, kv_heads: int, prefix: int, head_dim: int = 128, *,
                   device: DeviceInfo,
                   options: MosaicPrefixOptions = MosaicPrefixOptions()) -> MosaicPrefixConfig:
  """128-row CTAs (2 x 64); key splits while the split CTAs still fit in one wave of
  ``device.cores`` SMs (more splits than that only add partial states: docs/gpu-kernels.md).

  Shared memory holds q (2 x 64 rows) and ``max_concurrent_steps`` K and V
  tiles: with D = 256, 64-key tiles keep it under the 227 KiB of a Hopper SM.
  Long key ranges per split take 192-key steps (``options.wide_min_keys``); 128-key steps at
  D = 128 the intra-warpgroup overlap (``options.overlap``); ``options.stages`` K/V slots where
  they fit (docs/configuration.md gives the measurements).
  """
  cfg = MosaicPrefixConfig(block_kv=64 if head_dim > 128 else 128)
  tiles = pl.cdiv(rows, 2 * cfg.block_q) * kv_heads
  kv_blocks = prefix // cfg.block_kv
  splits = max(1, min(device.cores // tiles, kv_blocks // 4 or 1))
  block_kv = cfg.block_kv
  wide = options.wide_min_keys
  if head_dim <= 128 and wide and prefix // splits >= wide:
    block_kv = WIDE_BLOCK_KV
  cfg = dataclasses.replace(cfg, splits=splits, block_kv=block_kv,
                            overlap=options.overlap and block_kv == 128 and head_dim == 128)
  staged = dataclasses.replace(cfg, max_concurrent_steps=options.stages)
  return staged if smem_bytes(staged, head_dim) <= SMEM_LIMIT else cfg


def empty_state(block_q: int, head_dim: int):
  """A consumer warpgroup's online-softmax state before any key, in registers (wgmma layout):
  ``acc [block_q, D] = 0``, base-2 row max ``m_i = -inf`` and row sum ``l_i = 0``."""
  row = plgpu.Layout.WGMMA.reduce(1)
  m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), row)
  l_i = plgpu.layout_cast(jnp.full((block_q,), 0, jnp.float32), row)
  acc = plgpu.layout_cast(jnp.full((block_q, head_dim), 0, jnp.float32), plgpu.Layout.WGMMA)
  return acc, m_i, l_i


def store_result(acc, m_i, l_i, qo_smem, out_dst, lse_dst, *, dtype):
  """A consumer warpgroup's epilogue (this kernel's and the one-kernel decode path's): ``O / l``
  in ``dtype`` through its query tile in shared memory to ``out_dst`` (TMA), the natural-log LSE
  from registers to ``lse_dst``; rows without keys give ``(0, -inf)``, not 0/0."""
  has = l_i > 0
  safe_l = jnp.where(has, l_i, 1.0)
  acc /= lax.broadcast_in_dim(safe_l, acc.shape, [0])
  qo_smem[...] = acc.astype(dtype)
  lse = jnp.where(has, (m_i + jnp.log(safe_l) * (1 / LN2)) * LN2, -jnp.inf)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(qo_smem, out_dst)
  lse_dst[...] = lse
  plgpu.wait_smem_to_gmem(0)


def prefix_attention_rows_mgpu(q_rows, k, v, kv_length, *, scale: float,
                               config: MosaicPrefixConfig):
  """``q_rows [Hkv, R, D]`` (R a multiple of 2*block_q), ``k, v [P, Hkv, D]``.

  Returns ``out [splits, Hkv, R, D]`` in q's dtype and natural-log float32
  ``lse [splits, Hkv, R]``.
  """
  hkv, r, d = q_rows.shape
  p = k.shape[0]
  dtype = q_rows.dtype
  cfg = config
  block_q, block_kv = cfg.block_q, cfg.block_kv
  if r % (2 * block_q):
    raise ValueError(f"rows ({r}) must be a multiple of 2 * block_q ({2 * block_q})")
  kv_blocks = pl.cdiv(p, block_kv)  # a last block past P is zero-filled by TMA and masked
  blocks_per_split = pl.cdiv(kv_blocks, cfg.splits)
  steps_buf = max(2, min(cfg.max_concurrent_steps, blocks_per_split))
  qk_scale = scale * LOG2E

  def kernel(len_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, scoped):
    head = lax.axis_index("heads")
    split = lax.axis_index("split")
    smem_buffers, buffer_barriers, consumed_barriers, schedule_barrier = scoped
    wg_idx = lax.axis_index("wg")
    qo_smem2, k_smem, v_smem = smem_buffers
    k_barriers, v_barriers, q_barriers = buffer_barriers
    k_consumed_barriers, v_consumed_barriers = consumed_barriers
    kv_len = len_ref[0]
    first_block = split * blocks_per_split
    valid_blocks = lax.div(kv_len + (block_kv - 1), jnp.int32(block_kv))
    end_block = jnp.minimum(first_block + blocks_per_split, valid_blocks)
    kv_steps = jnp.maximum(end_block - first_block, 0)
    # Steps whose keys are all valid need no mask; only the last may be partial.
    full_steps = jnp.clip(jnp.minimum(end_block, lax.div(kv_len, jnp.int32(block_kv)))
                          - first_block, 0, None)

    def perform_schedule_barrier():
      plgpu.barrier_arrive(schedule_barrier)
      plgpu.barrier_wait(schedule_barrier)

    def store(qo_smem, q_base, acc, m_i, l_i):
      rows = pl.ds(q_base, block_q)
      store_result(acc, m_i, l_i, qo_smem, out_ref.at[split, head, rows],
                   lse_ref.at[split, head, rows], dtype=dtype)

    def load_q():
      """A consumer's registers raised and its query tile loaded: (the tile, its first row)."""
      plgpu.set_max_registers(232, action="increase")
      qo_smem = qo_smem2.at[wg_idx]
      tile = lax.axis_index("q_seq")
      q_base = tile * (2 * block_q) + wg_idx * block_q
      plgpu.copy_gmem_to_smem(q_ref.at[head, pl.ds(q_base, block_q)], qo_smem,
                              q_barriers.at[wg_idx])
      plgpu.barrier_wait(q_barriers.at[wg_idx])
      return qo_smem, q_base

    def softmax(qk, m_i, l_i, step, masked: bool):
      """One step's online softmax: the new row max and sum, the old state's scale and the
      probabilities in float32 (a split's first block always holds a valid key)."""
      if masked:
        kv_ids = plgpu.broadcasted_iota(jnp.int32, qk.shape, 1, layout=plgpu.Layout.WGMMA)
        qk = jnp.where(kv_ids + (first_block + step) * block_kv < kv_len, qk, -jnp.inf)
      m_ij = jnp.maximum(m_i, qk.max(axis=1) * qk_scale)
      alpha = jnp.exp2(m_i - m_ij)
      p = jnp.exp2(qk * qk_scale - lax.broadcast_in_dim(m_ij, qk.shape, [0]))
      l_i = l_i * alpha + p.sum(axis=1)
      return m_ij, l_i, alpha, p

    def _overlapped_consumer():
      """FlashAttention-3's intra-warpgroup overlap (and its ping-pong between the two
      consumer warpgroups, as a turn to issue products): step j issues ``S_j = Q K_j^T`` and
      ``O += P_{j-1} V_{j-1}`` back to back, waits for ``S_j`` only, and runs its softmax while
      the product of the previous step's probabilities is on the tensor cores; O is rescaled
      once that is done. Registers: S_j, P_{j-1} and O live at once (64 + 32 + 64 per thread
      at 128 keys)."""
      qo_smem, q_base = load_q()
      ring = lambda c: lax.rem(c, jnp.array(steps_buf, c.dtype))
      # The warpgroups take turns issuing their products (FlashAttention-3's ping-pong as a
      # token: schedule_barrier holds one single-arrival barrier per warpgroup, "your turn"),
      # but their softmaxes may run at the same time. Warpgroup 0 issues first.
      take_turn = lambda: plgpu.barrier_wait(schedule_barrier.at[wg_idx])
      pass_turn = lambda: plgpu.barrier_arrive(schedule_barrier.at[1 - wg_idx])

      @pl.when(kv_steps > 0)
      def _steps():
        plgpu.barrier_wait(k_barriers.at[0])

        def first_scores(s_ref):
          pl.when(wg_idx == 1)(take_turn)
          plgpu.wgmma(s_ref, qo_smem, k_smem.at[0].transpose((1, 0)))
          pass_turn()
          return s_ref[...]

        qk = pl.run_scoped(first_scores, plgpu.ACC((block_q, block_kv), jnp.float32))
        plgpu.barrier_arrive(k_consumed_barriers.at[0])
        m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32),
                                plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((block_q,), 0, jnp.float32),
                                plgpu.Layout.WGMMA.reduce(1))
        m_i, l_i, _, p = softmax(qk, m_i, l_i, 0, masked=True)
        p16 = p.astype(dtype)
        acc = plgpu.layout_cast(jnp.full((block_q, d), 0, jnp.float32), plgpu.Layout.WGMMA)

        def step(j, carry, masked: bool):
          acc, m_i, l_i, p_prev = carry
          slot, prev = ring(j), ring(j - 1)

          def body(o_ref, s_ref):
            o_ref[...] = acc
            plgpu.barrier_wait(k_barriers.at[slot])
            take_turn()
            plgpu.wgmma(s_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
            plgpu.barrier_wait(v_barriers.at[prev])
            plgpu.wgmma(o_ref, p_prev, v_smem.at[prev])
            pass_turn()
            qk = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S_j; P_{j-1} V_{j-1} runs on
            plgpu.barrier_arrive(k_consumed_barriers.at[slot])
            m_n, l_n, alpha, p = softmax(qk, m_i, l_i, j, masked)
            # Computed before the wait below (LLVM may not sink them past it), and converted to
            # q's dtype after it: the product in flight reads P_{j-1} from the registers the
            # loop carries P in (FlashAttention-3 converts after the wait, too).
            m_n, l_n, alpha, p = lax.optimization_barrier((m_n, l_n, alpha, p))
            o = plgpu.wgmma_accumulator_load(o_ref, wait_n=0)
            plgpu.barrier_arrive(v_consumed_barriers.at[prev])
            return o * lax.broadcast_in_dim(alpha, o.shape, [0]), m_n, l_n, p.astype(dtype)

          return pl.run_scoped(body, plgpu.ACC((block_q, d), jnp.float32),
                               plgpu.ACC((block_q, block_kv), jnp.float32))

        carry = (acc, m_i, l_i, p16)
        split_at = jnp.maximum(full_steps, 1)
        carry = lax.fori_loop(1, split_at, functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(split_at, kv_steps, functools.partial(step, masked=True), carry)
        acc, m_i, l_i, p16 = carry
        last = ring(kv_steps - 1)

        def last_product(o_ref):
          o_ref[...] = acc
          plgpu.barrier_wait(v_barriers.at[last])
          take_turn()
          plgpu.wgmma(o_ref, p16, v_smem.at[last])
          pass_turn()  # warpgroup 1's last arrival is never waited on (the kernel ends)
          return o_ref[...]

        acc = pl.run_scoped(last_product, plgpu.ACC((block_q, d), jnp.float32))
        plgpu.barrier_arrive(v_consumed_barriers.at[last])
        store(qo_smem, q_base, acc, m_i, l_i)

      @pl.when(kv_steps == 0)
      def _empty():
        zero = plgpu.layout_cast(jnp.full((block_q, d), 0, jnp.float32), plgpu.Layout.WGMMA)
        store(qo_smem, q_base, zero,
              plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32),
                                plgpu.Layout.WGMMA.reduce(1)),
              plgpu.layout_cast(jnp.full((block_q,), 0, jnp.float32),
                                plgpu.Layout.WGMMA.reduce(1)))

    def _compute_wg():
      qo_smem, q_base = load_q()
      acc, m_i, l_i = empty_state(block_q, d)

      @pl.when(kv_steps > 0)
      def _():
        plgpu.barrier_wait(k_barriers.at[0])

      pl.when(wg_idx == 1)(perform_schedule_barrier)

      def kv_loop(step, carry, masked: bool = False):
        acc, m_i, l_i = carry
        slot = lax.rem(step, jnp.array(steps_buf, step.dtype))

        def compute_qk(acc_ref):
          plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
          perform_schedule_barrier()
          return acc_ref[...]

        qk = pl.run_scoped(compute_qk, plgpu.ACC((block_q, block_kv), jnp.float32))
        plgpu.barrier_arrive(k_consumed_barriers.at[slot])
        if masked:
          kv_ids = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1,
                                          layout=plgpu.Layout.WGMMA)
          key = kv_ids + (first_block + step) * block_kv
          qk = jnp.where(key < kv_len, qk, -jnp.inf)
        m_ij = jnp.maximum(m_i, qk.max(axis=1) * qk_scale)
        alpha = jnp.exp2(m_i - m_ij)
        m_i = m_ij
        p = jnp.exp2(qk * qk_scale - lax.broadcast_in_dim(m_ij, qk.shape, [0]))
        acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
        l_i *= alpha
        p16 = p.astype(dtype)

        def end_softmax_barriers():
          plgpu.barrier_arrive(schedule_barrier)  # done with the softmax
          plgpu.barrier_wait(v_barriers.at[slot])
          plgpu.barrier_wait(schedule_barrier)  # wait until the tensor cores are free

        if d <= 128:
          l_i += p.sum(axis=1)
          acc, l_i, m_i, p16 = lax.optimization_barrier((acc, l_i, m_i, p16))
          end_softmax_barriers()
        else:
          end_softmax_barriers()
          l_i += p.sum(axis=1)

        def compute_pv(acc_ref):
          plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
          wait_step = step + 1
          wait_slot = lax.rem(wait_step, jnp.array(steps_buf, step.dtype))

          @pl.when(wait_step < kv_steps)
          def _wait():
            plgpu.barrier_wait(k_barriers.at[wait_slot])

        acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_consumed_barriers.at[slot])
        return acc, m_i, l_i

      acc, m_i, l_i = lax.fori_loop(0, full_steps, kv_loop, (acc, m_i, l_i))
      acc, m_i, l_i = lax.fori_loop(full_steps, kv_steps, functools.partial(kv_loop, masked=True),
                                    (acc, m_i, l_i))
      pl.when(wg_idx == 0)(perform_schedule_barrier)
      store(qo_smem, q_base, acc, m_i, l_i)

    pl.when(wg_idx < 2)(_overlapped_consumer if cfg.overlap else _compute_wg)

    @pl.when(wg_idx == 2)
    def _memory_wg():
      plgpu.set_max_registers(40, action="decrease")

      def issue(step, slot):
        s = (pl.ds((first_block + step) * block_kv, block_kv), head)
        plgpu.copy_gmem_to_smem(k_ref.at[s], k_smem.at[slot], k_barriers.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[s], v_smem.at[slot], v_barriers.at[slot])

      for i in range(steps_buf):
        pl.when(i < kv_steps)(functools.partial(issue, i, i))

      @pl.loop(0, jnp.maximum(kv_steps - steps_buf, 0))
      def _kv_loop(step):
        tma_step = step + steps_buf
        tma_slot = lax.rem(step, jnp.array(steps_buf, step.dtype))
        s = (pl.ds((first_block + tma_step) * block_kv, block_kv), head)
        plgpu.barrier_wait(k_consumed_barriers.at[tma_slot])
        plgpu.copy_gmem_to_smem(k_ref.at[s], k_smem.at[tma_slot], k_barriers.at[tma_slot])
        plgpu.barrier_wait(v_consumed_barriers.at[tma_slot])
        plgpu.copy_gmem_to_smem(v_ref.at[s], v_smem.at[tma_slot], v_barriers.at[tma_slot])

  def entry(len_ref, q_ref, k_ref, v_ref, out_ref, lse_ref):
    compute_wgs = 2
    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    qo_scratch = plgpu.SMEM((compute_wgs, block_q, d), dtype, transforms=(tiling, swizzle))
    k_scratch = plgpu.SMEM((steps_buf, block_kv, d), dtype, transforms=(tiling, swizzle))
    v_scratch = plgpu.SMEM((steps_buf, block_kv, d), dtype, transforms=(tiling, swizzle))
    pl.run_scoped(
        lambda *args: kernel(len_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, args),
        [qo_scratch, k_scratch, v_scratch],
        (plgpu.Barrier(num_barriers=steps_buf), plgpu.Barrier(num_barriers=steps_buf),
         plgpu.Barrier(num_barriers=compute_wgs)),
        (plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=steps_buf),) * 2,
        # The ping-pong: one barrier both warpgroups meet at, or (overlap) one per warpgroup.
        (plgpu.Barrier(num_barriers=compute_wgs) if cfg.overlap
         else plgpu.Barrier(num_arrivals=compute_wgs)),
        collective_axes="wg",
    )

  out_shape = [jax.ShapeDtypeStruct((cfg.splits, hkv, r, d), dtype),
               jax.ShapeDtypeStruct((cfg.splits, hkv, r), jnp.float32)]
  length = jnp.reshape(jnp.asarray(kv_length, jnp.int32), (1,))
  tiles = r // (2 * block_q)
  outs = plgpu.kernel(
      entry,
      out_type=out_shape,
      grid=(hkv, tiles, cfg.splits),
      grid_names=("heads", "q_seq", "split"),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(length, q_rows, k, v)
  return outs[0], outs[1]
