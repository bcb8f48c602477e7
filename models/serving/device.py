"""The engine's device programs: a prefill pass over the paged cache (several requests' chunks,
one per row), ``num_steps`` decode steps with sampling (and log-probabilities), and the copy
of a page.

Every program is keyed by shapes (the padded sizes of the plan and the chunks) and by static
values (the settings, the step count, the top-log-prob size, the mesh); page ids, lengths,
tokens, seeds and each row's sampling rule (:class:`models.serving.sampling.RowRules`) are
data.

On a mesh (tensor parallel: the "model" axis), the weights lie by the rules of
:mod:`models.parallel.sharding`, the page pools ``[num_pages, page_size, Hkv, D]`` are split
over their KV heads, and :class:`HeadShardedPagedKVCache` writes and attends per shard under
``shard_map`` (every device its own KV heads and their query heads: no communication); the
logits are gathered before sampling, so every device draws the same tokens.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_shared_attn.sharding import shard_map

from models.generation.settings import GenerationSettings
from models.model import graph as model_graph
from models.model.llama import layers_scannable, stack_layers
from models.parallel.mesh import MODEL
from models.serving.pages import NULL_PAGE
from models.serving.paged_cache import PagedKVCache, attend_pages, write_pages
from models.serving.sampling import RowRules, sample_rows


def keys_of(seeds, sample_ids, steps):
  """Per row ``fold_in(fold_in(key(seed), sample_id), step)``: :func:`sampling_keys`'s rule."""
  one = lambda s, i, t: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), i), t)
  return jax.vmap(one)(seeds, sample_ids, steps)


_DATA_FIELDS = [f.name for f in dataclasses.fields(PagedKVCache) if f.name != "layer_pages"]
HEADS = P(None, None, MODEL, None)  # pools [pages, ps, Hkv, D] and q/k/v [B, T, H, D]


@functools.partial(jax.tree_util.register_dataclass, data_fields=_DATA_FIELDS,
                   meta_fields=["layer_pages", "mesh"])
@dataclasses.dataclass(frozen=True)
class HeadShardedPagedKVCache(PagedKVCache):
  """:class:`PagedKVCache` with pools split over ``mesh``'s "model" axis by KV head: each
  device writes and attends its own heads (``shard_map``); page tables are replicated."""

  mesh: Optional[Mesh] = None

  def write(self, layer, k_new, v_new) -> "HeadShardedPagedKVCache":
    k, v, offset = self.pools(layer)
    k, v = shard_map(write_pages, self.mesh, (HEADS,) * 4 + (P(),) * 4, (HEADS, HEADS))(
        k, v, k_new, v_new, self.own_page_table + offset, self.own_lengths, self.write_limit,
        NULL_PAGE + offset)
    return self.with_pools(layer, k, v)

  def attention(self, xq, layer, t: int, settings, sharding=None, **variants):
    if sharding is not None:
      raise ValueError("HeadShardedPagedKVCache carries its mesh: sharding must be None")
    k, v, offset = self.pools(layer)
    tables = self.tables(offset)
    # The scale, soft-cap and window are the same on every shard; ALiBi slopes [Hq] split with
    # their query heads.
    slopes = variants.pop("alibi_slopes", None)
    if slopes is None:
      def local(xq, k, v, *tables):
        return attend_pages(xq, k, v, *tables, t=t, settings=settings, **variants)

      return shard_map(local, self.mesh, (HEADS,) * 3 + (P(),) * 5, HEADS)(xq, k, v, *tables)

    def local_alibi(xq, k, v, slopes, *tables):
      return attend_pages(xq, k, v, *tables, t=t, settings=settings, alibi_slopes=slopes,
                          **variants)

    return shard_map(local_alibi, self.mesh, (HEADS,) * 3 + (P(MODEL),) + (P(),) * 5, HEADS)(
        xq, k, v, slopes, *tables)


