"""One JAX process per host (or per GPU): ``jax.distributed`` set-up and the checks around it.

    >>> from models import distributed
    >>> distributed.initialize()                      # TPU pod slice, SLURM, ...: auto-detected
    >>> distributed.initialize("10.0.0.1:1234", num_processes=4, process_id=rank)   # or explicit
    >>> mesh = models.make_mesh((jax.device_count(), 1))  # spans every process's devices
    >>> model, tok, _ = models.from_pretrained(path, mesh=mesh)  # each process reads its shards
    >>> tokens = models.generate(model, prompt, num_samples=64, max_new_tokens=32, mesh=mesh)
    >>> if jax.process_index() == 0: print(tokens)    # every process returns all the tokens

JAX's multi-controller runtime is the engine: every process runs this same
program on the same inputs, the mesh covers all processes' devices, and XLA's
collectives (NCCL on GPUs, ICI/DCN on TPUs, gloo on CPUs) do the communication.
This module adds what a user needs around it: one ``initialize`` for explicit
arguments or cluster auto-detection, and cheap checks that turn the usual
mistakes into the same clear error on every process instead of a hang (a
process that raises while the others wait in a collective hangs them):

* processes holding different numbers of devices (:func:`initialize`);
* a mesh that does not span every process's devices
  (:func:`models.parallel.sharding.make_mesh`);
* processes that disagree on the prompt or the generation arguments
  (:func:`check_same`: one all-gather of a 16-byte digest per argument, from
  ``prefill`` and ``decode``).

Launching on a TPU pod slice or a SLURM GPU cluster: docs/multihost.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import re
from typing import Any, Optional, Sequence, Union

import jax
import numpy as np

DIGEST_WORDS = 4  # 16 bytes of SHA-256 per checked argument, as uint32 words


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None,
               local_device_ids: Optional[Union[int, Sequence[int]]] = None, *,
               timeout_s: int = 300) -> None:
  """Starts JAX's multi-controller runtime (``jax.distributed.initialize``) and checks it.

  Call it once per process, before anything else touches JAX's devices.
  With no arguments JAX detects the cluster (TPU pod slices, SLURM, Open
  MPI, Kubernetes JobSets, ...); otherwise give all of ``coordinator``,
  ``num_processes`` and ``process_id``. A second call is a no-op.

  Args:
    coordinator: ``"HOST:PORT"`` of process 0's coordination service.
    num_processes: how many processes take part (>= 1).
    process_id: this process's index in ``[0, num_processes)``.
    local_device_ids: the local devices this process uses (e.g. its GPU on a
      host that runs one process per GPU); default: all it sees.
    timeout_s: how long to wait for every process to join.

  Raises:
    ValueError: malformed or partial arguments, or (on every process) the
      processes hold different numbers of devices, which no
      ``(data, model)`` mesh can lay out evenly.
  """
  explicit = (coordinator, num_processes, process_id)
  if any(a is not None for a in explicit) and any(a is None for a in explicit):
    raise ValueError(f"initialize: give coordinator, num_processes and process_id together "
                     f"(or none of them, to auto-detect the cluster); got coordinator="
                     f"{coordinator!r}, num_processes={num_processes!r}, process_id={process_id!r}")
  if coordinator is not None:
    if not isinstance(coordinator, str) or not re.fullmatch(r"\S+:\d+", coordinator):
      raise ValueError(f"initialize: coordinator must be 'HOST:PORT'; got {coordinator!r}")
    if int(num_processes) != num_processes or num_processes < 1:
      raise ValueError(f"initialize: num_processes must be an int >= 1; got {num_processes!r}")
    if int(process_id) != process_id or not 0 <= process_id < num_processes:
      raise ValueError(f"initialize: process_id must lie in [0, {num_processes}); "
                       f"got {process_id!r}")
  if jax.distributed.is_initialized():
    return
  # CPU processes talk through gloo (the CPU client's default is no cross-process collectives);
  # GPU and TPU clients ignore this option.
  if getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") in (None, "", "none"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id, local_device_ids=local_device_ids,
                             initialization_timeout=int(timeout_s))
  check_devices()


def check_devices() -> None:
  """Raises on every process when the processes hold different numbers of devices."""
  if jax.process_count() == 1:
    return
  # Every process sees the same global device list: no communication, the same verdict.
  counts = [0] * jax.process_count()
  for d in jax.devices():
    counts[d.process_index] += 1
  if len(set(counts)) > 1:
    raise ValueError(f"jax.distributed: the processes hold different numbers of devices "
                     f"({counts} for processes 0..{len(counts) - 1}); "
                     f"{jax.device_count()} devices do not split evenly over "
                     f"{jax.process_count()} processes. Give every process the same number "
                     f"(local_device_ids, CUDA_VISIBLE_DEVICES, or one process per host)")


def spans_processes(mesh) -> bool:
  """Whether ``mesh`` (a Mesh or None) holds devices of more than one process."""
  return mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1


def check_same(mesh, **values: Any) -> None:
  """Raises the same ValueError on every process when the processes disagree on ``values``.

  A no-op unless ``mesh`` spans several processes. One all-gather of a
  16-byte digest per value: cheap next to a prefill, and it must be reached
  by every process (call it before any check that could fail on one
  process only; checks that follow from equal arguments fail everywhere).
  """
  if not spans_processes(mesh):
    return
  from jax.experimental import multihost_utils

  check_devices()  # process_allgather needs as many devices on every process

  names = sorted(values)
  mine = np.concatenate([_digest(values[n]) for n in names])
  every = np.asarray(multihost_utils.process_allgather(mine)).reshape(
      jax.process_count(), len(names), DIGEST_WORDS)
  differ = {n: [p for p in range(len(every)) if not np.array_equal(every[p, i], every[0, i])]
            for i, n in enumerate(names)}
  differ = {n: ps for n, ps in differ.items() if ps}
  if differ:
    what = "; ".join(f"{n} differs on process(es) {ps}" for n, ps in differ.items())
    raise ValueError(f"jax.distributed: the processes disagree with process 0 ({what}). "
                     "Every process must pass the same prompt_ids and generation arguments "
                     "(e.g. read them from the same file, with the same seed)")


def _digest(value: Any) -> np.ndarray:
  return np.frombuffer(hashlib.sha256(repr(_canonical(value)).encode()).digest(),
                       np.uint32)[:DIGEST_WORDS]


def _canonical(x: Any) -> Any:
  """A value whose ``repr`` is the same for equal inputs however they are spelled."""
  if isinstance(x, (np.ndarray, jax.Array)):  # an array of ids is the same prompt as a list
    return _canonical(np.asarray(x).tolist())
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return (type(x).__name__, tuple((f.name, _canonical(getattr(x, f.name)))
                                    for f in dataclasses.fields(x)))
  if isinstance(x, (list, tuple)):
    return tuple(_canonical(v) for v in x)
  if isinstance(x, np.generic):
    return x.item()
  return x


def gather(x):
  """``x`` on the host, whole, on every process (NumPy): ``jax.device_get`` for one process;
  across processes an all-gather of every process's shards."""
  if getattr(x, "is_fully_addressable", True):
    return jax.device_get(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# -- the command line -----------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
  """``--mesh`` and the ``jax.distributed`` flags (``--distributed``, ``--coordinator``, ...)."""
  g = parser.add_argument_group("devices and processes")
  g.add_argument("--mesh", default=None,
                 help="decode on a device mesh: 'auto' (every device on the data axis) or DxM "
                 "(data x model shards, e.g. 2x4); default: one device, or 'auto' with "
                 "several processes")
  g.add_argument("--distributed", action="store_true",
                 help="one process per host: jax.distributed.initialize() with the cluster "
                 "auto-detected (TPU pod slice, SLURM, ...); see docs/multihost.md")
  g.add_argument("--coordinator", metavar="HOST:PORT",
                 help="jax.distributed by hand: process 0's address (with --num-processes and "
                 "--process-id)")
  g.add_argument("--num-processes", type=int)
  g.add_argument("--process-id", type=int)
  g.add_argument("--local-device-ids", default=None,
                 help="comma-separated local devices this process uses (e.g. 0 for one GPU)")


def from_args(args: argparse.Namespace):
  """Initializes ``jax.distributed`` if the flags ask for it; returns the mesh spec (or None)."""
  if args.distributed or args.coordinator is not None:
    ids = (None if args.local_device_ids is None
           else [int(i) for i in args.local_device_ids.split(",")])
    initialize(args.coordinator, args.num_processes, args.process_id, ids)
  elif args.num_processes is not None or args.process_id is not None:
    raise SystemExit("hydragen: --num-processes and --process-id need --coordinator "
                     "(or use --distributed to auto-detect the cluster)")
  if args.mesh is None:
    return "auto" if jax.process_count() > 1 else None
  if args.mesh == "auto":
    return "auto"
  m = re.fullmatch(r"(-?\d+)x(-?\d+)", args.mesh)
  if m is None:
    raise SystemExit(f"hydragen: --mesh must be 'auto' or DxM (e.g. 2x4); got {args.mesh!r}")
  return int(m.group(1)), int(m.group(2))
