"""Choosing the implementation (``impl=``) behind the public attention API.

An implementation is an :class:`AttentionOps`: the three primitives of
:mod:`jax_shared_attn.reference` with the same signatures. ``"xla"`` is that
module itself; the Pallas families live in :mod:`pallas_kernels` and are
imported only when asked for (data flows one way: API -> kernels).

``impl`` values:

``"auto"``           the fastest correct path for the default backend: Pallas
                     kernels on GPU and TPU, ``"xla"`` on CPU.
``"xla"``            pure JAX (any backend, differentiable).
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

Every implementation, ``"xla"`` included, is wrapped so that ``jax.grad``
runs the chunked backward of :mod:`jax_shared_attn.backward` from the merged
output and LSE (the forward stays the family's own).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

from jax_shared_attn import reference

IMPLS = ("auto", "xla", "pallas", "pallas:triton", "pallas:mosaic_gpu", "pallas:tpu")


class AttentionOps(NamedTuple):
  """An implementation of the three primitives (see :mod:`jax_shared_attn.reference`).

  ``shared_attention`` is optional: a family may compute the whole
  decomposition itself, ``shared_attention(q, parts, suffix_k, suffix_v, *,
  kv_lengths, causal, scale) -> (out, lse)`` with ``parts`` a list of
  ``("prefix", k, v, length, None)`` / ``("segments", k, v, lengths,
  node_of_seq)``, to keep intermediates in its own layout and fuse merges.
  """

  name: str
  prefix_attention: Callable[..., Any]
  segment_attention: Callable[..., Any]
  suffix_attention: Callable[..., Any]
  shared_attention: Callable[..., Any] | None = None


XLA_OPS = AttentionOps("xla", reference.prefix_attention, reference.segment_attention,
                       reference.suffix_attention)

def reference_shared_attention(q, parts, suffix_k, suffix_v, *, kv_lengths, causal, scale,
                               ops: AttentionOps = XLA_OPS):
  """The decomposition from primitives: shared parts, merged, then the suffix merged in."""
  from jax_shared_attn.merge import merge_states
  states = []
  for kind, k, v, lengths, nodes in parts:
    if kind == "prefix":
      states.append(ops.prefix_attention(q, k, v, kv_length=lengths, scale=scale))
    else:
      states.append(ops.segment_attention(q, k, v, lengths=lengths, node_of_seq=nodes,
                                          scale=scale))
  prior = merge_states([s[0] for s in states], [s[1] for s in states]) if states else None
  return ops.suffix_attention(q, suffix_k, suffix_v, kv_lengths=kv_lengths, causal=causal,
                              scale=scale, prior=prior)


def differentiable(ops: AttentionOps, backward_config=None) -> AttentionOps:
  """``ops`` with the chunked backward (:mod:`jax_shared_attn.backward`) as every VJP."""
  from jax_shared_attn import backward
  config = backward.BackwardConfig() if backward_config is None else backward_config
  return backward.differentiable(ops, reference_shared_attention, config)


def _gpu_family() -> str:
  """Mosaic GPU (wgmma) on Hopper, Triton on every other CUDA GPU."""
  cc = str(getattr(jax.devices()[0], "compute_capability", ""))
  return "mosaic_gpu" if cc.startswith("9") else "triton"


def segment_alignment(impl: str = "auto") -> int:
  """Token multiple that shared-segment K/V buffers should be padded to for ``impl``.

  The Hopper (Mosaic GPU) prefix kernel streams whole 128-token TMA blocks and
  masks the keys past the segment's length in the last one; a buffer of any
  other size runs on the Triton kernel instead (correct, slower). Callers that
  allocate segment buffers (``models.generate``) round their width up to this
  multiple; the padding is never read as keys (the lengths mask it). 1 where
  any length runs at full speed.
  """
  if jax.default_backend() != "gpu":
    return 1
  if impl == "pallas:mosaic_gpu" or (impl in ("auto", "pallas") and _gpu_family() == "mosaic_gpu"):
    return 128
  return 1


def suffix_alignment(impl: str = "auto", rows_per_seq: int = 1) -> int:
  """Token multiple that per-sequence (own) K/V capacities should be padded to for ``impl``.

  On Hopper, decoding with one shared prefix runs prefix and suffixes in one Mosaic GPU kernel
  where it pays (``rows_per_seq = Hq / Hkv >= 8``); it streams the suffixes in 64-key blocks, so
  the capacity must be a multiple of 64 (other capacities run the kernels apart: correct,
  slower). 1 everywhere else: nothing is gained by padding, and the padding is memory (at batch
  1024 a Llama-3-8B cache of 130 tokens padded to 256 would take 17 GB more).
  """
  if segment_alignment(impl) == 1:
    return 1
  from pallas_kernels.gpu import shared_attention_plan as fp
  return fp.FusedConfig().block_s if fp.worthwhile(rows_per_seq) else 1


def resolve(impl: str, fn: str) -> AttentionOps:
  """Maps an ``impl`` string to the ops that run it on the default backend."""
  if not isinstance(impl, str) or impl not in IMPLS:
    raise ValueError(f"{fn}: impl must be one of {', '.join(map(repr, IMPLS))}; got {impl!r}")
  backend = jax.default_backend()
  if impl == "xla" or (impl == "auto" and backend not in ("gpu", "tpu")):
    return differentiable(XLA_OPS)
  if impl in ("auto", "pallas"):
    if backend not in ("gpu", "tpu"):
      raise ValueError(
          f"{fn}: impl='pallas' needs a GPU or TPU backend (the default backend is {backend!r}); "
          "use impl='xla', or impl='pallas:triton' / 'pallas:tpu' to run the kernels in "
          "interpret mode")
    family = _gpu_family() if backend == "gpu" else "tpu"
  else:
    family = impl.split(":", 1)[1]
    native = {"triton": "gpu", "mosaic_gpu": "gpu", "tpu": "tpu"}[family]
    if backend not in ("cpu", native):
      raise ValueError(f"{fn}: impl={impl!r} runs on {native} (or cpu, interpreted); the default "
                       f"backend is {backend!r}")
  import pallas_kernels  # deferred: the core does not need the kernels

  # Interpret mode vs native kernel is decided when lowering (platform_dependent).
  ops = pallas_kernels.get_ops(family)
  return differentiable(ops)
