"""The serving engine's KV cache: per layer one pool of pages, read through page tables.

Per layer, ``k[layer], v[layer]`` are ``[num_pages, page_size, Hkv, D]`` (page 0 is the null
page: padding reads it and padded writes land in it). A step's arrays say what each row (a
running sequence, in the cascade plan's depth-first order) reads and where its new tokens go:

- shared levels (:class:`models.serving.cascade.CascadePlan`): ``page_table [L, S, P]``,
  ``seg_lengths [L, S]``, ``segment_of_seq [L, B]``; each segment is read once for the queries
  of all rows that continue it;
- own keys: ``own_page_table [B, O]`` and ``own_lengths [B]`` (tokens before this step's);
  new token t of row b is position ``own_lengths[b] + t`` of its own keys, written to page
  ``own_page_table[b, p // page_size]`` at offset ``p % page_size`` if ``p < write_limit[b]``
  (else to the null page: padding tokens, padding rows, steps past a row's budget).

Attention is :func:`jax_shared_attn.paged_attention` with ``settings.impl`` and
``settings.config``: on GPUs its kernels read the pages in place; the XLA path (a CPU) gathers
them first. The decoder sees the same two methods as :class:`models.generation.cache.KVCache`:
``write(layer, k, v)`` and ``attention(q, layer, t, settings, sharding, **variants)``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jax_shared_attn import PagedLevel, paged_attention
from models.model.config import LlamaConfig
from models.serving.pages import NULL_PAGE

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """Page pools plus one step's page tables (a pytree; every array is data).

  Attributes:
    k, v: per layer ``[num_pages, page_size, Hkv, D]``.
    page_table: int32 ``[L, S, P]``: shared segments' pages (L may be 0: no shared levels).
    seg_lengths: int32 ``[L, S]``: tokens of each segment.
    segment_of_seq: int32 ``[L, B]``: the segment row b reads at each level, -1 for none.
    own_page_table: int32 ``[B, O]``: each row's own pages in token order.
    own_lengths: int32 ``[B]``: own tokens before this step's new ones.
    write_limit: int32 ``[B]``: own positions ``>= write_limit[b]`` are not stored.
  """

  k: tuple[Array, ...]
  v: tuple[Array, ...]
  page_table: Array
  seg_lengths: Array
  segment_of_seq: Array
  own_page_table: Array
  own_lengths: Array
  write_limit: Array

  @property
  def page_size(self) -> int:
    return self.k[0].shape[1]

  def context_lengths(self) -> Array:
    """int32 ``[B]``: tokens before this step's (shared levels + own): the next position."""
    total = self.own_lengths
    for l in range(self.page_table.shape[0]):
      seg = self.segment_of_seq[l]
      total = total + jnp.where(seg >= 0, self.seg_lengths[l][jnp.maximum(seg, 0)], 0)
    return total.astype(jnp.int32)

  def write(self, layer: int, k_new: Array, v_new: Array) -> "PagedKVCache":
    """Stores ``k_new, v_new [B, T, Hkv, D]`` at own positions ``own_lengths[b] + t``."""
    b, t = k_new.shape[:2]
    ps, width = self.page_size, self.own_page_table.shape[1]
    pos = self.own_lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    slot = pos // ps
    page = jnp.take_along_axis(self.own_page_table, jnp.minimum(slot, width - 1), axis=1)
    page = jnp.where((pos < self.write_limit[:, None]) & (slot < width), page, NULL_PAGE)
    k, v = list(self.k), list(self.v)
    k[layer] = k[layer].at[page, pos % ps].set(k_new.astype(k[layer].dtype))
    v[layer] = v[layer].at[page, pos % ps].set(v_new.astype(v[layer].dtype))
    return dataclasses.replace(self, k=tuple(k), v=tuple(v))

  def advance(self, t: int) -> "PagedKVCache":
    return dataclasses.replace(self, own_lengths=self.own_lengths + t)

  def attention(self, xq: Array, layer: int, t: int, settings, sharding=None,
                **variants) -> Array:
    """Causal attention of ``xq [B, T, Hq, D]`` over the shared levels and own keys, with the
    layer's ``variants`` (``scale``, ``softcap``, ``local_window_size``), as
    :meth:`models.generation.cache.KVCache.attention`."""
    if sharding is not None:
      raise ValueError("PagedKVCache runs without a mesh only (sharding must be None)")
    levels = [PagedLevel(self.page_table[l], self.seg_lengths[l], self.segment_of_seq[l])
              for l in range(self.page_table.shape[0])]
    return paged_attention(xq, self.k[layer], self.v[layer], self.own_page_table,
                           self.own_lengths + t, levels=levels, causal=True,
                           impl=settings.impl, config=settings.config, **variants)


def empty_pools(config: LlamaConfig, num_pages: int, page_size: int, dtype=None):
  """Zeroed per-layer pools ``k, v``: tuples of ``[num_pages, page_size, Hkv, D]``."""
  dtype = config.param_dtype if dtype is None else jnp.dtype(dtype)
  shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
  layers = range(config.num_layers)
  return (tuple(jnp.zeros(shape, dtype) for _ in layers),
          tuple(jnp.zeros(shape, dtype) for _ in layers))
