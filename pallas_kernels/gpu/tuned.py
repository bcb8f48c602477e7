"""Tuned tiles of the GPU kernels, as data: per device kind, per kernel and shape class.

The heuristics (``default_config`` of each kernel, the dispatch) take their tile sizes, warps
and stages from :func:`tiles` and their SM count from the plan's
:class:`~pallas_kernels.device.DeviceInfo`. Only the H100 has been measured; every other device
kind takes its row. The measurements behind each entry are in docs/gpu-kernels.md ("Tuned
tiles").
"""

from __future__ import annotations

import dataclasses
import types

from pallas_kernels.device import DEFAULT_KIND, DeviceInfo


@dataclasses.dataclass(frozen=True)
class Tiles:
  """One kernel's tiles for one shape class.

  Attributes:
    block_m: query rows per program (the most; the kernels shrink it for few rows).
    block_n: keys per inner step (shortened where float32 tiles would not fit shared memory).
    num_warps: warps per program (for full ``block_m`` tiles).
    num_stages: software-pipeline stages.
    min_steps: the fewest key steps a key split takes (splits of fewer steps cost more in
      partial states than they win in parallelism).
  """

  block_m: int
  block_n: int
  num_warps: int
  num_stages: int
  min_steps: int = 4


# Shape classes: "d128" head_dim <= 128, "d256" head_dim > 128 (half the shared memory per
# row); for the suffix kernel "decode16" (<= 16 rows a sequence), "decode64" (<= 64) and
# "prefill" (row tiles of 64).
_H100 = types.MappingProxyType({
    ("prefix", "d128"): Tiles(block_m=128, block_n=64, num_warps=4, num_stages=3),
    ("prefix", "d256"): Tiles(block_m=64, block_n=32, num_warps=4, num_stages=2),
    ("suffix", "decode16"): Tiles(block_m=64, block_n=32, num_warps=2, num_stages=2),
    ("suffix", "decode64"): Tiles(block_m=64, block_n=32, num_warps=4, num_stages=2),
    ("suffix", "prefill-d128"): Tiles(block_m=64, block_n=128, num_warps=4, num_stages=2),
    ("suffix", "prefill-d256"): Tiles(block_m=64, block_n=64, num_warps=4, num_stages=2),
    ("flat", "any"): Tiles(block_m=64, block_n=32, num_warps=2, num_stages=2),
    ("segment", "d128"): Tiles(block_m=128, block_n=128, num_warps=8, num_stages=3),
    ("segment", "d256"): Tiles(block_m=128, block_n=64, num_warps=8, num_stages=2),
    ("merge", "any"): Tiles(block_m=4, block_n=0, num_warps=4, num_stages=1),
})

TUNED = types.MappingProxyType({"NVIDIA H100 80GB HBM3": _H100})


def tiles(device: DeviceInfo, kernel: str, shape: str) -> Tiles:
  """The tuned tiles of ``kernel`` for ``shape`` on ``device`` (the H100's where the device
  kind has no row of its own)."""
  table = TUNED.get(device.device_kind, TUNED[DEFAULT_KIND["gpu"]])
  key = (kernel, shape)
  if key not in table:
    raise ValueError(f"gpu tuned tiles: no entry {key!r}; known: {sorted(table)}")
  return table[key]


def head_dim_class(head_dim: int) -> str:
  return "d256" if head_dim > 128 else "d128"
