"""Shared prefix and per-sequence suffixes in ONE Hopper kernel (Pallas Mosaic GPU).

The split kernels run one after the other: the batched prefix product is
compute-bound (wgmma at ~90% of the measured matmul rate) and the suffix pass
is memory-bound (2.0-2.6 TB/s), so neither hides the other and the sum sits
well above ``max(FLOPs / rate, bytes / bandwidth)``. Here every CTA of
:mod:`pallas_kernels.gpu.prefix_attention_mgpu`'s design (two consumer
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

Paired suffix steps (``FusedConfig.paired_suffix``, ``block_s == block_kv``; off by default,
:data:`PAIRED_SUFFIX`): a suffix step takes two K/V ring positions, each a whole slot of ONE
warpgroup's sequence (warpgroup 0's at the first, warpgroup 1's at the next, :func:`position`),
so each warpgroup takes ``block_kv`` keys of one of its sequences per step: half the steps, the
same products. Each warpgroup waits on and releases the other's slot too (barrier phases,
:func:`paired_waits`).

Key splits (flash-decoding, when the row tiles do not fill the SMs) cut the CTA's
step list -- prefix blocks then suffix steps -- into ranges of equal step counts, or (with
few splits and a long prefix, :func:`spreads`) each take an equal share of the prefix blocks
and of the suffix steps, running the suffix steps as one run among the prefix blocks from a
position that varies over the CTAs, so that the suffix reads (HBM) are spread over the
kernel's run instead of coming in one burst at its end (:func:`step_ranges`); the splits'
partial states are merged by LSE afterwards, or (``FusedConfig.cluster_merge``,
:data:`CLUSTER_MERGE`) inside the kernel: the splits of a row tile are one thread-block cluster,
and once every consumer warpgroup of the cluster is done with its K/V slots (a cluster barrier)
each warpgroup's 64 rows are merged by one CTA of the cluster -- warpgroup w's by split w -- to
which the other splits' warpgroup w push their normalised rows and LSEs
(``plgpu.async_store_smem``: ``st.async`` into the peer CTA's shared memory, completing on its
barrier; the receive tiles alias the K/V slots); it merges them in registers and writes the
final rows. With two splits the two CTAs exchange one tile each and each merges and stores half
the rows.

Transposed suffix steps (``FusedConfig.transposed_suffix``; off by default, measured slower at
most shapes, :data:`TRANSPOSED_SUFFIX`): a suffix step multiplies the sequence's 64 keys (wgmma's M side)
against the ``N = max(16, G)`` query rows of the column group holding it, ``S^T = K Q_g^T``, so
the waste is ``N / G`` instead of ``64 / G``; the softmax runs over the keys axis (a cross-warp
reduction), the probabilities go to shared memory as wgmma's B operand, ``O^T += V^T P^T`` with
the suffix V tiles in a narrower swizzle (a second view of the same V slots, ``plgpu.RefUnion``).
The group's state runs across its sequences' steps and is written out, normalised, at the
group's end (``[splits, Hkv, R / N, D, N]`` in q's dtype, and its LSE); the merge kernel
(:func:`merge_kernel.merge_to_sequences`) merges it with the prefix part and the key splits,
reading both where the kernel wrote them and writing ``[B, 1, Hq, D]``.

The suffix warpgroup (``FusedConfig.suffix_wg``; off by default, :data:`SUFFIX_WG`): a fourth
warpgroup per CTA takes the suffixes while the two consumer warpgroups run only prefix blocks.
Split ``s`` of a row tile holds an equal share of its column groups (:func:`side_range`: with two
splits, one consumer warpgroup's rows each) and, per group, its sequences' ``block_s``-key blocks
up to the longest of the group's sequences (not the tile's): transposed products as above, with
one K and one V slot of its own. At a group's end its normalised ``o^T`` and base-2 LSE go to
shared memory; when the consumers are past their last prefix block they fold them into their
state: a wgmma of a 0/1 placement matrix in registers against the ``o^T`` tile read transposed
puts each group's rows in place, then an exact LSE merge (:func:`fold_suffix`).

Keys and values past ``kv_length`` / ``suffix_lengths[b]`` (inside the buffers)
are multiplied by a zero probability: they must be finite, which the model's
zero-initialised caches guarantee (this is also true of the prefix kernel's
last block).

Reference: :func:`jax_shared_attn.reference.prefix_attention` merged with
:func:`jax_shared_attn.reference.suffix_attention`. LSE is natural log.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu import _common
from pallas_kernels.gpu.merge_kernel import merge_parts, merge_to_sequences
from pallas_kernels.gpu.prefix_attention_mgpu import SMEM_LIMIT, SMEM_RESERVE, store_result

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
CTA_ROWS = 128  # two consumer warpgroups of 64 rows


@dataclasses.dataclass(frozen=True)
class FusedConfig:
  block_q: int = 64  # rows per consumer warpgroup
  block_kv: int = 128  # prefix keys per step
  block_s: int = 64  # suffix keys per step (one sequence)
  max_concurrent_steps: int = 2
  splits: int = 1
  # Suffix steps as transposed products (see :func:`suffix_columns`): keys on the wgmma M side,
  # max(16, G) query rows as N, instead of the warpgroup's 64 rows against the keys.
  transposed_suffix: bool = False
  # Each key split takes an equal share of the prefix blocks and of the suffix steps, its suffix
  # steps starting at a position that varies over the CTAs (see :func:`step_ranges`), instead
  # of the splits at the end of "prefix blocks, then suffix steps" holding every suffix step.
  # default_config decides (:func:`spreads`).
  spread_suffix: bool = False
  # Paired suffix steps (block_s == block_kv): a suffix step takes two K/V slots, each holding
  # block_kv keys of ONE warpgroup's sequence, so each warpgroup multiplies its 64 rows against
  # a whole slot (half as many steps as with the halves of one slot). See :func:`position`.
  paired_suffix: bool = False
  # Each CTA takes the longest suffix of its sequences itself (one load per sequence) instead of
  # reading it from a reduction XLA runs before the kernel (:data:`TILE_MAX_IN_KERNEL`).
  tile_max_in_kernel: bool = False
  # The key splits of a row tile run as one cluster and merge in the kernel (module docstring,
  # :data:`CLUSTER_MERGE`); the output has one split. Needs 2 <= splits <= MAX_CLUSTER_SPLITS.
  cluster_merge: bool = False
  # A fourth warpgroup takes the suffixes (:func:`side_range`): transposed products of each
  # column group of max(16, G) rows against its sequences' own keys, with their own K/V slots,
  # concurrently with the two consumer warpgroups' prefix blocks, which fold its result into
  # their state at the end. The consumers then run no suffix steps. Needs splits >= 2.
  suffix_wg: bool = False
  # Registers per thread (consumer, producer, suffix warpgroup) for experiments; () takes
  # :data:`REGS` (or :data:`SIDE_REGS` with ``suffix_wg``).
  regs: tuple[int, ...] = ()


# The transposed suffix steps pass TestNativeFusedDecodeTransposed on an H100 (2026-11-23) and
# stay off (tools/device/transposed.py; docs/results/2026-11-23-h100-transposed-merge), with the
# suffix part merged in place (merge_to_sequences, 5-8.5 us): paper B=1024 P=16K S=128 131.4 vs
# 125.1 us (the kernel 125.4 vs 121.2: the axis-0 softmax reductions and the P^T stores cost more
# than the saved products). At Llama-3-8B's G = 4 they let the one kernel win the microbenchmark
# where the row tiles fill at most one wave (B=256 P=4K 73.6 vs 90.8, P=16K 145.5 vs 165.9) and tie
# from B=512 on, but lose in the decode loop (batch 512 prompt 2K -4.3% tokens/s, batch 256
# -1.6%): the growing suffixes are read in 64-key blocks.
TRANSPOSED_SUFFIX = False

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

# FusedConfig.paired_suffix as default_config sets it (read when tracing): True pairs wherever
# the suffix capacity is a multiple of block_kv (with :data:`STAGES` K/V slots; experiments).
# Off: with three slots paired steps save 1.1-1.7 us where every suffix fills its 128-key slot
# (paper shape B=1024 S=128, three runs), but lose where the suffixes are half full or less, as
# in the first half of decoding into a 128-key buffer (64 valid keys: P=16K 122.6 vs 118.1 us,
# P=4K 47.1 vs 41.7), and lose with longer suffixes or 8 key splits; with two slots they lose
# everywhere (tools/device/stages.py, 2026-11-24, docs/results/2026-11-24-h100-paired).
PAIRED_SUFFIX = False

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


# Registers per thread: consumer and producer warpgroups (three warpgroups, 384 threads:
# 2 * 232 + 40 <= 512 of the 65,536 a CTA may hold over 128 threads' worth), and with the
# suffix warpgroup (four, 512 threads) consumer, producer and suffix warpgroup. These are the
# setmaxnreg values at run time; ptxas compiles the whole kernel under the launch's cap (168
# registers at 384 threads, no spills; 128 at 512 threads, 228 bytes spilled whatever the
# split: MOSAIC_GPU_DUMP_PTXAS=1 on the H100, 2026-11-24), and the four register splits tried
# with the suffix warpgroup ran within 0.4 us of each other.
REGS = (232, 40)
SIDE_REGS = (216, 24, 56)

# FusedConfig.suffix_wg as default_config sets it (read when tracing; experiments). Off: on the
# H100 (tools/device/side_wg.sh, paper shape, 2026-11-24, three runs, device us shipped / suffix
# warpgroup) it passes TestNativeFusedDecodeSuffixWarpgroup (13 of 13) and is 1.1-1.3 us faster
# at B=1024 P=16K S=128 (122.2 / 121.0, 121.0 / 119.9, 121.3 / 120.0) and B=256 P=16K S=128
# (36.6 / 36.1), but much slower wherever the suffixes are a larger share: B=1024 P=4K S=128
# 45.9 / 75.8, B=256 P=4K 17.1 / 23.9, B=1024 P=16K S=512 153.8 / 266.9. Its units (one 64-key
# block of one group) take ~4.5 us each against the consumers' traffic, so it ends last there.
# Diagnostic builds (docs/results/2026-11-24-h100-suffix-warpgroup) put the suffixes' cost to
# the consumers at the headline as ~4.2 us for the loads alone (no products) and ~4.7 for the
# products alone (no loads), against 109.4 us with every suffix empty: even free products would
# leave 113.6 us, above the 112.9 that 25x needs.
SUFFIX_WG = False


def side_groups(rows_per_seq: int) -> int:
  """Column groups of a row tile that the suffix warpgroup takes (:func:`suffix_columns` rows
  each: the sequences of a group share its transposed products, masked by column)."""
  return CTA_ROWS // suffix_columns(rows_per_seq)


def side_range(split, splits: int, groups: int):
  """The column groups ``[lo, hi)`` of its row tile that split ``split``'s suffix warpgroup
  takes: an equal share each, so that with two splits each CTA's are one consumer's rows."""
  i32 = jnp.int32
  return lax.div(split * groups, i32(splits)), lax.div((split + 1) * groups, i32(splits))


def side_bytes(cfg: "FusedConfig", head_dim: int, rows_per_seq: int, itemsize: int = 2) -> int:
  """Shared memory of the suffix warpgroup: one K and one V slot of ``block_s`` keys, the
  probabilities, its groups' normalised ``o^T`` tiles and the tile's LSEs."""
  n = suffix_columns(rows_per_seq)
  held = pl.cdiv(side_groups(rows_per_seq), cfg.splits)
  return ((2 * cfg.block_s + cfg.block_s * n // head_dim + held * n) * head_dim * itemsize
          + CTA_ROWS * 4)


_LOAD_NEEDS_IDX = (inspect.signature(plgpu.load).parameters["idx"].default
                   is inspect.Parameter.empty)


def load_tile(ref, layout):
  """``plgpu.load`` of a whole shared-memory ref in ``layout`` (jax 0.10 needs the index
  argument, which jax 0.11 deprecates in favour of ``ref.at[...]``)."""
  return plgpu.load(ref, (), layout=layout) if _LOAD_NEEDS_IDX else plgpu.load(ref, layout=layout)


def cluster_recv_bytes(cfg: "FusedConfig", head_dim: int, itemsize: int = 2) -> int:
  """Shared memory a CTA of a cluster receives into (aliasing the K/V slots, :func:`smem_bytes`):
  per other split, one warpgroup's output tile and its LSE tile."""
  return (cfg.splits - 1) * (cfg.block_q * head_dim * itemsize + cfg.block_q * LSE_COLS * 4)


