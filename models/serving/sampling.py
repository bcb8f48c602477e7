"""Sampling rules as data: one decode program draws every row by its own rule.

    >>> rules = RowRules.of([SamplingParams(), SamplingParams(0.7, top_p=0.9), ...])
    >>> tokens = sample_rows(logits, keys, rules, config)   # any mix, no new program

:func:`models.generation.sampling.sample` takes its rule as a static value (one program per
rule); the engine's batch mixes requests' rules, so here each row's ``temperature``,
``top_k`` and ``top_p`` are arrays. The kept set is the definition's (logits / temperature,
then top-k, then top-p on what is left), found the way :func:`sample` finds it: the top-K
candidates (``SamplerConfig.candidates``, for the whole batch while they decide every row),
else the threshold search over the row; the draw is ``jax.random.categorical`` over the
masked logits with the row's key, as in ``sample`` (from the candidates' noise alone where
they hold every sampled row's kept set, bit-identical as in ``sample``). So a row draws ``sample``'s token for
its rule: top-k and temperature alone exactly; top-p up to the float32 rounding of its sums
(a token whose more likely mass lies within rounding of p may go either way, as between
``sample``'s own paths).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from models.generation.sampling import (SamplerConfig, SamplingParams, _gumbel_at,
                                        _partitionable_threefry, default_sampler_config,
                                        threshold_search)

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowRules:
  """Per-row sampling rules (a pytree of arrays; every value is data).

  Attributes:
    temperature: float32 ``[B]``; 0: greedy (``argmax`` of the logits).
    top_k: int32 ``[B]``; 0 (or >= the vocabulary): no top-k.
    top_p: float32 ``[B]``; 1: no top-p.
  """

  temperature: Array
  top_k: Array
  top_p: Array

  @staticmethod
  def of(params: Sequence[Optional[SamplingParams]]) -> "RowRules":
    """NumPy rules of ``params`` (None: a greedy padding row)."""
    params = [p or SamplingParams() for p in params]
    return RowRules(np.asarray([p.temperature for p in params], np.float32),
                    np.asarray([p.top_k or 0 for p in params], np.int32),
                    np.asarray([1.0 if p.top_p is None else p.top_p for p in params], np.float32))


def sample_rows(logits: Array, keys: Array, rules: RowRules,
                config: Optional[SamplerConfig] = None) -> Array:
  """int32 ``[B]``: row b's next token from ``logits [B, V]`` by its rule.

  ``keys``: ``[B]`` typed PRNG keys. ``config``: its ``candidates``, ``search_width`` and
  ``value_passes`` (default: :func:`default_sampler_config` of the default backend).
  """
  config = config or default_sampler_config(jax.default_backend())
  b, v = logits.shape
  t = rules.temperature
  sampled = t > 0
  has_k = sampled & (rules.top_k > 0) & (rules.top_k < v)
  has_p = sampled & (rules.top_p < 1)

  def draw():
    x = logits.astype(jnp.float32) / jnp.where(sampled, t, 1.0)[:, None]
    return lax.cond(jnp.any(has_k | has_p),
                    lambda: _filtered_draw(x, keys, sampled, has_k, rules.top_k, has_p,
                                           rules.top_p, config),
                    lambda: _categorical(x, keys, jnp.full((b, 1), -jnp.inf, jnp.float32)))

  drawn = lax.cond(jnp.any(sampled), draw, lambda: jnp.zeros((b,), jnp.int32))
  return jnp.where(sampled, drawn, jnp.argmax(logits, axis=-1).astype(jnp.int32))


def _categorical(x, keys, threshold) -> Array:
  """``jax.random.categorical`` per row over ``x >= threshold``."""
  filtered = jnp.where(x >= threshold, x, -jnp.inf)
  return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)


def _filtered_draw(x, keys, sampled, has_k, k, has_p, p, config: SamplerConfig) -> Array:
  """The draws of a batch with filtered rows: the first candidate count that decides every
  row (drawing from the candidates alone when they hold every sampled row's kept set), else
  the threshold search."""
  v = x.shape[-1]
  sizes = sorted({min(s, v) for s in config.candidates})
  # A sampled row without a filter keeps the whole row: no candidate set holds it.
  all_filtered = jnp.all(has_k | has_p | ~sampled)

  def search():  # filter_logits's two searches, per row
    kth = threshold_search(x, jnp.ones(x.shape, jnp.int32), jnp.where(has_k, k, 1)[:, None],
                           config)
    kth = jnp.where(has_k[:, None], kth, -jnp.inf)
    masked = jnp.where(x < kth, -jnp.inf, x)
    tp = threshold_search(masked, jax.nn.softmax(masked, axis=-1), p[:, None], config)
    return _categorical(x, keys, jnp.where(has_p[:, None], jnp.maximum(tp, kth), kth))

  def go(i):
    if i == len(sizes):
      return search()
    ok, threshold, vals, idx = _candidate_thresholds(x, has_k, k, has_p, p, sizes[i])

    def candidate_draw():  # sample's candidate draw: the Gumbel noise of the candidates only
      score = jnp.where(vals >= threshold, vals + _gumbel_at(keys, idx), -jnp.inf)
      best = jnp.max(score, axis=1, keepdims=True)
      return jnp.min(jnp.where(score == best, idx, v), axis=1).astype(jnp.int32)

    def decided():
      if not _partitionable_threefry():  # the candidates' noise is categorical's only then
        return _categorical(x, keys, threshold)
      return lax.cond(all_filtered, candidate_draw, lambda: _categorical(x, keys, threshold))

    return lax.cond(jnp.all(ok), decided, lambda: go(i + 1))

  return go(0)


def _candidate_thresholds(x, has_k, k, has_p, p, size: int):
  """(ok ``[B]``, threshold ``[B, 1]``, values, indices ``[B, size]``) from the top ``size``
  values: ``sample``'s candidate path with the rule's numbers per row (ok where the
  candidates decide the row and hold its kept set)."""
  v = x.shape[-1]
  vals, idx = lax.top_k(x, size)  # [B, K], descending
  # Keeps the top-k from turning into a full sort (one barrier per array, as in sample).
  vals, idx = lax.optimization_barrier(vals), lax.optimization_barrier(idx)
  last = vals[:, -1:]
  kth = jnp.take_along_axis(vals, jnp.clip(k, 1, size)[:, None] - 1, axis=1)
  kth = jnp.where(has_k[:, None], kth, -jnp.inf)
  # As sample's path: the k-th value must lie above the last candidate (ties beyond K).
  ok = ~has_k | ((k <= size) & ((kth[:, 0] > last[:, 0]) | (size == v)))
  keep = vals >= kth
  masked = jnp.where(x < kth, -jnp.inf, x)
  top = vals[:, :1]
  total = jnp.sum(jnp.exp(masked - top), axis=-1, keepdims=True)  # softmax's denominator
  probs = jnp.where(keep, jnp.exp(vals - top) / total, 0.0)
  # The mass of every candidate >= c, at each candidate value c (the end of c's run of ties).
  ends = jnp.concatenate([vals[:, :-1] > vals[:, 1:], jnp.ones_like(vals[:, :1], bool)], axis=1)
  mass = lax.cummin(jnp.where(ends, jnp.cumsum(probs, axis=1), jnp.inf), axis=1, reverse=True)
  reach = keep & (mass >= p[:, None])
  tp = jnp.max(jnp.where(reach, vals, -jnp.inf), axis=1, keepdims=True)
  if size < v:  # else every token is a candidate: the sums are the whole row's
    ok &= ~has_p | (tp[:, 0] > last[:, 0])
  return ok, jnp.where(has_p[:, None], jnp.maximum(tp, kth), kth), vals, idx
