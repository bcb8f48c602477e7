"""The interface every kernel family implements (a leaf module: the core and the kernels both
import it, and it imports neither)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple


class AttentionOps(NamedTuple):
  """An implementation of the three primitives (see :mod:`jax_shared_attn.reference`).

  ``shared_attention`` is optional: a family may compute the whole
  decomposition itself, ``shared_attention(q, parts, suffix_k, suffix_v, *,
  kv_lengths, causal, scale) -> (out, lse)`` with ``parts`` a list of
  ``("prefix", k, v, length, None)`` / ``("segments", k, v, lengths,
  node_of_seq)``, to keep intermediates in its own layout and fuse merges.
  The differentiable ops (``jax_shared_attn.ops.resolve``) also take ``need_lse`` (static) on
  ``shared_attention`` and ``suffix_attention``: False returns ``(out, None)``.
  """

  name: str
  prefix_attention: Callable[..., Any]
  segment_attention: Callable[..., Any]
  suffix_attention: Callable[..., Any]
  shared_attention: Callable[..., Any] | None = None
