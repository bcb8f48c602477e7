"""Bytes and FLOPs of one attention call: the floors that benchmarks compare against.

:class:`AttentionShape` lives with the kernel contract (:mod:`pallas_kernels.base`: the TPU
performance model uses it too) and is public here.
"""

from pallas_kernels.base import AttentionShape

__all__ = ["AttentionShape"]
