"""Sharded attention: the public API functions under ``shard_map``, one shard per device.

Pallas kernels are custom calls, which XLA's SPMD partitioner cannot split:
given sharded operands it would gather them onto every device. So the API
functions run under ``shard_map`` instead: each device calls the unchanged
function (kernel or XLA path) on its own block, the sequences of its slice of
``batch_axis`` times the heads of its slice of ``head_axis``::

    q, out        [B, Tq, Hq, D]    P(batch_axis, None, head_axis, None)
    lse           [B, Tq, Hq]       P(batch_axis, None, head_axis)
    suffix k, v   [B, S, Hkv, D]    P(batch_axis, None, head_axis, None)
    lengths, node_of_seq [B]        P(batch_axis)
    shared k, v   [N, T, Hkv, D]    P(None, None, head_axis, None)   (prefix: [P, Hkv, D])
    shared lengths [N], prefix_length []   replicated
    alibi_slopes  [B, Hq]           P(batch_axis, head_axis)          ([Hq]: broadcast first)

Nothing is communicated. A shared segment is replicated over the batch axis
(every device holds it for its own heads), so prefix attention reads local
memory; the LSE merge is elementwise per (sequence, query, head), so it runs
on the shard too. GQA stays consistent because a shard of ``Hq / n`` query
heads and ``Hkv / n`` KV heads (n = size of ``head_axis``) is a whole number
of groups: global query head h reads KV head ``h // G`` and local query head
``h - i * Hq / n`` reads local KV head ``(h // G) - i * Hkv / n``. That needs
``Hkv % n == 0``; with fewer KV heads than shards, replicate them first
(:func:`models.parallel.sharding.kv_replication`) so each shard holds its group's head.

    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    >>> attn = sharded(hierarchical_attention, mesh)                      # same signature
    >>> out = attn(q, levels, suffix_k, suffix_v, suffix_lengths=lens, impl="auto")
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jax_shared_attn import _checks
from jax_shared_attn.api import (SharedLevel, attention_with_lse, hierarchical_attention,
                                 shared_prefix_attention)

AxisName = Union[str, tuple[str, ...], None]


class AttentionSharding(NamedTuple):
  """Where attention's batch and head dimensions live on a mesh (hashable: static under jit).

  ``batch_axis=None``: every device holds every sequence (e.g. prefilling a
  few shared segments); ``head_axis=None``: every device holds every head.
  ``sharded(fn, *sharding)`` applies it.
  """

  mesh: Mesh
  batch_axis: AxisName = "data"
  head_axis: AxisName = "model"


def shard_map(fn: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
  """``jax.shard_map`` (jax >= 0.7), else ``jax.experimental.shard_map.shard_map``.

  Replication checking is off: Pallas calls have no replication rule, and
  every output here varies over both axes (the out_specs say so).
  """
  if hasattr(jax, "shard_map"):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  from jax.experimental.shard_map import shard_map as legacy
  return legacy(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def axis_size(mesh: Mesh, axis: AxisName) -> int:
  """Devices along ``axis`` (a name, a tuple of names, or None = 1)."""
  if axis is None:
    return 1
  names = (axis,) if isinstance(axis, str) else tuple(axis)
  size = 1
  for name in names:
    if name not in mesh.shape:
      raise ValueError(f"sharded: the mesh has no axis {name!r}; its axes are "
                       f"{dict(mesh.shape)}")
    size *= mesh.shape[name]
  return size


def sharded(fn: Callable, mesh: Mesh, batch_axis: AxisName = "data",
            head_axis: AxisName = "model") -> Callable:
  """``fn`` (one of the three attention API functions) run per shard of ``mesh``.

  Args:
    fn: :func:`attention_with_lse`, :func:`shared_prefix_attention` or
      :func:`hierarchical_attention`.
    mesh: a ``jax.sharding.Mesh``.
    batch_axis: mesh axis (or tuple of axes, or None) that splits the
      sequences; head_axis: the one that splits the heads.

  Returns:
    A function with ``fn``'s signature and results (global shapes in and
    out). Shapes are checked on the global arrays first (the API's messages),
    then the batch must divide by the batch axis and both head counts by the
    head axis (ValueError naming them).
  """
  if fn not in _SPECS:
    raise TypeError(f"sharded: fn must be attention_with_lse, shared_prefix_attention or "
                    f"hierarchical_attention; got {getattr(fn, '__name__', fn)!r}")
  name = fn.__name__
  nb, nh = axis_size(mesh, batch_axis), axis_size(mesh, head_axis)
  batch4, heads3 = P(batch_axis, None, head_axis, None), P(batch_axis, None, head_axis)
  shared4, shared3 = P(None, None, head_axis, None), P(None, head_axis, None)

  signature = inspect.signature(fn)

  @functools.wraps(fn)
  def call(*args, **kwargs):
    bound = signature.bind(*args, **kwargs).arguments  # arrays given by keyword too
    params = signature.parameters
    args = [v for k, v in bound.items() if params[k].kind is params[k].POSITIONAL_OR_KEYWORD]
    kwargs = {k: v for k, v in bound.items() if params[k].kind is params[k].KEYWORD_ONLY}
    # The API's own shape checks on the global arrays, traced abstractly through the XLA
    # path, so that errors name global shapes. Length values are not checked (they are
    # traced in the shards, so clamped into their capacity: the API's traced semantics).
    static = {k: v for k, v in kwargs.items() if k in _STATIC}
    jax.eval_shape(lambda a, kw: fn(*a, **kw, **{**static, "impl": "xla"}), args,
                   {k: v for k, v in kwargs.items() if k not in _STATIC})
    args, kwargs, in_specs = _SPECS[fn](list(args), dict(kwargs), batch4, shared4, shared3,
                                        P(batch_axis))
    if kwargs.get("alibi_slopes") is not None:  # [B, Hq], split as the query heads are
      q = args[0]
      kwargs["alibi_slopes"] = _checks.check_variants(
          name, kwargs["alibi_slopes"], None, None, q.shape[0], q.shape[2]).alibi_slopes
      in_specs["alibi_slopes"] = P(batch_axis, head_axis)
    q = args[0]
    kv_name, kv = ("k", args[1]) if fn is attention_with_lse else ("suffix_k", args[-2])
    _check_divisible(name, "q", q.shape[0], "sequences", batch_axis, nb)
    _check_divisible(name, "q", q.shape[2], "query heads", head_axis, nh)
    _check_divisible(name, kv_name, kv.shape[2], "key/value heads", head_axis, nh)
    dynamic = tuple(n for n in sorted(kwargs) if n in in_specs)
    with_lse = fn is attention_with_lse or static.get("return_lse", False)
    specs = tuple(in_specs["args"]) + tuple(in_specs[n] for n in dynamic)
    out_specs = (batch4, heads3) if with_lse else batch4
    key = (fn, mesh, len(args), dynamic, tuple(sorted(static.items())), specs, out_specs)
    try:
      program = _program(*key)
    except TypeError:  # an unhashable static value: a program for this call alone
      program = _program.__wrapped__(*key)
    return program(*args, *(kwargs[n] for n in dynamic))

  return call


@functools.lru_cache(maxsize=256)
def _program(fn, mesh, num_args, dynamic, static, specs, out_specs):
  """The jitted ``shard_map`` of one call's structure, kept so that eager calls of the same
  structure reuse its compiled executables (a new function each call would compile each
  time). Jitted: called eagerly, ``shard_map`` would dispatch every op of every shard one by
  one."""
  static = dict(static)

  def local(*xs):
    return fn(*xs[:num_args], **dict(zip(dynamic, xs[num_args:])), **static)

  return jax.jit(shard_map(local, mesh, specs, out_specs))


_STATIC = frozenset({"causal", "scale", "impl", "return_lse", "config", "softcap",
                     "local_window_size"})


def _check_divisible(fn: str, arg: str, n: int, what: str, axis: AxisName, size: int) -> None:
  if n % size:
    hint = (" (with fewer KV heads than head shards, replicate them: "
            "models.parallel.sharding.kv_replication)") if what == "key/value heads" else ""
    raise ValueError(f"sharded({fn}): {arg} has {n} {what}, not a multiple of the {size} "
                     f"shards of mesh axis {axis!r}{hint}")


def _lengths(x: Any, b: int, capacity: int) -> jax.Array:
  """A ``[B]`` int32 array for an optional per-sequence lengths argument."""
  return jnp.full((b,), capacity, jnp.int32) if x is None else jnp.asarray(x, jnp.int32)


def _specs_full(args, kwargs, batch4, shared4, shared3, batch1):
  q, k = args[0], args[1]
  kwargs["kv_lengths"] = _lengths(kwargs.get("kv_lengths"), q.shape[0], k.shape[1])
  return args, kwargs, {"args": (batch4, batch4, batch4), "kv_lengths": batch1}


def _specs_prefix(args, kwargs, batch4, shared4, shared3, batch1):
  q, pk, sk = args[0], args[1], args[3]
  kwargs["suffix_lengths"] = _lengths(kwargs.get("suffix_lengths"), q.shape[0], sk.shape[1])
  plen = kwargs.get("prefix_length")
  kwargs["prefix_length"] = jnp.asarray(pk.shape[0] if plen is None else plen, jnp.int32)
  return args, kwargs, {"args": (batch4, shared3, shared3, batch4, batch4),
                        "suffix_lengths": batch1, "prefix_length": P()}


def _specs_tree(args, kwargs, batch4, shared4, shared3, batch1):
  q, levels, sk = args[0], args[1], args[2]
  levels = [levels] if isinstance(levels, SharedLevel) else list(levels)
  args[1] = levels
  kwargs["suffix_lengths"] = _lengths(kwargs.get("suffix_lengths"), q.shape[0], sk.shape[1])
  level_specs = [SharedLevel(shared4, shared4, P(None), batch1, all_share=lv.all_share)
                 for lv in levels]
  return args, kwargs, {"args": (batch4, level_specs, batch4, batch4), "suffix_lengths": batch1}


_SPECS = types.MappingProxyType({attention_with_lse: _specs_full,
                                 shared_prefix_attention: _specs_prefix,
                                 hierarchical_attention: _specs_tree})
