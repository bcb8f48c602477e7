"""Pallas kernels for shared-prefix attention.

Each family implements the three primitives of
:mod:`jax_shared_attn.reference` with the same signatures and semantics
(float32 ``out``, natural-log float32 ``lse``, ``(0, -inf)`` for rows with no
visible key) and is returned by :func:`get_ops` as an
:class:`jax_shared_attn.ops.AttentionOps`.
"""

from __future__ import annotations


def get_ops(family: str, *, interpret: bool = False):
  """Returns the ``AttentionOps`` of a kernel family ("triton" or "tpu")."""
  raise NotImplementedError(
      f"pallas_kernels: the {family!r} kernels have not landed yet; use impl='xla'")
