"""Steps of the decode loop run per shard under ``shard_map`` (each device on its own block, no
communication the partitioner would add): the cache write and the vocab-parallel sampler."""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, PartitionSpec as P

from jax_shared_attn.sharding import AttentionSharding, shard_map
from models.generation.cache import KVCache
from models.parallel.mesh import DATA


def write_per_shard(cache: KVCache, layer: int, k_new: jax.Array, v_new: jax.Array,
                    sharding: AttentionSharding) -> KVCache:
  """:meth:`KVCache.write` with each device scattering its own block (sequences x KV heads).

  Left to the SPMD partitioner, the scatter into a batch-sharded buffer
  all-gathers the new tokens' K/V and indices over "data" every layer and
  step; per shard it is a local in-place scatter with no communication.
  """
  own = P(sharding.batch_axis, None, sharding.head_axis, None)

  def local(k_buf, v_buf, lengths, k, v):
    shard = KVCache((), (k_buf,), (v_buf,), lengths).write(0, k, v)
    return shard.k[0], shard.v[0]

  k_layer, v_layer = shard_map(local, sharding.mesh, (own, own, P(sharding.batch_axis), own, own),
                               (own, own))(cache.k[layer], cache.v[layer], cache.lengths,
                                           k_new, v_new)
  k, v = list(cache.k), list(cache.v)
  k[layer], v[layer] = k_layer, v_layer
  return dataclasses.replace(cache, k=tuple(k), v=tuple(v))


def sample_on_mesh(logits: jax.Array, keys: jax.Array, params, config=None, *,
                   mesh: Mesh) -> jax.Array:
  """:func:`models.generation.sampling.sample` for vocab-parallel logits ``[B, V]`` (rows on "data").

  Greedy and plain temperature draws are arg-max reductions over the split
  vocabulary (a tiny all-reduce). top-k/top-p sort each row's whole
  vocabulary: each data shard gathers its own rows over "model" and samples
  them locally (left to the partitioner, ``top_k`` gathered every row of the
  batch onto every device). Same tokens either way: rows are independent.
  """
  from models.generation.sampling import sample

  if params.top_k is None and params.top_p is None:
    return sample(logits, keys, params, config)
  rows = P(DATA)
  return shard_map(lambda l, k: sample(l, k, params, config), mesh, (P(DATA, None), rows), rows)(
      logits, keys)
