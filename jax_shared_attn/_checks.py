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

from pallas_kernels.base import ScoreMods

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


def check_variants(fn: str, alibi_slopes: Any, softcap: Any, local_window_size: Any, b: int,
                   hq: int):
  """The score variants of a public call as a :class:`pallas_kernels.base.ScoreMods`, or None
  when none is set: ``alibi_slopes`` float32 ``[Hq]`` or ``[B, Hq]`` (finite where concrete;
  returned as ``[B, Hq]``), ``softcap`` a finite number > 0, ``local_window_size`` an int >= 0
  or a ``(left, right)`` pair of them."""
  if alibi_slopes is None and softcap is None and local_window_size is None:
    return None
  slopes = None
  if alibi_slopes is not None:
    if not hasattr(alibi_slopes, "shape") or not hasattr(alibi_slopes, "dtype"):
      raise TypeError(f"{fn}: alibi_slopes must be a float32 array [Hq] or [B, Hq]; got "
                      f"{type(alibi_slopes).__name__}")
    if jnp.dtype(alibi_slopes.dtype) != jnp.float32:
      raise TypeError(f"{fn}: alibi_slopes must have dtype float32 ([Hq] or [B, Hq]); got "
                      f"{alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((hq,), (b, hq)):
      raise ValueError(f"{fn}: alibi_slopes must have shape [{hq}] (Hq) or [{b}, {hq}] "
                       f"(B, Hq); got {shape_str(alibi_slopes.shape)}")
    if is_concrete(alibi_slopes) and not np.all(np.isfinite(np.asarray(alibi_slopes))):
      raise ValueError(f"{fn}: alibi_slopes must be finite; got {np.asarray(alibi_slopes)}")
    slopes = jnp.broadcast_to(jnp.asarray(alibi_slopes), (b, hq))
  if softcap is not None:
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap,
                                                               (int, float, np.number)):
      raise TypeError(f"{fn}: softcap must be a Python float > 0 or None (static); got "
                      f"{type(softcap).__name__}")
    if not np.isfinite(softcap) or softcap <= 0:
      raise ValueError(f"{fn}: softcap must be a finite number > 0; got {softcap}")
    softcap = float(softcap)
  window = None
  if local_window_size is not None:
    pair = (local_window_size if isinstance(local_window_size, (tuple, list))
            else (local_window_size, local_window_size))
    if len(pair) != 2:
      raise ValueError(f"{fn}: local_window_size must be an int or a (left, right) pair; got "
                       f"{len(pair)} values {tuple(local_window_size)!r}")
    for side in pair:
      if isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer)):
        raise TypeError(f"{fn}: local_window_size must be an int or a (left, right) pair of "
                        f"ints >= 0; got {local_window_size!r}")
      if side < 0:
        raise ValueError(f"{fn}: local_window_size must be >= 0 (left and right); got "
                         f"{local_window_size!r}")
    window = (int(pair[0]), int(pair[1]))
  return ScoreMods(alibi_slopes=slopes, softcap=softcap, window=window)
