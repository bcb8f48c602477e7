"""The configuration classes of both kernel families, in one place."""

from __future__ import annotations

from typing import Union

from pallas_kernels.gpu.config import FusedDecodeOptions, GpuConfig, MosaicPrefixOptions
from pallas_kernels.tpu.common import BlockSizes
from pallas_kernels.tpu.config import TpuConfig

Config = Union[GpuConfig, TpuConfig]

__all__ = ["BlockSizes", "Config", "FusedDecodeOptions", "GpuConfig", "MosaicPrefixOptions",
           "TpuConfig"]