@dataclasses.dataclass(frozen=True, eq=False)
class ScannedGraph(model_graph.HashedOnce):
  """The graph of a model whose layers run under one ``lax.scan`` (``EngineConfig.scan_layers``):
  the whole model's graph, layer 0's, and the layer count. Its weights are ``(rest, stacked)``:
  the model's state without the layers, and :func:`models.model.llama.stack_layers`' stack.
  Hashed once (jit hashes its static arguments at every call)."""

  model: nnx.GraphDef
  layer: nnx.GraphDef
  num_layers: int


def scan_by_default(model_config, platform: str) -> bool:
  """``EngineConfig.scan_layers=None`` resolved: the layers under one scan when they run the
  same code (:func:`models.model.llama.layers_scannable`), except on a GPU. There XLA copies
  each layer's weight slices out of the stack before its GEMMs at every step (a read and a
  write of the weights per step), which costs more than the longer compiles of the unrolled
  layers. On a CPU the scan's shorter compiles win; a TPU keeps the scan (not measured there).
  ``platform`` is a device's ``platform`` (``"cpu"``, ``"gpu"``, ``"tpu"``)."""
  return layers_scannable(model_config) and platform != "gpu"


def split_model(model, scan_layers: bool):
  """``(graph, weights)`` of ``model`` for the programs here: :func:`models.model.graph.split`'s
  (a :class:`~models.model.graph.Graph` and the weights as a flat list), or with ``scan_layers``
  a :class:`ScannedGraph` and ``(rest, stacked)``."""
  if not scan_layers:
    return model_graph.split(model)
  graphdef, state = nnx.split(model)
  layer_def, stacked = stack_layers(model)
  rest = nnx.State({k: v for k, v in state.items() if k != "layers"})
  return ScannedGraph(graphdef, layer_def, model.config.num_layers), (rest, stacked)


def _merge(graph, weights):
  """``(model, stacked_layers)`` for ``model(..., stacked_layers=...)``."""
  if not isinstance(graph, ScannedGraph):
    return graph.merge(weights), None
  rest, stacked = weights
  # The unrolled layers' weights are never read under the scan: each is the stack (no copy).
  layers = nnx.State({i: stacked for i in range(graph.num_layers)})
  return nnx.merge(graph.model, nnx.State({**rest, "layers": layers})), (graph.layer, stacked)


def layer_pages(graph, k) -> int:
  """:attr:`PagedKVCache.layer_pages` of pools ``k`` for ``graph``: 0 (one pool per layer)
  unless the layers run under a scan (one pool of all layers' pages)."""
  return k[0].shape[0] // graph.num_layers if isinstance(graph, ScannedGraph) else 0


def _cache(graph, mesh: Optional[Mesh], k, v, *arrays) -> PagedKVCache:
  pages = layer_pages(graph, k)
  if mesh is None:
    return PagedKVCache(k, v, *arrays, layer_pages=pages)
  return HeadShardedPagedKVCache(k, v, *arrays, layer_pages=pages, mesh=mesh)


def pool_sharding(mesh: Mesh) -> NamedSharding:
  """Where a page pool ``[num_pages, page_size, Hkv, D]`` lies on ``mesh``: KV heads on "model"."""
  return NamedSharding(mesh, HEADS)


def no_levels(b: int):
  """The cascade arrays of a step without shared levels (one shape for every such step)."""
  return np.zeros((0, 1, 1), np.int32), np.zeros((0, 1), np.int32), np.zeros((0, b), np.int32)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("settings", "mesh"),
                   donate_argnums=(2, 3))
def prefill(graphdef, params, k, v, tokens, page_table, start, end, *,
            settings: GenerationSettings, mesh: Optional[Mesh] = None):
  """Writes the K/V of ``tokens [R, T]``: row r's chunk at positions ``start[r] + t`` of the
  pages ``page_table [R, W]`` (each row its own request; positions ``>= end[r]``, the padding,
  are not stored); attention reads each row's own pages only. Returns ``(k, v)``."""
  model, stacked = _merge(graphdef, params)
  cache = _cache(graphdef, mesh, k, v, *no_levels(tokens.shape[0]), page_table, start, end)
  _, cache = model(tokens, cache=cache, settings=settings, stacked_layers=stacked)
  return cache.k, cache.v


@functools.partial(jax.jit, static_argnums=0,
                   static_argnames=("num_steps", "top_logprobs", "settings", "mesh"),
                   donate_argnums=(2, 3))
