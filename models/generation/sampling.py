"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus), without a sort.

Applied in transformers' order: logits / temperature, then top-k, then
top-p on what is left, then one categorical draw per sequence.

* ``temperature == 0``: greedy, ``argmax(logits)`` (top-k/top-p are moot).
* ``top_k = k``: keep the k largest logits (ties with the k-th are kept).
* ``top_p = p``: keep the smallest set of most likely tokens whose total
  probability is >= p; the most likely token is always kept (ties with the
  last kept token are kept too). ``p >= 1`` keeps everything. Equivalently:
  keep a token iff the probability of the tokens strictly more likely than it
  is < p.

Both filters are a threshold ``t`` per row (keep ``x >= t``): the largest
logit ``c`` whose weight ``W(c) = sum of w(x) over x >= c`` reaches a target
(``w = 1``, target k for top-k; ``w`` = probability, target p for top-p).
:func:`sample` finds it without sorting the vocabulary:

0. Chunks (``SamplerConfig.chunk``, the GPU default; top-k on the CPU too): each
   chunk of the row reduced to its maximum. Top-k: the k chunks of largest
   maxima hold every token >= the k-th value, so a few levels narrow the row to
   ~2k tokens without a long sort. Top-p alone: the draw is the first kept
   token in the order of Gumbel scores; the chunks of best score hold the best
   F tokens, and one pass tests all F against p (F = 6, then 15 where some row
   kept none of its 6: each best-scoring token is kept with probability >= p).
   Where a row is not decided (ties, none of the F kept), the whole batch takes 2. On the
   GPU (``SamplerConfig.kernel``, from ``kernel_min_batch`` rows) the first F runs in one
   Pallas kernel (:mod:`pallas_kernels.gpu.sampler`: approximate noise, exact candidate
   scores recomputed here, a row decided only with a margin over the kernel's error).
1. Candidates (``SamplerConfig.candidates``, e.g. K = 64 and then 1024):
   ``lax.top_k(x, K)``. Where
   every row's threshold lies strictly above its K-th candidate, every kept
   token is a candidate; the weights are summed over the candidates and the
   draw needs the Gumbel noise of the candidates only (computed at their
   vocabulary positions, bit-identical to ``jax.random.categorical``'s).
2. Otherwise (``lax.cond``, for the whole batch; after the last K): a threshold search over the
   whole vocabulary. ``W`` is monotone in ``c``, so the threshold is found by
   bisection over the float32 values, ``search_width`` trial thresholds per
   pass over the row: a few passes on the values' range, then on the order of
   their bit patterns, which ends on the exact row value in at most 32 / log2
   (``search_width`` + 1) more passes; then ``jax.random.categorical`` over the
   masked logits.

Either way the kept set is the definition's (the sort-based
:func:`filter_logits_reference`), and the draw is ``categorical`` over the
same masked logits, so a seed gives the reference's tokens. The one
difference: the top-p sums are float32 sums in another order, so a token
whose strictly-more-likely mass is within float32 rounding of p may go
either way (as it may between two sorts).

Randomness: sequence b at step t draws with ``key(seed) -> fold_in(b) ->
fold_in(t)`` (:func:`sampling_keys`), where b is the caller's sample index:
a token depends only on (seed, sample, step), not on the batch layout, the
attention path or how many steps run per call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How the next token is chosen (hashable: a static argument of the decode program)."""

  temperature: float = 0.0
  top_k: Optional[int] = None
  top_p: Optional[float] = None

  def __post_init__(self):
    if not self.temperature >= 0 or not np.isfinite(self.temperature):
      raise ValueError(f"sampling: temperature must be finite and >= 0; got {self.temperature}")
    if self.top_k is not None and (int(self.top_k) != self.top_k or self.top_k < 1):
      raise ValueError(f"sampling: top_k must be a positive int or None; got {self.top_k}")
    if self.top_p is not None and not 0 < self.top_p <= 1:
      raise ValueError(f"sampling: top_p must lie in (0, 1] or be None; got {self.top_p}")
    object.__setattr__(self, "temperature", float(self.temperature))
    if self.top_k is not None:
      object.__setattr__(self, "top_k", int(self.top_k))
    if self.top_p is not None and self.top_p >= 1:  # keeps every token: no search needed
      object.__setattr__(self, "top_p", None)

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """How :func:`sample` finds the kept set (never what it is).

  Attributes:
    candidates: the K of the candidate path (``lax.top_k``), or several, tried in turn
      (e.g. ``(64, 1024)``: 1024 only where 64 did not hold every row's kept set); 0 or
      ``()`` skips it.
    search_width: trial thresholds per pass of the threshold search (each
      pass reads the row once and halves the interval ``search_width + 1``
      times over).
    value_passes: the first passes split the interval by value (fast on
      smooth logits), the rest by bit pattern (exact in a bounded count).
    chunk: the chunk size G of the chunked paths (0: off, then ``candidates`` and
      the search as above). Top-p alone: the ``score_candidates`` best chunks by
      Gumbel score hold the best-scoring tokens; each is tested against p in one
      pass. Top-k: the k chunks with the largest maxima hold every token >= the
      k-th value; the draw runs on them (several levels while that narrows).
    tie_slack: the chunks a top-k level keeps beyond k, for chunk maxima that tie with the
      k-th (more ties than that send the row to the search). 16-bit logits tie often: at
      1024 x 128,256 bf16, k = 50, 4 sent a row to the search 90 times in 2,048 rows, 8 none
      (the most ties seen beyond k: 9 in 4,096 rows).
    score_candidates: F, the tokens of best Gumbel score tested against top-p, or several,
      tried in turn (e.g. ``(6, 15)``: 15 only where none of some row's best 6 was kept; the
      pass that tests them costs about one read of the row plus a compare per token and
      candidate); 0 or ``()``: top-p alone takes the ``candidates`` path.
    kernel: top-p alone, the first F (``score_candidates[0]``) through one Pallas (Triton)
      kernel, :mod:`pallas_kernels.gpu.sampler` (a row per program: its noise by
      approximate logarithms, its candidates, its sums; the tokens stay exact), instead of
      XLA's passes. Interpreted off CUDA.
    kernel_min_batch: the kernel runs only for batches of at least this many rows (one row
      per program: fewer would leave most of the GPU idle); smaller ones take the XLA passes.
    kernel_tile: the tokens a program takes per step (a power of two); its "lanes" (the tokens
      ``j + t * kernel_tile``) play the chunks' part.
  """

  candidates: Union[int, tuple[int, ...]] = (64, 1024)
  search_width: int = 1
  value_passes: int = 4
  chunk: int = 0
  score_candidates: Union[int, tuple[int, ...]] = (6, 15)
  tie_slack: int = 16
  kernel: bool = False
  kernel_min_batch: int = 128
  kernel_tile: int = 2048

  def __post_init__(self):
    sizes = (self.candidates,) if np.ndim(self.candidates) == 0 else tuple(self.candidates)
    if any(int(k) != k or k < 0 for k in sizes) or list(sizes) != sorted(sizes):
      raise ValueError(f"SamplerConfig: {self.candidates=} must be ints >= 0, increasing")
    object.__setattr__(self, "candidates", tuple(int(k) for k in sizes if k > 0))
    if int(self.search_width) != self.search_width or self.search_width < 1:
      raise ValueError(f"SamplerConfig: {self.search_width=} must be an int >= 1")
    if int(self.value_passes) != self.value_passes or self.value_passes < 0:
      raise ValueError(f"SamplerConfig: {self.value_passes=} must be an int >= 0")
    if int(self.chunk) != self.chunk or self.chunk < 0:
      raise ValueError(f"SamplerConfig: {self.chunk=} must be an int >= 0")
    fs = (self.score_candidates,) if np.ndim(self.score_candidates) == 0 else tuple(
        self.score_candidates)
    if any(int(f) != f or f < 0 for f in fs) or list(fs) != sorted(fs):
      raise ValueError(f"SamplerConfig: {self.score_candidates=} must be ints >= 0, increasing")
    object.__setattr__(self, "score_candidates", tuple(int(f) for f in fs if f > 0))
    if int(self.tie_slack) != self.tie_slack or self.tie_slack < 0:
      raise ValueError(f"SamplerConfig: {self.tie_slack=} must be an int >= 0")
    if not isinstance(self.kernel, bool):
      raise ValueError(f"SamplerConfig: {self.kernel=} must be a bool")
    if int(self.kernel_min_batch) != self.kernel_min_batch or self.kernel_min_batch < 1:
      raise ValueError(f"SamplerConfig: {self.kernel_min_batch=} must be an int >= 1")
    if self.kernel and not (self.chunk and 1 <= (self.score_candidates or (0,))[0] <= 7):
      raise ValueError(f"SamplerConfig: kernel needs chunk (the XLA passes after it) and "
                       f"score_candidates whose first F is 1..7 (it runs that F); got "
                       f"{self.chunk=}, {self.score_candidates=}")
    tile = self.kernel_tile
    if int(tile) != tile or tile < 1 or int(tile) & (int(tile) - 1):
      raise ValueError(f"SamplerConfig: {self.kernel_tile=} must be a power of two")


def default_sampler_config(platform: str) -> SamplerConfig:
  """The configuration :func:`sample` uses on ``platform`` (``jax.default_backend()``).

  CPU: ``lax.top_k`` is a cheap partial sort and one wide pass costs more than
  several narrow ones; top-k takes the chunk levels, top-p alone the candidates (the
  Gumbel noise of the whole row costs more there). GPU: ``lax.top_k`` of more than 16
  elements is a sort; the chunked paths read the row twice (top-p) or once (top-k) and
  sort only short rows. TPU: the threshold search (a pass is bound by reading the row,
  so a wide pass is nearly free).
  """
  if platform == "cpu":
    return SamplerConfig(candidates=(64, 1024), search_width=1, chunk=128, score_candidates=())
  if platform == "gpu":  # the best 6 scores decide a row but with probability ~0.1^6
    return SamplerConfig(candidates=0, search_width=15, chunk=128, score_candidates=(6, 15),
                         kernel=True)
  return SamplerConfig(candidates=0, search_width=15)


# -- the reference (sorts the vocabulary) --------------------------------------------------------

def filter_logits_reference(logits: Array, params: SamplingParams) -> Array:
  """float32 ``[B, V]``: ``logits / temperature`` with dropped tokens at ``-inf`` (by sorting).

  Requires ``temperature > 0``.
  """
  logits = logits.astype(jnp.float32) / params.temperature
  if params.top_k is not None and params.top_k < logits.shape[-1]:
    kth = lax.top_k(logits, params.top_k)[0][:, -1:]  # [B, 1]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if params.top_p is not None:
    ordered = -jnp.sort(-logits, axis=-1)  # [B, V] descending
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
    keep = before < params.top_p  # a prefix of the sorted order; always holds the top token
    threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, -jnp.inf, logits)
  return logits


def sample_reference(logits: Array, keys: Array, params: SamplingParams) -> Array:
  """:func:`sample` through :func:`filter_logits_reference` (a full sort per row)."""
  if params.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  filtered = filter_logits_reference(logits, params)
  return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)


# -- the threshold search over the whole row -----------------------------------------------------

def _order_keys(x: Array) -> Array:
  """int32 keys of float32 values, in the values' order (-0.0 just below +0.0)."""
  bits = lax.bitcast_convert_type(x, jnp.int32)
  return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _from_order_keys(k: Array) -> Array:
  return lax.bitcast_convert_type(jnp.where(k < 0, k ^ jnp.int32(0x7FFFFFFF), k), jnp.float32)


def threshold_search(x: Array, weights: Array, target, config: SamplerConfig) -> Array:
  """float32 ``[B, 1]``: per row the largest value ``c`` of ``x`` with ``sum(weights[x >= c]) >= target``.

  The row's smallest finite value where no value qualifies. ``x``: float32
  ``[B, V]`` (-inf allowed, not NaN); ``weights`` >= 0 of the same shape.
  Invariant per row: the answer's key lies in ``[lo, hi)``; ``lo`` qualifies
  (or is the row minimum), ``hi`` does not. Ends when ``hi == lo + 1``.
  """
  m = config.search_width
  lo = _order_keys(jnp.min(jnp.where(jnp.isfinite(x), x, jnp.inf), axis=-1))
  hi = _order_keys(jnp.max(x, axis=-1)) + 1
  j = jnp.arange(1, m + 1, dtype=jnp.uint32)
  gap = lambda lo, hi: lax.bitcast_convert_type(hi - lo, jnp.uint32)  # no int32 overflow

  def running(carry):
    i, lo, hi = carry
    return (i < config.value_passes + 33) & jnp.any(gap(lo, hi) > 1)

  def one_pass(carry):
    i, lo, hi = carry
    d = gap(lo, hi)
    step = jnp.maximum(d // (m + 1), 1)
    offset = step[:, None] * j
    by_key = jnp.where(offset < d[:, None],
                       lo[:, None] + lax.bitcast_convert_type(offset, jnp.int32), hi[:, None])
    vlo, vhi = _from_order_keys(lo)[:, None], _from_order_keys(hi)[:, None]
    by_value = jnp.clip(_order_keys(vlo + (vhi - vlo) * (j.astype(jnp.float32) / (m + 1))),
                        lo[:, None] + 1, hi[:, None])
    trial = jnp.where(i < config.value_passes, by_value, by_key)  # [B, m] keys in (lo, hi]
    c = _from_order_keys(trial)
    if m == 1:  # one plain reduction: what a CPU vectorises best
      w = jnp.sum(jnp.where(x >= c, weights, 0), axis=-1, keepdims=True)
    else:
      w = jnp.sum(jnp.where(x[:, :, None] >= c[:, None, :], weights[:, :, None], 0), axis=1)
    ok = (w >= target) & (trial < hi[:, None])
    lo = jnp.max(jnp.where(ok, trial, lo[:, None]), axis=1)
    hi = jnp.min(jnp.where(ok, hi[:, None], trial), axis=1)
    return i + 1, lo, hi

  _, lo, _ = lax.while_loop(running, one_pass, (jnp.int32(0), lo, hi))
  return _from_order_keys(lo)[:, None]


def filter_logits(logits: Array, params: SamplingParams,
                  config: Optional[SamplerConfig] = None) -> Array:
  """:func:`filter_logits_reference` by threshold search (no sort). Requires ``temperature > 0``."""
  config = config or default_sampler_config(jax.default_backend())
  x = logits.astype(jnp.float32) / params.temperature
  if params.top_k is not None and params.top_k < x.shape[-1]:
    t = threshold_search(x, jnp.ones(x.shape, jnp.int32), params.top_k, config)
    x = jnp.where(x < t, -jnp.inf, x)
  if params.top_p is not None:
    t = threshold_search(x, jax.nn.softmax(x, axis=-1), jnp.float32(params.top_p), config)
    x = jnp.where(x < t, -jnp.inf, x)
  return x


# -- the candidate path ---------------------------------------------------------------------------

def _partitionable_threefry() -> bool:
  """Whether a key's bits at position i are threefry(key, i) (what ``_gumbel_at`` computes)."""
  return bool(jax.config.jax_threefry_partitionable) and (
      str(jax.config.jax_default_prng_impl) == "threefry2x32")


def _gumbel_at(keys: Array, idx: Array) -> Array:
  """float32 ``[B, K]``: ``jax.random.gumbel(keys[b], (V,))[idx[b]]`` without the other V - K draws."""
  from jax.extend.random import threefry2x32_p

  from pallas_kernels.gpu.sampler import gumbel_from_bits

  data = jax.random.key_data(keys)  # uint32 [B, 2]
  k1 = jnp.broadcast_to(data[:, :1], idx.shape)
  k2 = jnp.broadcast_to(data[:, 1:], idx.shape)
  b1, b2 = threefry2x32_p.bind(k1, k2, jnp.zeros(idx.shape, jnp.uint32), idx.astype(jnp.uint32))
  return gumbel_from_bits(b1 ^ b2)


def _candidate_draw(x: Array, keys: Array, params: SamplingParams, k: int,
                    positions: Optional[Array] = None, vocab: Optional[int] = None):
  """(ok bool ``[B]``, token int32 ``[B]``): the draw from the top-k candidates, where they hold the kept set.

  ``positions`` (int32, like ``x``): the vocabulary index of each column of ``x``, a part of
  the row that holds every token of the kept set and the top-k's tokens (default: ``x`` is
  the row); ``vocab``: the row's length V then.
  """
  # The barrier keeps XLA from folding later slices of the result into the top-k, which turns
  # it back into a full sort on the CPU.
  vals, idx = lax.top_k(x, k)  # [B, K], descending
  # One barrier per array: a barrier over the tuple crashes XLA's CPU compiler under SPMD.
  vals, idx = lax.optimization_barrier(vals), lax.optimization_barrier(idx)
  if positions is not None:
    idx = jnp.take_along_axis(positions, idx, axis=1)
  v = x.shape[-1] if vocab is None else vocab
  last = vals[:, -1:]
  keep = jnp.ones(vals.shape, bool)
  ok = jnp.ones(x.shape[:1], bool)
  masked = x
  if params.top_k is not None and params.top_k < v:
    if params.top_k > k:  # the k-th value is not among the candidates
      kth, ok = last, jnp.zeros_like(ok)
    else:
      kth = vals[:, params.top_k - 1:params.top_k]
      ok &= kth[:, 0] > last[:, 0]
    keep = vals >= kth
    masked = jnp.where(x < kth, -jnp.inf, x)
  if params.top_p is not None:
    top = vals[:, :1]
    total = jnp.sum(jnp.exp(masked - top), axis=-1, keepdims=True)  # softmax's denominator
    probs = jnp.where(keep, jnp.exp(vals - top) / total, 0.0)
    # W(c) at each candidate value c: the mass of every candidate >= c, i.e. the running sum
    # at the end of c's group of ties (a reverse running minimum of the group ends' sums).
    ends = jnp.concatenate([vals[:, :-1] > vals[:, 1:], jnp.ones_like(vals[:, :1], bool)], axis=1)
    mass = lax.cummin(jnp.where(ends, jnp.cumsum(probs, axis=1), jnp.inf), axis=1, reverse=True)
    reach = keep & (mass >= jnp.float32(params.top_p))
    t = jnp.max(jnp.where(reach, vals, -jnp.inf), axis=1, keepdims=True)
    keep &= vals >= t
    ok &= t[:, 0] > last[:, 0]
  if k == x.shape[-1]:  # every token is a candidate
    ok = jnp.ones_like(ok)
  score = jnp.where(keep, vals + _gumbel_at(keys, idx), -jnp.inf)
  best = jnp.max(score, axis=1, keepdims=True)
  # argmax's rule: of equal scores the lowest vocabulary index wins.
  token = jnp.min(jnp.where(score == best, idx, v), axis=1)
  return ok, token.astype(jnp.int32)


# -- the chunked paths ----------------------------------------------------------------------------

def _chunks(x: Array, g: int) -> Array:
  """``[B, ceil(n / g), g]``: ``x [B, n]`` in chunks of g, the last one padded with ``-inf``."""
  b, n = x.shape
  nc = -(-n // g)
  return jnp.pad(x, ((0, 0), (0, nc * g - n)), constant_values=-jnp.inf).reshape(b, nc, g)


def _gather_chunks(x: Array, positions: Array, chunk_ids: Array, g: int):
  """(values, positions) ``[B, n * g]`` of chunks ``chunk_ids [B, n]`` of ``x``, in row order."""
  b, m = x.shape
  cols = (jnp.sort(chunk_ids, axis=1)[:, :, None] * g + jnp.arange(g)).reshape(b, -1)
  inside = cols < m  # the last chunk's padding
  cols = jnp.minimum(cols, m - 1)
  vals = jnp.where(inside, jnp.take_along_axis(x, cols, axis=1), -jnp.inf)
  return vals, jnp.take_along_axis(positions, cols, axis=1)


def _top_k_levels(v: int, k: int, g: int, slack: int) -> list[int]:
  """The chunk sizes that narrow a row of v to the chunks holding its top k (empty: none does).

  A level keeps ``k + slack`` of its chunks, so it pays only while there are at least 4
  times as many; the first uses ``g``, the next ones the size that leaves that many.
  """
  keep = k + slack
  sizes, n = [], v
  while True:
    size = g if not sizes else max(1, n // (4 * keep))
    if size < 2 or -(-n // size) < 4 * keep:
      return sizes
    sizes.append(size)
    n = keep * size


def _chunked_top_k_draw(x: Array, keys: Array, params: SamplingParams, config: SamplerConfig):
  """(ok, token) of top-k (then top-p) via the k chunks with the largest maxima, level by level.

  Every token >= the k-th largest value t lies in a chunk whose maximum is >= the k-th largest
  chunk maximum M (k chunks have an element >= M, so t >= M). The k + ``tie_slack`` chunks of
  largest maxima hold them all, unless more than that many maxima are >= M and t == M (``ok``
  False: exact ties).
  """
  b, v = x.shape
  k = params.top_k
  positions = jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), x.shape)
  kths, ties = [], []
  keep = k + config.tie_slack
  for g in _top_k_levels(v, k, config.chunk, config.tie_slack):
    maxima = jnp.max(_chunks(x, g), axis=2)  # [B, nc]
    best, chunk_ids = lax.top_k(maxima, keep)
    kths.append(best[:, k - 1])
    ties.append(jnp.sum(maxima >= best[:, k - 1:k], axis=1) > keep)
    x, positions = _gather_chunks(x, positions, chunk_ids, g)
  t = lax.top_k(x, k)[0][:, -1]
  ok = jnp.ones((b,), bool)
  for kth, tie in zip(kths, ties):
    ok &= ~tie | (t > kth)
  sub_ok, token = _candidate_draw(x, keys, params, x.shape[1], positions, vocab=v)
  return ok & sub_ok, token


def _sum_above(x: Array, weights: Array, thresholds: Array):
  """(total ``[B]``, ``[B, F]`` sums of ``weights`` over ``x > thresholds[:, f]``): one reduction."""
  f = thresholds.shape[1]
  operands = [weights] + [jnp.where(x > thresholds[:, j:j + 1], weights, 0.0) for j in range(f)]
  sums = lax.reduce(operands, [jnp.float32(0)] * (f + 1),
                    lambda a, b: [ai + bi for ai, bi in zip(a, b)], (1,))
  return sums[0], jnp.stack(sums[1:], axis=1)


def _top_few(x: Array, k: int) -> tuple[Array, Array]:
  """``lax.top_k(x, k)`` for a few k by k arg-max passes (XLA's GPU top-k of more than 16 columns
  is a sort, slower than a few passes over the row).

  Equal values: the lower index first, as ``lax.top_k``. A row with fewer than k values above
  ``-inf`` repeats index 0 where ``lax.top_k`` gives other ``-inf`` columns; the score path
  stays exact (a repeated candidate is the same token, still in score order).
  """
  iota = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  vals, idxs = [], []
  for _ in range(k):
    i = jnp.argmax(x, axis=-1).astype(jnp.int32)
    vals.append(jnp.take_along_axis(x, i[..., None], axis=-1)[..., 0])
    idxs.append(i)
    x = jnp.where(iota == i[..., None], -jnp.inf, x)
  return jnp.stack(vals, axis=-1), jnp.stack(idxs, axis=-1)


def _score_noise(x: Array, keys: Array, g: int):
  """Chunk maxima ``[B, nc]`` of the Gumbel scores ``x + noise`` and of ``x``, in one pass."""
  v = x.shape[1]
  noise = jax.vmap(lambda key: jax.random.gumbel(key, (v,), x.dtype))(keys)
  score_max, x_max = lax.reduce(
      (_chunks(noise + x, g), _chunks(x, g)), (jnp.float32(-jnp.inf),) * 2,
      lambda a, c: (lax.max(a[0], c[0]), lax.max(a[1], c[1])), (2,))
  return score_max, x_max


def _score_draw(x: Array, keys: Array, params: SamplingParams, g: int, f: int, chunk_maxima):
  """(ok, token) of top-p alone: the first of the f best-scoring tokens (Gumbel-max) that is kept.

  ``categorical`` draws the kept token of highest score ``x + gumbel``. Kept sets are
  ``x >= t``, so in the order of scores, the draw is the first kept token. The F chunks of
  highest maximum score hold the F best scores of the row (ties aside), their F best are
  the candidates, and one pass sums, per candidate, the probability strictly above it (kept
  iff < p). ``ok`` where a kept candidate scores above every other chunk.
  """
  b, v = x.shape
  score_max, x_max = chunk_maxima
  nc = score_max.shape[1]
  f = min(f, nc)
  best, chunk_ids = _top_few(score_max, min(f + 1, nc))
  outside = best[:, f] if f < nc else jnp.full((b,), -jnp.inf)  # the best score elsewhere
  positions = jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), x.shape)
  xs, pos = _gather_chunks(x, positions, chunk_ids[:, :f], g)
  scores, col = _top_few(_gumbel_at(keys, pos) + xs, f)  # ties: the lower vocabulary index first
  cand_x = jnp.take_along_axis(xs, col, axis=1)
  top = jnp.max(x_max, axis=1, keepdims=True)
  total, above = _sum_above(x, jnp.exp(x - top), cand_x)
  kept = (above < jnp.float32(params.top_p) * total[:, None]) & (scores > outside[:, None])
  first = jnp.argmax(kept, axis=1)
  token = jnp.take_along_axis(jnp.take_along_axis(pos, col, axis=1), first[:, None], axis=1)[:, 0]
  return jnp.any(kept, axis=1), token.astype(jnp.int32)


def _kernel_score_draw(logits: Array, keys: Array, params: SamplingParams, config: SamplerConfig):
  """(ok, token) of top-p alone as :func:`_score_draw`, with the passes over the row in one kernel.

  The kernel picks F candidates and sums by its own noise; here their scores are recomputed
  with ``jax.random.gumbel``'s bits (:func:`_gumbel_at`) and a row is decided only where its
  best kept candidate beats every other token's score (``bound``, the kernel's) by a margin
  far above the kernel's rounding, so the token is ``categorical``'s whatever that rounding.
  """
  from pallas_kernels.gpu import sampler as kernel

  v = logits.shape[1]
  pos, above, total, bound = kernel.score_candidates(
      logits, jax.random.key_data(keys), temperature=params.temperature,
      f=config.score_candidates[0], tile=config.kernel_tile)
  # Positions past the row's end (rows shorter than F chunks) are never kept.
  x = jnp.take_along_axis(logits, jnp.minimum(pos, v - 1), axis=1).astype(jnp.float32)
  x = x / params.temperature
  score = jnp.where(above < jnp.float32(params.top_p) * total[:, None], x + _gumbel_at(keys, pos),
                    -jnp.inf)
  best = jnp.max(score, axis=1)
  token = jnp.min(jnp.where(score == best[:, None], pos, v), axis=1)  # argmax's tie rule
  # The kernel's scores are within NOISE_ERROR of the exact ones, plus float32 rounding of
  # x = l * (1 / T) and of the sum (a few ulps).
  finite = jnp.where(jnp.isfinite(bound), jnp.abs(bound), 0.0)
  margin = 2 * kernel.NOISE_ERROR + 2.0 ** -18 * (jnp.abs(best) + finite)
  return (best > -jnp.inf) & (best > bound + margin), token.astype(jnp.int32)


def sample(logits: Array, keys: Array, params: SamplingParams,
           config: Optional[SamplerConfig] = None) -> Array:
  """int32 ``[B]``: the next token of each sequence from float ``logits [B, V]``.

  ``keys``: ``[B]`` typed PRNG keys (:func:`sampling_keys`). ``config``:
  default :func:`default_sampler_config` of the default backend.
  """
  if params.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  config = config or default_sampler_config(jax.default_backend())

  def full():
    filtered = filter_logits(logits, params, config)
    return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)

  v = logits.shape[-1]
  sizes = sorted({min(k, v) for k in config.candidates})
  top_k = params.top_k is not None and params.top_k < v
  if not (sizes or config.chunk) or not (top_k or params.top_p is not None) or (
      not _partitionable_threefry()):
    return full()
  if config.chunk and top_k and _top_k_levels(v, params.top_k, config.chunk, config.tie_slack):
    x = logits.astype(jnp.float32) / params.temperature
    return _first_decided([lambda: _chunked_top_k_draw(x, keys, params, config)], full)
  if config.chunk and not top_k and config.score_candidates:
    def score_path(fs):
      if not fs:
        return full()
      x = logits.astype(jnp.float32) / params.temperature
      maxima = _score_noise(x, keys, config.chunk)  # one pass, shared by every F tried
      return _first_decided([functools.partial(_score_draw, x, keys, params, config.chunk, f,
                                               maxima) for f in fs], full)

    if config.kernel and logits.shape[0] >= config.kernel_min_batch:
      # The kernel's F first; the XLA passes for the next F.
      return _first_decided([lambda: _kernel_score_draw(logits, keys, params, config)],
                            lambda: score_path(config.score_candidates[1:]))
    return score_path(config.score_candidates)
  x = logits.astype(jnp.float32) / params.temperature
  return _first_decided([functools.partial(_candidate_draw, x, keys, params, k) for k in sizes],
                        full)


def _first_decided(attempts: Sequence[Callable], fallback: Callable) -> Array:
  """The token of the first attempt (``() -> (ok [B], token [B])``) that decides every row,
  else ``fallback()``; each later attempt runs only where the ones before it did not
  (``lax.cond`` for the whole batch)."""
  def go(i):
    if i == len(attempts):
      return fallback()
    ok, token = attempts[i]()
    return lax.cond(jnp.all(ok), lambda: token, lambda: go(i + 1))
  return go(0)


def sampling_keys(seed: Array, sample_ids: Array, step: Array) -> Array:
  """``[B]`` keys: ``fold_in(fold_in(key(seed), sample_ids[b]), step)``."""
  base = jax.random.key(seed)
  return jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(base, i), step))(sample_ids)