def cluster_merge_fits(cfg: "FusedConfig", head_dim: int, itemsize: int = 2) -> bool:
  """Whether ``cfg`` can merge its key splits in the kernel (:data:`CLUSTER_MERGE`)."""
  kv = cfg.max_concurrent_steps * 2 * cfg.block_kv * head_dim * itemsize
  return (2 <= cfg.splits <= MAX_CLUSTER_SPLITS and not cfg.transposed_suffix
          and cluster_recv_bytes(cfg, head_dim, itemsize) <= kv)


def smem_bytes(cfg: "FusedConfig", head_dim: int, itemsize: int = 2,
               rows_per_seq: int = 8) -> int:
  """Shared memory of the kernel's buffers: the query tiles, ``max_concurrent_steps`` K and V
  slots (and the transposed steps' tiles, or the suffix warpgroup's, :func:`side_bytes`), plus
  :data:`SMEM_RESERVE`."""
  q = 2 * cfg.block_q * head_dim * itemsize
  kv = cfg.max_concurrent_steps * 2 * cfg.block_kv * head_dim * itemsize
  extra = 0
  if cfg.transposed_suffix:  # probabilities, o^T tile and LSE per warpgroup (n_cols <= 64)
    n = cfg.block_q
    extra = 2 * (cfg.block_s * n * itemsize + head_dim * n * itemsize + cfg.block_q * 4)
  if cfg.suffix_wg:
    extra = side_bytes(cfg, head_dim, rows_per_seq, itemsize)
  return q + kv + extra + SMEM_RESERVE


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


