"""Deprecated: :class:`AttentionOps` lives in :mod:`pallas_kernels.base`."""

import warnings

from pallas_kernels.base import AttentionOps

__all__ = ["AttentionOps"]

warnings.warn("pallas_kernels.interface is deprecated; import AttentionOps from "
              "pallas_kernels.base", DeprecationWarning, stacklevel=2)
