"""The whole decomposition on TPU, intermediates kept in kernel layout (Hydragen Sec. 3).

``shared_attention(q, parts, suffix_k, suffix_v, ...)`` computes what
:func:`pallas_kernels.base.reference_shared_attention` computes from the three
primitives -- every shared part (a prefix or a tree level), their LSE merge, and the
suffix with the merged result fused in -- but folds the queries ONCE into the rows
``[Hkv, B*Tq*G, D]`` that all three kernels read, and hands each partial state to the
next kernel in the layout it was written in: the prefix kernel's ``out``/``lse``
``[Hkv, B*Tq*G, .]`` are the suffix kernel's prior ``[Hkv, B, Tq*G, .]`` after a free
reshape. With one shared part there is no XLA pass over the states at all; with
several, one elementwise merge. The suffix kernel writes ``out`` in q's dtype.

Per decode step and query row this moves: q (read by each kernel), the prefix state
(float32 out + lane-replicated LSE, written once and read once) and the output, on top
of the K/V bytes of the IO model (see docs/tpu.md).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.base import ScoreMods, gather_pages, part_offsets
from pallas_kernels.device import DeviceInfo
from pallas_kernels.tpu import common, dispatch
from pallas_kernels.tpu.common import BlockSizes
from pallas_kernels.tpu.config import TpuConfig
from pallas_kernels.tpu.paged import paged_suffix_rows
from pallas_kernels.tpu.prefix import fold_rows, prefix_rows, unfold_rows, variants
from pallas_kernels.tpu.segment import segment_rows
from pallas_kernels.tpu.suffix import suffix_rows


def merge_rows(states):
  """Exact LSE merge of kernel-layout states ``(out [..., Dp], lse [..., 128])`` (natural
  log, lane-replicated): ``lse = log(sum_i exp(lse_i))``, ``out = sum_i exp(lse_i - lse)
  * out_i``; parts with ``lse = -inf`` weigh 0 and all-empty rows stay ``(0, -inf)``."""
  if len(states) == 1:
    return states[0]
  lses = [s[1][..., :1] for s in states]  # one lane carries the value
  m = lses[0]
  for x in lses[1:]:
    m = jnp.maximum(m, x)
  m = jnp.where(m > -jnp.inf, m, 0.0)
  w = [jnp.exp(x - m) for x in lses]
  denom = sum(w)
  has = denom > 0
  safe = jnp.where(has, denom, 1.0)
  out = sum(wi * s[0] for wi, s in zip(w, states)) / safe
  lse = jnp.where(has, m + jnp.log(safe), -jnp.inf)
  return out, jnp.broadcast_to(lse, states[0][1].shape)


def shared_attention(
    q: jax.Array,  # [B, Tq, Hq, D]
    parts: Sequence[tuple],  # ("prefix", k [P,Hkv,D], v, length, None) | ("segments", k [N,T,Hkv,D], v, lengths [N], node_of_seq [B])
    suffix_k: jax.Array,  # [B, S, Hkv, D]
    suffix_v: jax.Array,  # [B, S, Hkv, D]
    *,
    kv_lengths: jax.Array,  # int32 [B]
    causal: bool,
    scale: float,
    block_sizes: BlockSizes,
    device: Optional[DeviceInfo] = None,
    interpret: Optional[bool] = None,
    mods: Optional[ScoreMods] = None,
):
  """Attention over shared parts then each sequence's suffix, merged exactly by LSE: the plan
  of these shapes with ``block_sizes`` (:func:`pallas_kernels.tpu.dispatch.plan`), run by
  :func:`run_plan`.

  Equals :func:`pallas_kernels.base.reference_shared_attention` (the decomposition of
  Hydragen Sec. 3.1-3.3). Returns ``out [B, Tq, Hq, D]`` in q's dtype and float32
  natural-log ``lse [B, Tq, Hq] = log(sum_j exp(scale * q . k_j))`` over every visible
  key (all valid shared keys; with ``causal``, suffix keys up to the query's position
  ``kv_lengths[b] - Tq + i``); ``(0, -inf)`` for rows that see nothing.

  Example:
    >>> parts = [("prefix", pk, pv, jnp.int32(P), None)]
    >>> out, lse = shared_attention(q, parts, sk, sv, kv_lengths=lens, causal=True, scale=0.125,
    ...                             block_sizes=tpu.block_sizes_for("v5e"))
  """
  plan = dispatch.plan(q, parts, suffix_k, device=device or DeviceInfo.for_target("tpu"),
                       config=TpuConfig(block_sizes=block_sizes))
  return run_plan(plan, q, parts, suffix_k, suffix_v, kv_lengths=kv_lengths, causal=causal,
                  scale=scale, interpret=interpret, mods=mods)


def run_plan(plan: dispatch.TpuPlan, q, parts, suffix_k, suffix_v, *, kv_lengths, causal, scale,
             interpret: Optional[bool] = None, mods: Optional[ScoreMods] = None):
  """Executes ``plan`` (:func:`pallas_kernels.tpu.dispatch.plan` of these inputs): every
  kernel with the plan's blocks; ``mods``: score variants (each shared part's rows at its
  offset, :func:`pallas_kernels.base.part_offsets`)."""
  b, tq, hq = q.shape[:3]
  hkv = suffix_k.shape[2]
  if len(plan.prefix_blocks) != len(parts):
    raise ValueError(f"tpu run_plan: the plan has {len(plan.prefix_blocks)} shared parts, the "
                     f"call {len(parts)}")
  vmem = plan.block_sizes.vmem_limit_bytes
  dtype = common.compute_dtype(q, suffix_k, suffix_v, *[p[1] for p in parts])
  rows = fold_rows(q.astype(dtype), hkv)  # the one fold every kernel reads
  prior = _shared_state(plan, rows, parts, kv_lengths, q.shape, scale=scale,
                        interpret=interpret, mods=mods)
  out, lse = suffix_rows(rows, suffix_k, suffix_v, kv_lengths, prior, q_len=tq, causal=causal,
                         scale=scale, d_out=suffix_v.shape[-1], out_dtype=q.dtype,
                         blocks=plan.suffix_blocks, vmem_limit_bytes=vmem, interpret=interpret,
                         mods=variants(mods, b, tq, hq, hkv))
  return unfold_rows(out, b, tq, hq), unfold_rows(lse, b, tq, hq)


def _shared_state(plan: dispatch.TpuPlan, rows, parts, kv_lengths, q_shape, *, scale, interpret,
                  mods, seq_of_part=None, offset_parts=None):
  """The shared parts' kernels on the folded ``rows`` and their merged kernel-layout state
  (None without parts). ``seq_of_part[i]``: for a ``"prefix"`` part that stands for a level of
  one segment, int32 ``[B]`` (the level's ``segment_of_seq``): rows of sequences outside it
  drop out (LSE -inf). ``offset_parts``: the parts as :func:`pallas_kernels.base.part_offsets`
  counts them for the variants' positions (None: ``parts``)."""
  b, tq, hq = q_shape[:3]
  hkv = rows.shape[0]
  vmem = plan.block_sizes.vmem_limit_bytes
  offsets = [None] * len(parts)
  if mods is not None and mods.positional:
    offsets = part_offsets(parts if offset_parts is None else offset_parts, kv_lengths, tq, b)
  seq_of_part = seq_of_part or [None] * len(parts)
  states = []
  for (kind, k, v, lengths, nodes), blocks, offset, members in zip(
      parts, plan.prefix_blocks, offsets, seq_of_part):
    part_mods = variants(mods, b, tq, hq, hkv, offset)
    if kind == "prefix":
      out, lse = prefix_rows(rows, k, v, lengths, scale=scale, blocks=blocks,
                             vmem_limit_bytes=vmem, interpret=interpret, mods=part_mods)
      if members is not None:  # [B] -> the rows (b, t, g) of each KV head
        mine = jnp.repeat(members == 0, rows.shape[1] // b)
        lse = jnp.where(mine[None, :, None], lse, -jnp.inf)
      states.append((out, lse))
    elif kind == "segments":
      states.append(segment_rows(rows, k, v, lengths, nodes, scale=scale, blocks=blocks,
                                 vmem_limit_bytes=vmem, interpret=interpret, mods=part_mods))
    else:
      raise ValueError(f"shared_attention: a part's kind must be 'prefix' or 'segments'; "
                       f"got {kind!r}")
  return merge_rows(states) if states else None


def paged_attention(q, k_pages, v_pages, levels, page_table, kv_lengths, *, causal, scale,
                    block_sizes: Optional[BlockSizes] = None,
                    plan: Optional[dispatch.TpuPlan] = None,
                    device: Optional[DeviceInfo] = None, interpret: Optional[bool] = None,
                    mods: Optional[ScoreMods] = None):
  """Attention over page pools (see :func:`pallas_kernels.base.paged_attention`) on TPU: runs
  ``plan`` (path "paged", :func:`pallas_kernels.tpu.dispatch.plan_paged`) where given, else
  the plan for these shapes with ``block_sizes`` on ``device``.

  Each shared level's pages are gathered once (a level of one segment: one copy of the segment,
  read by the prefix kernel for all its queries; several segments: the segment kernel), the
  levels merged by LSE and fused as the prior into the paged suffix kernel, which reads every
  sequence's own pages in place. Returns ``out [B, Tq, Hq, D]`` in q's dtype and float32
  natural-log ``lse [B, Tq, Hq]``.
  """
  if plan is None:
    config = TpuConfig(block_sizes=block_sizes)
    plan = dispatch.plan_paged(q, [t for t, _, _ in levels], k_pages, page_table,
                               device=device or DeviceInfo.for_target("tpu"), config=config)
  if plan.path != "paged":
    raise ValueError("tpu paged_attention: the plan must be a paged plan "
                     "(pallas_kernels.tpu.dispatch.plan_paged)")
  if len(plan.prefix_blocks) != len(levels):
    raise ValueError(f"tpu paged_attention: the plan has {len(plan.prefix_blocks)} levels, the "
                     f"call {len(levels)}")
  b, tq, hq = q.shape[:3]
  hkv = k_pages.shape[2]
  parts, members = [], []
  for table, lengths, nodes in levels:
    if table.shape[0] == 1:  # one segment: its pages gathered once, for the prefix kernel
      parts.append(("prefix", gather_pages(k_pages, table)[0], gather_pages(v_pages, table)[0],
                    lengths[0], nodes))
      members.append(nodes)
    else:
      parts.append(("segments", gather_pages(k_pages, table), gather_pages(v_pages, table),
                    lengths, nodes))
      members.append(None)
  # Offsets (variants) count a one-segment level only for the sequences that continue it.
  offset_parts = [("segments", None, None, jnp.reshape(lengths, (-1,)), nodes)
                  for _, _, _, lengths, nodes in parts]
  rows = fold_rows(q.astype(common.compute_dtype(q, k_pages, v_pages)), hkv)
  prior = _shared_state(plan, rows, parts, kv_lengths, q.shape, scale=scale,
                        interpret=interpret, mods=mods, seq_of_part=members,
                        offset_parts=offset_parts)
  out, lse = paged_suffix_rows(rows, k_pages, v_pages, page_table, kv_lengths, prior, q_len=tq,
                               causal=causal, scale=scale, out_dtype=q.dtype,
                               blocks=plan.suffix_blocks,
                               vmem_limit_bytes=plan.block_sizes.vmem_limit_bytes,
                               interpret=interpret, mods=variants(mods, b, tq, hq, hkv))
  return unfold_rows(out, b, tq, hq), unfold_rows(lse, b, tq, hq)


def run_suffix(plan: dispatch.TpuPlan, q, k, v, *, kv_lengths, causal, scale, prior=None,
               interpret: Optional[bool] = None, mods: Optional[ScoreMods] = None):
  """The suffix primitive (:func:`pallas_kernels.tpu.suffix.suffix_attention`) with the plan's
  suffix blocks: ``plan`` is the plan of a call without shared parts (``prior`` None) or with
  them (``prior`` their merged state)."""
  if (prior is not None) != bool(plan.prefix_blocks):
    raise ValueError("tpu run_suffix: the plan's suffix blocks are for a call "
                     f"{'with' if plan.prefix_blocks else 'without'} a prior state")
  b, tq, hq, _ = q.shape
  hkv = k.shape[2]
  state = None
  if prior is not None:
    state = (fold_rows(prior[0].astype(jnp.float32), hkv),
             fold_rows(prior[1].astype(jnp.float32)[..., None], hkv)[..., 0])
  out, lse = suffix_rows(fold_rows(q, hkv), k, v, kv_lengths, state, q_len=tq, causal=causal,
                         scale=scale, d_out=v.shape[-1], blocks=plan.suffix_blocks,
                         vmem_limit_bytes=plan.block_sizes.vmem_limit_bytes, interpret=interpret,
                         mods=variants(mods, b, tq, hq, hkv))
  return unfold_rows(out, b, tq, hq), unfold_rows(lse, b, tq, hq)
