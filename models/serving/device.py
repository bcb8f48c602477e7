"""The engine's device programs: forward passes over the paged cache (prefill chunks and
``num_steps`` decode steps with sampling) and the copy of a page.

Every program is keyed by shapes (the padded sizes of the plan and the chunk) and by static
values (the settings, the step count, the set of sampling rules in the batch); page ids,
lengths, tokens and seeds are data.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from models.generation.sampling import SamplingParams, sample
from models.generation.settings import GenerationSettings
from models.serving.paged_cache import PagedKVCache


def no_sampling(b: int):
  return (np.zeros(b, np.uint32), np.zeros(b, np.int32), np.zeros(b, np.int32),
          np.zeros(b, np.int32))


def keys_of(seeds, sample_ids, steps):
  """Per row ``fold_in(fold_in(key(seed), sample_id), step)``: :func:`sampling_keys`'s rule."""
  one = lambda s, i, t: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), i), t)
  return jax.vmap(one)(seeds, sample_ids, steps)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("num_steps", "settings", "rules"),
                   donate_argnums=(2, 3))
def forward(graphdef, params, k, v, tokens, page_table, seg_lengths, segment_of_seq,
             own_page_table, own_lengths, write_limit, seeds, sample_ids, first_step, rule_of,
             *, num_steps: int, settings: GenerationSettings,
             rules: tuple[SamplingParams, ...]):
  """``num_steps`` forward passes of ``tokens [B, T]`` over the paged cache.

  With ``rules`` (decode, T = 1): each step samples row b's next token with
  ``rules[rule_of[b]]`` and feeds it; returns ``(k, v, tokens int32 [B, num_steps])``.
  Without (prefill): one pass that only writes K/V; returns ``(k, v, None)``.
  """
  model = nnx.merge(graphdef, params)
  cache = PagedKVCache(k, v, page_table, seg_lengths, segment_of_seq, own_page_table,
                       own_lengths, write_limit)
  if not rules:
    _, cache = model(tokens, cache=cache, settings=settings)
    return cache.k, cache.v, None

  def body(j, carry):
    cache, tokens, out = carry
    logits, cache = model(tokens, cache=cache, settings=settings)
    keys = keys_of(seeds, sample_ids, first_step + j)
    new = jnp.zeros(tokens.shape[0], jnp.int32)
    for i, rule in enumerate(rules):
      new = jnp.where(rule_of == i, sample(logits[:, 0], keys, rule, settings.sampler), new)
    out = lax.dynamic_update_slice(out, new[:, None], (0, j))
    return cache, new[:, None], out

  out = jnp.zeros((tokens.shape[0], num_steps), jnp.int32)
  cache, _, out = lax.fori_loop(0, num_steps, body, (cache, tokens, out))
  return cache.k, cache.v, out


@functools.partial(jax.jit, donate_argnums=(0, 1))
def copy_page(k, v, src, dst):
  """Every layer's page ``src`` copied to page ``dst``."""
  return (tuple(x.at[dst].set(x[src]) for x in k), tuple(x.at[dst].set(x[src]) for x in v))
