"""The kernel families' configuration classes (``config=`` of the public API); see
docs/configuration.md."""

from pallas_kernels.config import (BlockSizes, Config, FusedDecodeOptions, GpuConfig,
                                   MosaicPrefixOptions, TpuConfig, XlaConfig)

__all__ = ["BlockSizes", "Config", "FusedDecodeOptions", "GpuConfig", "MosaicPrefixOptions",
           "TpuConfig", "XlaConfig"]
