"""The top-p draw's passes over the logits in one Pallas (Triton) kernel, a row per program.

:mod:`models.generation.sampling`'s score path (``_score_draw``) finds the token ``jax.random.categorical``
draws from the top-p set as the first kept token in the order of the Gumbel scores
``x + g`` (``x = logits / T``): one pass computes the noise of every token (one threefry2x32
per token, bit-identical to ``jax.random.gumbel``) and the best score per chunk, a selection
picks the F best scores, a second pass sums the probability above each. In XLA that is three
programs and two reads of the row, and the first pass spends most of its instructions on two
accurate logarithms and a division per token besides threefry. This kernel does it all per
row, with cheaper arithmetic where the result allows it:

* Noise: threefry exactly (the same 32 bits), then ``-log(-log(u))`` with ``lg2.approx`` and
  a series for ``-log(u)`` near ``u = 1``: within :data:`NOISE_ERROR` of the exact noise (the
  rounding of the exact noise is what the candidates' order needs, and it is recomputed for
  them); ``x`` as ``l * (1 / T)``, within an ulp.
* Candidates: per lane (the tokens ``j + t * tile``, the ones a thread visits) the best score
  of the row so far, no reduction per step; then the F lanes of best score, and the F best of
  their tokens. ``bound``: the best score of every other token (the F+1-th lane maximum, the
  F+1-th token of the chosen lanes).
* Sums: ``2^((l - max l) log2(e) / T)`` with ``ex2.approx`` over the row and over the tokens
  above each candidate, "above" decided exactly: ``l > L`` with ``L`` the largest float32 whose
  quotient ``L / T`` equals the candidate's (as XLA divides), so ``l > L`` iff ``l / T > x``.

The caller (``models.generation.sampling._kernel_score_draw``) recomputes the candidates' scores with
``jax.random.gumbel``'s arithmetic and decides a row only where its best kept candidate beats
``bound`` by more than the kernel's error, so the token is ``categorical``'s; other rows take
the XLA passes. Interpreted (CPU), the logarithms are ``jnp.log2`` and ``jnp.exp2``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu import common

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
#: Columns of the float output: the F sums above at 0..F-1, the row total at next_pow2(F + 1),
#: the bound after it.
VALUES = 16


def threefry_bits(k0, k1, counter):
  """uint32: ``bits1 ^ bits2`` of threefry2x32(key (k0, k1), counter (0, counter)), i.e. the
  32 random bits ``jax.random.bits(key, (V,))`` holds at position ``counter`` (partitionable
  threefry, 20 rounds)."""
  ks = (k0, k1, k0 ^ k1 ^ np.uint32(0x1BD11BDA))
  x0 = jnp.zeros_like(counter) + ks[0]
  x1 = counter + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = (x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r))
      x1 = x0 ^ x1
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x0 ^ x1


def _uniform(bits):
  """float32 ``u`` in [tiny, 1) from 32 random bits, as ``jax.random.uniform(minval=tiny)``
  (``floats * (1 - tiny) + tiny``, where ``1 - tiny`` rounds to 1)."""
  one = np.uint32(np.array(1.0, np.float32).view(np.uint32))
  floats = lax.bitcast_convert_type((bits >> np.uint32(9)) | one, jnp.float32) - np.float32(1.0)
  tiny = np.float32(np.finfo(np.float32).tiny)
  return jnp.maximum(tiny, floats * np.float32(1.0 - tiny) + tiny)


def gumbel_from_bits(bits):
  """float32 Gumbel noise from 32 random bits, step for step as ``jax.random.gumbel``."""
  return -jnp.log(-jnp.log(_uniform(bits)))


def _asm(instruction: str, x):
  return plgpu.elementwise_inline_asm(f"{instruction} $0, $1;", args=[x], constraints="=f,f",
                                      pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct.like(x)])[0]


def _log2(x, fast: bool):
  """log2 of float32 ``x`` > 0: ``lg2.approx`` (absolute error <= 2^-22 on the GPU) or exact."""
  return _asm("lg2.approx.ftz.f32", x) if fast else jnp.log2(x)


def _exp2(x, fast: bool):
  return _asm("ex2.approx.ftz.f32", x) if fast else jnp.exp2(x)


#: Below this, ``-log(1 - d)`` is summed as a series (where ``lg2.approx``'s absolute error
#: would be large against the result).
_SERIES_BELOW = np.float32(2.0 ** -7)


def gumbel_approx(bits, fast: bool):
  """Gumbel noise of the same 32 random bits as :func:`gumbel_from_bits` to within
  :data:`NOISE_ERROR` (absolute): ``-log(-log(u))`` with ``lg2.approx``, and ``-log(u)`` by its
  series ``d + d^2/2 + d^3/3`` (``d = 1 - u``, exact) where ``d < 2^-7``."""
  u = _uniform(bits)
  d = np.float32(1.0) - u
  ln2 = np.float32(np.log(2.0))
  series = d * (np.float32(1.0) + d * (np.float32(0.5) + d * np.float32(1.0 / 3.0)))
  w = jnp.where(d < _SERIES_BELOW, series, -ln2 * _log2(u, fast))
  return -ln2 * _log2(w, fast)


#: A bound on ``|gumbel_approx - gumbel_from_bits|``: where ``d >= 2^-7``, ``-log(u) >= 0.0078``
#: and ``lg2.approx``'s 2^-22 absolute error (1.7e-7 in natural log) is <= 2.2e-5 of it; the
#: series' error is <= d^3/4 of it (< 1e-6); the outer log adds 1.7e-7; float32 rounding of each
#: step a few 1e-7 more. 2^-14 (6.1e-5) leaves a factor of ~2.5.
NOISE_ERROR = 2.0 ** -14


def _next_up(v):
  """The next float32 above ``v`` (``-0.0`` -> the smallest subnormal; ``+inf`` stays)."""
  bits = lax.bitcast_convert_type(v, jnp.int32)
  up = jnp.where(bits >= 0, bits + 1, jnp.where(bits == np.int32(-2 ** 31), 1, bits - 1))
  return jnp.where(v == jnp.inf, v, lax.bitcast_convert_type(up, jnp.float32))


def _kernel(l_ref, k0_ref, k1_ref, pos_ref, val_ref, *, v, temperature, f, tile, fast):
  ts = tile
  nt = pl.cdiv(v, ts)
  ntp = common.next_pow2(nt)  # tokens per lane
  fp = common.next_pow2(f + 1)
  neg = jnp.float32(-jnp.inf)
  big = jnp.int32(np.iinfo(np.int32).max)
  lane = lax.broadcasted_iota(jnp.int32, (ts,), 0)
  inv_t = np.float32(1.0 / temperature)
  log2e_t = np.float32(np.log2(np.e) / temperature)
  t32 = jnp.float32(temperature)
  k0, k1 = plgpu.load(k0_ref), plgpu.load(k1_ref)  # [1] each

  def load(t):
    start = t * ts
    return plgpu.load(l_ref.at[pl.ds(start, ts)], mask=start + lane < v,
                      other=-jnp.inf).astype(jnp.float32)

  def noise(positions):
    return gumbel_approx(threefry_bits(k0, k1, positions.astype(jnp.uint32)), fast)

  def pass_a(t, carry):
    """Per lane (the tokens at ``lane + t * tile``) the best approximate score and the largest
    logit so far."""
    best, lmax = carry
    l = load(t)
    return jnp.maximum(best, l * inv_t + noise(t * ts + lane)), jnp.maximum(lmax, l)

  best, lmax = lax.fori_loop(0, nt, pass_a, (jnp.full((ts,), neg), jnp.full((ts,), neg)))

  # The F lanes of best score hold the row's F best scores (every other lane's best score is
  # <= the F+1-th lane maximum); their F best tokens are the candidates.
  ids = []
  for _ in range(f + 1):
    m = jnp.max(best)
    i = jnp.min(jnp.where(best == m, lane, ts))
    ids.append(i)
    best = jnp.where(lane == i, neg, best)
  outside = m  # the best lane maximum after the F taken
  frow = lax.broadcasted_iota(jnp.int32, (fp, ntp), 0)
  step = lax.broadcasted_iota(jnp.int32, (ntp,), 0)
  pos = jnp.full((fp, ntp), big)
  ls = jnp.full((fp, ntp), neg)
  ss = jnp.full((fp, ntp), neg)
  for j in range(f):
    cols = ids[j] + step * ts
    l = plgpu.load(l_ref.at[jnp.minimum(cols, v - 1)], mask=cols < v,
                   other=-jnp.inf).astype(jnp.float32)
    pos = jnp.where(frow == j, cols[None, :], pos)
    ls = jnp.where(frow == j, l[None, :], ls)
    ss = jnp.where(frow == j, (l * inv_t + noise(cols))[None, :], ss)
  limits, places = [], []
  for j in range(f + 1):
    m = jnp.max(ss)
    p = jnp.min(jnp.where(ss == m, pos, big))
    if j < f:
      # ``l > limit`` iff ``l / T > x`` (x = the candidate's l / T): the largest logit whose
      # quotient equals x, a few floats above the candidate's at most.
      lc = jnp.max(jnp.where(pos == p, ls, neg))
      x = lc / t32
      limit = lc
      for _ in range(4):
        nxt = _next_up(limit)
        limit = jnp.where(nxt / t32 == x, nxt, limit)
      limits.append(limit)
      places.append(p)
    ss = jnp.where(pos == p, neg, ss)
  bound = jnp.maximum(outside, m)  # the best score of every token that is not a candidate
  scaled_top = jnp.max(lmax) * log2e_t

  def pass_b(t, sums):
    """The unnormalised mass of the row, and above each candidate."""
    l = load(t)
    w = _exp2(l * log2e_t - scaled_top, fast)
    return (sums[0] + w,) + tuple(a + jnp.where(l > lim, w, 0.0) for a, lim in zip(sums[1:], limits))

  sums = lax.fori_loop(0, nt, pass_b, tuple(jnp.zeros((ts,), jnp.float32) for _ in range(f + 1)))
  col = lax.broadcasted_iota(jnp.int32, (VALUES,), 0)
  out = jnp.where(col == fp, jnp.sum(sums[0]), jnp.where(col == fp + 1, bound, 0.0))
  pcol = lax.broadcasted_iota(jnp.int32, (fp,), 0)
  where = jnp.zeros((fp,), jnp.int32)
  for j in range(f):
    out = jnp.where(col == j, jnp.sum(sums[1 + j]), out)
    where = jnp.where(pcol == j, places[j], where)
  plgpu.store(val_ref.at[pl.ds(0, VALUES)], out)
  plgpu.store(pos_ref.at[pl.ds(0, fp)], where)


def score_candidates(logits: jax.Array, key_data: jax.Array, *, temperature: float, f: int,
                     tile: int = 2048, num_warps: int = 4, interpret: bool | None = None):
  """Per row of ``logits [B, V]`` (noise from ``key_data [B, 2]`` uint32, one key per row):

  ``(positions int32 [B, F], above float32 [B, F], total float32 [B], bound float32 [B])``:
  the F best-scoring tokens of the F lanes of best score (lane j: the tokens ``j + t * tile``;
  ``tile`` tokens per step of a program, one row per program), the unnormalised mass
  (``2^((l - max l) log2(e) / T)``) of the tokens with ``x > x[position]`` (``x = l / T``, as XLA
  divides) for each, the row's whole mass, and the best score of any other token. The scores
  are the kernel's (within :data:`NOISE_ERROR` of ``jax.random.gumbel``'s plus ``l * (1 / T)``'s
  rounding); the positions and sums do not depend on that rounding except through which
  tokens are the candidates.
  """
  b, v = logits.shape
  if tile < 1 or tile & (tile - 1):
    raise ValueError(f"score_candidates: tile must be a power of two; got {tile}")
  if not 1 <= f < VALUES // 2:
    raise ValueError(f"score_candidates: need 1 <= f < {VALUES // 2}; got {f=}")
  if not temperature > 0:
    raise ValueError(f"score_candidates: temperature must be > 0; got {temperature}")
  fp = common.next_pow2(f + 1)
  kernel = functools.partial(_kernel, v=v, temperature=float(temperature), f=f, tile=tile)

  def call(logits, k0, k1, *, interpret):
    return pl.pallas_call(
        functools.partial(kernel, fast=not interpret), grid=(b,),
        in_specs=[pl.BlockSpec((None, v), lambda i: (i, 0)),
                  pl.BlockSpec((1,), lambda i: (i,)), pl.BlockSpec((1,), lambda i: (i,))],
        out_specs=(pl.BlockSpec((None, fp), lambda i: (i, 0)),
                   pl.BlockSpec((None, VALUES), lambda i: (i, 0))),
        out_shape=(jax.ShapeDtypeStruct((b, fp), jnp.int32),
                   jax.ShapeDtypeStruct((b, VALUES), jnp.float32)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="sampler_score_candidates")(logits, k0, k1)

  key_data = key_data.astype(jnp.uint32)
  pos, vals = common.run(call, logits, key_data[:, 0], key_data[:, 1], interpret=interpret)
  return pos[:, :f], vals[:, :f], vals[:, fp], vals[:, fp + 1]