def decode(graphdef, params, k, v, tokens, page_table, seg_lengths, segment_of_seq,
           own_page_table, own_lengths, write_limit, rules: RowRules, seeds, sample_ids,
           first_step, *, num_steps: int, settings: GenerationSettings, top_logprobs: int = 0,
           mesh: Optional[Mesh] = None):
  """``num_steps`` decode steps of ``tokens [B, 1]`` over the paged cache (the cascade plan's
  arrays: :class:`PagedKVCache`); row b samples by its rule in ``rules`` with the key of
  (``seeds[b]``, ``sample_ids[b]``, ``first_step[b] + step``) and feeds the token back.

  Log-probabilities are ``log_softmax`` of the model's raw logits in float32 (before the
  row's temperature, top-k and top-p, as vLLM returns them by default).

  Returns ``(k, v, tokens int32 [B, num_steps], logprobs float32 [B, num_steps], top_ids
  int32 [B, num_steps, top_logprobs], top_values float32 [B, num_steps, top_logprobs])``:
  each sampled token's log-prob and the ``top_logprobs`` most likely tokens (descending;
  a static size, so 0 compiles no top-k).
  """
  model, stacked = _merge(graphdef, params)
  cache = _cache(graphdef, mesh, k, v, page_table, seg_lengths, segment_of_seq, own_page_table,
                 own_lengths, write_limit)

  def body(j, carry):
    cache, tokens, out, logprobs, top_ids, top_values = carry
    logits, cache = model(tokens, cache=cache, settings=settings, stacked_layers=stacked)
    if mesh is not None:  # the whole vocabulary on every device: one draw, the same everywhere
      logits = lax.with_sharding_constraint(logits, NamedSharding(mesh, P()))
    keys = keys_of(seeds, sample_ids, first_step + j)
    new = sample_rows(logits[:, 0], keys, rules, settings.sampler)
    logp = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, new[:, None], axis=1)
    out = lax.dynamic_update_slice(out, new[:, None], (0, j))
    logprobs = lax.dynamic_update_slice(logprobs, chosen, (0, j))
    if top_logprobs:
      values, ids = lax.top_k(logp, top_logprobs)
      top_ids = lax.dynamic_update_slice(top_ids, ids[:, None].astype(jnp.int32), (0, j, 0))
      top_values = lax.dynamic_update_slice(top_values, values[:, None], (0, j, 0))
    return cache, new[:, None], out, logprobs, top_ids, top_values

  b = tokens.shape[0]
  init = (cache, tokens, jnp.zeros((b, num_steps), jnp.int32),
          jnp.zeros((b, num_steps), jnp.float32),
          jnp.zeros((b, num_steps, top_logprobs), jnp.int32),
          jnp.zeros((b, num_steps, top_logprobs), jnp.float32))
  cache, _, out, logprobs, top_ids, top_values = lax.fori_loop(0, num_steps, body, init)
  return cache.k, cache.v, out, logprobs, top_ids, top_values


@functools.partial(jax.jit, donate_argnums=(0, 1), static_argnames=("layer_pages",))
def copy_page(k, v, src, dst, *, layer_pages: int = 0):
  """Every layer's page ``src`` copied to page ``dst``; ``layer_pages``: as
  :attr:`PagedKVCache.layer_pages` (0: a pool per layer; n: one pool of all layers, each
  layer's n pages after the one before; :func:`layer_pages`)."""
  def copy(x):
    layers = x.shape[0] // layer_pages if layer_pages else 1
    offsets = layer_pages * jnp.arange(layers, dtype=jnp.int32)
    return x.at[dst + offsets].set(x[src + offsets])

  return tuple(map(copy, k)), tuple(map(copy, v))


def _sizes(buckets, largest: int) -> list[int]:
  """The padded sizes a bucket field allows up to the one that holds ``largest``."""
  if buckets is None:
    return [1 << i for i in range(max(largest - 1, 0).bit_length() + 1)]
  top = next((s for s in buckets if s >= largest), buckets[-1])
  return [s for s in buckets if s <= top]


