"""The one-kernel decode path's plan: its configuration and dispatch, and which steps each CTA,
key split and warpgroup runs (pure int32 arithmetic on scalars, shared by the Mosaic GPU kernel
in :mod:`pallas_kernels.gpu.shared_mgpu` and the CPU emulations of
``tests/kernels/test_fused_decode_plan.py``, since the kernel itself has no interpret mode).

- :class:`FusedConfig` and :func:`default_config` (key splits, step plan, K/V slots, the split
  merge inside the kernel), chosen with :class:`pallas_kernels.gpu.config.FusedDecodeOptions`
  (docs/configuration.md gives the measurements behind each default).
- :func:`supported`, :func:`worthwhile`: which shapes :mod:`pallas_kernels.gpu.dispatch` sends to
  the kernel.
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

from pallas_kernels.device import DeviceInfo
from pallas_kernels.gpu.config import FusedDecodeOptions
from pallas_kernels.gpu.prefix_mgpu import SMEM_LIMIT, SMEM_RESERVE

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
  # default_config decides (:func:`spreads`, ``FusedDecodeOptions.spread_suffix``).
  spread_suffix: bool = False
  # Each CTA takes the longest suffix of its sequences itself (one load per sequence) instead of
  # reading it from a reduction XLA runs before the kernel.
  tile_max_in_kernel: bool = False
  # The key splits of a row tile run as one cluster and merge in the kernel (see
  # shared_mgpu); the output has one split. Needs 2 <= splits <= MAX_CLUSTER_SPLITS.
  cluster_merge: bool = False


# A CTA takes its sequences' longest suffix itself only while it holds at most this many
# sequences (G >= 8); cluster merges run with exactly CLUSTER_MERGE_SPLITS splits (the kernel
# takes up to MAX_CLUSTER_SPLITS, whose receive tiles fit in the K/V slots).
MAX_TILE_LOADS = 16
CLUSTER_MERGE_SPLITS = 2
MAX_CLUSTER_SPLITS = 4
LSE_COLS = 8  # a peer's LSE travels as a [64, 8] float32 tile (WGMMA layout; wgmma's N >= 8)


def cluster_recv_bytes(cfg: "FusedConfig", head_dim: int, itemsize: int = 2) -> int:
  """Shared memory a CTA of a cluster receives into (aliasing the K/V slots, :func:`smem_bytes`):
  per other split, one warpgroup's output tile and its LSE tile."""
  return (cfg.splits - 1) * (cfg.block_q * head_dim * itemsize + cfg.block_q * LSE_COLS * 4)


def cluster_merge_fits(cfg: "FusedConfig", head_dim: int, itemsize: int = 2) -> bool:
  """Whether ``cfg`` can merge its key splits in the kernel (``cluster_merge``)."""
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
  suffix step in the last split's tail and those CTAs read the suffixes in one burst. Where
  the suffix steps dominate, equal ranges already run them alongside the prefix blocks and are
  faster; with many splits spreading does not help (measurements: docs/gpu-kernels.md).
  """
  return splits <= 2 and prefix_blocks >= 2 * suffix_steps


# In a suffix step each warpgroup multiplies one of its sequences' keys against its 64 rows:
# 64 / G times the useful products. The one kernel runs where that waste is at most this: beyond
# it the kernels apart are faster (docs/configuration.md).
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


def default_config(rows: int, kv_heads: int, prefix: int, capacity: int, rows_per_seq: int, *,
                   device: DeviceInfo, head_dim: int = 128,
                   options: FusedDecodeOptions = FusedDecodeOptions()) -> FusedConfig:
  """Key splits while the row tiles leave ``device.cores`` SMs idle, down to ~4 steps per split (counted over
  prefix blocks and suffix steps); the step plan, K/V slots and split merge as ``options``
  ask, where the shape allows them."""
  cfg = FusedConfig(tile_max_in_kernel=options.tile_max_in_kernel
                    and 2 * FusedConfig.block_q // rows_per_seq <= MAX_TILE_LOADS)
  tiles = pl.cdiv(rows, CTA_ROWS) * kv_heads
  prefix_blocks = prefix // cfg.block_kv
  suffix_steps = (cfg.block_q // rows_per_seq) * pl.cdiv(capacity, cfg.block_s)
  splits = max(1, min(device.cores // tiles, (prefix_blocks + suffix_steps) // 4))
  spread = (spreads(splits, prefix_blocks, suffix_steps) if options.spread_suffix is None
            else options.spread_suffix)
  cfg = dataclasses.replace(cfg, splits=splits, spread_suffix=spread)
  staged = dataclasses.replace(cfg, max_concurrent_steps=options.stages)
  cfg = staged if smem_bytes(staged, head_dim) <= SMEM_LIMIT else cfg
  if options.cluster_merge and cfg.splits == CLUSTER_MERGE_SPLITS and cluster_merge_fits(cfg, head_dim):
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
