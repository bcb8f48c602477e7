"""Device timing and the two ceilings (copy bandwidth, matmul rate).

Device work is timed, not Python dispatch: one jitted program applies the op
to ``n`` distinct input sets in turn (so that consecutive calls do not find
their inputs in L2), it is warmed up, run several times, and the median time
per op is reported. The program's single launch overhead is amortised over
the ``n`` ops. On a CPU the same code runs (tiny sizes, for CI).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

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


def device_time(op: Callable, make_inputs: Callable[[int], Sequence], *, n_sets: int,
                trials: int = 7, warmup: int = 2) -> float:
  """Median seconds per call of ``op(*inputs)`` over ``n_sets`` rotating input sets."""
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
  return float(np.median(times)) / n_sets


def copy_bandwidth(n_bytes: int = 2 * 2**30, trials: int = 7) -> float:
  """Bytes per second of a device copy (bytes read + bytes written)."""
  n = n_bytes // 4
  x = jnp.arange(n, dtype=jnp.float32)
  iters = 10

  @jax.jit
  def loop(x):
    # Each step reads and writes the whole buffer; the tiny add defeats folding.
    return jax.lax.fori_loop(0, iters, lambda i, y: y + jnp.float32(1e-7), x)

  jax.block_until_ready(loop(x))
  times = []
  for _ in range(trials):
    t0 = time.perf_counter()
    jax.block_until_ready(loop(x))
    times.append(time.perf_counter() - t0)
  return 2 * n * 4 * iters / float(np.median(times))


def matmul_rate(n: int = 8192, dtype=jnp.bfloat16, trials: int = 7) -> float:
  """FLOP/s of a chain of dependent n x n x n products on random data."""
  k1, k2 = jax.random.split(jax.random.key(0))
  a = jax.random.normal(k1, (n, n), dtype)
  w = (jax.random.normal(k2, (n, n), jnp.float32) / np.sqrt(n)).astype(dtype)
  iters = 10

  @jax.jit
  def loop(a):
    return jax.lax.fori_loop(0, iters, lambda i, x: (x @ w).astype(dtype), a)

  jax.block_until_ready(loop(a))
  times = []
  for _ in range(trials):
    t0 = time.perf_counter()
    jax.block_until_ready(loop(a))
    times.append(time.perf_counter() - t0)
  return 2 * n**3 * iters / float(np.median(times))


def device_info() -> dict:
  d = jax.devices()[0]
  return {"backend": jax.default_backend(), "device": d.device_kind, "count": jax.device_count(),
          "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}
