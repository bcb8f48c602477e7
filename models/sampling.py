"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus).

Applied in transformers' order: logits / temperature, then top-k, then
top-p on what is left, then one categorical draw per sequence.

* ``temperature == 0``: greedy, ``argmax(logits)`` (top-k/top-p are moot).
* ``top_k = k``: keep the k largest logits (ties with the k-th are kept).
* ``top_p = p``: keep the smallest set of most likely tokens whose total
  probability is >= p; the most likely token is always kept (ties with the
  last kept token are kept too). ``p >= 1`` keeps everything.

Randomness: sequence b at step t draws with ``key(seed) -> fold_in(b) ->
fold_in(t)`` (:func:`sampling_keys`), where b is the caller's sample index:
a token depends only on (seed, sample, step), not on the batch layout, the
attention path or how many steps run per call.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How the next token is chosen (hashable: a static argument of the decode program)."""

  temperature: float = 0.0
  top_k: Optional[int] = None
  top_p: Optional[float] = None

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"sampling: temperature must be >= 0; got {self.temperature}")
    if self.top_k is not None and (int(self.top_k) != self.top_k or self.top_k < 1):
      raise ValueError(f"sampling: top_k must be a positive int or None; got {self.top_k}")
    if self.top_p is not None and not 0 < self.top_p <= 1:
      raise ValueError(f"sampling: top_p must lie in (0, 1] or be None; got {self.top_p}")
    object.__setattr__(self, "temperature", float(self.temperature))
    if self.top_p is not None and self.top_p >= 1:  # keeps every token: no sort needed
      object.__setattr__(self, "top_p", None)

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def filter_logits(logits: Array, params: SamplingParams) -> Array:
  """float32 ``[B, V]``: ``logits / temperature`` with dropped tokens at ``-inf``.

  Requires ``temperature > 0``.
  """
  logits = logits.astype(jnp.float32) / params.temperature
  if params.top_k is not None and params.top_k < logits.shape[-1]:
    kth = lax.top_k(logits, params.top_k)[0][:, -1:]  # [B, 1]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if params.top_p is not None:
    logits = _top_p(logits, params.top_p)
  return logits


def _top_p(logits: Array, top_p: float) -> Array:
  ordered = -jnp.sort(-logits, axis=-1)  # [B, V] descending
  probs = jax.nn.softmax(ordered, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
  keep = before < top_p  # a prefix of the sorted order; always holds the top token
  threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits < threshold, -jnp.inf, logits)


def sampling_keys(seed: Array, sample_ids: Array, step: Array) -> Array:
  """``[B]`` keys: ``fold_in(fold_in(key(seed), sample_ids[b]), step)``."""
  base = jax.random.key(seed)
  return jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(base, i), step))(sample_ids)


def sample(logits: Array, keys: Array, params: SamplingParams) -> Array:
  """int32 ``[B]``: the next token of each sequence from float ``logits [B, V]``."""
  if params.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  filtered = filter_logits(logits, params)
  return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
