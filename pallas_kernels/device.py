"""The device a plan is made for: a small frozen value, read from JAX or from a table.

Every heuristic that depends on the hardware (how many programs fill a GPU, which TPU chip's
block sizes) reads a :class:`DeviceInfo`, never a constant. :func:`DeviceInfo.current` reads the
default device; :func:`DeviceInfo.named` looks a device kind up in :data:`KNOWN`, so that a CPU
can plan (``explain``, ``jax.export``) for a GPU or TPU it does not have.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Optional

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
  """What the planners need to know of a device.

  Attributes:
    platform: "cpu", "gpu" or "tpu".
    device_kind: as ``jax.Device.device_kind`` spells it ("NVIDIA H100 80GB HBM3",
      "TPU v5 lite", "cpu").
    cores: streaming multiprocessors of a GPU, TensorCores of a TPU chip, 1 for a CPU.
    memory_bytes: device memory (0 where unknown).
  """

  platform: str
  device_kind: str
  cores: int
  memory_bytes: int = 0

  def __post_init__(self):
    if self.platform not in PLATFORMS:
      raise ValueError(f"DeviceInfo: {self.platform=} must be one of {PLATFORMS}")
    if not isinstance(self.cores, int) or self.cores < 1:
      raise ValueError(f"DeviceInfo: {self.cores=} must be an int >= 1")

  @classmethod
  def named(cls, device_kind: str) -> "DeviceInfo":
    """The table's entry for ``device_kind`` (:data:`KNOWN`)."""
    if device_kind not in KNOWN:
      raise ValueError(f"DeviceInfo.named: device_kind must be one of {sorted(KNOWN)}; got "
                       f"{device_kind!r}")
    return KNOWN[device_kind]

  @classmethod
  def current(cls) -> "DeviceInfo":
    """The default device, read from ``jax.devices()`` (its table entry where it has one)."""
    dev = jax.devices()[0]
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(dev.platform, dev.platform)
    platform = platform if platform in PLATFORMS else "cpu"
    kind = str(dev.device_kind)
    known = KNOWN.get(kind)
    fallback = known or KNOWN[DEFAULT_KIND[platform]]  # a kind missing from the table
    cores = int(getattr(dev, "core_count", 0) or fallback.cores)
    memory = known.memory_bytes if known else 0
    try:
      memory = int((dev.memory_stats() or {}).get("bytes_limit", memory))
    except Exception:  # some backends (CPU) have no memory statistics
      pass
    return cls(platform, kind, cores, memory)

  @classmethod
  def for_target(cls, platform: str, device_kind: Optional[str] = None) -> "DeviceInfo":
    """The device a call on ``platform`` is planned for: ``device_kind``'s table entry if
    given (a kind missing from the table gets the numbers of the platform's
    :data:`DEFAULT_KIND`); else the default device where it is of that platform; else the
    platform's :data:`DEFAULT_KIND` (planning on a CPU for a GPU or TPU target: export,
    interpret mode)."""
    if device_kind is not None:
      if device_kind in KNOWN:
        return KNOWN[device_kind]
      return dataclasses.replace(KNOWN[DEFAULT_KIND[platform]], device_kind=device_kind)
    current = cls.current()
    if current.platform == platform:
      return current
    return KNOWN[DEFAULT_KIND[platform]]


def _table(*devices: DeviceInfo):
  return types.MappingProxyType({d.device_kind: d for d in devices})


# Public figures (vendor datasheets); the keys are ``jax.Device.device_kind`` strings.
KNOWN = _table(
    DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", 132, 80 * GiB),
    DeviceInfo("gpu", "NVIDIA H100 PCIe", 114, 80 * GiB),
    DeviceInfo("gpu", "NVIDIA H200", 132, 141 * GiB),
    DeviceInfo("gpu", "NVIDIA GH200 480GB", 132, 96 * GiB),
    DeviceInfo("gpu", "NVIDIA A100-SXM4-80GB", 108, 80 * GiB),
    DeviceInfo("gpu", "NVIDIA A100-SXM4-40GB", 108, 40 * GiB),
    DeviceInfo("gpu", "NVIDIA L4", 58, 24 * GiB),
    DeviceInfo("tpu", "TPU v5 lite", 1, 16 * GiB),
    DeviceInfo("tpu", "TPU v5", 2, 95 * GiB),
    DeviceInfo("tpu", "TPU v6 lite", 1, 32 * GiB),
    DeviceInfo("cpu", "cpu", 1),
)
# The kind planned for when the target platform is not the one running (the kernels' tuning
# was measured on an H100; v5e has the TPU family's smallest limits).
DEFAULT_KIND = types.MappingProxyType(
    {"gpu": "NVIDIA H100 80GB HBM3", "tpu": "TPU v5 lite", "cpu": "cpu"})
