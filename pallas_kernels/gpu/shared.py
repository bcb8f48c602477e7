"""The GPU family's entry points, which run a plan of :mod:`pallas_kernels.gpu.dispatch`: the
three primitives and the whole decomposition (shared parts + suffix, fused).

``shared_attention`` runs the shared parts' partial states (every key split, every tree level)
straight into the suffix kernel's epilogue, which writes the final output once; or, as the plan
says, the small-batch flat kernel, or on Hopper the one-kernel decode path
(:mod:`pallas_kernels.gpu.shared_mgpu`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.base import ScoreMods, gather_pages, part_offsets
from pallas_kernels.device import DeviceInfo
from pallas_kernels.gpu import common, dispatch
from pallas_kernels.gpu.config import GpuConfig
from pallas_kernels.gpu.merge import default_config as merge_config
from pallas_kernels.gpu.merge import merge_parts
from pallas_kernels.gpu.prefix import prefix_attention_rows
from pallas_kernels.gpu.segment import default_config as segment_default_config
from pallas_kernels.gpu.segment import segment_attention as segment_kernel
from pallas_kernels.gpu.segment import segment_rows
from pallas_kernels.gpu.suffix import flat_rows, suffix_rows
from pallas_kernels.gpu.suffix import suffix_attention as suffix_kernel


def prefix_attention(
    q: jax.Array,  # [B, Tq, Hq, D]
    k: jax.Array,  # [P, Hkv, D]
    v: jax.Array,  # [P, Hkv, D]
    *,
    kv_length: jax.Array,
    scale: float,
    device: DeviceInfo,
    mosaic: bool = False,
    config: GpuConfig = GpuConfig(),
    interpret: bool | None = None,
    mods: ScoreMods | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Same signature and result as the reference: float32 out ``[B, Tq, Hq, D]``, lse
  ``[B, Tq, Hq]``; planned for ``device`` (:func:`pallas_kernels.gpu.dispatch.plan_prefix`).
  ``mods``: score variants with the prefix's offset; they run on the Triton kernel."""
  b, t, hq, d = q.shape
  hkv = k.shape[1]
  q_rows = common.fold_rows(q, hkv)
  plan = dispatch.plan_prefix(q_rows.shape[1], hkv, k.shape[0], d, q.dtype, device=device,
                              kv_itemsize=k.dtype.itemsize,
                              family="mosaic_gpu" if mosaic and mods is None else "triton",
                              interpret=interpret, options=config.prefix)
  rows = None if mods is None else common.row_mods(mods, b, t, hq, hkv, offset=mods.offset)
  out, lse = prefix_attention_rows(q_rows, k, v, kv_length=kv_length, scale=scale, plan=plan,
                                   interpret=interpret, mods=rows)
  out, lse = merge_parts([(out, lse)], out_dtype=jnp.float32, config=merge_config(device),
                         transposed_next=hkv > 1, interpret=interpret)
  return common.unfold_rows(out, b, t), common.unfold_rows(lse, b, t)


