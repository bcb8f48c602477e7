"""The one-kernel decode path's plan: its configuration and dispatch, and which steps each CTA,
key split and warpgroup runs (pure int32 arithmetic on scalars, shared by the Mosaic GPU kernel
in :mod:`pallas_kernels.gpu.shared_attention_mgpu` and the CPU emulations of
``tests/test_fused_decode_plan.py``, since the kernel itself has no interpret mode).

- :class:`FusedConfig` and :func:`default_config` (key splits, step plan, K/V slots, the split
  merge inside the kernel), with the module-level switches it reads when a call is traced (set
  them through the context managers of :mod:`pallas_kernels.gpu`); their comments record the
  H100 measurements behind each default.
- :func:`supported`, :func:`worthwhile`: which shapes the dispatcher sends to the kernel.
- :func:`smem_bytes` and friends: the kernel's shared memory, checked against Mosaic GPU's own
  count in CI.
- :func:`step_ranges` and the step helpers: a CTA's list of prefix blocks and suffix steps, its
  key split's range of it, and the K/V barriers each step arrives on and waits on.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gpu.prefix_attention_mgpu import SMEM_LIMIT, SMEM_RESERVE

CTA_ROWS = 128  # two consumer warpgroups of 64 rows


@dataclasses.dataclass(frozen=True)
class FusedConfig:
  block_q: int = 64  # rows per consumer warpgroup
  block_kv: int = 128  # prefix keys per step
  block_s: int = 64  # suffix keys per step (one sequence)
  max_concurrent_steps: int = 2
  splits: int = 1
  # Each key split takes an equal share of the prefix blocks and of the suffix steps, its suffix
  # steps starting at a position that varies over the CTAs (see :func:`step_ranges`), instead
  # of the splits at the end of "prefix blocks, then suffix steps" holding every suffix step.
  # default_config decides (:func:`spreads`).
  spread_suffix: bool = False
  # Each CTA takes the longest suffix of its sequences itself (one load per sequence) instead of
  # reading it from a reduction XLA runs before the kernel (:data:`TILE_MAX_IN_KERNEL`).
  tile_max_in_kernel: bool = False
  # The key splits of a row tile run as one cluster and merge in the kernel (module docstring,
  # :data:`CLUSTER_MERGE`); the output has one split. Needs 2 <= splits <= MAX_CLUSTER_SPLITS.
  cluster_merge: bool = False


# Transposed suffix steps -- the consumers' suffix steps as S^T = K Q_g^T over column groups of
# max(16, G) rows (the keys on wgmma's M side, N / G times the useful products), their suffix
# part merged with the prefix part afterwards -- passed the native tests on an H100 and stayed
# off (2026-11-23, docs/results/2026-11-23-h100-transposed-merge): paper B=1024 P=16K S=128
# 131.4 vs 125.1 us (the kernel 125.4 vs 121.2: the axis-0 softmax reductions and the P^T stores
# cost more than the saved products). At Llama-3-8B's G = 4 they won the microbenchmark where
# the row tiles fill at most one wave (B=256 P=4K 73.6 vs 90.8 us, P=16K 145.5 vs 165.9) and tied
# from B=512 on, but lost in the decode loop (batch 512 prompt 2K -4.3% tokens/s, batch 256
# -1.6%). Removed on 2026-11-24; the patch that restores them is in that folder.

# Mixed steps -- each suffix step also carrying half a prefix block in 192-key slots, so each
# warpgroup runs one 64 x 128 step of 64 suffix and 64 prefix keys -- passed the native tests
# and ran slower at every point on an H100 (2026-11-24, paper B=1024 P=16K S=128 125.4 vs 122.0
# us, P=4K 52.0 vs 46.5): a mixed step cost a prefix step plus ~1.1 us. Reverted; the patch is in
# docs/results/2026-11-24-h100-mixed-steps.

# TMA multicast -- pairs of row tiles as one cluster, each CTA loading half of every prefix block
# into both -- passed the native tests and did not shorten the kernel on an H100 (2026-11-24,
# paper B=1024 P=16K S=128 120.0 us + the 3.1 us merge kernel vs 121.7 us shipped; B=256 P=4K
# 14.9 vs 14.6 us, both with the merge kernel): the kernel is not short of L2 bandwidth.
# Reverted; the patch, and diagnostic builds that time the parts of a suffix step, are in
# docs/results/2026-11-24-h100-multicast.

# FusedConfig.spread_suffix as default_config sets it (read when tracing): None follows
# :func:`spreads`; True or False forces it (experiments).
SPREAD_SUFFIX: bool | None = None

# K/V slots in flight (FusedConfig.max_concurrent_steps) as default_config sets them, where they
# fit in shared memory (:func:`smem_bytes`; otherwise 2). Read when tracing. Three fit at D = 128
# since the LSE is stored from registers, pass TestNativeFusedDecodeThreeStages on an H100, and
# change nothing (tools/device/stages.py, 2026-11-24, docs/results/2026-11-24-h100-stages; paper
# shape, device us, two / three slots: B=1024 P=16K S=128 123.3 / 123.6, S=512 158.3 / 157.4,
# P=4K S=128 48.3 / 48.3, B=256 P=4K S=128 17.1 / 17.4): the suffix steps' HBM reads do not wait
# on the pipeline's depth.
STAGES = 2

# Paired suffix steps -- each warpgroup taking a whole 128-key slot of one of its sequences per
# suffix step, half the steps for the same products -- passed the native tests on an H100 and
# stayed off (2026-11-24, docs/results/2026-11-24-h100-paired): with three K/V slots they saved
# 1.1-1.7 us where every suffix fills its 128-key slot (paper shape B=1024 S=128) but lost where
# the suffixes are half full or less, as in decoding (64 valid keys: P=16K 122.6 vs 118.1 us, P=4K
# 47.1 vs 41.7), with longer suffixes, with 8 key splits, and everywhere with two slots. Removed
# on 2026-11-24 (later); the patch that restores them is in that folder.

# FusedConfig.tile_max_in_kernel as default_config sets it (read when tracing), where a CTA holds
# at most MAX_TILE_LOADS sequences (G >= 8); TestNativeFusedDecodeXlaTileMax covers the off case.
# Alone it measured neutral (tools/device/stages.py --ragged, 2026-11-24, paper shape, two runs,
# device us default / in the kernel: B=1024 P=16K S=128 123.7 / 123.0 and 123.2 / 124.3, P=4K 48.9
# / 49.3 and 49.5 / 48.3, S=512 158.9 / 157.0 and 158.6 / 157.1): XLA still clamps the lengths in a
# fusion of its own. With the split merge in the kernel (CLUSTER_MERGE) it was faster at every
# point (the kernel alone 0.3-1.1 us, and one XLA fusion less with full suffixes), so it is on;
# docs/results/2026-11-24-h100-cluster-merge.
TILE_MAX_IN_KERNEL = True
MAX_TILE_LOADS = 16

# FusedConfig.cluster_merge as default_config sets it (read when tracing): with exactly two key
# splits (each row tile's two CTAs one cluster). The kernel takes 2 <= splits <=
# MAX_CLUSTER_SPLITS (the receive tiles of 3 peers fit in the K/V slots,
# :func:`cluster_recv_bytes`; TestNativeFusedDecodeMergeKernel passes with 2, 3 and 4), but four
# splits ran 2x slower on the H100 (paper B=512 P=4K S=128 54.6 vs 28.0 us, P=16K 130.2 vs 66.1):
# 32 clusters of 4 whole-SM CTAs did not fit at once on the GPCs, and the last ran as a second
# wave. Two splits, against the merge kernel after the kernel (tools/device/stages.py, paper
# shape, 2026-11-24, with TILE_MAX_IN_KERNEL, device us shipped before / cluster merge): B=1024
# P=16K S=128 123.2 / 122.4, P=4K 48.9 / 46.4, ragged suffixes P=16K S=128 124.8 / 124.1, P=4K
# 49.0 / 47.5, S=512 159.3 / 156.9 (docs/results/2026-11-24-h100-cluster-merge). The kernel
# itself is 1.3-3.4 us longer (0.8 of it the cluster launch alone) than without the exchange;
# the merge kernel it replaces took 3.1.
CLUSTER_MERGE = True
CLUSTER_MERGE_SPLITS = 2
MAX_CLUSTER_SPLITS = 4
LSE_COLS = 8  # a peer's LSE travels as a [64, 8] float32 tile (WGMMA layout; wgmma's N >= 8)



# The suffix warpgroup -- a fourth warpgroup per CTA running the suffixes as transposed products
# (column groups of max(16, G) rows, one K and one V slot of its own) while the consumers ran only
# prefix blocks and folded its result into their state at the end -- passed the native tests on
# an H100 (13 of 13) and stayed off (2026-11-24, docs/results/2026-11-24-h100-suffix-warpgroup;
# paper shape, device us shipped / suffix warpgroup): 1.1-1.3 us faster at B=1024 P=16K S=128
# (three runs, e.g. 121.3 / 120.0) with full suffixes, within 0.5 us with half-full ones as in
# decoding, and much slower wherever the suffixes weigh more (B=1024 P=4K S=128 45.9 / 75.8,
# B=1024 P=16K S=512 153.8 / 266.9). Its diagnostic builds put the suffixes' cost to the
# consumers at the headline at ~4.2 us for the loads alone and ~4.7 for the products alone,
# against 109.4 us with every suffix empty. Removed on 2026-11-24 (latest); the patch that restores it is
# in that folder.


def cluster_recv_bytes(cfg: "FusedConfig", head_dim: int, itemsize: int = 2) -> int:
  """Shared memory a CTA of a cluster receives into (aliasing the K/V slots, :func:`smem_bytes`):
  per other split, one warpgroup's output tile and its LSE tile."""
  return (cfg.splits - 1) * (cfg.block_q * head_dim * itemsize + cfg.block_q * LSE_COLS * 4)


