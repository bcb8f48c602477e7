"""The GPU family's tuning and dispatch choices, as values (frozen, hashable: static under jit).

A :class:`GpuConfig` travels with the call (``shared_prefix_attention(..., config=GpuConfig())``)
into :mod:`pallas_kernels.gpu.dispatch`, which turns it with the shapes into a plan. The
defaults are the tuned choices; docs/configuration.md gives each field's reason and numbers.
This module imports nothing of the kernels, so both the kernels and the core can import it.
"""

from __future__ import annotations

import dataclasses


def _check(ok: bool, message: str) -> None:
  if not ok:
    raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class MosaicPrefixOptions:
  """How the Hopper (Mosaic GPU) prefix kernel's config is chosen (``prefix_mgpu``).

  Attributes:
    wide_min_keys: keys per split from which steps take 192 keys instead of 128 (D <= 128);
      0: never.
    stages: K/V slots in flight for 128-key (or 64-key) steps, where they fit in shared memory
      (otherwise 2).
    overlap: FlashAttention-3's intra-warpgroup overlap for 128-key steps at D = 128.
  """

  wide_min_keys: int = 8192
  stages: int = 2
  overlap: bool = True

  def __post_init__(self):
    _check(isinstance(self.wide_min_keys, int) and self.wide_min_keys >= 0,
           f"MosaicPrefixOptions: {self.wide_min_keys=} must be an int >= 0 (0: never)")
    _check(isinstance(self.stages, int) and self.stages >= 2,
           f"MosaicPrefixOptions: {self.stages=} must be an int >= 2")
    _check(isinstance(self.overlap, bool), f"MosaicPrefixOptions: {self.overlap=} must be a bool")


@dataclasses.dataclass(frozen=True)
class FusedDecodeOptions:
  """How the one-kernel decode path's plan is chosen (``shared_mgpu_plan.default_config``).

  Attributes:
    spread_suffix: each key split takes an equal share of prefix blocks and suffix steps (True)
      or the step list is cut into equal ranges (False); None: ``spreads`` decides.
    stages: K/V slots in flight, where they fit in shared memory (otherwise 2).
    tile_max_in_kernel: each CTA takes its sequences' longest suffix itself (where a CTA holds
      at most ``MAX_TILE_LOADS`` sequences) instead of an XLA reduction before the kernel.
    cluster_merge: with exactly two key splits, merge them inside the kernel (a thread-block
      cluster) instead of the merge kernel after it.
  """

  spread_suffix: bool | None = None
  stages: int = 2
  tile_max_in_kernel: bool = True
  cluster_merge: bool = True

  def __post_init__(self):
    _check(self.spread_suffix is None or isinstance(self.spread_suffix, bool),
           f"FusedDecodeOptions: {self.spread_suffix=} must be None, True or False")
    _check(isinstance(self.stages, int) and self.stages >= 2,
           f"FusedDecodeOptions: {self.stages=} must be an int >= 2")
    for name in ("tile_max_in_kernel", "cluster_merge"):
      _check(isinstance(getattr(self, name), bool),
             f"FusedDecodeOptions: self.{name}={getattr(self, name)!r} must be a bool")


@dataclasses.dataclass(frozen=True)
class GpuConfig:
  """The GPU family's choices (``impl="pallas:triton"`` / ``"pallas:mosaic_gpu"``).

  Attributes:
    fused_decode: on Hopper, decode with one shared prefix in ONE Mosaic GPU kernel (prefix and
      suffixes) where it applies; False runs the prefix and suffix kernels apart.
    flat_max_shared_reads: the small-batch flat path (one Triton kernel over each sequence's
      shared-then-own keys) applies while the shared K/V bytes all sequences read stay within
      this budget where the alternative is the one-kernel decode path; 0 turns it off.
    flat_split_factor: the budget is this many times larger where the alternative is two
      kernels (the prefix and suffix kernels apart).
    flat_sequence_major: the flat path reads q and writes its output sequence-major (in
      decoding ``[B, 1, Hq, D]`` reshaped: no transpose before or after the kernel).
    max_fused_prior_splits: a shared part with more key splits than this is merged by the
      merge kernel before the suffix kernel (whose epilogue merges priors one by one).
    prefix: :class:`MosaicPrefixOptions`.
    fused: :class:`FusedDecodeOptions`.
    backward: what ``jax.grad`` runs for each part: ``"cudnn"`` (cuDNN's flash-attention
      backward from the merged output and LSE, :mod:`pallas_kernels.gpu.cudnn`, on a CUDA GPU
      of compute capability >= 8.0 for the parts it supports; the Triton kernels elsewhere and
      for the rest) or ``"triton"`` (the Triton kernels, :mod:`pallas_kernels.gpu.backward`).
  """

  fused_decode: bool = True
  flat_max_shared_reads: int = 16 * 2**20
  flat_split_factor: int = 4
  flat_sequence_major: bool = True
  max_fused_prior_splits: int = 4
  prefix: MosaicPrefixOptions = MosaicPrefixOptions()
  fused: FusedDecodeOptions = FusedDecodeOptions()
  backward: str = "cudnn"

  def __post_init__(self):
    for name in ("fused_decode", "flat_sequence_major"):
      _check(isinstance(getattr(self, name), bool),
             f"GpuConfig: self.{name}={getattr(self, name)!r} must be a bool")
    _check(isinstance(self.flat_max_shared_reads, int) and self.flat_max_shared_reads >= 0,
           f"GpuConfig: {self.flat_max_shared_reads=} must be an int >= 0 (bytes; 0: off)")
    _check(isinstance(self.flat_split_factor, int) and self.flat_split_factor >= 1,
           f"GpuConfig: {self.flat_split_factor=} must be an int >= 1")
    _check(isinstance(self.max_fused_prior_splits, int) and self.max_fused_prior_splits >= 1,
           f"GpuConfig: {self.max_fused_prior_splits=} must be an int >= 1")
    _check(isinstance(self.prefix, MosaicPrefixOptions),
           f"GpuConfig: {self.prefix=} must be a MosaicPrefixOptions")
    _check(isinstance(self.fused, FusedDecodeOptions),
           f"GpuConfig: {self.fused=} must be a FusedDecodeOptions")
    _check(self.backward in ("cudnn", "triton"),
           f"GpuConfig: {self.backward=} must be 'cudnn' or 'triton'")
