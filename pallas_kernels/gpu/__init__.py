"""GPU kernel family (Pallas): Triton kernels for any CUDA GPU, Mosaic GPU on Hopper.

``prefix_attention``   batched prefix attention, rows = B * Tq * G per KV head
                       on the tensor cores (Triton ``tl.dot``, or on Hopper a
                       wgmma/TMA Mosaic GPU kernel), key splits for small batches.
``suffix_attention``   ragged per-sequence attention (flash-decoding splits for
                       small batches) that merges the shared parts in-kernel.
``segment_attention``  a tree level: rows grouped by segment in tiles.
``shared_attention``   the whole decomposition in the folded row layout: the
                       shared parts' partial states (every key split, every
                       tree level) go straight into the suffix kernel's
                       epilogue, which writes the final output once. On
                       Hopper, decoding with one shared prefix runs prefix and
                       suffixes in ONE Mosaic GPU kernel instead
                       (``shared_attention_mgpu``: the suffix bytes stream
                       while the tensor cores run the prefix product).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from jax_shared_attn.ops import AttentionOps
from pallas_kernels.gpu import _common
from pallas_kernels.gpu.merge_kernel import merge_parts
from pallas_kernels.gpu.prefix_attention import prefix_attention, prefix_attention_rows
from pallas_kernels.gpu.segment_attention import segment_attention, segment_rows
from pallas_kernels.gpu.suffix_attention import MAX_ROWS as _MAX_ROWS
from pallas_kernels.gpu.suffix_attention import flat_rows, suffix_attention, suffix_rows


# A prior with more key splits than this is merged first (the merge kernel: one parallel pass
# over its splits); the suffix kernel's epilogue merges priors one after another, which at 32
# splits (few rows, a long prefix) cost 45 us on an H100 against ~1 us for one parallel pass.
MAX_FUSED_PRIOR_SPLITS = 4


# Decoding with one shared prefix on Hopper runs prefix and suffixes in one Mosaic GPU kernel
# (shared_attention_mgpu); False keeps them apart (benchmark comparisons). Read when tracing.
FUSED_DECODE = True


@contextlib.contextmanager
def _setting(name: str, value, module=None):
  """Temporarily sets the module-level switch ``name`` of ``module`` (this one by default;
  read when tracing)."""
  space = globals() if module is None else vars(module)
  before = space[name]
  space[name] = value
  try:
    yield
  finally:
    space[name] = before


def fused_decode(enabled: bool):
  """Temporarily turns the one-kernel decode path on or off (for calls traced inside)."""
  return _setting("FUSED_DECODE", bool(enabled))


def spread_suffix(enabled: bool | None):
  """Temporarily sets ``shared_attention_plan.SPREAD_SUFFIX``: the one-kernel path's key splits
  each take an equal share of prefix blocks and suffix steps, the suffix steps' position
  varying over the CTAs (True), or cut "prefix blocks, then suffix steps" into equal ranges
  (False); None: as ``shared_attention_plan.spreads`` decides (the default). For calls traced
  inside."""
  from pallas_kernels.gpu import shared_attention_plan as fp
  return _setting("SPREAD_SUFFIX", None if enabled is None else bool(enabled), fp)


# Few sequences with one shared prefix: ONE Triton kernel of per-sequence key splits over the
# shared keys followed by each sequence's own (suffix_attention.flat_rows), instead of a prefix
# kernel, a suffix kernel and their launch latencies. Every sequence reads the shared K/V (from
# L2 at these sizes), so the path applies while those reads, batch x prefix K/V bytes, stay at
# most this many bytes where the alternative is the one-kernel decode path (Hopper, G >= 8), and
# FLAT_SPLIT_FACTOR times as many where it is two kernels; 0 turns it off. Read when tracing.
# Measured on an H100 (tools/device/flat_tune.py, 2026-11-23), device us, flat vs the other path:
# paper shape (G = 8, one kernel) 8 MiB (B=16, P=1K) 8.3 vs 12.7; 16 MiB (B=32, P=1K) 9.5 vs
# 13.1; 32 MiB (B=16, P=4K) 13.9 vs 13.1 and (B=64, P=1K) 15.0 vs 13.7. Llama-3-8B shape (G = 4,
# two kernels) 64 MiB (B=16, P=1K) 21.5 vs 25.3 (python -m jax_shared_attn.bench attention).
FLAT_MAX_SHARED_READS = 16 * 2**20
FLAT_SPLIT_FACTOR = 4


# The flat path with sequence-major rows in and out (flat_rows(by_sequence=True)): in decoding q
# and the output are [B, 1, Hq, D] reshaped, so with several KV heads neither the query fold nor
# the transpose back runs, and the split merge is the merge kernel instead of XLA's merge fused
# into that transpose. Measured on an H100 (tools/device/flat_tune.py, Llama-3-8B shape,
# 2026-11-23, docs/results/2026-11-23-h100-switches): never slower than the head-major layout
# at 14 points (B 1-32, P 1K/4K, S 128/512), 0-1.5 us faster (B=16 P=1K S=128: 20.3 vs 21.6 us);
# with one KV head both layouts are the same bytes. Read when tracing.
FLAT_SEQUENCE_MAJOR = True


def flat_sequence_major(enabled: bool):
  """Temporarily sets :data:`FLAT_SEQUENCE_MAJOR`, for calls traced inside."""
  return _setting("FLAT_SEQUENCE_MAJOR", bool(enabled))


def flat_decode(max_shared_reads: int):
  """Temporarily sets :data:`FLAT_MAX_SHARED_READS` (bytes; 0: off), for calls traced inside."""
  return _setting("FLAT_MAX_SHARED_READS", int(max_shared_reads))


def wide_prefix_steps(min_keys: int):
  """Temporarily sets ``prefix_attention_mgpu.WIDE_MIN_KEYS``: the keys per split from which the
  Mosaic GPU prefix kernel takes 192-key steps (0: always 128), for calls traced inside."""
  from pallas_kernels.gpu import prefix_attention_mgpu as mg
  return _setting("WIDE_MIN_KEYS", int(min_keys), mg)


def prefix_overlap(enabled: bool):
  """Temporarily sets ``prefix_attention_mgpu.OVERLAP``: the Mosaic GPU prefix kernel's 128-key
  steps at D = 128 with FlashAttention-3's intra-warpgroup overlap (the default) or without,
  for calls traced inside."""
  from pallas_kernels.gpu import prefix_attention_mgpu as mg
  return _setting("OVERLAP", bool(enabled), mg)


def tile_max_in_kernel(enabled: bool):
  """Temporarily sets ``shared_attention_plan.TILE_MAX_IN_KERNEL``: the one-kernel decode path
  takes each row tile's longest suffix itself instead of XLA's reduction before it (the
  default), for calls traced inside."""
  from pallas_kernels.gpu import shared_attention_plan as fp
  return _setting("TILE_MAX_IN_KERNEL", bool(enabled), fp)


def cluster_merge(enabled: bool):
  """Temporarily sets ``shared_attention_plan.CLUSTER_MERGE``: the one-kernel decode path merges
  its key splits inside the kernel (each row tile's splits one thread-block cluster, the others
  pushing their rows into the CTA that merges them) instead of the merge kernel after it (the
  default with two splits), for calls traced inside."""
  from pallas_kernels.gpu import shared_attention_plan as fp
  return _setting("CLUSTER_MERGE", bool(enabled), fp)


def kv_stages(fused: int | None = None, prefix: int | None = None):
  """Temporarily sets the K/V slots in flight of the one-kernel decode path
  (``shared_attention_plan.STAGES``) and of the Mosaic GPU prefix kernel's 128-key steps
  (``prefix_attention_mgpu.STAGES``), where they fit in shared memory; None leaves one as it
  is. For calls traced inside."""
  from pallas_kernels.gpu import prefix_attention_mgpu as mg
  from pallas_kernels.gpu import shared_attention_plan as fp
  stack = contextlib.ExitStack()
  if fused is not None:
    stack.enter_context(_setting("STAGES", int(fused), fp))
  if prefix is not None:
    stack.enter_context(_setting("STAGES", int(prefix), mg))
  return stack


def flat_shared_reads(batch: int, k) -> int:
  """Bytes of shared K and V read by ``batch`` sequences on the flat path (``k [P, Hkv, D]``)."""
  return 2 * batch * k.size * k.dtype.itemsize


def flat_applies(q, parts, suffix_k, mosaic=False, interpret=None) -> bool:
  """One shared prefix, at most 64 query rows per sequence and KV head, non-empty prefix and
  suffix buffers, and shared K/V reads within the budget (see :data:`FLAT_MAX_SHARED_READS`)."""
  if not (len(parts) == 1 and parts[0][0] == "prefix" and q.shape[0] > 0):
    return False
  b, tq, hq, _ = q.shape
  k = parts[0][1]
  if not (tq * (hq // k.shape[1]) <= _MAX_ROWS and k.shape[0] > 0 and suffix_k.shape[1] > 0):
    return False
  one_kernel = _fused_decode_applies(q, parts, suffix_k, mosaic, interpret)
  budget = FLAT_MAX_SHARED_READS * (1 if one_kernel else FLAT_SPLIT_FACTOR)
  return flat_shared_reads(b, k) <= budget


def _fused_decode_applies(q, parts, suffix_k, mosaic, interpret) -> bool:
  from pallas_kernels.gpu import shared_attention_plan as fp
  if not (FUSED_DECODE and mosaic and interpret is not True and len(parts) == 1
          and parts[0][0] == "prefix" and q.shape[1] == 1 and q.shape[0] > 0):
    return False
  b, _, hq, d = q.shape
  k = parts[0][1]
  hkv = k.shape[1]
  return (fp.supported(q.dtype, d, k.shape[0], suffix_k.shape[1], hq // hkv, fp.FusedConfig())
          and fp.worthwhile(hq // hkv) and suffix_k.dtype == q.dtype == k.dtype)


def shared_attention(q, parts, suffix_k, suffix_v, *, kv_lengths, causal, scale, mosaic=False,
                     interpret=None):
  """Shared parts + suffix, fused (see :class:`jax_shared_attn.ops.AttentionOps`).

  Returns ``out [B, Tq, Hq, D]`` in q's dtype and natural-log ``lse [B, Tq, Hq]``.
  """
  if flat_applies(q, parts, suffix_k, mosaic, interpret):
    _, k, v, length, _ = parts[0]
    b, tq, hq, d = q.shape
    hkv = k.shape[1]
    run = functools.partial(flat_rows, shared_k=k, shared_v=v, shared_length=length, k=suffix_k,
                            v=suffix_v, lengths=kv_lengths, q_len=tq, causal=causal, scale=scale,
                            out_dtype=q.dtype, interpret=interpret)
    if FLAT_SEQUENCE_MAJOR:  # in decoding [B, 1, Hq, D] reshaped, in and out
      out, lse = run(_common.seq_rows(q, hkv), by_sequence=True)
      return _common.unfold_seq_rows(out, tq), _common.unfold_seq_rows(lse, tq)
    m = tq * (hq // hkv)
    out, lse = run(_common.fold_rows(q, hkv).reshape(hkv, b, m, d))
    return (_common.unfold_rows(out.reshape(hkv, b * m, -1), b, tq),
            _common.unfold_rows(lse.reshape(hkv, b * m), b, tq))
  if _fused_decode_applies(q, parts, suffix_k, mosaic, interpret):
    from pallas_kernels.gpu import shared_attention_mgpu as fm
    _, k, v, length, _ = parts[0]
    b, tq, hq, _ = q.shape
    hkv = k.shape[1]

    def native(q, k, v, length, sk, sv, lens):
      return fm.fused_decode(q, k, v, length, sk, sv, lens, scale=scale)

    def elsewhere(q, k, v, length, sk, sv, lens):  # no Mosaic interpret mode: Triton, interpreted
      return _split_shared_attention(q, [("prefix", k, v, length, None)], sk, sv, kv_lengths=lens,
                                     causal=causal, scale=scale, mosaic=False, interpret=True)

    return jax.lax.platform_dependent(q, k, v, jnp.asarray(length, jnp.int32), suffix_k, suffix_v,
                                      jnp.asarray(kv_lengths, jnp.int32), cuda=native,
                                      default=elsewhere)
  return _split_shared_attention(q, parts, suffix_k, suffix_v, kv_lengths=kv_lengths,
                                 causal=causal, scale=scale, mosaic=mosaic, interpret=interpret)


def _split_shared_attention(q, parts, suffix_k, suffix_v, *, kv_lengths, causal, scale, mosaic,
                            interpret):
  """The shared parts' kernels, then the suffix kernel merging their states in its epilogue."""
  b, tq, hq, d = q.shape
  hkv = suffix_k.shape[2]
  m = tq * (hq // hkv)
  q_rows = _common.fold_rows(q, hkv)  # [Hkv, B * M, D]; a reshape when Hkv == 1
  priors = []
  for kind, k, v, lengths, nodes in parts:
    if kind == "prefix":
      out, lse = prefix_attention_rows(q_rows, k, v, kv_length=lengths, scale=scale,
                                       mosaic=mosaic, interpret=interpret)
    elif k.shape[0] == 1:  # one segment: the batched prefix kernel; rows without it drop out
      out, lse = prefix_attention_rows(q_rows, k[0], v[0], kv_length=lengths[0], scale=scale,
                                       mosaic=mosaic, interpret=interpret)
      mine = jnp.repeat(nodes == 0, m)  # [B * M]
      lse = jnp.where(mine[None, None, :], lse, -jnp.inf)
    else:
      out, lse = segment_rows(q_rows, k, v, rows_per_seq=m, lengths=lengths, node_of_seq=nodes,
                              scale=scale, interpret=interpret)
      out, lse = out[None], lse[None]
    if out.shape[0] > MAX_FUSED_PRIOR_SPLITS:
      out, lse = merge_parts([(out, lse)], out_dtype=jnp.float32, interpret=interpret)
      out, lse = out[None], lse[None]  # float32: no extra rounding
    priors.append((out.reshape(out.shape[0], hkv, b, m, d), lse.reshape(lse.shape[0], hkv, b, m)))
  # Sequence-major output: in decoding the kernel writes [B, 1, Hq, D] itself (no transpose).
  out, lse = suffix_rows(q_rows.reshape(hkv, b, m, d), suffix_k, suffix_v, kv_lengths, priors,
                         q_len=tq, causal=causal, scale=scale, out_dtype=q.dtype,
                         by_sequence=True, interpret=interpret)
  return _common.unfold_seq_rows(out, tq), _common.unfold_seq_rows(lse, tq)


def get_ops(interpret: bool | None = None, mosaic: bool = False) -> AttentionOps:
  """The GPU family; ``mosaic`` uses the Hopper prefix kernel where it applies.

  ``interpret=None`` picks native vs interpret mode when lowering.
  """
  name = "pallas:mosaic_gpu" if mosaic else "pallas:triton"
  return AttentionOps(
      name,
      functools.partial(prefix_attention, mosaic=mosaic, interpret=interpret),
      functools.partial(segment_attention, interpret=interpret),
      functools.partial(suffix_attention, interpret=interpret),
      functools.partial(shared_attention, mosaic=mosaic, interpret=interpret),
  )
