"""The engine's device programs: a prefill pass over the paged cache (several requests' chunks,
one per row), ``num_steps`` decode steps with sampling, and the copy of a page.

Every program is keyed by shapes (the padded sizes of the plan and the chunks) and by static
values (the settings, the step count); page ids, lengths, tokens, seeds and each row's
sampling rule (:class:`models.serving.sampling.RowRules`) are data.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from models.generation.settings import GenerationSettings
from models.serving.paged_cache import PagedKVCache
from models.serving.sampling import RowRules, sample_rows


def keys_of(seeds, sample_ids, steps):
  """Per row ``fold_in(fold_in(key(seed), sample_id), step)``: :func:`sampling_keys`'s rule."""
  one = lambda s, i, t: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), i), t)
  return jax.vmap(one)(seeds, sample_ids, steps)


def _no_levels(b: int):
  return jnp.zeros((0, 1, 1), jnp.int32), jnp.zeros((0, 1), jnp.int32), jnp.zeros((0, b),
                                                                                  jnp.int32)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("settings",),
                   donate_argnums=(2, 3))
def prefill(graphdef, params, k, v, tokens, page_table, start, end, *,
            settings: GenerationSettings):
  """Writes the K/V of ``tokens [R, T]``: row r's chunk at positions ``start[r] + t`` of the
  pages ``page_table [R, W]`` (each row its own request; positions ``>= end[r]``, the padding,
  are not stored); attention reads each row's own pages only. Returns ``(k, v)``."""
  model = nnx.merge(graphdef, params)
  cache = PagedKVCache(k, v, *_no_levels(tokens.shape[0]), page_table, start, end)
  _, cache = model(tokens, cache=cache, settings=settings)
  return cache.k, cache.v


@functools.partial(jax.jit, static_argnums=0, static_argnames=("num_steps", "settings"),
                   donate_argnums=(2, 3))
def decode(graphdef, params, k, v, tokens, page_table, seg_lengths, segment_of_seq,
           own_page_table, own_lengths, write_limit, rules: RowRules, seeds, sample_ids,
           first_step, *, num_steps: int, settings: GenerationSettings):
  """``num_steps`` decode steps of ``tokens [B, 1]`` over the paged cache (the cascade plan's
  arrays: :class:`PagedKVCache`); row b samples by its rule in ``rules`` with the key of
  (``seeds[b]``, ``sample_ids[b]``, ``first_step[b] + step``) and feeds the token back.
  Returns ``(k, v, tokens int32 [B, num_steps])``."""
  model = nnx.merge(graphdef, params)
  cache = PagedKVCache(k, v, page_table, seg_lengths, segment_of_seq, own_page_table,
                       own_lengths, write_limit)

  def body(j, carry):
    cache, tokens, out = carry
    logits, cache = model(tokens, cache=cache, settings=settings)
    keys = keys_of(seeds, sample_ids, first_step + j)
    new = sample_rows(logits[:, 0], keys, rules, settings.sampler)
    out = lax.dynamic_update_slice(out, new[:, None], (0, j))
    return cache, new[:, None], out

  out = jnp.zeros((tokens.shape[0], num_steps), jnp.int32)
  cache, _, out = lax.fori_loop(0, num_steps, body, (cache, tokens, out))
  return cache.k, cache.v, out


@functools.partial(jax.jit, donate_argnums=(0, 1))
def copy_page(k, v, src, dst):
  """Every layer's page ``src`` copied to page ``dst``."""
  return (tuple(x.at[dst].set(x[src]) for x in k), tuple(x.at[dst].set(x[src]) for x in v))
