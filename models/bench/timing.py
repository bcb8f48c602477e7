"""Device timing and the two ceilings (copy bandwidth, matmul rate).

Device work is timed, not Python dispatch: one jitted program applies the op
to ``n`` distinct input sets in turn (so that consecutive calls do not find
their inputs in L2), it is warmed up and run several times. On a GPU the
reported time is the profiler's: how long the device was busy per op (the
kernels' own time; the host's launch gaps between short kernels are left
out, as they overlap other work inside a model's step). The host clock's
median per op is kept beside it (``wall_s``). On a CPU the host clock is the
only one (tiny sizes, for CI).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.bench import profile as profile_lib

L2_BYTES = 64 * 2**20  # more than any current GPU's L2; sets are rotated past it


def tree_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def sets_needed(set_bytes: int, min_sets: int = 2, max_sets: int = 8) -> int:
  """Enough distinct input sets that their total exceeds the L2 cache.

  At most ``max_sets`` (the program unrolls one call per set, and compile time
  grows with it): the smallest configurations may then find part of their
  inputs in L2, which only matters where the time is launch-bound anyway.
  """
  return int(np.clip(-(-2 * L2_BYTES // max(1, set_bytes)), min_sets, max_sets))


def measure(op: Callable, make_inputs: Callable[[int], Sequence], *, n_sets: int,
            trials: int = 7, warmup: int = 2, profile: bool = True) -> dict:
  """Seconds per call of ``op(*inputs)`` over ``n_sets`` rotating input sets.

  Returns ``wall_s`` (median over ``trials`` of the host clock around the
  program, divided by ``n_sets``) and, where the profiler sees a device
  (GPU/TPU), ``device_s``: the time the device was busy per call, from a
  trace of ``trials`` further runs, with the busiest kernels in
  ``breakdown`` (see :mod:`models.bench.profile`). ``seconds`` is
  ``device_s`` where there is one, else ``wall_s``; ``method`` says which.
  """
  sets = [make_inputs(i) for i in range(n_sets)]

  @jax.jit
  def many(sets):
    return [op(*s) for s in sets]

  for _ in range(warmup):
    jax.block_until_ready(many(sets))
  times = []
  for _ in range(trials):
    t0 = time.perf_counter()
    jax.block_until_ready(many(sets))
    times.append(time.perf_counter() - t0)
  result = {"wall_s": float(np.median(times)) / n_sets, "n_sets": n_sets}
  events = None
  if profile and jax.default_backend() != "cpu":
    def run_trials():
      for _ in range(trials):
        jax.block_until_ready(many(sets))
    try:
      events = profile_lib.device_events(run_trials)
    except Exception as e:  # noqa: BLE001 -- a profiler that cannot run leaves the wall clock
      result["profile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  if events:
    per = trials * n_sets
    result["device_s"] = profile_lib.busy_ns(events) / 1e9 / per
    result["breakdown"] = profile_lib.breakdown(events, per=per)
    result.update(seconds=result["device_s"], method="profiler")
  else:
    result.update(seconds=result["wall_s"], method="wall")
  return result


def device_time(op: Callable, make_inputs: Callable[[int], Sequence], *, n_sets: int,
                trials: int = 7, warmup: int = 2) -> float:
  """Seconds per call: the profiler's device time where there is a device, else the wall clock."""
  return measure(op, make_inputs, n_sets=n_sets, trials=trials, warmup=warmup)["seconds"]


def compare_ops(ops: dict[str, Callable], make_inputs: Callable[[int], Sequence], *, n_sets: int,
                trials: int = 7) -> dict:
  """Times every op of ``ops`` (``name -> op``) with :func:`measure` on the same inputs and
  checks each output against the first op's (relative error). Returns, per name, ``name``
  (microseconds per call, or ``"err: ..."`` where the op failed: reported, not fatal),
  ``name_span_us`` and ``name_kernels`` (with the profiler) and ``err_name`` (all but the first).
  """
  from jax_shared_attn.testing import rel_err
  row, ref = {}, None
  for name, op in ops.items():
    try:
      res = measure(op, make_inputs, n_sets=n_sets, trials=trials)
      row[name] = res["seconds"] * 1e6
      if "breakdown" in res:
        row[f"{name}_span_us"] = res["breakdown"]["span_us"]
        row[f"{name}_kernels"] = res["breakdown"]["kernels"]
      out = np.asarray(jax.jit(op)(*make_inputs(0)), np.float32)
      if ref is None:
        ref = out
      else:
        row[f"err_{name}"] = rel_err(out, ref)
    except Exception as e:  # noqa: BLE001 -- a variant that cannot run is reported
      row[name] = f"err: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
  return row


def _seconds_per_run(fn: Callable, x, trials: int) -> float:
  """Device-busy seconds per run of ``fn(x)`` from the profiler; the host clock's median on CPU."""
  jax.block_until_ready(fn(x))
  if jax.default_backend() != "cpu":
    try:
      events = profile_lib.device_events(
          lambda: [jax.block_until_ready(fn(x)) for _ in range(trials)])
    except Exception:  # noqa: BLE001 -- no profiler: the host clock below
      events = None
    if events:
      return profile_lib.busy_ns(events) / 1e9 / trials
  times = []
  for _ in range(trials):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(x))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def copy_bandwidth(n_bytes: int = 2 * 2**30, trials: int = 7) -> float:
  """Bytes per second of a device copy (bytes read + bytes written)."""
  n = n_bytes // 4
  x = jnp.arange(n, dtype=jnp.float32)
  iters = 10

  @jax.jit
  def loop(x):
    # Each step reads and writes the whole buffer; the tiny add defeats folding.
    return jax.lax.fori_loop(0, iters, lambda i, y: y + jnp.float32(1e-7), x)

  return 2 * n * 4 * iters / _seconds_per_run(loop, x, trials)


def matmul_rate(n: int = 8192, dtype=jnp.bfloat16, trials: int = 7) -> float:
  """FLOP/s of a chain of dependent n x n x n products on random data."""
  k1, k2 = jax.random.split(jax.random.key(0))
  a = jax.random.normal(k1, (n, n), dtype)
  w = (jax.random.normal(k2, (n, n), jnp.float32) / np.sqrt(n)).astype(dtype)
  iters = 10

  @jax.jit
  def loop(a):
    return jax.lax.fori_loop(0, iters, lambda i, x: (x @ w).astype(dtype), a)

  return 2 * n**3 * iters / _seconds_per_run(loop, a, trials)


def ceilings() -> tuple[float, float]:
  """This run's copy bandwidth and bf16 matmul rate (small probes on a CPU, where only the
  benchmarks' smoke tests run)."""
  if jax.default_backend() == "cpu":
    return copy_bandwidth(2**24, trials=3), matmul_rate(512, jnp.bfloat16, trials=3)
  return copy_bandwidth(), matmul_rate(8192, jnp.bfloat16)
