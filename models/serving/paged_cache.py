"""The serving engine's KV cache: per layer one pool of pages, read through page tables.

Per layer, ``k[layer], v[layer]`` are ``[num_pages, page_size, Hkv, D]`` (page 0 is the null
page: padding reads it and padded writes land in it). With ``layer_pages = n`` (the layers
under one ``lax.scan``: the layer is a traced int) there is one pool of every layer's pages,
``k[0], v[0] [num_layers * n, page_size, Hkv, D]``: layer l's page p is row ``l * n + p``
(each layer its own null page, ``l * n``), and the tables below hold per-layer ids that each
call offsets by ``l * n``. A step's arrays say what each row (a
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
    layer_pages: static: 0, one pool per layer; n > 0, one pool of all layers' pages, n per
      layer (the layer index may then be traced).
  """

  k: tuple[Array, ...]
  v: tuple[Array, ...]
  page_table: Array
  seg_lengths: Array
  segment_of_seq: Array
  own_page_table: Array
  own_lengths: Array
  write_limit: Array
  layer_pages: int = dataclasses.field(default=0, metadata=dict(static=True))

  @property
  def page_size(self) -> int:
    return self.k[0].shape[1]

  def pools(self, layer) -> tuple[Array, Array, Array]:
    """``(k, v, offset)``: the pools holding ``layer``'s pages and the id of its page 0 there."""
    if self.layer_pages:
      return self.k[0], self.v[0], jnp.asarray(layer, jnp.int32) * self.layer_pages
    return self.k[layer], self.v[layer], jnp.int32(0)

  def with_pools(self, layer, k: Array, v: Array) -> "PagedKVCache":
    """This cache with :meth:`pools`' arrays of ``layer`` replaced by ``k, v``."""
    if self.layer_pages:
      return dataclasses.replace(self, k=(k,), v=(v,))
    ks, vs = list(self.k), list(self.v)
    ks[layer], vs[layer] = k, v
    return dataclasses.replace(self, k=tuple(ks), v=tuple(vs))

  def tables(self, offset) -> tuple[Array, ...]:
    """The step's attention arrays with page ids offset by ``offset`` (a layer's page 0 in its
    pool): ``(page_table, seg_lengths, segment_of_seq, own_page_table, own_lengths)``."""
    return (self.page_table + offset, self.seg_lengths, self.segment_of_seq,
            self.own_page_table + offset, self.own_lengths)

  def context_lengths(self) -> Array:
    """int32 ``[B]``: tokens before this step's (shared levels + own): the next position."""
    total = self.own_lengths
    for l in range(self.page_table.shape[0]):
      seg = self.segment_of_seq[l]
      total = total + jnp.where(seg >= 0, self.seg_lengths[l][jnp.maximum(seg, 0)], 0)
    return total.astype(jnp.int32)

  def write(self, layer, k_new: Array, v_new: Array) -> "PagedKVCache":
    """Stores ``k_new, v_new [B, T, Hkv, D]`` at own positions ``own_lengths[b] + t``."""
    k, v, offset = self.pools(layer)
    return self.with_pools(layer, *write_pages(k, v, k_new, v_new, self.own_page_table + offset,
                                               self.own_lengths, self.write_limit,
                                               NULL_PAGE + offset))

  def advance(self, t: int) -> "PagedKVCache":
    return dataclasses.replace(self, own_lengths=self.own_lengths + t)

  def attention(self, xq: Array, layer: int, t: int, settings, sharding=None,
                **variants) -> Array:
    """Causal attention of ``xq [B, T, Hq, D]`` over the shared levels and own keys, with the
    layer's ``variants`` (``scale``, ``softcap``, ``local_window_size``), as
    :meth:`models.generation.cache.KVCache.attention`."""
    if sharding is not None:
      raise ValueError("PagedKVCache runs without a mesh only (sharding must be None)")
    k, v, offset = self.pools(layer)
    return attend_pages(xq, k, v, *self.tables(offset), t=t, settings=settings, **variants)


def write_pages(k: Array, v: Array, k_new: Array, v_new: Array, own_page_table: Array,
                own_lengths: Array, write_limit: Array, null_page) -> tuple[Array, Array]:
  """:meth:`PagedKVCache.write` on one pool: new token t of row b at own position
  ``own_lengths[b] + t``, to page ``own_page_table[b, p // page_size]`` (``null_page`` past
  ``write_limit[b]`` or the table)."""
  t = k_new.shape[1]
  ps, width = k.shape[1], own_page_table.shape[1]
  pos = own_lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
  slot = pos // ps
  page = jnp.take_along_axis(own_page_table, jnp.minimum(slot, width - 1), axis=1)
  page = jnp.where((pos < write_limit[:, None]) & (slot < width), page, null_page)
  return (k.at[page, pos % ps].set(k_new.astype(k.dtype)),
          v.at[page, pos % ps].set(v_new.astype(v.dtype)))


def attend_pages(xq: Array, k: Array, v: Array, page_table, seg_lengths, segment_of_seq,
                 own_page_table, own_lengths, *, t: int, settings, **variants) -> Array:
  """:meth:`PagedKVCache.attention` on one pool whose page ids the tables hold."""
  levels = [PagedLevel(page_table[l], seg_lengths[l], segment_of_seq[l])
            for l in range(page_table.shape[0])]
  return paged_attention(xq, k, v, own_page_table, own_lengths + t, levels=levels, causal=True,
                         impl=settings.impl, config=settings.config, **variants)


def empty_pools(config: LlamaConfig, num_pages: int, page_size: int, dtype=None, *,
                one_pool: bool = False):
  """Zeroed pools ``k, v``: tuples of ``[num_pages, page_size, Hkv, D]`` per layer, or with
  ``one_pool`` 1-tuples of ``[num_layers * num_pages, page_size, Hkv, D]``
  (``PagedKVCache.layer_pages = num_pages``)."""
  dtype = config.param_dtype if dtype is None else jnp.dtype(dtype)
  shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
  if one_pool:
    whole = (config.num_layers * num_pages,) + shape[1:]
    return (jnp.zeros(whole, dtype),), (jnp.zeros(whole, dtype),)
  layers = range(config.num_layers)
  return (tuple(jnp.zeros(shape, dtype) for _ in layers),
          tuple(jnp.zeros(shape, dtype) for _ in layers))
