"""The KV cache: per-sequence writes at each sequence's length, context lengths over a tree, bytes."""

import jax.numpy as jnp
import numpy as np
import pytest

from models.generation import cache as cache_lib
from models.generation.cache import KVCache, SegmentLevel
from models.model.config import preset

CONFIG = preset("tiny").replace(num_layers=3, num_kv_heads=2, head_dim=4, num_heads=4)


def per_layer(shape):
  """Zero K or V of a level: one ``shape[1:]`` buffer per layer (``shape[0]`` layers)."""
  return tuple(jnp.zeros(shape[1:]) for _ in range(shape[0]))


def test_write_lands_at_each_sequences_own_length_in_one_layer():
  cache = cache_lib.empty(CONFIG, 3, 6, lengths=[0, 2, 4])
  new = jnp.arange(3 * 2 * 2 * 4, dtype=jnp.float32).reshape(3, 2, 2, 4) + 1
  out = cache.write(1, new, -new).advance(2)
  k = np.stack([np.asarray(x) for x in out.k])  # [L, B, S, Hkv, D]
  for b, start in enumerate([0, 2, 4]):
    np.testing.assert_array_equal(k[1, b, start:start + 2], np.asarray(new[b]))
    np.testing.assert_array_equal(np.asarray(out.v[1])[b, start:start + 2], -np.asarray(new[b]))
  written = np.zeros_like(k, bool)
  for b, start in enumerate([0, 2, 4]):
    written[1, b, start:start + 2] = True
  assert (k[~written] == 0).all()  # nothing else touched (other layers, other positions)
  np.testing.assert_array_equal(np.asarray(out.lengths), [2, 4, 6])


def test_write_beyond_capacity_is_an_error_naming_the_capacity():
  cache = cache_lib.empty(CONFIG, 2, 5, lengths=[0, 4])
  with pytest.raises(ValueError, match="capacity of 5"):
    cache.write(0, jnp.zeros((2, 2, 2, 4)), jnp.zeros((2, 2, 2, 4)))


def test_context_lengths_follow_each_sequences_path():
  shape = (CONFIG.num_layers, 2, 7, 2, 4)
  level0 = SegmentLevel(per_layer(shape[:1] + (1,) + shape[2:]),
                        per_layer(shape[:1] + (1,) + shape[2:]), jnp.asarray([7]),
                        jnp.asarray([0, 0, 0, -1]))
  level1 = SegmentLevel(per_layer(shape), per_layer(shape), jnp.asarray([3, 5]),
                        jnp.asarray([1, -1, 0, -1]))
  cache = cache_lib.empty(CONFIG, 4, 2, levels=[level0, level1], lengths=[1, 2, 0, 1])
  np.testing.assert_array_equal(np.asarray(cache.context_lengths()), [7 + 5 + 1, 7 + 2, 7 + 3, 1])
  views = cache.shared_levels(2)
  assert len(views) == 2 and views[1].k.shape == (2, 7, 2, 4)


def test_bytes_count_shared_segments_once():
  per_token = cache_lib.kv_bytes_per_token(CONFIG)
  assert per_token == 2 * 3 * 2 * 4 * 4
  shared = per_layer((3, 1, 10, 2, 4))
  level = SegmentLevel(shared, shared, jnp.asarray([10]), jnp.zeros((64,), jnp.int32))
  cache = cache_lib.empty(CONFIG, 64, 5, levels=[level])
  assert cache.shared_nbytes == 10 * per_token
  assert cache.own_nbytes == 64 * 5 * per_token
  assert cache.nbytes == cache.shared_nbytes + cache.own_nbytes
  assert isinstance(cache, KVCache) and cache.capacity == 5 and cache.batch_size == 64


def test_empty_buffers_are_zero_and_each_its_own():
  """One program builds every layer's zeroed K and V; each is a buffer of its own (a program
  that donates one leaves the others alone)."""
  cache = cache_lib.empty(CONFIG, 2, 5, dtype="bfloat16", lengths=np.array([1, 3]))
  buffers = cache.k + cache.v
  assert len({x.unsafe_buffer_pointer() for x in buffers}) == 2 * CONFIG.num_layers
  for x in buffers:
    assert x.shape == (2, 5, CONFIG.num_kv_heads, CONFIG.head_dim) and x.dtype == jnp.bfloat16
    assert not np.asarray(x, np.float32).any()
  assert cache.lengths.dtype == jnp.int32 and cache.lengths.tolist() == [1, 3]
