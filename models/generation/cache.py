"""The KV cache: shared segments stored once, plus each sequence's own K/V.

Sequence b's context is, level by level, the shared segment it continues at
that level (a tree: Hydragen Sec. 3.3), then its own tokens::

    levels[0].k[layer][levels[0].node_of_seq[b], :levels[0].lengths[...]]  (e.g. the few-shot prompt)
    levels[1].k[layer][levels[1].node_of_seq[b], :levels[1].lengths[...]]  (e.g. this problem's text)
    ...
    k[layer][b, :lengths[b]]                                             (this sample's tokens)

Each layer's K/V is its own buffer (a tuple over layers), not a slice of one
``[L, ...]`` array: the attention kernels are custom calls, and XLA copies a
slice before passing it to one, which would copy every layer's cache on every
decode step.
A shared segment's K/V exists ONCE, whatever the number of sequences that
continue it: that is the memory saving the paper's Section 4.4 turns into a
larger batch. The "standard" baseline is the same structure with no levels
and the whole prompt copied into every sequence's own buffer.

Shapes are static (jit-friendly); lengths are int32 arrays. A cache is a
pytree, so jitted steps take it as an argument and donate it: the per-token
writes (:meth:`KVCache.write`) are then in-place scatters.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jax_shared_attn import SharedLevel, attention_with_lse, hierarchical_attention
from jax_shared_attn.sharding import AttentionSharding, sharded
from models.model.config import LlamaConfig

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SegmentLevel:
  """One level of the sharing tree, for all layers.

  Attributes:
    k, v: per layer, ``[N, T, Hkv, D]``: the level's N segments (padded to T tokens).
    lengths: int32 ``[N]``: valid tokens of each segment.
    node_of_seq: int32 ``[B]``: the segment sequence b continues, or -1.
    all_share: static: one segment continued by every sequence (see
      :class:`jax_shared_attn.SharedLevel`); set by :func:`models.generation.loop.prefill`.
  """

  k: tuple[Array, ...]
  v: tuple[Array, ...]
  lengths: Array
  node_of_seq: Array
  all_share: bool = dataclasses.field(default=False, metadata=dict(static=True))

  def layer(self, i: int) -> SharedLevel:
    """The core's view of this level at layer ``i`` (``k, v [N, T, Hkv, D]``)."""
    return SharedLevel(self.k[i], self.v[i], self.lengths, self.node_of_seq,
                       all_share=self.all_share)

  def context_lengths(self) -> Array:
    """int32 ``[B]``: tokens this level adds to each sequence's context (0 where -1)."""
    nodes = self.node_of_seq
    return jnp.where(nodes >= 0, self.lengths[jnp.maximum(nodes, 0)], 0).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Shared levels plus per-sequence K/V buffers.

  Attributes:
    levels: tuple of :class:`SegmentLevel` (empty for the standard baseline).
    k, v: per layer, ``[B, S, Hkv, D]``: each sequence's own keys/values, capacity S.
    lengths: int32 ``[B]``: valid own tokens of each sequence.
  """

  levels: tuple[SegmentLevel, ...]
  k: tuple[Array, ...]
  v: tuple[Array, ...]
  lengths: Array

  @property
  def num_layers(self) -> int:
    return len(self.k)

  @property
  def batch_size(self) -> int:
    return self.k[0].shape[0]

  @property
  def capacity(self) -> int:
    """S: own tokens each sequence can hold."""
    return self.k[0].shape[1]

  def context_lengths(self) -> Array:
    """int32 ``[B]``: the tokens each sequence attends to (shared + own)."""
    total = self.lengths
    for level in self.levels:
      total = total + level.context_lengths()
    return total

  def shared_levels(self, layer: int) -> list[SharedLevel]:
    return [level.layer(layer) for level in self.levels]

  def write(self, layer: int, k_new: Array, v_new: Array) -> "KVCache":
    """Stores ``k_new, v_new [B, T, Hkv, D]`` at own positions ``lengths[b] + t``.

    ``lengths`` is not advanced here (every layer writes at the same
    positions): call :meth:`advance` once per forward pass. Writes past the
    capacity are dropped, never wrapped; the public entry points check
    capacity before running (and so does this method on concrete lengths).
    """
    b, t = k_new.shape[:2]
    longest = _concrete_max(self.lengths)
    if longest is not None and longest + t > self.capacity:
      raise ValueError(f"KVCache.write: {t} new token(s) after {longest} exceed the cache "
                       f"capacity of {self.capacity} tokens per sequence (k[layer].shape[1])")
    rows = jnp.arange(b)[:, None]  # [B, 1]
    cols = self.lengths[:, None] + jnp.arange(t)[None, :]  # [B, T]
    k, v = list(self.k), list(self.v)
    # (b, lengths[b] + t) pairs are distinct and in order: XLA may then write without atomics.
    put = dict(mode="drop", unique_indices=True, indices_are_sorted=True)
    k[layer] = k[layer].at[rows, cols].set(k_new.astype(k[layer].dtype), **put)
    v[layer] = v[layer].at[rows, cols].set(v_new.astype(v[layer].dtype), **put)
    return dataclasses.replace(self, k=tuple(k), v=tuple(v))

  def advance(self, t: int) -> "KVCache":
    return dataclasses.replace(self, lengths=self.lengths + t)

  def attention(self, xq: Array, layer: int, t: int, settings,
                sharding: Optional[AttentionSharding] = None, **variants) -> Array:
    """Causal attention of the T new queries ``xq [B, T, Hq, D]`` over the shared levels and
    own K/V of ``layer`` (written by :meth:`write` just before). ``variants``: the layer's
    ``scale``, ``softcap``, ``local_window_size`` (:meth:`models.model.llama.Attention.variants`),
    passed on as they are: positions count through the levels, then the own tokens, as the
    model's positions do."""
    own_k, own_v = self.k[layer], self.v[layer]  # [B, S, Hkv, D]
    own_lengths = self.lengths + t
    if self.levels:  # Hydragen: each shared segment attended once by all its sequences' queries
      return per_shard(hierarchical_attention, sharding)(
          xq, self.shared_levels(layer), own_k, own_v, suffix_lengths=own_lengths, causal=True,
          impl=settings.impl, config=settings.config, **variants)
    out, _ = per_shard(attention_with_lse, sharding)(xq, own_k, own_v, kv_lengths=own_lengths,
                                                     causal=True, impl=settings.impl,
                                                     config=settings.config, **variants)
    return out

  # -- accounting -----------------------------------------------------------------------------

  @property
  def shared_nbytes(self) -> int:
    """Bytes of the shared segments' K/V (stored once, whatever the batch)."""
    return sum(x.nbytes for level in self.levels for x in level.k + level.v)

  @property
  def own_nbytes(self) -> int:
    """Bytes of the per-sequence K/V buffers."""
    return sum(x.nbytes for x in self.k + self.v)

  @property
  def nbytes(self) -> int:
    return self.shared_nbytes + self.own_nbytes