def segment_attention(q, k, v, *, lengths, node_of_seq, scale, device: DeviceInfo,
                      interpret=None, mods: ScoreMods | None = None):
  """Same signature and result as the reference; the segment kernel's config for ``device``."""
  hkv = k.shape[2]
  rows = q.shape[0] * q.shape[1] * (q.shape[2] // hkv)
  cfg = segment_default_config(rows, k.shape[0], q.shape[3], k.dtype.itemsize, device=device)
  return segment_kernel(q, k, v, lengths=lengths, node_of_seq=node_of_seq, scale=scale,
                        config=cfg, interpret=interpret, mods=mods)


def suffix_attention(q, k, v, *, kv_lengths, causal, scale, prior=None, device: DeviceInfo,
                     plan: dispatch.GpuPlan | None = None, interpret=None,
                     mods: ScoreMods | None = None):
  """Same signature and result as the reference; runs ``plan`` (path "suffix") where given,
  else the plan for these shapes on ``device``."""
  if plan is None:
    plan = dispatch.plan_suffix(q, k, device=device)
  return suffix_kernel(q, k, v, kv_lengths=kv_lengths, causal=causal, scale=scale, prior=prior,
                       config=plan.suffix, merge=plan.merge, interpret=interpret, mods=mods)


def shared_attention(q, parts, suffix_k, suffix_v, *, kv_lengths, causal, scale,
                     device: DeviceInfo, mosaic=False, config: GpuConfig = GpuConfig(),
                     plan: dispatch.GpuPlan | None = None, interpret=None,
                     mods: ScoreMods | None = None):
  """Shared parts + suffix, fused (see :class:`pallas_kernels.base.AttentionOps`): runs ``plan``
  where given, else the plan for these shapes on ``device``. ``mods``: score variants (the
  Triton kernels apply them; a plan with variants is planned for the "triton" family).

  Returns ``out [B, Tq, Hq, D]`` in q's dtype and natural-log ``lse [B, Tq, Hq]``.
  """
  if plan is None:
    plan = dispatch.plan_shared(q, parts, suffix_k, device=device,
                                family="mosaic_gpu" if mosaic and mods is None else "triton",
                                interpret=interpret, config=config)
  return run_plan(plan, q, parts, suffix_k, suffix_v, kv_lengths=kv_lengths, causal=causal,
                  scale=scale, interpret=interpret, mods=mods)


def run_plan(plan: dispatch.GpuPlan, q, parts, suffix_k, suffix_v, *, kv_lengths, causal, scale,
             interpret=None, mods: ScoreMods | None = None):
  """Executes ``plan`` (:func:`pallas_kernels.gpu.dispatch.plan_shared` of these inputs) with
  the score variants ``mods`` (None: none)."""
  if mods is not None and plan.path == "fused_decode":
    raise ValueError(f"gpu run_plan: the one-kernel decode path takes no score variants "
                     f"({', '.join(mods.arguments())}); plan the triton family")
  if plan.path == "flat":
    _, k, v, length, _ = parts[0]
    b, tq, hq, d = q.shape
    hkv = k.shape[1]
    run = functools.partial(flat_rows, shared_k=k, shared_v=v, shared_length=length, k=suffix_k,
                            v=suffix_v, lengths=kv_lengths, q_len=tq, causal=causal, scale=scale,
                            out_dtype=q.dtype, config=plan.flat, merge=plan.merge,
                            interpret=interpret, mods=common.row_mods(mods, b, tq, hq, hkv))
    if plan.sequence_major:  # in decoding [B, 1, Hq, D] reshaped, in and out
      out, lse = run(common.seq_rows(q, hkv), by_sequence=True)
      return common.unfold_seq_rows(out, tq), common.unfold_seq_rows(lse, tq)
    m = tq * (hq // hkv)
    out, lse = run(common.fold_rows(q, hkv).reshape(hkv, b, m, d))
    return (common.unfold_rows(out.reshape(hkv, b * m, -1), b, tq),
            common.unfold_rows(lse.reshape(hkv, b * m), b, tq))
  if plan.path == "fused_decode":
    from pallas_kernels.gpu import shared_mgpu as fm
    _, k, v, length, _ = parts[0]

    def native(q, k, v, length, sk, sv, lens):
      return fm.fused_decode(q, k, v, length, sk, sv, lens, scale=scale, config=plan.fused,
                             merge=plan.merge)

    def elsewhere(q, k, v, length, sk, sv, lens):  # no Mosaic interpret mode
      return run_plan(plan.fallback, q, [("prefix", k, v, length, None)], sk, sv,
                      kv_lengths=lens, causal=causal, scale=scale, interpret=True)

    return jax.lax.platform_dependent(q, k, v, jnp.asarray(length, jnp.int32), suffix_k, suffix_v,
                                      jnp.asarray(kv_lengths, jnp.int32), cuda=native,
                                      default=elsewhere)
  if plan.path == "suffix":
    if parts:
      raise ValueError("gpu run_plan: a 'suffix' plan takes no shared parts")
    return suffix_kernel(q, suffix_k, suffix_v, kv_lengths=kv_lengths, causal=causal,
                         scale=scale, config=plan.suffix, merge=plan.merge, interpret=interpret,
                         mods=mods)
  return _split(plan, q, parts, suffix_k, suffix_v, kv_lengths=kv_lengths, causal=causal,
                scale=scale, interpret=interpret, mods=mods)


def paged_attention(q, k_pages, v_pages, levels, page_table, kv_lengths, *, causal, scale,
                    plan: dispatch.GpuPlan | None = None, device: DeviceInfo | None = None,
                    interpret=None, mods: ScoreMods | None = None):
  """Attention over page pools (see :func:`pallas_kernels.base.paged_attention`): runs ``plan``
  (path "paged", :func:`pallas_kernels.gpu.dispatch.plan_paged`) where given, else the plan for
  these shapes on ``device``. A level of one segment has its pages gathered (one copy of the
  segment) for the batched prefix kernel; a level of several segments is read in place by the
  segment kernel; every sequence's own pages are read in place by the suffix kernel. ``mods``:
  score variants (the Triton kernels apply them). Returns ``out [B, Tq, Hq, D]`` in q's dtype and natural-log ``lse [B, Tq, Hq]``."""
  if plan is None:
    plan = dispatch.plan_paged(q, [t for t, _, _ in levels], k_pages, page_table,
                               device=device or DeviceInfo.for_target("gpu"))
  align = dispatch.segment_alignment(plan.family)
  parts = []
  for (table, lengths, nodes), prefix_plan in zip(levels, plan.prefixes):
    if prefix_plan is None:
      parts.append(("pages", table, None, lengths, nodes))
      continue
    keys = table.shape[1] * k_pages.shape[1]
    pad = ((0, 0), (0, -keys % align), (0, 0), (0, 0))
    k, v = (jnp.pad(gather_pages(x, table), pad) for x in (k_pages, v_pages))
    parts.append(("segments", k, v, lengths, nodes))
  return _split(plan, q, parts, k_pages, v_pages, kv_lengths=kv_lengths, causal=causal,
                scale=scale, interpret=interpret, page_table=page_table, mods=mods)


def _split(plan, q, parts, suffix_k, suffix_v, *, kv_lengths, causal, scale, interpret,
           page_table=None, mods=None):
  """The shared parts' kernels, then the suffix kernel merging their states in its epilogue.

  With ``page_table``, ``suffix_k, suffix_v`` are page pools, the suffix kernel reads each
  sequence's own pages in place, and a part ``("pages", table, None, lengths, nodes)`` is a
  tree level whose segments the segment kernel reads in place from the pools."""
  b, tq, hq, d = q.shape
  hkv = suffix_k.shape[2]
  m = tq * (hq // hkv)
  q_rows = common.fold_rows(q, hkv)  # [Hkv, B * M, D]; a reshape when Hkv == 1
  offsets = [None] * len(parts)
  if mods is not None and mods.positional:  # where each part's keys sit in the contexts
    offsets = part_offsets(parts, kv_lengths, tq, b)
  priors = []
  for (kind, k, v, lengths, nodes), prefix_plan, seg_cfg, offset in zip(
      parts, plan.prefixes, plan.segments, offsets):
    rows = common.row_mods(mods, b, tq, hq, hkv, offset=offset)
    if kind == "prefix":
      out, lse = prefix_attention_rows(q_rows, k, v, kv_length=lengths, scale=scale,
                                       plan=prefix_plan, interpret=interpret, mods=rows)
    elif prefix_plan is not None:  # one segment: the batched prefix kernel; rows without it drop out
      out, lse = prefix_attention_rows(q_rows, k[0], v[0], kv_length=lengths[0], scale=scale,
                                       plan=prefix_plan, interpret=interpret, mods=rows)
      mine = jnp.repeat(nodes == 0, m)  # [B * M]
      lse = jnp.where(mine[None, None, :], lse, -jnp.inf)
    elif kind == "pages":  # k is the level's page table
      out, lse = segment_rows(q_rows, suffix_k, suffix_v, rows_per_seq=m, lengths=lengths,
                              node_of_seq=nodes, scale=scale, config=seg_cfg, page_table=k,
                              interpret=interpret, mods=rows)
    else:
      out, lse = segment_rows(q_rows, k, v, rows_per_seq=m, lengths=lengths, node_of_seq=nodes,
                              scale=scale, config=seg_cfg, interpret=interpret, mods=rows)
    if prefix_plan is not None and prefix_plan.merge_first:
      out, lse = merge_parts([(out, lse)], out_dtype=jnp.float32, config=plan.merge,
                             interpret=interpret)
      out, lse = out[None], lse[None]  # float32: no extra rounding
    priors.append((out.reshape(out.shape[0], hkv, b, m, d), lse.reshape(lse.shape[0], hkv, b, m)))
  # Sequence-major output: in decoding the kernel writes [B, 1, Hq, D] itself (no transpose).
  out, lse = suffix_rows(q_rows.reshape(hkv, b, m, d), suffix_k, suffix_v, kv_lengths, priors,
                         q_len=tq, causal=causal, scale=scale, out_dtype=q.dtype,
                         config=plan.suffix, merge=plan.merge, by_sequence=True,
                         page_table=page_table, interpret=interpret,
                         mods=common.row_mods(mods, b, tq, hq, hkv))
  return common.unfold_seq_rows(out, tq), common.unfold_seq_rows(lse, tq)
