"""Values onto their shards: parameters (whole, or read block by block from a checkpoint), a
model, a decode state. Each device receives only its block."""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from models.model import graph as model_graph
from models.model.config import LlamaConfig
from models.parallel.mesh import MODEL, MeshSpec, make_mesh
from models.parallel.rules import (check_batch, kv_head_axis, kv_replication, param_spec,
                                   sharded_config,
                                   state_shardings)


def place_param(path: str, value: Any, config: LlamaConfig, mesh: Mesh, dtype=None) -> jax.Array:
  """``value`` on its shards of ``mesh``: cast, KV heads repeated if needed, then placed.

  A host (NumPy) array is cast on the host and ``jax.device_put`` sends each
  device only its shard: no full copy lands on one device first. ``config``
  may be the original or the sharded one (:func:`sharded_config`): KV heads
  are repeated up to ``lcm(value heads, m)``, so placing twice is a no-op.
  """
  dtype = jnp.dtype(config.param_dtype if dtype is None else dtype)
  if isinstance(value, jax.Array):
    xp = jnp  # already on devices (shard_model): repeat there, then reshard
  else:
    value, xp = np.asarray(value), np
  if value.dtype != dtype:
    value = value.astype(dtype)
  axis = kv_head_axis(path)
  if axis is not None:  # k_proj [hidden, Hkv, D], k_bias [Hkv, D], ...
    r = kv_replication(value.shape[axis], mesh.shape[MODEL])
    if r > 1:
      value = xp.repeat(value, r, axis=axis)  # head j of the result is original head j // r
  return jax.device_put(value, NamedSharding(mesh, param_spec(path, config, mesh)))


def place_param_from(path: str, shape: Sequence[int], read, config: LlamaConfig, mesh: Mesh,
                     dtype=None) -> jax.Array:
  """Parameter ``path`` on its shards of ``mesh``, each block read by ``read`` as it is needed.

  ``read(index)`` returns the block ``index`` (a tuple of slices into
  ``shape``, the parameter's own shape) as a NumPy array. Every process
  calls ``read`` only for the blocks its own devices hold (each sent by an
  explicit ``device_put`` to its device), so under ``jax.distributed`` no host
  reads tensors or parts of them that it does not place. KV heads are repeated
  (:func:`kv_replication`) from the original heads each block covers.
  """
  dtype = jnp.dtype(config.param_dtype if dtype is None else dtype)
  shape = tuple(int(n) for n in shape)
  axis = kv_head_axis(path)  # k_proj [hidden, Hkv, D], k_bias [Hkv, D], ...
  r = 1 if axis is None else kv_replication(shape[axis], mesh.shape[MODEL])
  global_shape = shape if r == 1 else shape[:axis] + (shape[axis] * r,) + shape[axis + 1:]

  blocks = {}  # devices holding the same block (replicas over "data") read it once

  def block(index):
    index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, global_shape))
    key = tuple((s.start, s.stop) for s in index)
    if key not in blocks:
      if r == 1:
        x = np.asarray(read(index))
      else:  # replicated head j is original head j // r
        lo, hi = index[axis].start, index[axis].stop
        first = lo // r
        heads = index[:axis] + (slice(first, -(-hi // r)),) + index[axis + 1:]
        x = np.repeat(np.asarray(read(heads)), r, axis=axis)
        x = np.take(x, np.arange(lo - first * r, hi - first * r), axis=axis)
      blocks[key] = x.astype(dtype, copy=False)
    return blocks[key]

  # As jax.make_array_from_callback, with each block sent by an explicit device_put.
  sharding = NamedSharding(mesh, param_spec(path, config, mesh))
  arrays = [jax.device_put(block(index), device)
            for device, index in sharding.addressable_devices_indices_map(global_shape).items()]
  return jax.make_array_from_single_device_arrays(global_shape, sharding, arrays)


# Models found laid out on a mesh: (the model, weakly; the mesh; its weights' shardings then).
_PLACED: dict[int, tuple[weakref.ref, Mesh, list]] = {}


def _shardings(model) -> list:
  return [getattr(w, "sharding", None) for w in model_graph.split(model)[1]]


def shard_model(model, mesh: MeshSpec):
  """``model`` with every parameter on its shards of ``mesh`` (see the rules table).

  Returns the model itself when it is laid out so already (checked once per model, then by its
  weights' shardings alone: a decode call on a mesh does not walk the graph); otherwise a new
  model of the same class (with ``num_kv_heads`` replicated where the model
  axis needs it: :func:`sharded_config`). Works on any NNX module built as
  ``cls(config, rngs=...)`` whose parameter paths the rules name, so this
  module needs no import of :mod:`models.model.llama` (which imports this one).
  """
  mesh = make_mesh(mesh)
  placed_as = _PLACED.get(id(model))
  if (placed_as is not None and placed_as[0]() is model and placed_as[1] == mesh
      and _shardings(model) == placed_as[2]):
    return model  # laid out as when last checked: no walk of the graph
  config = sharded_config(model.config, mesh)
  graphdef, state = nnx.split(model)
  tree = nnx.to_pure_dict(state)
  dotted = lambda keypath: ".".join(str(k.key) for k in keypath)
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  if config == model.config and all(
      getattr(v, "sharding", None) == NamedSharding(mesh, param_spec(dotted(p), config, mesh))
      for p, v in leaves):
    key = id(model)
    _PLACED[key] = (weakref.ref(model, lambda _, key=key: _PLACED.pop(key, None)), mesh,
                    _shardings(model))
    return model
  placed = jax.tree_util.tree_map_with_path(
      lambda p, v: place_param(dotted(p), v, model.config, mesh), tree)
  if config != model.config:  # new KV head count: the graph of the model with those heads
    graphdef, state = nnx.split(nnx.eval_shape(lambda: type(model)(config, rngs=nnx.Rngs(0))))
  nnx.replace_by_pure_dict(state, placed)
  return nnx.merge(graphdef, state)


def shard_state(state, mesh: Mesh):
  """``state`` placed by :func:`state_shardings` (arrays already in place are not copied)."""
  check_batch(state.batch_size, mesh, "the decode state's batch")
  return jax.device_put(state, state_shardings(state, mesh))