def per_shard(fn, sharding: Optional[AttentionSharding]):
  """``fn`` itself, or on a mesh ``fn`` under shard_map: each device runs it (kernels
  included) on its sequences x heads block, with no communication (models.parallel.sharding)."""
  return fn if sharding is None else sharded(fn, *sharding)


def _concrete_max(lengths: Array):
  """``max(lengths)`` as an int when the lengths are concrete (outside jit), else None."""
  if lengths.size == 0:
    return 0
  if isinstance(lengths, jax.core.Tracer):  # no int(): its error costs ~50 ms per layer to build
    return None
  try:
    return int(jnp.max(lengths))
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
    return None  # traced: the entry points checked capacity before tracing


def empty(config: LlamaConfig, batch_size: int, capacity: int, *,
          levels: Sequence[SegmentLevel] = (), lengths=None, dtype=None,
          sharding: Optional[NamedSharding] = None) -> KVCache:
  """A cache with zeroed own buffers, per layer ``[batch_size, capacity, Hkv, D]``.

  ``sharding``: the own buffers' layout on a mesh
  (:func:`models.parallel.rules.own_kv_sharding`): each buffer is created on its shards, never
  whole on one device, and the lengths follow its batch axis. None: the default device.
  """
  dtype = config.param_dtype if dtype is None else jnp.dtype(dtype)
  shape = (batch_size, capacity, config.num_kv_heads, config.head_dim)
  lengths = np.zeros((batch_size,), np.int32) if lengths is None else lengths
  if sharding is None:
    # Host values are copied over as they are (jnp.asarray would run a device program).
    lengths = (jnp.asarray(lengths, jnp.int32) if isinstance(lengths, jax.Array)
               else jax.device_put(np.asarray(lengths, np.int32)))
    k, v = _zero_buffers(shape, dtype, config.num_layers)
    return KVCache(tuple(levels), k, v, lengths)
  lengths = jax.device_put(np.asarray(lengths, np.int32),
                           NamedSharding(sharding.mesh, PartitionSpec(sharding.spec[0])))
  layers = range(config.num_layers)
  zeros = lambda: jnp.zeros(shape, dtype, device=sharding)
  return KVCache(tuple(levels), tuple(zeros() for _ in layers), tuple(zeros() for _ in layers),
                 lengths)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _zero_buffers(shape: tuple[int, ...], dtype, count: int):
  """``count`` zeroed K buffers and as many V buffers of ``shape``: one program, not a
  dispatch per buffer (each output is a buffer of its own)."""
  zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(count))
  return zeros(), zeros()


def kv_bytes_per_token(config: LlamaConfig, dtype=None) -> int:
  """Bytes of K and V of one token across all layers."""
  dtype = config.param_dtype if dtype is None else jnp.dtype(dtype)
  return 2 * config.num_layers * config.num_kv_heads * config.head_dim * np.dtype(dtype).itemsize
