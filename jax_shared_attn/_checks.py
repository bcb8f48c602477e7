"""Trace-time argument checks with messages that name the argument.

Everything here runs on shapes and dtypes (static under jit). Values of
length arguments are checked only when they are concrete (Python ints or
arrays outside a trace); traced lengths cannot be inspected, so the callers
clamp them and document that.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


def shape_str(shape: Sequence[int]) -> str:
  return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def check_rank(fn: str, name: str, x: Any, rank: int, layout: str) -> None:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{fn}: {name} must be an array of shape {layout}; got {type(x).__name__}")
  if x.ndim != rank:
    raise ValueError(
        f"{fn}: {name} must have rank {rank} with layout {layout}; got shape {shape_str(x.shape)}")


def check_float_dtypes(fn: str, **arrays: Any) -> jnp.dtype:
  """All arrays must share one floating dtype; returns it."""
  dtypes = {name: jnp.dtype(a.dtype) for name, a in arrays.items()}
  for name, dt in dtypes.items():
    if not jnp.issubdtype(dt, jnp.floating):
      raise TypeError(f"{fn}: {name} must have a floating dtype (float32, bfloat16, float16); got {dt}")
  first = next(iter(dtypes.values()))
  if any(dt != first for dt in dtypes.values()):
    listing = ", ".join(f"{n} {d}" for n, d in dtypes.items())
    raise TypeError(f"{fn}: {', '.join(dtypes)} must share one dtype; got {listing}")
  return first


def check_heads(fn: str, q_name: str, hq: int, kv_name: str, hkv: int) -> int:
  if hkv <= 0 or hq % hkv != 0:
    raise ValueError(
        f"{fn}: the query heads of {q_name} ({hq}) must be a multiple of the key/value heads of "
        f"{kv_name} ({hkv}) (GQA/MQA)")
  return hq // hkv


def check_same(fn: str, what: str, **values: int) -> None:
  vals = list(values.values())
  if any(v != vals[0] for v in vals):
    listing = ", ".join(f"{n}={v}" for n, v in values.items())
    raise ValueError(f"{fn}: {what} must match; got {listing}")


def check_kv_pair(fn: str, k_name: str, k: Any, v_name: str, v: Any) -> None:
  if k.shape != v.shape:
    raise ValueError(
        f"{fn}: {k_name} and {v_name} must have the same shape; got {shape_str(k.shape)} and "
        f"{shape_str(v.shape)}")


def is_concrete(x: Any) -> bool:
  return not isinstance(x, jax.core.Tracer)


def lengths_array(fn: str, name: str, x: Any, shape: tuple[int, ...], capacity: int,
                  capacity_name: str) -> jax.Array:
  """Validates an integer length argument and returns it as int32.

  Concrete values must lie in [0, capacity]; traced values are clamped into it.
  """
  if isinstance(x, (bool, np.bool_)):
    raise TypeError(f"{fn}: {name} must be an integer or an int array; got a bool")
  if isinstance(x, (int, np.integer)):
    arr = np.asarray(x)
  else:
    arr = x
  if not hasattr(arr, "dtype") or not jnp.issubdtype(arr.dtype, jnp.integer):
    dt = getattr(arr, "dtype", type(x).__name__)
    raise TypeError(f"{fn}: {name} must have an integer dtype; got {dt}")
  if tuple(arr.shape) != tuple(shape):
    raise ValueError(f"{fn}: {name} must have shape {shape_str(shape)}; got {shape_str(arr.shape)}")
  if is_concrete(arr):
    host = np.asarray(arr)
    if host.size and (host.min() < 0 or host.max() > capacity):
      raise ValueError(
          f"{fn}: {name} must lie in [0, {capacity}] ({capacity_name}); got values in "
          f"[{host.min()}, {host.max()}]")
  return jnp.clip(jnp.asarray(arr, jnp.int32), 0, capacity)


def check_scale(fn: str, scale: Any, head_dim: int) -> float | jax.Array:
  if scale is None:
    return head_dim ** -0.5
  if isinstance(scale, (int, float, np.number)):
    if not np.isfinite(scale) or scale <= 0:
      raise ValueError(f"{fn}: scale must be a positive finite number; got {scale}")
    return float(scale)
  raise TypeError(f"{fn}: scale must be a Python float or None; got {type(scale).__name__}")
