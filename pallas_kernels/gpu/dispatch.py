"""Which GPU kernels run a call: pure functions of shapes, dtypes, the family, a
:class:`~pallas_kernels.gpu.config.GpuConfig` and the :class:`~pallas_kernels.device.DeviceInfo`
planned for, the one place the GPU family decides. A :class:`GpuPlan` holds every kernel's
config; the kernels (:mod:`pallas_kernels.gpu.shared`) only execute it.

- :func:`plan_shared`: the whole decomposition (``shared_attention``): the small-batch flat
  kernel, the one-kernel decode path (Hopper), or the shared parts' kernels then the suffix
  kernel ("split"), with every kernel's config.
- :func:`plan_suffix`: attention without a shared part (the suffix kernel alone).
- :func:`plan_paged`: attention over page pools (``paged_attention``): per shared level the
  prefix kernel on the gathered segment or the segment kernel reading pages in place, then the
  suffix kernel reading each sequence's own pages in place.
- :func:`plan_prefix`: a shared prefix's kernel, Mosaic GPU (Hopper) or Triton, and its configs.
- :func:`segment_alignment`, :func:`suffix_alignment`: the buffer multiples that let a cache
  reach the Hopper kernels.

The family is ``"mosaic_gpu"`` (Hopper: the Mosaic GPU kernels where they apply) or
``"triton"``. ``interpret=True`` plans for Pallas interpret mode (Triton only: Mosaic GPU has no
interpret mode).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

from pallas_kernels.device import DeviceInfo
from pallas_kernels.gpu import merge as merge_lib
from pallas_kernels.gpu import prefix_mgpu as mg
from pallas_kernels.gpu import segment as segment_lib
from pallas_kernels.gpu import shared_mgpu_plan as fp
from pallas_kernels.gpu import suffix as suffix_lib
from pallas_kernels.gpu.config import GpuConfig, MosaicPrefixOptions
from pallas_kernels.gpu.merge import MergeConfig
from pallas_kernels.gpu.prefix import PrefixConfig
from pallas_kernels.gpu.prefix import default_config as triton_prefix_config
from pallas_kernels.gpu.suffix import MAX_ROWS, SuffixConfig, flat_config

FAMILIES = ("triton", "mosaic_gpu")
PATHS = ("suffix", "flat", "fused_decode", "split", "paged")


@dataclasses.dataclass(frozen=True)
class PrefixPlan:
  """One shared prefix's kernel: ``kernel`` is "mosaic" (``mosaic`` config; ``triton`` is the
  fallback where the program is not lowered for CUDA, with the same splits), "triton", or
  "empty" (no rows or no keys: nothing runs). ``merge_first``: the splits are merged by the
  merge kernel before the suffix kernel takes them (``GpuConfig.max_fused_prior_splits``)."""

  kernel: str
  triton: Optional[PrefixConfig] = None
  mosaic: Optional[mg.MosaicPrefixConfig] = None
  merge_first: bool = False
  reasons: tuple[str, ...] = ()

  @property
  def splits(self) -> int:
    return 1 if self.kernel == "empty" else self.triton.splits


@dataclasses.dataclass(frozen=True)
class GpuPlan:
  """The GPU family's plan for one call: every kernel that runs and its config.

  Attributes:
    family: "mosaic_gpu" or "triton".
    path: "suffix" (no shared part: the suffix kernel alone), "flat" (one Triton kernel, shared
      then own keys per sequence), "fused_decode" (one Mosaic GPU kernel, prefix and suffixes),
      "split" (the shared parts' kernels, then the suffix kernel merging their states in its
      epilogue), or "paged" (as "split", over page pools: :func:`plan_paged`).
    device: the device planned for (its SM count sizes every grid).
    merge: the merge kernel's config (key splits merged after a kernel).
    flat: the flat kernel's config (path "flat").
    sequence_major: the flat kernel's rows are sequence-major (path "flat").
    fused: the one kernel's config (path "fused_decode").
    fallback: path "fused_decode": the "split" plan that runs where the program is not lowered
      for CUDA (the Triton kernels, interpreted: Mosaic GPU has no interpret mode).
    prefixes: per shared part, its :class:`PrefixPlan`, or None for a tree level of several
      segments (paths "split" and "paged").
    segments: per shared part, the segment kernel's config where it runs, else None (paths
      "split" and "paged").
    suffix: the suffix kernel's config (paths "suffix", "split" and "paged").
    reasons: why, in words.
  """

  family: str
  path: str
  device: DeviceInfo
  merge: MergeConfig
  flat: Optional[SuffixConfig] = None
  sequence_major: bool = False
  fused: Optional[fp.FusedConfig] = None
  fallback: Optional["GpuPlan"] = None
  prefixes: tuple = ()
  segments: tuple = ()
  suffix: Optional[SuffixConfig] = None
  reasons: tuple[str, ...] = ()


def _check_family(family: str) -> None:
  if family not in FAMILIES:
    raise ValueError(f"gpu dispatch: family must be one of {FAMILIES}; got {family!r}")


def plan_prefix(rows: int, kv_heads: int, prefix: int, head_dim: int, dtype, *,
                device: DeviceInfo, kv_itemsize: int = 2, family: str = "triton",
                interpret: Optional[bool] = None,
                options: MosaicPrefixOptions = MosaicPrefixOptions(),
                max_fused_prior_splits: Optional[int] = None) -> PrefixPlan:
  """The kernel and configs for ``rows`` query rows per KV head against ``prefix`` keys."""
  _check_family(family)
  if prefix == 0 or rows == 0:
    return PrefixPlan("empty", reasons=("no query rows or no prefix keys: nothing to run",))
  triton = triton_prefix_config(rows, kv_heads, prefix, head_dim, device=device,
                                itemsize=kv_itemsize)
  reasons = []
  kernel = "triton"
  mosaic = None
  if family == "mosaic_gpu":
    if interpret is True:
      reasons.append("interpret=True: Mosaic GPU has no interpret mode, the Triton kernel runs")
    elif not mg.supported(dtype, head_dim, prefix):
      reasons.append(f"the Mosaic GPU prefix kernel needs bf16/f16, D % 64 == 0 (D <= 256) and "
                     f"P a multiple of {mg.alignment(head_dim)} (got {jnp.dtype(dtype).name}, "
                     f"D={head_dim}, P={prefix}): the Triton kernel runs")
    else:
      kernel = "mosaic"
      mosaic = mg.default_config(rows, kv_heads, prefix, head_dim, device=device,
                                 options=options)
      triton = dataclasses.replace(triton, splits=mosaic.splits)
      reasons.append(f"Mosaic GPU prefix kernel (Hopper): {mosaic}")
  if kernel == "triton":
    reasons.append(f"Triton prefix kernel: {triton}")
  merge_first = max_fused_prior_splits is not None and triton.splits > max_fused_prior_splits
  if merge_first:
    reasons.append(f"{triton.splits} key splits > max_fused_prior_splits="
                   f"{max_fused_prior_splits}: merged by the merge kernel first")
  return PrefixPlan(kernel, triton, mosaic, merge_first, tuple(reasons))


def _shared_reads(batch: int, k) -> int:
  """Bytes of shared K and V read by ``batch`` sequences on the flat path (``k [P, Hkv, D]``)."""
  return 2 * batch * k.shape[0] * k.shape[1] * k.shape[2] * jnp.dtype(k.dtype).itemsize


def _fused_decode_check(q, parts, suffix_k, family, interpret, config) -> Optional[str]:
  """None where the one-kernel decode path applies, else why not."""
  if not config.fused_decode:
    return "GpuConfig.fused_decode is off"
  if family != "mosaic_gpu":
    return "the one-kernel decode path needs the mosaic_gpu family (Hopper)"
  if interpret is True:
    return "interpret=True: Mosaic GPU has no interpret mode"
  if not (len(parts) == 1 and parts[0][0] == "prefix"):
    return "the one-kernel decode path takes one shared prefix"
  b, tq, hq, d = q.shape
  if tq != 1 or b == 0:
    return f"the one-kernel decode path decodes one token per sequence (Tq={tq}, B={b})"
  k = parts[0][1]
  g = hq // k.shape[1]
  if not fp.supported(q.dtype, d, k.shape[0], suffix_k.shape[1], g, fp.FusedConfig()):
    return (f"the one-kernel decode path needs bf16/f16, D in (64, 128), P a multiple of "
            f"{fp.FusedConfig.block_kv}, S a multiple of {fp.FusedConfig.block_s} and G dividing "
            f"{fp.FusedConfig.block_q} (got {jnp.dtype(q.dtype).name}, D={d}, P={k.shape[0]}, "
            f"S={suffix_k.shape[1]}, G={g})")
  if not fp.worthwhile(g):
    return (f"G={g}: the one kernel's suffix steps would compute {fp.waste(g)}x the useful "
            f"products (> MAX_WASTE={fp.MAX_WASTE}); the kernels apart are faster")
  if not jnp.dtype(suffix_k.dtype) == jnp.dtype(q.dtype) == jnp.dtype(k.dtype):
    return "the one-kernel decode path needs q, the prefix and the suffixes in one dtype"
  return None


def _flat_check(q, parts, suffix_k, one_kernel: bool, config: GpuConfig) -> Optional[str]:
  """None where the flat path applies, else why not."""
  if not (len(parts) == 1 and parts[0][0] == "prefix" and q.shape[0] > 0):
    return "the flat path takes one shared prefix"
  b, tq, hq, _ = q.shape
  k = parts[0][1]
  if not (tq * (hq // k.shape[1]) <= MAX_ROWS and k.shape[0] > 0 and suffix_k.shape[1] > 0):
    return (f"the flat path needs Tq * G <= {MAX_ROWS} and non-empty prefix and suffix "
            f"buffers")
  budget = config.flat_max_shared_reads * (1 if one_kernel else config.flat_split_factor)
  reads = _shared_reads(b, k)
  if reads > budget:
    return (f"{b} sequences would read {reads} bytes of shared K/V, over the flat path's budget "
            f"of {budget} (flat_max_shared_reads"
            f"{'' if one_kernel else ' x flat_split_factor'})")
  return None


def _suffix_config(q, suffix_k, device: DeviceInfo) -> SuffixConfig:
  b, tq, hq, d = q.shape
  hkv = suffix_k.shape[2]
  return suffix_lib.default_config(b, hkv, suffix_k.shape[1], d, rows=tq * (hq // hkv),
                                   device=device, itemsize=jnp.dtype(suffix_k.dtype).itemsize)


def plan_suffix(q, suffix_k, *, device: DeviceInfo, family: str = "triton") -> GpuPlan:
  """The plan for attention without a shared part: ``q [B, Tq, Hq, D]`` against ``suffix_k [B,
  S, Hkv, D]``, the suffix kernel alone."""
  _check_family(family)
  suffix = _suffix_config(q, suffix_k, device)
  return GpuPlan(family, "suffix", device, merge_lib.default_config(device), suffix=suffix,
                 reasons=(f"no shared part: the suffix kernel alone: {suffix}",))


def plan_shared(q, parts, suffix_k, *, device: DeviceInfo, family: str = "triton",
                interpret: Optional[bool] = None, config: Optional[GpuConfig] = None) -> GpuPlan:
  """The plan for ``q [B, Tq, Hq, D]``, shared ``parts`` (``(kind, k, v, lengths, nodes)`` as
  ``shared_attention`` takes them) and ``suffix_k [B, S, Hkv, D]``; anything with ``shape`` and
  ``dtype`` (arrays, ``jax.ShapeDtypeStruct``) will do."""
  _check_family(family)
  config = GpuConfig() if config is None else config
  merge = merge_lib.default_config(device)
  b, tq, hq, d = q.shape
  hkv = suffix_k.shape[2]
  not_fused = _fused_decode_check(q, parts, suffix_k, family, interpret, config)
  not_flat = _flat_check(q, parts, suffix_k, not_fused is None, config)
  if not_flat is None:
    k = parts[0][1]
    flat = flat_config(b, hkv, k.shape[0] + suffix_k.shape[1], d, device=device,
                       itemsize=jnp.dtype(suffix_k.dtype).itemsize)
    reads = _shared_reads(b, k)
    return GpuPlan(family, "flat", device, merge, flat=flat,
                   sequence_major=config.flat_sequence_major,
                   reasons=(f"few sequences: their shared K/V reads ({reads} bytes) fit the flat "
                            f"path's budget, one Triton kernel per sequence over shared then own "
                            f"keys: {flat}",
                            "sequence-major rows" if config.flat_sequence_major
                            else "head-major rows"))
  if not_fused is None:
    k = parts[0][1]
    g = hq // k.shape[1]
    fused = fp.default_config(b * g, k.shape[1], k.shape[0], suffix_k.shape[1], g,
                              device=device, head_dim=d, options=config.fused)
    fallback = plan_split(q, parts, suffix_k, device=device, family="triton", interpret=True,
                          config=config, reasons=("not lowered for CUDA: the Triton kernels, "
                                                  "interpreted",))
    return GpuPlan(family, "fused_decode", device, merge, fused=fused, fallback=fallback,
                   reasons=(f"not flat: {not_flat}",
                            f"decoding with one shared prefix at G={g}: prefix and suffixes in "
                            f"one Mosaic GPU kernel: {fused}"))
  return plan_split(q, parts, suffix_k, device=device, family=family, interpret=interpret,
                    config=config,
                    reasons=(f"not flat: {not_flat}", f"not one kernel: {not_fused}"))


def plan_split(q, parts, suffix_k, *, device: DeviceInfo, family: str = "triton",
               interpret: Optional[bool] = None, config: Optional[GpuConfig] = None,
               reasons: tuple[str, ...] = ()) -> GpuPlan:
  """The "split" path's plan: each shared part's kernel, then the suffix kernel."""
  _check_family(family)
  config = GpuConfig() if config is None else config
  b, tq, hq, d = q.shape
  hkv = suffix_k.shape[2]
  m = tq * (hq // hkv)
  prefixes, segments = [], []
  for kind, k, *_ in parts:
    if kind == "prefix" or k.shape[0] == 1:  # one segment: the batched prefix kernel
      keys = k.shape[0] if kind == "prefix" else k.shape[1]
      prefixes.append(plan_prefix(b * m, hkv, keys, d, q.dtype, device=device,
                                  kv_itemsize=jnp.dtype(k.dtype).itemsize, family=family,
                                  interpret=interpret, options=config.prefix,
                                  max_fused_prior_splits=config.max_fused_prior_splits))
      segments.append(None)
    else:
      prefixes.append(None)
      segments.append(segment_lib.default_config(b * m, k.shape[0], d, jnp.dtype(k.dtype).itemsize,
                                                 device=device))
  suffix = _suffix_config(q, suffix_k, device)
  per_part = tuple(f"part {i}: {r}" for i, pp in enumerate(prefixes) if pp is not None
                   for r in pp.reasons)
  per_part += tuple(f"part {i}: a tree level of several segments: the segment kernel: {sc}"
                    for i, sc in enumerate(segments) if sc is not None)
  return GpuPlan(family, "split", device, merge_lib.default_config(device),
                 prefixes=tuple(prefixes), segments=tuple(segments), suffix=suffix,
                 reasons=tuple(reasons) + (
                     "the shared parts' kernels, then the suffix kernel merging their states "
                     f"in its epilogue: {suffix}",) + per_part)


def plan_paged(q, level_tables, k_pages, page_table, *, device: DeviceInfo,
               family: str = "triton", interpret: Optional[bool] = None,
               config: Optional[GpuConfig] = None) -> GpuPlan:
  """The plan for ``q [B, Tq, Hq, D]`` over page pools ``k_pages [pages, page_size, Hkv, D]``,
  the levels' page tables ``[S, P]`` in ``level_tables``, each sequence's own pages
  ``page_table [B, O]``. Per level: one segment (a system prompt) is gathered into a
  contiguous buffer, padded to :func:`segment_alignment`, for the batched prefix kernel
  (:func:`plan_prefix`: key splits, Mosaic GPU on Hopper), one copy of the segment that the
  prefix product's time dwarfs; several segments are read in place by the segment kernel,
  its keys split to fill the machine. Then the suffix kernel reads the own pages in place and
  merges every level's states in its epilogue."""
  _check_family(family)
  config = GpuConfig() if config is None else config
  b, tq, hq, d = q.shape
  page_size, hkv = k_pages.shape[1], k_pages.shape[2]
  m = tq * (hq // hkv)
  itemsize = jnp.dtype(k_pages.dtype).itemsize
  prefixes, segments, reasons = [], [], []
  for i, t in enumerate(level_tables):
    keys = t.shape[1] * page_size
    if t.shape[0] == 1:
      keys += -keys % segment_alignment(family)
      pp = plan_prefix(b * m, hkv, keys, d, q.dtype, device=device, kv_itemsize=itemsize,
                       family=family, interpret=interpret, options=config.prefix,
                       max_fused_prior_splits=config.max_fused_prior_splits)
      prefixes.append(pp)
      segments.append(None)
      reasons.append(f"level {i}: one segment of up to {t.shape[1]} pages, gathered into "
                     f"{keys} contiguous keys for the prefix kernel")
      reasons += [f"level {i}: {r}" for r in pp.reasons]
    else:
      sc = segment_lib.with_key_splits(
          segment_lib.default_config(b * m, t.shape[0], d, itemsize, device=device),
          b * m, t.shape[0], hkv, keys, device=device)
      prefixes.append(None)
      segments.append(sc)
      reasons.append(f"level {i}: {t.shape[0]} segments of up to {t.shape[1]} pages read in "
                     f"place by the segment kernel: {sc}")
  suffix = suffix_lib.default_config(b, hkv, page_table.shape[1] * page_size, d, rows=m,
                                     device=device, itemsize=itemsize)
  reasons.append(f"own pages (up to {page_table.shape[1]} of {page_size} tokens per sequence) "
                 f"read in place by the suffix kernel, the levels merged in its epilogue: "
                 f"{suffix}")
  return GpuPlan(family, "paged", device, merge_lib.default_config(device),
                 prefixes=tuple(prefixes), segments=tuple(segments), suffix=suffix,
                 reasons=tuple(reasons))


def segment_alignment(family: str) -> int:
  """Token multiple shared-segment K/V buffers should be padded to: the Hopper prefix kernel
  streams whole 128-token TMA blocks (any other size runs the Triton kernel: correct, slower)."""
  _check_family(family)
  return 128 if family == "mosaic_gpu" else 1


def suffix_alignment(family: str, rows_per_seq: int = 1,
                     config: Optional[GpuConfig] = None) -> int:
  """Token multiple per-sequence K/V capacities should be padded to: the one-kernel decode path
  streams suffixes in 64-key blocks, where it runs (Hopper, ``rows_per_seq = G`` worthwhile);
  1 elsewhere (padding would only cost memory)."""
  config = GpuConfig() if config is None else config
  if segment_alignment(family) == 1 or not config.fused_decode:
    return 1
  return fp.FusedConfig().block_s if fp.worthwhile(rows_per_seq) else 1
