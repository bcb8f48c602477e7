"""Choosing the implementation (``impl=``) behind the public attention API.

An implementation is an :class:`AttentionOps`: the three primitives of
:mod:`jax_shared_attn.reference` with the same signatures. ``"xla"`` is
:mod:`pallas_kernels.xla` (the same math as an online softmax over tiles, ``XlaConfig``); the
Pallas families live in :mod:`pallas_kernels` and are imported only when asked for (data
flows one way: API -> kernels).

``impl`` values:

``"auto"``           the fastest correct path for the default backend: Pallas
                     kernels on GPU and TPU, ``"xla"`` on CPU.
``"xla"``            pure JAX over tiles (any backend, differentiable).
``"pallas"``         the Pallas family for the backend: on a Hopper GPU (sm_90)
                     ``"pallas:mosaic_gpu"``, on other GPUs ``"pallas:triton"``,
                     on a TPU ``"pallas:tpu"``; an error on CPU.
``"pallas:triton"``  the portable GPU (Triton) kernels; lowered for a CPU they
                     run in Pallas interpret mode (slow, for testing).
``"pallas:mosaic_gpu"`` Hopper: the prefix product on wgmma/TMA (Mosaic GPU),
                     the rest Triton. Mosaic GPU has no interpret mode: lowered
                     for a CPU, the Triton kernels run interpreted instead.
``"pallas:tpu"``     the TPU (Mosaic) kernels; interpret mode when lowered for a
                     CPU, native when lowered (or exported) for a TPU.

``config`` (a :class:`pallas_kernels.gpu.config.GpuConfig`,
:class:`pallas_kernels.tpu.config.TpuConfig` or :class:`pallas_kernels.xla.XlaConfig`, None for
the defaults) travels with the ops the family returns; which kernels a call runs is decided by
the family's ``dispatch`` module (:mod:`jax_shared_attn.dispatch` shows it, ``explain``).

Every implementation, ``"xla"`` included, is wrapped so that ``jax.grad``
runs the chunked backward of :mod:`jax_shared_attn.backward` from the merged
output and LSE (the forward stays the family's own).
"""

from __future__ import annotations

from jax_shared_attn import dispatch
from jax_shared_attn.dispatch import IMPLS  # noqa: F401  (re-exported)
from pallas_kernels.base import XLA_OPS, AttentionOps, reference_shared_attention  # noqa: F401
from pallas_kernels.base import gather_pages
from pallas_kernels.base import paged_attention as base_paged_attention


def differentiable(ops: AttentionOps, backward_config=None) -> AttentionOps:
  """``ops`` with the chunked backward (:mod:`jax_shared_attn.backward`) as every VJP."""
  from jax_shared_attn import backward
  config = backward.BackwardConfig() if backward_config is None else backward_config
  return backward.differentiable(ops, reference_shared_attention, config)



def segment_alignment(impl: str = "auto") -> int:
  """Token multiple for shared-segment K/V buffers on the default backend
  (:func:`jax_shared_attn.dispatch.segment_alignment`)."""
  return dispatch.segment_alignment(impl)


def suffix_alignment(impl: str = "auto", rows_per_seq: int = 1, config=None) -> int:
  """Token multiple for per-sequence K/V capacities on the default backend
  (:func:`jax_shared_attn.dispatch.suffix_alignment`)."""
  return dispatch.suffix_alignment(impl, rows_per_seq, config, segment=segment_alignment(impl))


def gathered_paged_attention(q, k_pages, v_pages, levels, page_table, kv_lengths, *, causal,
                             scale, ops: AttentionOps, mods=None):
  """``paged_attention`` of a family without a paged entry: the pages gathered into contiguous
  buffers, then the family's whole decomposition (``ops.shared_attention``) where it has one,
  else :func:`pallas_kernels.base.paged_attention` from its primitives. ``mods``: score
  variants (a :class:`pallas_kernels.base.ScoreMods`; the "xla" family)."""
  extra = {} if mods is None else {"mods": mods}
  if ops.shared_attention is None:
    return base_paged_attention(q, k_pages, v_pages, levels, page_table, kv_lengths,
                                causal=causal, scale=scale, ops=ops, **extra)
  parts = [("segments", gather_pages(k_pages, t), gather_pages(v_pages, t), lengths, nodes)
           for t, lengths, nodes in levels]
  return ops.shared_attention(q, parts, gather_pages(k_pages, page_table),
                              gather_pages(v_pages, page_table), kv_lengths=kv_lengths,
                              causal=causal, scale=scale, **extra)


def executor(plan: dispatch.Plan, config=None, forward_only: bool = False) -> AttentionOps:
  """The ops that execute ``plan`` (:func:`jax_shared_attn.dispatch.plan` of one call,
  ``config`` that call's): the family's entry points bound to the plan's kernel configs, with
  the plan's backward (``forward_only``: the family's ops as they are, no backward)."""
  from jax_shared_attn import backward
  if plan.impl == "xla":
    from pallas_kernels import xla
    ops = xla.get_ops(plan.backend)
    return ops if forward_only else differentiable(
        ops, backward.BackwardConfig(kernels=plan.backward, kernel_tiles=plan.backward_tiles))
  family = plan.impl.split(":", 1)[1]
  if family == "tpu":
    from pallas_kernels import tpu
    ops = tpu.get_ops(config=config, plan=plan.backend)
  else:
    from pallas_kernels import gpu
    ops = gpu.get_ops(mosaic=family == "mosaic_gpu", config=config, plan=plan.backend)
  if forward_only:
    return ops
  return differentiable(ops, backward.BackwardConfig(kernels=plan.backward,
                                                     kernel_tiles=plan.backward_tiles))


def resolve(impl: str, fn: str, config=None) -> AttentionOps:
  """The ops of ``impl`` and ``config`` on the default backend, each call planned by the
  family for its own shapes (the public functions plan once with
  :func:`jax_shared_attn.dispatch.plan` and run :func:`executor` instead)."""
  family = dispatch.choose_family(impl, fn)
  dispatch.check_config(fn, family, config)
  if family == "xla":
    from pallas_kernels import xla
    return differentiable(xla.get_ops(config if isinstance(config, xla.XlaConfig) else None))
  import pallas_kernels

  # Interpret mode vs native kernel is decided when lowering (platform_dependent).
  return differentiable(pallas_kernels.get_ops(family, config=config),
                        backward_config(family, config))


def backward_config(family: str, config=None):
  """The :class:`~jax_shared_attn.backward.BackwardConfig` a family's ``config`` asks for on the
  default backend: the GPU families' ``GpuConfig.backward`` ("cudnn" where
  :func:`pallas_kernels.gpu.cudnn.available`, else "triton"); None (the family's own kernels)
  for the others."""
  if family not in ("triton", "mosaic_gpu"):
    return None
  from jax_shared_attn import backward
  from pallas_kernels.config import GpuConfig
  from pallas_kernels.gpu import cudnn
  engine = (config or GpuConfig()).backward
  return backward.BackwardConfig(
      kernels="cudnn" if engine == "cudnn" and cudnn.available() else "triton")
