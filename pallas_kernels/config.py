"""The configuration classes of the kernel families (GPU, TPU, XLA), in one place."""

from __future__ import annotations

from typing import Union

from pallas_kernels.gpu.config import FusedDecodeOptions, GpuConfig, MosaicPrefixOptions
from pallas_kernels.tpu.common import BlockSizes
from pallas_kernels.tpu.config import TpuConfig
from pallas_kernels.xla import XlaConfig

Config = Union[GpuConfig, TpuConfig, XlaConfig]

__all__ = ["BlockSizes", "Config", "FusedDecodeOptions", "GpuConfig", "MosaicPrefixOptions",
           "TpuConfig", "XlaConfig"]