def suffix_columns(rows_per_seq: int) -> int:
  """Query rows (N) of a transposed suffix step: the 16-row group (or the sequence's G rows,
  if more) holding the step's sequence. wgmma needs N >= 8, and the probabilities' shared-memory
  tile (keys x N in bf16) must be at least 32 bytes wide for a supported swizzle."""
  return max(16, rows_per_seq)


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
# -1.9%..+2.6% (batch 256-512), the run-to-run spread. With transposed suffix steps
# (TRANSPOSED_SUFFIX) the waste is max(16, G) / G: 4 at G = 4, 2 at G = 8.
MAX_WASTE = 8


def waste(rows_per_seq: int, transposed: bool = False) -> int:
  """Suffix products computed per useful one: 64 / G for row steps, max(16, G) / G transposed."""
  if transposed:
    return suffix_columns(rows_per_seq) // rows_per_seq
  return FusedConfig().block_q // rows_per_seq


def worthwhile(rows_per_seq: int) -> bool:
  """Whether the one kernel is expected to beat the two apart (see :data:`MAX_WASTE`)."""
  return waste(rows_per_seq, TRANSPOSED_SUFFIX) <= MAX_WASTE


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
  cfg = FusedConfig(transposed_suffix=TRANSPOSED_SUFFIX,
                    tile_max_in_kernel=TILE_MAX_IN_KERNEL
                    and 2 * FusedConfig.block_q // rows_per_seq <= MAX_TILE_LOADS)
  if PAIRED_SUFFIX and not cfg.transposed_suffix and capacity % cfg.block_kv == 0:
    cfg = dataclasses.replace(cfg, paired_suffix=True, block_s=cfg.block_kv)
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
  side = dataclasses.replace(cfg, suffix_wg=True, spread_suffix=False, max_concurrent_steps=2)
  if (SUFFIX_WG and side_fits(side, head_dim, rows_per_seq)):
    cfg = side
  return cfg


def side_fits(cfg: FusedConfig, head_dim: int, rows_per_seq: int, itemsize: int = 2) -> bool:
  """Whether ``cfg`` (with ``suffix_wg``) can run: row suffix steps, two or more key splits
  and the suffix warpgroup's buffers within the shared memory."""
  return (not cfg.paired_suffix and not cfg.transposed_suffix and cfg.splits >= 2
          and rows_per_seq <= cfg.block_q
          and smem_bytes(cfg, head_dim, itemsize, rows_per_seq) <= SMEM_LIMIT)


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


def suffix_step(i, r: StepRanges, *, rows_per_seq: int, transposed: bool = False):
  """Local suffix step ``i`` of a warpgroup: its sequence ``j`` among the warpgroup's, the key
  block ``blk``; with ``transposed``, also the column group's first row ``g_first``, the
  sequence's first column ``col0`` in it, and whether the step starts (``start``: the split's
  first suffix step or the group's first) or ends (``end``) the group's state."""
  i32 = jnp.int32
  n_sblk = jnp.maximum(r.n_sblk, 1)
  u = r.s_lo + i - r.o
  j = lax.div(u, n_sblk)
  blk = u - j * n_sblk
  if not transposed:
    return j, blk
  m = rows_per_seq
  n_cols = suffix_columns(m)
  per_group = n_cols // m
  g_first = lax.div(j, i32(per_group)) * n_cols
  col0 = lax.rem(j, i32(per_group)) * m
  start = (i == r.o) | ((col0 == 0) & (blk == 0))
  end = (i == r.o + r.n_s - 1) | ((col0 + m == n_cols) & (blk == n_sblk - 1))
  return j, blk, g_first, col0, start, end


def position(i, r: StepRanges, paired: bool):
  """The K/V ring position of local step ``i``'s (first) slot: ``i``, but with paired suffix
  steps each suffix step before ``i`` takes two positions. Position ``c`` uses slot
  ``c % max_concurrent_steps``, and the producer loads positions in order."""
  if not paired:
    return i
  return i + jnp.clip(i - r.o, 0, r.n_s)


def positions(r: StepRanges, paired: bool):
  """The split's number of ring positions (K/V slot loads)."""
  return r.steps + r.n_s if paired else r.steps


def position_step(c, r: StepRanges):
  """Paired suffix steps: the local step loaded at ring position ``c`` and the warpgroup whose
  keys it holds (0 for a prefix step, read by both), the inverse of :func:`position` (suffix
  step ``i`` holds warpgroup 0's keys at ``position(i)``, warpgroup 1's at the next)."""
  in_suffix = (c >= r.o) & (c < r.o + 2 * r.n_s)
  i = jnp.where(c < r.o, c, jnp.where(in_suffix, r.o + lax.div(c - r.o, 2), c - r.n_s))
  return i, jnp.where(in_suffix, lax.rem(c - r.o, 2), 0)


def paired_waits(w: int, i, r: StepRanges, suffix: bool):
  """Paired suffix steps: the ring positions whose K (and V) barriers warpgroup ``w`` waits on at
  local step ``i``, in order: its own slot's first, then (at a suffix step) the other
  warpgroup's, whose data it does not read (every phase of a barrier must be waited on, see
  :func:`arrivals`)."""
  c = position(i, r, True)
  return (c + w, c + 1 - w) if suffix else (c,)


def fused_rows_mgpu(q_rows, k, v, kv_length, suffix_k, suffix_v, suffix_lengths, *,
                    rows_per_seq: int, scale: float, config: FusedConfig):
  """``q_rows [Hkv, R, D]`` (R a multiple of 128; rows ``b * G + g``, padding past ``B * G``),
  prefix ``k, v [P, Hkv, D]``, ``kv_length`` int32 ``[1]``, suffixes ``[B, S, Hkv, D]``,
  ``suffix_lengths`` int32 ``[B]``.

  Returns ``out [splits, Hkv, R, D]`` in q's dtype and natural-log ``lse [splits, Hkv, R]``
  (one split, merged, with ``cluster_merge``); with transposed suffix steps those are the
  prefix part, followed by the suffix part
  ``[splits, Hkv, R / N, D, N]`` (q's dtype; groups a split never reached are not written,
  their LSE is -inf) and its LSE ``[splits, Hkv, R]``.
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
  paired = cfg.paired_suffix
  if block_q % m or (block_s != block_kv if paired else 2 * block_s != block_kv):
    raise ValueError(f"rows_per_seq ({m}) must divide {block_q}, and block_s ({block_s}) must "
                     f"be block_kv ({block_kv}) with paired suffix steps, half of it otherwise")
  if paired and cfg.transposed_suffix:
    raise ValueError("paired_suffix and transposed_suffix exclude each other")
  clustered = cfg.cluster_merge
  if clustered and not cluster_merge_fits(cfg, d, jnp.dtype(dtype).itemsize):
    raise ValueError(f"cluster_merge needs 2 <= splits <= {MAX_CLUSTER_SPLITS}, row suffix "
                     f"steps and room for the receive tiles in the K/V slots; got {cfg}")
  side = cfg.suffix_wg
  if side and (paired or cfg.transposed_suffix or cfg.splits < 2 or m > block_q):
    raise ValueError(f"suffix_wg needs row suffix steps (not paired or transposed), splits >= 2 "
                     f"and rows_per_seq <= {block_q}; got {cfg}, rows_per_seq={m}")
  regs = cfg.regs or (SIDE_REGS if side else REGS)
  if len(regs) != 3 + side - 1 or 2 * regs[0] + sum(regs[1:]) > 512 or any(n % 8 for n in regs):
    # setmaxnreg.inc waits for registers the other warpgroups give back: over 65,536 it hangs.
    raise ValueError(f"regs {regs}: one per warpgroup kind (consumer, producer"
                     f"{', suffix' if side else ''}), multiples of 8, 2 * consumer + the others "
                     f"<= 512 (65,536 registers over 128-thread warpgroups)")
  seqs_per_wg = block_q // m
  seqs_per_cta = 2 * seqs_per_wg
  prefix_blocks = p // block_kv
  tiles = r // CTA_ROWS  # row tiles per KV head
  steps_buf = cfg.max_concurrent_steps
  qk_scale = scale * LOG2E
  transposed = cfg.transposed_suffix
  n_cols = suffix_columns(m)  # transposed suffix steps: query rows per step (a column group)
  groups = side_groups(m)  # the suffix warpgroup's column groups per row tile
  wg_groups = block_q // n_cols  # of which in one consumer warpgroup's rows
  per_group = n_cols // m  # sequences per column group
  held = pl.cdiv(groups, cfg.splits)  # groups a split's suffix warpgroup takes at most

  def kernel(len_ref, slen_ref, tmax_ref, q_ref, k_ref, v_ref, sk_ref, sv_ref, out_ref, lse_ref,
             *rest):
    if transposed:  # the suffix part's own outputs, merged with the prefix part's afterwards
      osuf_ref, lsuf_ref, scoped = rest
    else:
      (scoped,) = rest
    head = lax.axis_index("heads")
    tile = lax.axis_index("q_seq")
    split = lax.axis_index("split")
    smem_buffers, buffer_barriers, consumed_barriers, schedule_barrier = scoped[:4]
    wg_idx = lax.axis_index("wg")
    if side:  # the suffix warpgroup's buffers and barriers (last)
      (sk_smem, sv_smem, spt_smem, osuf_all, lsuf_all), (sk_bar, sv_bar, side_done) = scoped[-1]
    if clustered:  # the receive tiles alias the K/V slots (used once every step is done)
      qo_smem2, ((k_smem, v_smem), (recv_o, recv_l)) = smem_buffers
      recv_barrier, done_barrier = scoped[4]
    else:
      qo_smem2, k_smem, v_smem = smem_buffers
    if transposed:
      # V slots: prefix tiles in the 128-byte swizzle of the row products, suffix tiles in the
      # narrower swizzle of the transposed product's probabilities (wgmma needs both operands'
      # swizzles equal); a slot holds one or the other (written after its last reader is done).
      v_smem, vs_smem = v_smem
      pt_smem2, osuf_smem2, lsuf_smem2 = scoped[4]
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
    if side:  # the consumers run no suffix steps
      max_len = jnp.int32(0)
    elif tmax_ref is None:
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
      j, blk = suffix_step(i, ranges, rows_per_seq=m)
      return seq0 + w * seqs_per_wg + j, j, blk

    def perform_schedule_barrier():
      plgpu.barrier_arrive(schedule_barrier)
      plgpu.barrier_wait(schedule_barrier)

    def consumer(w: int):
      """Warpgroup w's rows (static w: static halves of the suffix slots)."""
      plgpu.set_max_registers(regs[0], action="increase")
      qo_smem = qo_smem2.at[w]
      q_base = tile * CTA_ROWS + w * block_q
      if transposed:
        pt_smem, osuf_smem, lsuf_smem = pt_smem2.at[w], osuf_smem2.at[w], lsuf_smem2.at[w]
        # Rows of groups this split never reaches: (0, -inf) (their outputs are not written).
        lsuf_smem[...] = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32),
                                           plgpu.Layout.WGMMA.reduce(1))

      bars = dict(k=k_barriers, v=v_barriers, k1=k1_barriers, v1=v1_barriers)

      def wait_on(kind: str, suffix: bool, slot):
        """Waits on the K ("k") or V ("v") barriers of a prefix or suffix step, as :func:`waits`
        says."""
        for name in waits(w, suffix):
          if name[0] == kind:
            plgpu.barrier_wait(bars[name].at[slot])

      def wait_slot(i):
        """The slot whose K barrier step i waits on first: with paired suffix steps, the
        warpgroup's own (:func:`paired_waits`; the other's is waited on later in the step)."""
        c = i
        if paired:
          c = position(i, ranges, True) + jnp.where(is_suffix(i, ranges), w, 0)
        return lax.rem(c, jnp.array(steps_buf, c.dtype))

      def wait_for(kind: str, i, slot):
        """:func:`wait_on` for local step i, whose kind is known only when the kernel runs."""
        if w == 0 or paired:  # paired suffix steps arrive on "k" and "v" only
          wait_on(kind, False, slot)
        else:
          suffix = is_suffix(i, ranges)
          pl.when(~suffix)(lambda: wait_on(kind, False, slot))
          pl.when(suffix)(lambda: wait_on(kind, True, slot))

      wait_k = functools.partial(wait_for, "k")

      plgpu.copy_gmem_to_smem(q_ref.at[head, pl.ds(q_base, block_q)], qo_smem, q_barriers.at[w])
      plgpu.barrier_wait(q_barriers.at[w])
      m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
      l_i = plgpu.layout_cast(jnp.full((block_q,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      acc = plgpu.layout_cast(jnp.full((block_q, d), 0, jnp.float32), plgpu.Layout.WGMMA)

      @pl.when(steps > 0)
      def _():
        wait_k(jnp.int32(0), wait_slot(jnp.int32(0)) if paired else 0)

      if w == 1:
        perform_schedule_barrier()

      def kv_loop(i, carry, kind: str):
        acc, m_i, l_i = carry
        ring = lambda c: lax.rem(c, jnp.array(steps_buf, c.dtype))
        slot = ring(position(i, ranges, paired))
        pair = paired and kind == "suffix"
        if pair:  # a whole slot of the warpgroup's own; the other warpgroup's slot next to it
          c0, c1 = paired_waits(w, i, ranges, True)
          slot, other = ring(c0), ring(c1)
          k_tile, v_tile, n_keys = k_smem.at[slot], v_smem.at[slot], block_kv
        elif kind == "suffix":
          half = pl.ds(w * block_s, block_s)
          k_tile, v_tile, n_keys = k_smem.at[slot, half], v_smem.at[slot, half], block_s
        else:
          k_tile, v_tile, n_keys = k_smem.at[slot], v_smem.at[slot], block_kv

        if kind == "suffix":  # issued before the product: the load's latency hides behind it
          seq, j, blk = suffix_coords(i, w)
          n_valid = jnp.where(seq < batch, slen_ref[jnp.minimum(seq, batch - 1)], 0)

        def compute_qk(acc_ref):
          plgpu.wgmma(acc_ref, qo_smem, k_tile.transpose((1, 0)))
          perform_schedule_barrier()
          return acc_ref[...]

        qk = pl.run_scoped(compute_qk, plgpu.ACC((block_q, n_keys), jnp.float32))
        plgpu.barrier_arrive(k_consumed_barriers.at[slot])
        if pair:  # the other warpgroup's K: waited on (its phase), released, not read
          plgpu.barrier_wait(k_barriers.at[other])
          plgpu.barrier_arrive(k_consumed_barriers.at[other])
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
        if pair:
          if w == 1:  # the other slot comes first: release it before waiting on anything later
            plgpu.barrier_wait(v_barriers.at[other])
            plgpu.barrier_arrive(v_consumed_barriers.at[other])
          plgpu.barrier_wait(v_barriers.at[slot])
        else:
          wait_on("v", kind == "suffix", slot)
        plgpu.barrier_wait(schedule_barrier)  # wait until the tensor cores are free

        def compute_pv(acc_ref):
          plgpu.wgmma(acc_ref, p16, v_tile)
          wait_step = i + 1
          next_slot = wait_slot(wait_step)
          pl.when(wait_step < steps)(lambda: wait_k(wait_step, next_slot))

        acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_consumed_barriers.at[slot])
        if pair and w == 0:  # the other slot comes next: its V lands last, after this product
          plgpu.barrier_wait(v_barriers.at[other])
          plgpu.barrier_arrive(v_consumed_barriers.at[other])
        return acc, m_i, l_i

      def suffix_step_transposed(i, carry):
        """S^T = K Q_g^T for the column group g of n_cols rows holding the step's sequence: keys
        on the M side, so a step computes n_cols / G times the useful products (not 64 / G).
        The group's state (o^T [D, n_cols], m, l over the keys axis) runs across its sequences'
        steps (columns of other sequences are masked) and is written out at the group's end."""
        acc, m_i, l_i, o_t, m_s, l_s = carry
        slot = lax.rem(i, jnp.array(steps_buf, i.dtype))
        half = pl.ds(w * block_s, block_s)
        j, blk, g_first, col0, start, end = suffix_step(i, ranges, rows_per_seq=m,
                                                        transposed=True)
        seq = seq0 + w * seqs_per_wg + j
        n_valid = jnp.where(seq < batch, slen_ref[jnp.minimum(seq, batch - 1)], 0)
        # A new group's state starts here. Arithmetic, not a select: jax 0.11's Mosaic GPU
        # lowering rejects a select of arrays under a scalar predicate ("Implicit broadcast not
        # implemented with warpgroup semantics"). o and l are finite, so * 0 clears them, and
        # m + (-inf) is -inf whatever m holds.
        keep = jnp.where(start, 0.0, 1.0).astype(jnp.float32)
        o_t = o_t * keep
        l_s = l_s * keep
        m_s = m_s + jnp.where(start, -jnp.inf, 0.0).astype(jnp.float32)

        def compute_st(acc_ref):
          plgpu.wgmma(acc_ref, k_smem.at[slot, half],
                      qo_smem.at[pl.ds(g_first, n_cols)].transpose((1, 0)))
          perform_schedule_barrier()
          return acc_ref[...]

        st = pl.run_scoped(compute_st, plgpu.ACC((block_s, n_cols), jnp.float32))
        plgpu.barrier_arrive(k_consumed_barriers.at[slot])
        # The reductions below run over the keys, which wgmma spreads over the 4 warps: Mosaic
        # GPU reduces across warps through one shared-memory scratch area that both consumer
        # warpgroups would use. They are safe because they sit between this step's schedule
        # barrier wait (in compute_st) and its next arrive: every phase of that barrier takes
        # one arrival from each warpgroup, so the two warpgroups' softmax sections strictly
        # alternate. Keep any cross-warp reduction inside that section.
        keys = plgpu.broadcasted_iota(jnp.int32, (block_s, n_cols), 0, layout=plgpu.Layout.WGMMA)
        cols = plgpu.broadcasted_iota(jnp.int32, (block_s, n_cols), 1, layout=plgpu.Layout.WGMMA)
        st = jnp.where(keys + blk * block_s < n_valid, st, -jnp.inf)
        st = jnp.where(cols >= col0, st, -jnp.inf)
        st = jnp.where(cols < col0 + m, st, -jnp.inf)
        m_new = jnp.maximum(m_s, st.max(axis=0) * qk_scale)
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # columns with no visible key yet
        alpha = jnp.exp2(m_s - m_use)
        p_t = jnp.exp2(st * qk_scale - lax.broadcast_in_dim(m_use, st.shape, [1]))
        l_s = l_s * alpha + p_t.sum(axis=0)
        o_t = o_t * lax.broadcast_in_dim(alpha, o_t.shape, [1])
        m_s = m_new
        pt_smem[...] = p_t.astype(dtype)  # wgmma's B operand lives in shared memory
        plgpu.commit_smem()
        acc, m_i, l_i, o_t, m_s, l_s = lax.optimization_barrier((acc, m_i, l_i, o_t, m_s, l_s))
        plgpu.barrier_arrive(schedule_barrier)  # done with the softmax
        wait_on("v", True, slot)
        plgpu.barrier_wait(schedule_barrier)  # wait until the tensor cores are free

        def compute_pv(acc_ref):  # V^T P^T [D, n_cols], added to O^T below
          plgpu.wgmma(acc_ref, vs_smem.at[slot, half].transpose((1, 0)), pt_smem)
          wait_step = i + 1
          next_slot = wait_slot(wait_step)
          pl.when(wait_step < steps)(lambda: wait_k(wait_step, next_slot))
          return acc_ref[...]

        # A zeroed scoped accumulator and an add, not pl.run_state(...)(ACC.init(o_t)): run_state
        # returns its closed-over values, and jax 0.11's Mosaic GPU lowering rejects a constant
        # index among them (the per-warpgroup P^T view) -- "Shaped arrays must be represented by
        # ir.Values, got: TypedInt(0, dtype=int32)". The add is 16 registers a thread.
        o_t = o_t + pl.run_scoped(compute_pv, plgpu.ACC((d, n_cols), jnp.float32))
        plgpu.barrier_arrive(v_consumed_barriers.at[slot])

        @pl.when(end)
        def _write_group():
          has = l_s > 0
          safe = jnp.where(has, l_s, 1.0)
          osuf_smem[...] = (o_t / lax.broadcast_in_dim(safe, o_t.shape, [1])).astype(dtype)
          lsuf_smem.at[pl.ds(g_first, n_cols)][...] = jnp.where(
              has, (m_s + jnp.log(safe) * (1 / LN2)) * LN2, -jnp.inf)
          plgpu.commit_smem()
          group = lax.div(q_base + g_first, jnp.int32(n_cols))
          plgpu.copy_smem_to_gmem(osuf_smem, osuf_ref.at[split, head, group])
          plgpu.wait_smem_to_gmem(0)  # the tile is reused by the next group

        return acc, m_i, l_i, o_t, m_s, l_s

      # The steps in order (StepRanges): unmasked prefix blocks, the suffix steps, the other
      # unmasked prefix blocks, the masked last prefix block.
      prefix = functools.partial(kv_loop, kind="prefix")
      carry = lax.fori_loop(0, o, prefix, (acc, m_i, l_i))
      if transposed:
        cols_layout = plgpu.Layout.WGMMA.reduce(0)
        suffix_carry = (
            plgpu.layout_cast(jnp.full((d, n_cols), 0, jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((n_cols,), -jnp.inf, jnp.float32), cols_layout),
            plgpu.layout_cast(jnp.full((n_cols,), 0, jnp.float32), cols_layout))
        *carry, _, _, _ = lax.fori_loop(o, o + n_s, suffix_step_transposed,
                                        (*carry, *suffix_carry))
        carry = tuple(carry)
      else:
        carry = lax.fori_loop(o, o + n_s, functools.partial(kv_loop, kind="suffix"), carry)
      carry = lax.fori_loop(o + n_s, n_s + n_pf, prefix, carry)
      acc, m_i, l_i = lax.fori_loop(n_s + n_pf, steps,
                                    functools.partial(kv_loop, kind="prefix_last"), carry)
      if w == 0:
        perform_schedule_barrier()
      if side:
        acc, m_i, l_i = fold_suffix(w, acc, m_i, l_i)

      # A split without visible keys gives (0, -inf). The LSE goes from registers (as the prefix
      # kernel's): no staging tile, which lets three K/V slots fit (:func:`smem_bytes`).
      rows = pl.ds(q_base, block_q)
      if clustered:
        merge_in_cluster(w, acc, m_i, l_i, qo_smem, rows)
        return
      suffix_lse = None
      if transposed:  # the suffix part's LSE, staged per warpgroup
        suffix_lse = lambda: plgpu.copy_smem_to_gmem(lsuf_smem, lsuf_ref.at[split, head, rows])
      store_result(acc, m_i, l_i, qo_smem, out_ref.at[split, head, rows],
                   lse_ref.at[split, head, rows], dtype=dtype, extra=suffix_lse)

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

    def seq_length(seq):
      """Valid suffix keys of sequence ``seq`` (0 past the batch), at most the capacity."""
      n = jnp.where(seq < batch, slen_ref[jnp.minimum(seq, batch - 1)], 0)
      return jnp.clip(n, 0, capacity)

    def fold_suffix(w: int, acc, m_i, l_i):
      """Consumer w's rows: the suffix warpgroup's normalised ``o`` and base-2 LSE folded into the
      prefix state (exact LSE merge). Its ``o^T`` tiles come out of shared memory transposed, as
      wgmma's B operand against a 0/1 placement matrix in registers (``E[r, c] = 1`` where row
      ``r`` of the warpgroup is column ``c`` of the held group): each held group lands on its
      rows, the others' rows get 0, and their LSE is -inf (the suffix warpgroup's reset)."""
      g_lo, g_hi = side_range(split, cfg.splits, groups)
      plgpu.barrier_wait(side_done)
      rows = plgpu.broadcasted_iota(jnp.int32, (block_q, n_cols), 0, layout=plgpu.Layout.WGMMA)
      cols = plgpu.broadcasted_iota(jnp.int32, (block_q, n_cols), 1, layout=plgpu.Layout.WGMMA)

      def place(acc_ref):
        for k in range(held):
          g = g_lo + k
          first = (g - w * wg_groups) * n_cols  # the group's first row among the warpgroup's
          hit = (rows == cols + first) & (g < g_hi)
          plgpu.wgmma(acc_ref, jnp.where(hit, 1.0, 0.0).astype(dtype),
                      osuf_all.at[k].transpose((1, 0)))
        return acc_ref[...]

      o_s = pl.run_scoped(place, plgpu.ACC((block_q, d), jnp.float32))
      l_s2 = load_tile(lsuf_all.at[pl.ds(w * block_q, block_q)], plgpu.Layout.WGMMA.reduce(1))
      m_new = jnp.maximum(m_i, l_s2)
      m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp2(m_i - m_use)
      beta = jnp.exp2(l_s2 - m_use)
      acc = (acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
             + o_s * lax.broadcast_in_dim(beta, acc.shape, [0]))
      return acc, m_new, l_i * alpha + beta

    def suffix_wg():
      """The suffix warpgroup: for each column group it holds (:func:`side_range`), each of the
      group's sequences' ``block_s``-key blocks up to the longest of them (blocks past that are
      not loaded), ``S^T = K Q_g^T`` with keys on wgmma's M side, a softmax over the keys (a
      cross-warp reduction; the consumers run none, so Mosaic GPU's scratch area is its own),
      ``O^T += V^T P^T``; at the group's end its normalised ``o^T`` and base-2 LSE go to shared
      memory for the consumers' :func:`fold_suffix`. One K and one V slot: the next unit's K
      loads while this one's softmax and PV product run, its V while the next S^T runs."""
      plgpu.set_max_registers(regs[2], action="decrease")
      i32 = jnp.int32
      g_lo, g_hi = side_range(split, cfg.splits, groups)
      for k in range(held):  # finite o tiles and LSE -inf until a group writes its own
        osuf_all.at[k][...] = plgpu.layout_cast(jnp.full((d, n_cols), 0, dtype),
                                                plgpu.Layout.WGMMA)
      lsuf_all[...] = plgpu.layout_cast(jnp.full((CTA_ROWS,), -jnp.inf, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
      # Units u in [0, total): held group k, its sequence j, key block blk (group-major).
      nbs, cum = [], [i32(0)]
      for k in range(held):
        g = g_lo + k
        longest = functools.reduce(jnp.maximum, [
            seq_length(seq0 + g * per_group + j) for j in range(per_group)])
        nb = jnp.where(g < g_hi, lax.div(longest + (block_s - 1), i32(block_s)), 0)
        nbs.append(nb)
        cum.append(cum[-1] + per_group * nb)
      total = cum[-1]

      def pick(k, values):
        out = values[0]
        for i in range(1, len(values)):
          out = jnp.where(k == i, values[i], out)
        return out

      def locate(u):
        k = functools.reduce(jnp.add, [(u >= cum[i + 1]).astype(i32) for i in range(held - 1)],
                             i32(0))
        nb = jnp.maximum(pick(k, nbs), 1)
        t = u - pick(k, cum[:held])
        j = lax.div(t, nb)
        g = g_lo + k
        return k, g, j, t - j * nb, t == 0, t == per_group * nb - 1

      def issue(u, which: str):
        _, g, j, blk, _, _ = locate(u)
        seq = jnp.minimum(seq0 + g * per_group + j, batch - 1)
        src, dst, bar = (sk_ref, sk_smem, sk_bar) if which == "k" else (sv_ref, sv_smem, sv_bar)
        plgpu.copy_gmem_to_smem(src.at[seq, pl.ds(blk * block_s, block_s), head], dst, bar)

      @pl.when(total > 0)
      def _run():
        issue(i32(0), "k")
        issue(i32(0), "v")
        plgpu.barrier_wait(q_barriers.at[0])
        plgpu.barrier_wait(q_barriers.at[1])

        def unit(u, carry):
          o_t, m_s, l_s = carry
          k, g, j, blk, start, end = locate(u)
          n_valid = seq_length(seq0 + g * per_group + j)
          # A new group's state starts here (arithmetic, not a select: see the transposed steps).
          keep = jnp.where(start, 0.0, 1.0).astype(jnp.float32)
          o_t, l_s = o_t * keep, l_s * keep
          m_s = m_s + jnp.where(start, -jnp.inf, 0.0).astype(jnp.float32)
          q_t = qo_smem2.at[lax.div(g, i32(wg_groups)),
                            pl.ds(lax.rem(g, i32(wg_groups)) * n_cols, n_cols)]
          plgpu.barrier_wait(sk_bar)

          def compute_st(acc_ref):
            plgpu.wgmma(acc_ref, sk_smem, q_t.transpose((1, 0)))
            return acc_ref[...]

          st = pl.run_scoped(compute_st, plgpu.ACC((block_s, n_cols), jnp.float32))
          pl.when(u + 1 < total)(lambda: issue(u + 1, "k"))
          keys = plgpu.broadcasted_iota(jnp.int32, (block_s, n_cols), 0, layout=plgpu.Layout.WGMMA)
          cols = plgpu.broadcasted_iota(jnp.int32, (block_s, n_cols), 1, layout=plgpu.Layout.WGMMA)
          st = jnp.where(keys + blk * block_s < n_valid, st, -jnp.inf)
          st = jnp.where(cols >= j * m, st, -jnp.inf)
          st = jnp.where(cols < j * m + m, st, -jnp.inf)
          m_new = jnp.maximum(m_s, st.max(axis=0) * qk_scale)
          m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # columns with no visible key yet
          alpha = jnp.exp2(m_s - m_use)
          p_t = jnp.exp2(st * qk_scale - lax.broadcast_in_dim(m_use, st.shape, [1]))
          l_s = l_s * alpha + p_t.sum(axis=0)
          o_t = o_t * lax.broadcast_in_dim(alpha, o_t.shape, [1])
          spt_smem[...] = p_t.astype(dtype)  # wgmma's B operand lives in shared memory
          plgpu.commit_smem()
          plgpu.barrier_wait(sv_bar)

          def compute_pv(acc_ref):  # V^T P^T [D, n_cols]
            plgpu.wgmma(acc_ref, sv_smem.transpose((1, 0)), spt_smem)
            return acc_ref[...]

          o_t = o_t + pl.run_scoped(compute_pv, plgpu.ACC((d, n_cols), jnp.float32))
          pl.when(u + 1 < total)(lambda: issue(u + 1, "v"))

          @pl.when(end)
          def _write_group():
            has = l_s > 0
            safe = jnp.where(has, l_s, 1.0)
            osuf_all.at[k][...] = (o_t / lax.broadcast_in_dim(safe, o_t.shape, [1])).astype(dtype)
            lsuf_all.at[pl.ds(g * n_cols, n_cols)][...] = jnp.where(
                has, m_new + jnp.log(safe) * (1 / LN2), -jnp.inf)

          return o_t, m_new, l_s

        cols_layout = plgpu.Layout.WGMMA.reduce(0)
        lax.fori_loop(0, total, unit, (
            plgpu.layout_cast(jnp.full((d, n_cols), 0, jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((n_cols,), -jnp.inf, jnp.float32), cols_layout),
            plgpu.layout_cast(jnp.full((n_cols,), 0, jnp.float32), cols_layout)))

      plgpu.commit_smem()  # the o^T tiles are read by the consumers' wgmma (async proxy)
      plgpu.barrier_arrive(side_done)

    pl.when(wg_idx == 0)(functools.partial(consumer, 0))
    pl.when(wg_idx == 1)(functools.partial(consumer, 1))
    if side:
      pl.when(wg_idx == 3)(suffix_wg)

    @pl.when(wg_idx == 2)
    def _memory_wg():
      plgpu.set_max_registers(regs[1], action="decrease")

      def issue(c, slot, which: str):
        """Loads ring position c (local step c unless paired) into the slot."""
        src_pre, src_suf = (k_ref, sk_ref) if which == "k" else (v_ref, sv_ref)
        smem = (k_smem if which == "k" else v_smem).at[slot]
        suf_smem = vs_smem.at[slot] if transposed and which == "v" else smem
        bars = (k_barriers, k1_barriers) if which == "k" else (v_barriers, v1_barriers)

        i, owner = position_step(c, ranges) if paired else (c, None)
        suffix = is_suffix(i, ranges)

        @pl.when(~suffix)
        def _prefix():
          blk = prefix_block(i, ranges)
          plgpu.copy_gmem_to_smem(src_pre.at[pl.ds(blk * block_kv, block_kv), head], smem,
                                  bars[0].at[slot])

        if paired:
          @pl.when(suffix)
          def _suffix_paired():  # one warpgroup's sequence, block_kv keys: the whole slot
            seq, _, blk = suffix_coords(i, owner)
            plgpu.copy_gmem_to_smem(
                src_suf.at[jnp.minimum(seq, batch - 1), pl.ds(blk * block_s, block_s), head],
                smem, bars[0].at[slot])
          return

        @pl.when(suffix)
        def _suffix():
          for w in (0, 1):  # each warpgroup's sequence into its half of the slot
            seq, _, blk = suffix_coords(i, w)
            plgpu.copy_gmem_to_smem(
                src_suf.at[jnp.minimum(seq, batch - 1), pl.ds(blk * block_s, block_s), head],
                suf_smem.at[pl.ds(w * block_s, block_s)], bars[w].at[slot])

      n_pos = positions(ranges, paired)
      for i in range(steps_buf):
        @pl.when(i < n_pos)
        def _first(i=i):
          issue(jnp.int32(i), i, "k")
          issue(jnp.int32(i), i, "v")

      @pl.loop(0, jnp.maximum(n_pos - steps_buf, 0))
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
    tmax_ref, q_ref, k_ref, v_ref, sk_ref, sv_ref, out_ref, lse_ref, *suffix_out_refs = refs
    compute_wgs = 2
    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    qo_scratch = plgpu.SMEM((compute_wgs, block_q, d), dtype, transforms=(tiling, swizzle))
    k_scratch = plgpu.SMEM((steps_buf, block_kv, d), dtype, transforms=(tiling, swizzle))
    v_scratch = plgpu.SMEM((steps_buf, block_kv, d), dtype, transforms=(tiling, swizzle))
    buffers, extra = [qo_scratch, k_scratch, v_scratch], []
    if transposed:
      narrow = (plgpu.TilingTransform((8, n_cols)), plgpu.SwizzleTransform(2 * n_cols))
      buffers[2] = plgpu.RefUnion(
          v_scratch, plgpu.SMEM((steps_buf, block_kv, d), dtype, transforms=narrow))
      extra = [(plgpu.SMEM((compute_wgs, block_s, n_cols), dtype, transforms=narrow),
                plgpu.SMEM((compute_wgs, d, n_cols), dtype, transforms=narrow),
                plgpu.SMEM((compute_wgs, block_q), jnp.float32))]
    if clustered:  # receive tiles in the K/V slots' memory; their barrier; the cluster barrier
      peers = cfg.splits - 1
      lse_t = (plgpu.TilingTransform((8, LSE_COLS)), plgpu.SwizzleTransform(4 * LSE_COLS))
      buffers = [qo_scratch, plgpu.RefUnion(
          (k_scratch, v_scratch),
          (plgpu.SMEM((peers, block_q, d), dtype, transforms=(tiling, swizzle)),
           plgpu.SMEM((peers, block_q, LSE_COLS), jnp.float32, transforms=lse_t)))]
      extra = [(plgpu.Barrier(num_arrivals=2 * peers),
                plgpu.ClusterBarrier(collective_axes=("split",), num_arrivals=compute_wgs))]
    if side:  # K (128-byte swizzle, against the query tiles) and V, probabilities, o^T tiles
      narrow = (plgpu.TilingTransform((8, n_cols)), plgpu.SwizzleTransform(2 * n_cols))
      extra.append((
          (plgpu.SMEM((block_s, d), dtype, transforms=(tiling, swizzle)),
           plgpu.SMEM((block_s, d), dtype, transforms=narrow),
           plgpu.SMEM((block_s, n_cols), dtype, transforms=narrow),
           plgpu.SMEM((held, d, n_cols), dtype, transforms=narrow),
           plgpu.SMEM((CTA_ROWS,), jnp.float32)),
          (plgpu.Barrier(), plgpu.Barrier(), plgpu.Barrier())))
    pl.run_scoped(
        lambda *args: kernel(len_ref, slen_ref, tmax_ref, q_ref, k_ref, v_ref, sk_ref, sv_ref,
                             out_ref, lse_ref, *suffix_out_refs, args),
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
  if transposed:  # the suffix part: o^T per column group, and its LSE per row
    out_shape += [jax.ShapeDtypeStruct((cfg.splits, hkv, r // n_cols, d, n_cols), dtype),
                  jax.ShapeDtypeStruct((cfg.splits, hkv, r), jnp.float32)]
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
      num_threads=4 if side else 3,
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
                 config: FusedConfig | None = None):
  """Prefix + suffix attention, merged, for one decode step: ``q [B, 1, Hq, D]``, prefix
  ``k, v [P, Hkv, D]``, suffixes ``[B, S, Hkv, D]`` -> ``out [B, 1, Hq, D]`` (q's dtype) and
  natural-log ``lse [B, 1, Hq]``. Native CUDA only (no interpret mode).

  Row suffix steps: the kernel's key splits are merged (the merge kernel with one KV head; with
  several, XLA fused into the transpose back from the folded rows). Transposed suffix steps:
  the prefix part (row tiles) and the suffix part (column groups, ``[.., D, N]``) go straight
  into :func:`merge_to_sequences`, read where the kernel wrote them, and come out in
  ``[B, 1, Hq, D]`` (no transpose, no concatenation).
  """
  b, tq, hq, d = q.shape
  hkv = k.shape[1]
  if tq != 1 or hq % hkv:
    raise ValueError(f"fused_decode: q must be [B, 1, Hq, D] with Hq a multiple of Hkv "
                     f"({hkv}); got {q.shape}")
  g = hq // hkv
  r = b * g
  cfg = config or default_config(r, hkv, k.shape[0], suffix_k.shape[1], g, head_dim=d)
  q_rows = _common.fold_rows(q, hkv)
  r_pad = pl.cdiv(r, CTA_ROWS) * CTA_ROWS
  if r_pad != r:
    q_rows = jnp.pad(q_rows, ((0, 0), (0, r_pad - r), (0, 0)))
  length = jnp.reshape(jnp.asarray(kv_length, jnp.int32), (1,))
  outs = _fused_jit(q_rows, k, v, length, suffix_k, suffix_v,
                    jnp.asarray(suffix_lengths, jnp.int32), rows_per_seq=g, scale=float(scale),
                    config=cfg)
  if cfg.transposed_suffix:
    out, lse, osuf, lsuf = outs
    out, lse = merge_to_sequences(out, lse, (osuf, lsuf), batch=b, rows_per_seq=g,
                                  out_dtype=q.dtype, interpret=False)
    return out.reshape(b, 1, hq, d), lse.reshape(b, 1, hq)
  out, lse = outs
  if out.shape[0] > 1:  # exact LSE merge of the key splits (splits without keys: (0, -inf))
    out, lse = merge_parts([(out, lse)], out_dtype=q.dtype, transposed_next=hkv > 1,
                           interpret=False)
  else:
    out, lse = out[0], lse[0]
  return _common.unfold_rows(out[:, :r], b, 1), _common.unfold_rows(lse[:, :r], b, 1)
