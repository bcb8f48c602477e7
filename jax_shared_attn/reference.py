"""Pure-JAX attention primitives that return the log-sum-exp (the "xla" path).

The references every kernel must equal; they live with the kernel contract in
:mod:`pallas_kernels.base` (the bottom layer) and are public here.

``prefix_attention``   all queries of all sequences against ONE shared K/V sequence: one
                       matrix product with rows ``B * Tq * G`` per KV head (Hydragen Sec. 3.2).
``segment_attention``  a tree level: N shared segments, each sequence's queries against the
                       segment it continues (Sec. 3.3).
``suffix_attention``   per-sequence attention over ragged own K/V, optionally causal,
                       optionally merged with a prior partial result.
"""

from pallas_kernels.base import (State, _precision, prefix_attention,  # noqa: F401
                                 reference_shared_attention, segment_attention, softmax_attend,
                                 suffix_attention, visibility_mask)

__all__ = ["State", "prefix_attention", "reference_shared_attention", "segment_attention",
           "softmax_attend", "suffix_attention", "visibility_mask"]
