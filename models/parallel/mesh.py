"""The ``("data", "model")`` device mesh: built from a simple spec, checked against the processes
of a ``jax.distributed`` run, and found again from the arrays laid out on it."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)
MeshSpec = Union[Mesh, str, Sequence[int]]


def make_mesh(spec: MeshSpec = "auto", *, devices: Optional[Sequence[Any]] = None) -> Mesh:
  """A ``("data", "model")`` mesh from a simple spec.

  Args:
    spec: ``(d, m)``: d data shards x m model shards, the first ``d * m``
      devices (one entry may be -1: "the rest"); ``"auto"``: every device on
      "data" (``(n, 1)``: decoding a large batch needs no communication
      then; give ``(d, m)`` when the parameters or the shared cache need
      splitting); or a ``jax.sharding.Mesh`` with axes named "data" and
      "model" (returned as is).
    devices: the devices to use (default ``jax.devices()``: TPU, GPU or CPU).

  Raises:
    ValueError: a malformed spec, more devices asked for than exist, or a
      Mesh without the two axis names.
  """
  if isinstance(spec, Mesh):
    missing = [a for a in AXES if a not in spec.axis_names]
    if missing:
      raise ValueError(f"mesh: a Mesh needs the axes {AXES}; {tuple(spec.axis_names)} lacks "
                       f"{missing}")
    _check_spans_processes(spec)
    return spec
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if isinstance(spec, str):
    if spec != "auto":
      raise ValueError(f"mesh must be 'auto', (data, model) or a Mesh; got {spec!r}")
    shape = (n, 1)
  else:
    shape = tuple(spec) if isinstance(spec, (tuple, list)) else ()
    if (len(shape) != 2 or not all(isinstance(s, (int, np.integer)) for s in shape)
        or any(s == 0 or s < -1 for s in shape) or shape == (-1, -1)):
      raise ValueError(f"mesh must be 'auto', (data, model) with positive sizes (one may be -1) "
                       f"or a Mesh; got {spec!r}")
    if -1 in shape:
      known = shape[0] * shape[1] * -1
      if n % known:
        raise ValueError(f"mesh {spec}: {n} devices do not split into shards of {known}")
      shape = tuple(n // known if s == -1 else int(s) for s in shape)
    shape = (int(shape[0]), int(shape[1]))
  if shape[0] * shape[1] > n:
    raise ValueError(f"mesh {shape} needs {shape[0] * shape[1]} devices; there are {n} "
                     f"({devices[0].platform})")
  grid = _device_grid(shape, devices[:shape[0] * shape[1]])
  auto = getattr(jax.sharding, "AxisType", None)
  if auto is None:  # older JAX: every axis is "auto" (the SPMD partitioner decides)
    mesh = Mesh(grid, AXES)
  else:  # Auto axes: jit partitions the dense layers from the arrays' NamedShardings (the rules)
    mesh = Mesh(grid, AXES, axis_types=(auto.Auto, auto.Auto))
  _check_spans_processes(mesh)
  return mesh


def _check_spans_processes(mesh: Mesh) -> None:
  """Under jax.distributed every process runs every program: the mesh must hold all devices.

  A process with no device in the mesh would compute nothing while the
  others wait for it in a collective. The check needs no communication:
  every process sees the same global device list, so all of them raise.
  """
  if jax.process_count() == 1:
    return
  n = jax.device_count()
  if mesh.devices.size != n or {d.id for d in mesh.devices.flat} != {d.id for d in jax.devices()}:
    raise ValueError(
        f"mesh {tuple(mesh.devices.shape)}: under jax.distributed the mesh must span every "
        f"process's devices ({jax.process_count()} processes, {n} devices, "
        f"{jax.local_device_count()} per process); it holds {mesh.devices.size}. Use a "
        f"(data, model) shape whose product is {n}, e.g. ({n}, 1) or "
        f"({jax.process_count()}, {jax.local_device_count()})")


def _device_grid(shape: tuple[int, int], devices: list) -> np.ndarray:
  """Devices as a ``[data, model]`` array; topology-aware where JAX knows the topology."""
  try:
    from jax.experimental import mesh_utils
    return mesh_utils.create_device_mesh(shape, devices=devices)
  except Exception:  # CPU devices, a subset mesh_utils cannot place: plain order
    return np.asarray(devices, dtype=object).reshape(shape)


def axis_sizes(mesh: Mesh) -> tuple[int, int]:
  """``(data, model)`` sizes."""
  return mesh.shape[DATA], mesh.shape[MODEL]


def mesh_of(tree: Any) -> Optional[Mesh]:
  """The ("data", "model") mesh the first sharded leaf of ``tree`` lives on, or None."""
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and all(a in sharding.mesh.axis_names for a in AXES):
      return sharding.mesh
  return None
