"""The TPU chips the block-size heuristic knows, as data: public per-chip numbers and the device
kinds that name them.

:func:`pallas_kernels.tpu.common.block_sizes_for` derives every block size from a chip's row
(docs/tpu.md explains each number); :func:`chip_of_device_kind` maps a
:class:`~pallas_kernels.device.DeviceInfo`'s kind to its row.
"""

from __future__ import annotations

import dataclasses
import types


@dataclasses.dataclass(frozen=True)
class Chip:
  """Public per-chip numbers (Google Cloud TPU datasheets, see docs/tpu.md)."""

  name: str
  hbm_bytes_per_s: float  # HBM bandwidth per chip
  bf16_flops_per_s: float  # peak bf16 matmul rate per chip
  mxu: int  # systolic array width (128 x 128 or 256 x 256)
  tensorcores: int  # 2 = megacore: "parallel" grid dims are split across the two cores
  vmem_bytes: int  # VMEM per TensorCore (jax/_src/pallas/mosaic/tpu_info.py)

  @property
  def ridge(self) -> float:
    """FLOPs per HBM byte at which the matmul units and HBM take equal time."""
    return self.bf16_flops_per_s / self.hbm_bytes_per_s


CHIPS = types.MappingProxyType({
    "v5e": Chip("v5e", 819e9, 197e12, 128, 1, 128 << 20),
    "v5p": Chip("v5p", 2765e9, 459e12, 128, 2, 64 << 20),
    "v6e": Chip("v6e", 1640e9, 918e12, 256, 1, 128 << 20),
})
DEFAULT_CHIP = "v5e"  # used when the chip is unknown (CPU, export): the smallest limits


def chip_of_device_kind(kind: str) -> str:
  """``"TPU v5 lite"``/``"TPU v5e"`` -> v5e, ``"TPU v5"``/``"TPU v5p"`` -> v5p,
  ``"TPU v6 lite"``/``"TPU v6e"`` -> v6e; anything else -> ``DEFAULT_CHIP``."""
  kind = kind.lower()
  if "v6" in kind:
    return "v6e"
  if "v5" in kind:
    return "v5e" if ("lite" in kind or "v5e" in kind) else "v5p"
  return DEFAULT_CHIP

# Rows per tile of the backward kernels (pallas_kernels.tpu.backward), every chip.
BACKWARD_BLOCK_ROWS = 128