def unbounded_buckets(config) -> list[str]:
  """The bucket fields :func:`program_shapes` needs set and ``config`` leaves None: with
  ``cascade`` on, the level, segment and page buckets (powers of two have no bound there)."""
  fields = ("level_buckets", "segment_buckets", "page_buckets") if config.cascade else ()
  return [name for name in fields if getattr(config, name) is None]


def program_shapes(config, max_context: int):
  """(prefill, decode): the padded shapes of every program the engine can run.

  prefill: ``(rows, chunk, page-table width)``; decode: ``(batch, levels, segments, pages,
  own pages)`` (levels 0: no shared level). ``max_context``: the model's context (bounds the
  page tables). The level, segment and page buckets must be set when ``cascade`` is on
  (powers of two have no bound there).
  """
  c, ps = config, config.page_size
  unbounded = unbounded_buckets(c)
  if unbounded:
    raise ValueError(f"warmup: EngineConfig.{', '.join(unbounded)} must be set (with cascade "
                     "on, powers of two have no bound)")
  batch = _sizes(c.batch_buckets, c.max_running)
  chunks = _sizes(c.prefill_buckets, c.max_prefill_tokens)
  own = _sizes(c.own_page_buckets, -(-(max_context + chunks[-1]) // ps))
  rows = _sizes(c.prefill_row_buckets, c.max_running)
  prefill = list(itertools.product(rows, chunks, own))
  levels = [(0, 1, 1)]
  if c.cascade:
    levels += list(itertools.product(c.level_buckets, c.segment_buckets, c.page_buckets))
  decode = [(b, *lsp, o) for b, lsp, o in itertools.product(batch, levels, own)]
  return prefill, decode


def top_sizes(config, vocab_size: int) -> list[int]:
  """The top-log-prob sizes of the decode programs: 0, and ``max_logprobs`` (at most the
  vocabulary) for a call in which a row asks for top log-probs."""
  top = min(config.max_logprobs, vocab_size)
  return [0, top] if top else [0]


def warm_up(graphdef, params, k, v, config, max_context: int, vocab_size: int,
            settings: GenerationSettings, mesh: Optional[Mesh] = None, threads: int = 1):
  """Runs every program of :func:`program_shapes` once on the null page (compiling it), the
  decode programs at each of :func:`top_sizes`; returns ``(k, v, programs)``.

  With ``threads`` > 1 the programs are traced and lowered here, one after another, then
  compiled side by side on that many threads (XLA compiles without Python's lock); the runs
  that follow find each program compiled (the jitted functions' caches hold the lowerings).
  """
  prefill_shapes, decode_shapes = program_shapes(config, max_context)
  tops = top_sizes(config, vocab_size)
  zeros = lambda *shape: np.zeros(shape, np.int32)
  calls = [(prefill, (jnp.asarray(zeros(rows, t)), zeros(rows, width), zeros(rows),
                      zeros(rows)), dict(settings=settings, mesh=mesh))
           for rows, t, width in prefill_shapes]
  for (b, levels, segments, pages, own), top in itertools.product(decode_shapes, tops):
    cascade = ((zeros(levels, segments, pages), zeros(levels, segments),
                np.full((levels, b), -1, np.int32)) if levels else no_levels(b))
    calls.append((decode, (jnp.asarray(zeros(b, 1)), *cascade, zeros(b, own), zeros(b),
                           zeros(b), RowRules.of([None] * b), np.zeros(b, np.uint32), zeros(b),
                           zeros(b)),
                  dict(num_steps=config.decode_steps, settings=settings, top_logprobs=top,
                       mesh=mesh)))
  if threads > 1:
    lowered = [fn.lower(graphdef, params, k, v, *args, **kw) for fn, args, kw in calls]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      list(pool.map(lambda program: program.compile(), lowered))
  for fn, args, kw in calls:
    k, v = fn(graphdef, params, k, v, *args, **kw)[:2]
  k, v = copy_page(k, v, np.int32(0), np.int32(0), layer_pages=layer_pages(graphdef, k))
  return k, v, len(prefill_shapes) + len(decode_shapes) * len(tops) + 1