def cluster_merge_fits(cfg: "FusedConfig", head_dim: int, itemsize: int = 2) -> bool:
  """Whether ``cfg`` can merge its key splits in the kernel (:data:`CLUSTER_MERGE`)."""
  kv = cfg.max_concurrent_steps * 2 * cfg.block_kv * head_dim * itemsize
  return (2 <= cfg.splits <= MAX_CLUSTER_SPLITS
          and cluster_recv_bytes(cfg, head_dim, itemsize) <= kv)


def smem_bytes(cfg: "FusedConfig", head_dim: int, itemsize: int = 2) -> int:
  """Shared memory of the kernel's buffers: the query tiles and ``max_concurrent_steps`` K and V
  slots, plus :data:`SMEM_RESERVE`."""
  q = 2 * cfg.block_q * head_dim * itemsize
  kv = cfg.max_concurrent_steps * 2 * cfg.block_kv * head_dim * itemsize
  return q + kv + SMEM_RESERVE


def spreads(splits: int, prefix_blocks: int, suffix_steps: int) -> bool:
  """Whether the key splits spread their suffix steps (:func:`step_ranges`): with at most 2
  splits and at least twice as many prefix blocks as suffix steps, where equal ranges put every
  suffix step in the last split's tail and those CTAs read the suffixes in one burst.

  Measured on an H100 (tools/device/spread_suffix.py, paper shape, one process per row, 2026-11-23,
  docs/results/2026-11-23-h100-spread-suffix; device us, spread / equal ranges): B=1024 P=16K
  S=128 124.1 / 125.9, S=512 159.3 / 167.5 (2 splits, 128 prefix blocks against 16 and 64 suffix
  steps); B=1024 P=4K S=128 49.4 / 49.4. Slower where the suffix steps dominate, which equal
  ranges already run alongside the prefix blocks (B=1024 P=4K S=512 114.2 / 103.5, P=1K S=128
  38.0 / 35.5, S=512 104.0 / 101.2), and no better with 8 splits (B=256 P=16K S=128 36.7 / 36.5,
  P=4K S=128 17.4 / 17.2, P=4K S=512 37.9 / 34.4).
  """
  return splits <= 2 and prefix_blocks >= 2 * suffix_steps


# In a suffix step each warpgroup multiplies one of its sequences' keys against its 64 rows:
# 64 / G times the useful FLOPs, and every sequence's K/V is read in whole 64-key TMA blocks
# (up to 63 keys past its length). Measured on an H100 (2026-11-23): at G = 8 (8x) the one
# kernel beat the two apart in every paper-shape configuration (B=1024, P=16K, S=128: 125.8 vs
# 142.1 us). At G = 4 (16x, Llama-3-8B) it won the microbenchmark with full suffixes (B=1024,
# P=1K, S=128: 224 vs 246 us) but lost in decoding, where the suffixes grow a token per step:
# batch 1024 / prompt 2K ran 0.78 of the no-attention ceiling against 0.80 apart (attention
# 10.5 vs 8.6 ms per step; with 130-token suffixes the 64-key blocks read 192 keys per
# sequence, where the Triton suffix kernel's masked 32-key steps read 130). Reading the suffixes
# in 16-key chunks of several sequences, and interleaving prefix and suffix steps, did not change
# that on average (docs/results/2026-11-23-h100-chunks-rejected). Long shared prompts do not
# change it either (docs/results/2026-11-23-h100-g4-one-kernel): at G = 4 the one kernel wins
# every full-suffix microbenchmark row (B=256 P=16K S=512: 227 vs 293 us) but decodes batch 1024
# with 128 new tokens 2.6-2.8% slower at prompts 4K-16K, and with 512 new tokens is within
# -1.9%..+2.6% (batch 256-512), the run-to-run spread.
MAX_WASTE = 8


def waste(rows_per_seq: int) -> int:
  """Suffix products computed per useful one: 64 / G."""
  return FusedConfig().block_q // rows_per_seq


def worthwhile(rows_per_seq: int) -> bool:
  """Whether the one kernel is expected to beat the two apart (see :data:`MAX_WASTE`)."""
  return waste(rows_per_seq) <= MAX_WASTE


def supported(dtype, head_dim: int, prefix: int, capacity: int, rows_per_seq: int,
              cfg: FusedConfig) -> bool:
  """Shapes the fused kernel takes (otherwise the prefix and suffix kernels run apart)."""
  return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and head_dim in (64, 128) and prefix > 0 and prefix % cfg.block_kv == 0
          and capacity > 0 and capacity % cfg.block_s == 0
          and 0 < rows_per_seq <= cfg.block_q and cfg.block_q % rows_per_seq == 0)


def default_config(rows: int, kv_heads: int, prefix: int, capacity: int, rows_per_seq: int,
                   num_sms: int = 132, head_dim: int = 128) -> FusedConfig:
  """Key splits while the row tiles leave SMs idle, down to ~4 steps per split.

  Measured on an H100 (tools/device/fused.sh, 2026-11-23): splits from the prefix blocks alone
  ran paper-shape B=16, P=1024 at 31 us (40 steps over 2 CTAs); counted over all steps, 12.7.
  """
  cfg = FusedConfig(tile_max_in_kernel=TILE_MAX_IN_KERNEL
                    and 2 * FusedConfig.block_q // rows_per_seq <= MAX_TILE_LOADS)
  tiles = pl.cdiv(rows, CTA_ROWS) * kv_heads
  prefix_blocks = prefix // cfg.block_kv
  suffix_steps = (cfg.block_q // rows_per_seq) * pl.cdiv(capacity, cfg.block_s)
  splits = max(1, min(num_sms // tiles, (prefix_blocks + suffix_steps) // 4))
  spread = (spreads(splits, prefix_blocks, suffix_steps) if SPREAD_SUFFIX is None
            else SPREAD_SUFFIX)
  cfg = dataclasses.replace(cfg, splits=splits, spread_suffix=spread)
  staged = dataclasses.replace(cfg, max_concurrent_steps=STAGES)
  cfg = staged if smem_bytes(staged, head_dim) <= SMEM_LIMIT else cfg
  if CLUSTER_MERGE and cfg.splits == CLUSTER_MERGE_SPLITS and cluster_merge_fits(cfg, head_dim):
    cfg = dataclasses.replace(cfg, cluster_merge=True)
  return cfg


@dataclasses.dataclass(frozen=True)
class StepRanges:
  """One CTA split's steps (int32 scalars, traced in the kernel). Local steps ``[0, steps)``:
  ``[0, o)`` prefix blocks ``p_lo, p_lo + 1, ...`` (unmasked), ``[o, o + n_s)`` suffix steps
  ``s_lo, s_lo + 1, ...`` (of ``seqs_per_wg * n_sblk``: sequence-major, ``n_sblk`` key blocks
  each), ``[o + n_s, n_s + n_pf)`` the split's other unmasked prefix blocks, and
  ``[n_s + n_pf, steps)`` its last prefix block when the prefix ends inside it (masked; 0 or 1
  step). See :func:`step_ranges`."""
  n_pre: jax.Array  # the prefix's valid blocks (all splits)
  n_sblk: jax.Array  # key blocks per sequence (the CTA's longest suffix)
  p_lo: jax.Array
  n_p: jax.Array  # prefix blocks of this split
  n_pf: jax.Array  # of which unmasked
  s_lo: jax.Array
  n_s: jax.Array  # suffix steps of this split
  o: jax.Array  # where the suffix steps start among the split's steps
  steps: jax.Array


def step_ranges(kv_len, max_len, split, cta=0, *, prefix_blocks: int, block_kv: int,
                block_s: int, seqs_per_wg: int, splits: int, spread: bool = False,
                ctas: int = 1) -> StepRanges:
  """The kernel's steps for one CTA and split (``kv_len``: valid prefix keys, at most the
  buffer; ``max_len``: the CTA's longest suffix, at most the capacity). Pure int32 arithmetic,
  shared by the kernel and the CPU emulation in the tests.

  By default the list "prefix blocks, then suffix steps" is cut into ``splits`` ranges of
  equal step counts: the splits at its end hold every suffix step. With ``spread`` every split
  takes an equal share of the prefix blocks AND of the suffix steps, and its suffix steps start
  at a position that varies over the ``ctas`` CTAs of a KV head (``cta`` in ``[0, ctas)``), so
  that at any time only some CTAs read suffix bytes from HBM while the others run prefix blocks
  from L2 (:func:`spreads` says when the kernel does this).
  """
  i32 = jnp.int32
  n_pre = jnp.minimum(lax.div(kv_len + (block_kv - 1), i32(block_kv)), prefix_blocks)
  full_pre = jnp.minimum(lax.div(kv_len, i32(block_kv)), n_pre)
  n_sblk = lax.div(max_len + (block_s - 1), i32(block_s))
  n_suf = seqs_per_wg * n_sblk
  if spread:
    p_lo = lax.div(split * n_pre, i32(splits))
    n_p = lax.div((split + 1) * n_pre, i32(splits)) - p_lo
    s_lo = lax.div(split * n_suf, i32(splits))
    n_s = lax.div((split + 1) * n_suf, i32(splits)) - s_lo
    n_pf = jnp.clip(full_pre - p_lo, 0, n_p)
    o = lax.div(lax.rem(cta, i32(ctas)) * (n_pf + 1), i32(ctas))  # spread over [0, n_pf]
  else:
    n_total = n_pre + n_suf
    per_split = lax.div(n_total + (splits - 1), i32(splits))
    lo = split * per_split
    steps = jnp.clip(n_total - lo, 0, per_split)
    p_lo = jnp.minimum(lo, n_pre)
    n_p = jnp.clip(n_pre - lo, 0, steps)
    n_pf = jnp.clip(full_pre - lo, 0, n_p)
    s_lo = jnp.maximum(lo - n_pre, 0)
    n_s = steps - n_p
    o = n_pf
  return StepRanges(n_pre, n_sblk, p_lo, n_p, n_pf, s_lo, n_s, o, n_p + n_s)


def is_suffix(i, r: StepRanges):
  """Whether local step ``i`` is a suffix step."""
  return (i >= r.o) & (i < r.o + r.n_s)


def prefix_block(i, r: StepRanges):
  """The prefix block of local step ``i`` (a prefix step)."""
  return r.p_lo + jnp.where(i < r.o, i, i - r.n_s)


# The K/V slot barriers. The producer's copies complete ("arrive on") "k" and "v" for a prefix
# step, and for a suffix step "k" and "v" (warpgroup 0's half of the slot) and "k1" and "v1"
# (warpgroup 1's half). Mosaic GPU tracks a barrier's phase in each waiting thread, flipping it
# at every wait, so a warpgroup that waits on a barrier at all must wait on every phase of it
# up to its last wait: warpgroup 1 waits on "k" and "v" at suffix steps too (for data it does
# not read), because prefix steps may follow them.
def arrivals(suffix: bool) -> tuple[str, ...]:
  """The barriers the producer's copies of one step arrive on."""
  return ("k", "v", "k1", "v1") if suffix else ("k", "v")


def waits(w: int, suffix: bool) -> tuple[str, ...]:
  """The barriers consumer warpgroup ``w`` waits on at one step (of the K ones and of the V
  ones, the last is the one its own data comes with)."""
  if w == 0 or not suffix:
    return ("k", "v")
  return ("k", "k1", "v", "v1")


def suffix_step(i, r: StepRanges):
  """Local suffix step ``i`` of a warpgroup: its sequence ``j`` among the warpgroup's and the
  key block ``blk``."""
  n_sblk = jnp.maximum(r.n_sblk, 1)
  u = r.s_lo + i - r.o
  j = lax.div(u, n_sblk)
  return j, u - j * n_sblk
