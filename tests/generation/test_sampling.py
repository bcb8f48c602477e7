"""Sampling follows the definitions of greedy, temperature, top-k and top-p on fixed logits."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.generation.sampling import SamplingParams, filter_logits, sample, sampling_keys
from strategies import small_jit

# Probabilities 0.4, 0.25, 0.15, 0.1, 0.06, 0.04 (sorted order scrambled on purpose).
PROBS = np.array([0.1, 0.4, 0.04, 0.25, 0.06, 0.15])
LOGITS = jnp.asarray(np.log(PROBS)[None], jnp.float32)
DRAWS = 4000


def kept(params: SamplingParams) -> set[int]:
  return set(np.flatnonzero(np.isfinite(np.asarray(filter_logits(LOGITS, params))[0])))


def draw(params: SamplingParams, logits=LOGITS, n=DRAWS, seed=0) -> np.ndarray:
  """n draws from one row of logits, each with its own key."""
  keys = sampling_keys(jnp.uint32(seed), jnp.arange(n, dtype=jnp.int32), jnp.int32(0))
  return np.asarray(small_jit(sample, static_argnums=2)(jnp.repeat(logits, n, axis=0), keys, params))


def test_greedy_is_argmax_whatever_top_k_and_top_p():
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(5, 33)), jnp.float32)
  expected = np.argmax(np.asarray(logits), axis=-1)
  for params in (SamplingParams(), SamplingParams(0.0, top_k=3, top_p=0.2)):
    got = sample(logits, sampling_keys(jnp.uint32(0), jnp.arange(5), jnp.int32(0)), params)
    np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize("k, expected", [(1, {1}), (2, {1, 3}), (4, {1, 3, 5, 0}),
                                         (6, set(range(6))), (99, set(range(6)))])
def test_top_k_keeps_the_k_largest(k, expected):
  assert kept(SamplingParams(1.0, top_k=k)) == expected


@pytest.mark.parametrize("p, expected", [
    (0.05, {1}),  # the top token alone already covers p
    (0.5, {1, 3}),  # 0.4 < 0.5 <= 0.65
    (0.7, {1, 3, 5}),  # 0.65 < 0.7 <= 0.8
    (0.85, {1, 3, 5, 0}),  # 0.8 < 0.85 <= 0.9
    (0.99, set(range(6))),
    (1.0, set(range(6))),
])
def test_top_p_keeps_the_smallest_set_reaching_p(p, expected):
  assert kept(SamplingParams(1.0, top_p=p)) == expected


def test_top_p_exactly_at_a_cumulative_boundary():
  # p = 0.4 equals the top probability: {1} is minimal; rounding of log/softmax may add the next.
  assert kept(SamplingParams(1.0, top_p=0.4)) in ({1}, {1, 3})


def test_top_p_applies_after_top_k_and_temperature():
  # top_k=3 renormalises 0.4, 0.25, 0.15 to 0.5, 0.3125, 0.1875: p = 0.75 needs two tokens.
  assert kept(SamplingParams(1.0, top_k=3, top_p=0.75)) == {1, 3}
  # Temperature 0.5 squares and renormalises: 0.4^2 / sum(p^2) = 0.61 covers p = 0.5 alone.
  assert kept(SamplingParams(0.5, top_p=0.5)) == {1}


def frequencies(tokens, v=6):
  return np.bincount(tokens, minlength=v) / len(tokens)


def within_sampling_noise(freq, probs, n=DRAWS):
  """Every frequency within 4.5 standard errors of its probability (fixed seeds: no flakes)."""
  sigma = np.sqrt(probs * (1 - probs) / n) + 1e-12
  return bool(np.all(np.abs(freq - probs) <= 4.5 * sigma + 1e-9))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_samples_softmax_of_logits_over_t(temperature):
  target = PROBS ** (1 / temperature)
  target /= target.sum()
  freq = frequencies(draw(SamplingParams(temperature)))
  assert within_sampling_noise(freq, target)
  other = PROBS ** (1 / (temperature * 1.6))
  assert not within_sampling_noise(freq, other / other.sum())  # the check can fail


def test_filtered_sampling_renormalises_over_the_kept_set():
  freq = frequencies(draw(SamplingParams(1.0, top_p=0.7)))
  target = np.where(np.isin(np.arange(6), [1, 3, 5]), PROBS, 0.0)
  assert within_sampling_noise(freq, target / target.sum())


def test_keys_depend_only_on_seed_sample_and_step():
  keys = lambda seed, ids, step: np.asarray(jax.random.key_data(
      sampling_keys(jnp.uint32(seed), jnp.asarray(ids, jnp.int32), jnp.int32(step))))
  a = keys(7, [0, 1, 2, 3], 5)
  np.testing.assert_array_equal(a[[2, 0]], keys(7, [2, 0], 5))  # batch layout does not matter
  assert not np.array_equal(a, keys(8, [0, 1, 2, 3], 5))
  assert not np.array_equal(a, keys(7, [0, 1, 2, 3], 6))
  assert len({tuple(r) for r in a}) == 4
  np.testing.assert_array_equal(draw(SamplingParams(1.0), seed=3), draw(SamplingParams(1.0), seed=3))
  assert not np.array_equal(draw(SamplingParams(1.0), seed=3), draw(SamplingParams(1.0), seed=4))


@pytest.mark.parametrize("kwargs, name", [(dict(temperature=-1.0), "temperature"),
                                          (dict(temperature=1.0, top_k=0), "top_k"),
                                          (dict(temperature=1.0, top_p=0.0), "top_p"),
                                          (dict(temperature=1.0, top_p=1.5), "top_p")])
def test_bad_parameters_name_themselves(kwargs, name):
  with pytest.raises(ValueError, match=name):
    SamplingParams(**kwargs)


# -- the sort-free sampler equals the sort-based reference ---------------------------------------

from hypothesis import assume, given, settings, strategies as st

from models.generation.sampling import (SamplerConfig, _gumbel_at, default_sampler_config,
                             filter_logits_reference, sample_reference, threshold_search)
from strategies import count_case

B, V = 4, 203
_search = lambda width, passes=4: SamplerConfig(candidates=0, search_width=width, value_passes=passes)
# (config, params): each config's paths under top-k, top-p, both, extreme temperatures, top_k >= V.
CASES = (
    (_search(1), SamplingParams(0.7, top_p=0.9)),
    (_search(6), SamplingParams(0.5, top_k=12, top_p=0.6)),
    (_search(3, passes=0), SamplingParams(1.0, top_k=5)),
    (_search(1), SamplingParams(1e-3, top_p=0.95)),
    (_search(15), SamplingParams(50.0, top_p=0.3)),
    (SamplerConfig(candidates=8, search_width=3), SamplingParams(0.7, top_k=6, top_p=0.8)),
    (SamplerConfig(candidates=8), SamplingParams(1.0, top_k=V)),
    (SamplerConfig(candidates=64), SamplingParams(1.0, top_k=70, top_p=0.999)),
    (SamplerConfig(candidates=(8, 1024)), SamplingParams(0.7, top_p=0.9)),
    (SamplerConfig(candidates=64), SamplingParams(2.0, top_k=1)),
)


def oracle_kept(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, float]:
  """float64 definition: (kept mask [B, V], the smallest |strictly-above mass - p| of any row).

  top-k: x >= the k-th largest; top-p: the mass of the kept tokens strictly more likely than x
  is < p. The margin says how close a decision came to p (float32 rounding decides below ~1e-6).
  """
  x = logits.astype(np.float64) / params.temperature
  keep = np.ones(x.shape, bool)
  if params.top_k is not None and params.top_k < x.shape[1]:
    keep = x >= np.sort(x, axis=1)[:, -params.top_k][:, None]
  margin = np.inf
  if params.top_p is not None:
    w = np.where(keep, np.exp(x - x.max(axis=1, keepdims=True)), 0.0)
    w /= w.sum(axis=1, keepdims=True)
    above = np.array([[w[b][x[b] > v].sum() for v in x[b]] for b in range(x.shape[0])])
    keep &= above < params.top_p
    margin = float(np.min(np.abs(above - params.top_p)))
  return keep, margin


@functools.lru_cache(maxsize=None)
def _jitted(config, params):
  """One program per case: (kept mask, tokens) of the sampler and of the reference."""
  def both(logits, keys):
    return (jnp.isfinite(filter_logits(logits, params, config)), sample(logits, keys, params, config),
            jnp.isfinite(filter_logits_reference(logits, params)),
            sample_reference(logits, keys, params))
  return small_jit(both)


@settings(max_examples=40)
@given(seed=st.integers(0, 2**31 - 1), case=st.sampled_from(CASES),
       levels=st.sampled_from([0, 3, 12]), scale=st.sampled_from([0.5, 4.0, 30.0]),
       flat_rows=st.integers(0, B))
def test_kept_set_and_tokens_equal_the_sorting_reference(seed, case, levels, scale, flat_rows):
  """Random logits, ties (``levels`` distinct values per row) and flat rows (the fallback path)."""
  count_case("sampler-vs-sort")
  config, params = case
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(B, V)) * scale
  if levels:
    x = np.round(x * levels / scale) / levels * scale  # many exact ties
  x[:flat_rows] *= 1e-3  # near-uniform rows: the kept set is most of the vocabulary
  logits = x.astype(np.float32)
  expected, margin = oracle_kept(logits, params)
  assume(margin > 1e-5)  # closer to p, float32 rounding decides (for the reference as well)
  keys = sampling_keys(jnp.uint32(seed % 1000), jnp.arange(B, dtype=jnp.int32), jnp.int32(3))
  kept, tokens, kept_ref, tokens_ref = map(np.asarray, _jitted(config, params)(logits, keys))
  np.testing.assert_array_equal(kept, kept_ref)
  np.testing.assert_array_equal(kept, expected)
  np.testing.assert_array_equal(tokens, tokens_ref)
  assert expected[np.arange(B), tokens].all()


def test_the_candidate_path_and_the_fallback_both_run_and_agree():
  """A peaked batch fits 8 candidates; one flat row sends the whole batch to the search."""
  rng = np.random.default_rng(1)
  peaked = (rng.normal(size=(B, V)) * 8).astype(np.float32)
  flat = peaked.copy()
  flat[2] *= 1e-3
  params = SamplingParams(0.7, top_p=0.9)
  keys = sampling_keys(jnp.uint32(5), jnp.arange(B, dtype=jnp.int32), jnp.int32(0))
  config = SamplerConfig(candidates=8)
  from models.generation.sampling import _candidate_draw
  for logits, fits in ((peaked, True), (flat, False)):
    ok, _ = _candidate_draw(jnp.asarray(logits) / params.temperature, keys, params, 8)
    assert bool(jnp.all(ok)) == fits
    _, tokens, _, tokens_ref = _jitted(config, params)(jnp.asarray(logits), keys)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(tokens_ref))


def test_gumbel_at_positions_is_jax_random_gumbel_there():
  keys = sampling_keys(jnp.uint32(11), jnp.arange(3, dtype=jnp.int32), jnp.int32(7))
  full = jax.vmap(lambda k: jax.random.gumbel(k, (1000,)))(keys)
  idx = jnp.asarray(np.random.default_rng(2).integers(0, 1000, (3, 17)), jnp.int32)
  np.testing.assert_array_equal(np.asarray(_gumbel_at(keys, idx)),
                                np.take_along_axis(np.asarray(full), np.asarray(idx), 1))


def test_threshold_search_finds_the_exact_row_value():
  """Values across signs, binades and -inf; the answer is a row value to the last bit."""
  rng = np.random.default_rng(3)
  x = (rng.normal(size=(6, 500)) * np.array([1e-30, 1e-3, 1.0, 1e3, 1e30, 1.0])[:, None])
  x = x.astype(np.float32)
  x[5, :400] = -np.inf
  for k in (1, 7, 100):
    got = np.asarray(threshold_search(jnp.asarray(x), jnp.ones(x.shape, jnp.int32), k,
                                      SamplerConfig(search_width=3)))[:, 0]
    np.testing.assert_array_equal(got, np.sort(x, axis=1)[:, -k])


def test_default_configs_and_bad_configs():
  assert default_sampler_config("cpu").candidates == (64, 1024)
  assert default_sampler_config("cpu").score_candidates == () == SamplerConfig(
      score_candidates=0).score_candidates
  assert default_sampler_config("gpu").score_candidates == (6, 15)
  assert default_sampler_config("gpu").candidates == () == SamplerConfig(candidates=0).candidates
  assert default_sampler_config("gpu").chunk == 128
  for kwargs, name in ((dict(candidates=-1), "candidates"), (dict(candidates=(64, 8)), "candidates"), (dict(search_width=0), "search_width"),
                       (dict(value_passes=-2), "value_passes"), (dict(chunk=-1), "chunk"),
                       (dict(chunk=2.5), "chunk"), (dict(score_candidates=-1), "score_candidates"),
                       (dict(score_candidates=(15, 6)), "score_candidates"),
                       (dict(tie_slack=-1), "tie_slack"), (dict(chunk=8, kernel=1), "kernel"),
                       (dict(kernel=True, chunk=8, score_candidates=()), "kernel"),
                       (dict(kernel=True, chunk=0, score_candidates=6), "kernel"),
                       (dict(kernel=True, chunk=8, score_candidates=(8, 15)), "kernel"),
                       (dict(kernel_min_batch=0), "kernel_min_batch"),
                       (dict(kernel_tile=1000), "kernel_tile")):
    with pytest.raises(ValueError, match=name):
      SamplerConfig(**kwargs)
  assert default_sampler_config("gpu").kernel and not default_sampler_config("cpu").kernel
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams(float("inf"))


# -- the chunked paths (GPU default) equal the sort-based reference ------------------------------

from models.generation.sampling import (_chunked_top_k_draw, _score_draw, _score_noise, _top_few,
                             _top_k_levels)

# tie_slack 4: small vocabularies still take the chunk levels (16, the default, needs more chunks).
_chunked = lambda g, f=16: SamplerConfig(candidates=0, search_width=7, chunk=g, score_candidates=f,
                                         tie_slack=4)
# The top-p kernel (interpreted here): tiles of 16-128 tokens, so rows take 2-33 steps.
_kernel = lambda tile, f=6: dataclasses.replace(_chunked(8, f), kernel=True, kernel_min_batch=1,
                                                kernel_tile=tile)
# (vocab, config, params): top-p alone (the score path), top-k with and without top-p (the
# chunk levels), p near 0 and 1, extreme temperatures; vocab sizes no chunk size divides.
CHUNKED_CASES = (
    (203, "float32", _chunked(8), SamplingParams(0.7, top_p=0.9)),
    (203, "bfloat16", _chunked(16, f=4), SamplingParams(1.0, top_p=0.999)),
    (203, "float32", _chunked(8, f=(1, 3)), SamplingParams(1.0, top_p=0.6)),  # stage 2 often
    (517, "float32", _chunked(8), SamplingParams(1e-3, top_p=1e-6)),
    (517, "bfloat16", _chunked(32, f=3), SamplingParams(50.0, top_p=0.5)),
    (517, "bfloat16", _chunked(4), SamplingParams(0.7, top_k=5, top_p=0.9)),
    (517, "float32", _chunked(8), SamplingParams(1.0, top_k=3)),
    (517, "bfloat16", _chunked(4), SamplingParams(2.0, top_k=1, top_p=0.3)),
    (203, "float32", _chunked(8), SamplingParams(0.7, top_k=100, top_p=0.9)),  # no level pays
    (203, "float32", _kernel(16), SamplingParams(0.7, top_p=0.9)),
    (517, "bfloat16", _kernel(64, f=3), SamplingParams(50.0, top_p=0.5)),
    (517, "float32", _kernel(128, f=(1, 3)), SamplingParams(1.0, top_p=0.6)),  # stage 2 often
    (203, "float32", _kernel(32), SamplingParams(1e-3, top_p=1e-6)),
)


@functools.lru_cache(maxsize=None)
def _jitted_sample(config, params):
  return small_jit(lambda logits, keys: (sample(logits, keys, params, config),
                                         sample_reference(logits, keys, params)))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), case=st.sampled_from(CHUNKED_CASES),
       levels=st.sampled_from([0, 4, 40]), scale=st.sampled_from([0.01, 1.0, 8.0]),
       neg_inf=st.sampled_from([0.0, 0.5, 0.99]))
def test_chunked_paths_draw_the_reference_tokens(seed, case, levels, scale, neg_inf):
  """Ties (``levels``), ``-inf`` entries (0.99: rows with fewer finite chunks than candidates),
  bf16 logits: the same tokens as the sorting reference."""
  count_case("sampler-chunked-vs-sort")
  v, dtype, config, params = case
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(B, v)) * scale
  if levels:
    x = np.round(x * levels / scale) / levels * scale
  x[rng.random(size=x.shape) < neg_inf] = -np.inf
  x[:, rng.integers(v)] = 0.0  # at least one finite entry per row
  logits = jnp.asarray(x, dtype)
  expected, margin = oracle_kept(np.asarray(logits.astype(jnp.float32)), params)
  assume(margin > 1e-5)
  keys = sampling_keys(jnp.uint32(seed % 1000), jnp.arange(B, dtype=jnp.int32), jnp.int32(2))
  tokens, tokens_ref = map(np.asarray, _jitted_sample(config, params)(logits, keys))
  np.testing.assert_array_equal(tokens, tokens_ref)
  assert expected[np.arange(B), tokens].all()


def test_chunked_paths_decide_without_the_fallback_on_typical_rows():
  """The fast paths hold (``ok``) on flat and peaked rows; exact ties send a row to the fallback."""
  rng = np.random.default_rng(4)
  keys = sampling_keys(jnp.uint32(9), jnp.arange(8, dtype=jnp.int32), jnp.int32(0))
  config = _chunked(16)
  score = lambda x, keys, params, config: _score_draw(x, keys, params, config.chunk, 16,
                                                      _score_noise(x, keys, config.chunk))
  for params, path in ((SamplingParams(0.7, top_p=0.9), score),
                       (SamplingParams(0.7, top_k=50, top_p=0.9), _chunked_top_k_draw)):
    run = small_jit(lambda x, path=path, params=params: (
        path(x / params.temperature, keys, params, config), sample_reference(x, keys, params)))
    for scale in (0.01, 1.0, 8.0):
      (ok, token), expected = run(jnp.asarray(rng.normal(size=(8, 2053)) * scale, jnp.float32))
      assert bool(jnp.all(ok)), (scale, params)
      np.testing.assert_array_equal(np.asarray(token), np.asarray(expected))
  tied = jnp.zeros((8, 2053), jnp.float32)  # every chunk maximum ties with the k-th
  params = SamplingParams(1.0, top_k=7)
  ok, _ = _chunked_top_k_draw(tied, keys, params, config)
  assert not bool(jnp.any(ok))
  np.testing.assert_array_equal(np.asarray(sample(tied, keys, params, config)),
                                np.asarray(sample_reference(tied, keys, params)))


def test_score_candidates_are_tried_in_turn_then_the_search():
  """Top-p 0.3 on flat rows: the best score is often not kept, so F = 1 leaves rows undecided,
  F = 2 too; each stage must be checked before its token is used, the search taking the rest."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(16, 203)), jnp.float32)
  keys = sampling_keys(jnp.uint32(1), jnp.arange(16, dtype=jnp.int32), jnp.int32(0))
  params = SamplingParams(1.0, top_p=0.3)
  config = _chunked(8, f=(1, 2))
  maxima = _score_noise(x, keys, 8)
  for f in (1, 2):
    ok, _ = _score_draw(x, keys, params, 8, f, maxima)
    assert not bool(jnp.all(ok)), f  # this stage alone does not decide every row
  np.testing.assert_array_equal(np.asarray(sample(x, keys, params, config)),
                                np.asarray(sample_reference(x, keys, params)))


def test_top_k_levels_narrow_to_k_chunks_while_that_pays():
  assert _top_k_levels(128256, 50, 128, 16) == [128, 32, 8, 2]
  assert _top_k_levels(128256, 2000, 128, 16) == []  # 1002 chunks < 4k: the candidates path
  assert _top_k_levels(517, 3, 8, 4) == [8, 2]
  for v, k, g, slack in ((128256, 50, 128, 16), (49152, 1, 64, 16), (1000, 7, 16, 4)):
    n = v
    for size in _top_k_levels(v, k, g, slack):
      assert -(-n // size) >= 4 * (k + slack)
      n = (k + slack) * size
    assert n >= k


def test_bf16_ties_do_not_send_top_k_rows_to_the_search():
  """bf16 logits tie often: with 4 chunks of slack 3 of these 64 rows took the search (the
  whole batch with them); the default keeps 16 and decides every row."""
  logits = jax.random.normal(jax.random.key(1), (64, 128256)).astype(jnp.bfloat16)
  keys = sampling_keys(jnp.uint32(0), jnp.arange(64, dtype=jnp.int32), jnp.int32(0))
  params = SamplingParams(0.7, top_k=50, top_p=0.9)
  x = logits.astype(jnp.float32) / params.temperature
  for slack, decided in ((4, 61), (16, 64)):
    config = dataclasses.replace(default_sampler_config("gpu"), tie_slack=slack)
    ok, token = small_jit(lambda x: _chunked_top_k_draw(x, keys, params, config))(x)
    assert int(jnp.sum(ok)) == decided, slack
  np.testing.assert_array_equal(np.asarray(token), np.asarray(sample_reference(logits, keys, params)))


@pytest.mark.parametrize("params", [SamplingParams(0.7, top_p=0.9),
                                    SamplingParams(0.7, top_k=50, top_p=0.9)])
def test_gpu_default_exports_for_cuda_without_a_sort_of_the_vocabulary(params):
  """The GPU path's top-k calls and sorts see short rows only (outside the fallback's search)."""
  b, v = 8, 128256
  keys = sampling_keys(jnp.uint32(0), jnp.arange(b, dtype=jnp.int32), jnp.int32(0))
  fn = small_jit(lambda l, k: sample(l, k, params, default_sampler_config("gpu")))
  text = jax.export.export(fn, platforms=["cuda"])(
      jax.ShapeDtypeStruct((b, v), jnp.float32), keys).mlir_module()
  sorts = [line for line in text.splitlines() if '"stablehlo.sort"' in line or "chlo.top_k" in line]
  assert sorts and not any(f"tensor<{b}x{v}x" in line for line in sorts)  # candidates=64 has one


@pytest.mark.parametrize("levels", [0, 3])
def test_top_few_is_lax_top_k(levels):
  """Values, indices and the order of ties; rows with ``-inf`` entries (at least k finite)."""
  rng = np.random.default_rng(levels)
  x = rng.normal(size=(64, 37))
  if levels:
    # Many ties; + 0.0 turns -0.0 into 0.0: lax.top_k sorts -0.0 below 0.0, arg-max (as
    # jax.random.categorical's) takes them as equal.
    x = np.round(x * levels) / levels + 0.0
  x[rng.random(size=x.shape) < 0.5] = -np.inf
  x[:, :7] = np.where(np.isinf(x[:, :7]), 0.0, x[:, :7])  # >= 7 finite per row
  x = jnp.asarray(x, jnp.float32)
  for k in (1, 2, 7):
    vals, idx = _top_few(x, k)
    want_vals, want_idx = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_vals))
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))


# -- the top-p kernel (pallas_kernels.gpu.sampler; interpreted here) -----------------------------

from models.generation.sampling import _kernel_score_draw
from pallas_kernels.gpu import sampler as sampler_kernel


def _worst_noise_error(log2_error: float) -> float:
  """The largest |kernel noise - exact noise| over all 2^23 uniforms, each log2 off by up to
  ``log2_error`` (absolute) in the worse direction, plus float32 rounding of each step."""
  m = np.arange(2 ** 23, dtype=np.float64)
  tiny = float(np.finfo(np.float32).tiny)
  u = np.maximum(m / 2 ** 23, tiny)
  exact = -np.log(-np.log(u))
  d = 1.0 - u
  ulp = 2.0 ** -23
  worst = 0.0
  for sign in (-1.0, 1.0):
    series = d * (1 + d * (0.5 + d / 3.0)) * (1 + sign * 4 * ulp)  # + 4 ulps of rounding
    from_log = -np.log(2.0) * (np.log2(u) - sign * log2_error) * (1 + sign * 2 * ulp)
    w = np.where(d < float(sampler_kernel._SERIES_BELOW), series, from_log)
    for outer in (-1.0, 1.0):
      g = -np.log(2.0) * (np.log2(w) + outer * log2_error)
      g = g + np.abs(g) * 4 * ulp * outer
      worst = max(worst, float(np.max(np.abs(g - exact))))
  return worst


def test_kernel_noise_is_within_its_bound_of_jax_random_gumbel():
  """Every one of the 2^23 uniforms: the kernel's noise (series near 1, logarithms elsewhere)
  stays within NOISE_ERROR of ``jax.random.gumbel``'s, with exact logarithms (as here) and with
  logarithms off by 2^-21, twice the GPU's ``lg2.approx`` bound (measured on an H200: 5.2e-6
  at most over 131 M draws)."""
  bits = jnp.asarray(np.arange(2 ** 23, dtype=np.uint32) << np.uint32(9))
  exact = small_jit(sampler_kernel.gumbel_from_bits)(bits)
  approx = small_jit(lambda b: sampler_kernel.gumbel_approx(b, False))(bits)
  assert float(jnp.max(jnp.abs(approx - exact))) < sampler_kernel.NOISE_ERROR / 8
  assert _worst_noise_error(2.0 ** -21) < sampler_kernel.NOISE_ERROR
  assert _worst_noise_error(2.0 ** -14) > sampler_kernel.NOISE_ERROR  # the model can fail
  keys = sampling_keys(jnp.uint32(3), jnp.arange(4, dtype=jnp.int32), jnp.int32(1))
  data = jax.random.key_data(keys)
  counters = jnp.arange(5000, dtype=jnp.uint32)
  bits = jax.vmap(lambda k: sampler_kernel.threefry_bits(k[0], k[1], counters))(data)
  np.testing.assert_array_equal(
      np.asarray(bits), np.asarray(jax.vmap(lambda k: jax.random.bits(k, (5000,), jnp.uint32))(keys)))


def _kernel_reference(l32: np.ndarray, keys, temperature: float, f: int, tile: int):
  """NumPy: the F lanes of best exact score, their F best tokens, the sums over x > x_c (x the
  float32 quotient, as XLA divides), the best other score."""
  b, v = l32.shape
  x32 = (jnp.asarray(l32) / temperature).astype(jnp.float32)
  s = np.asarray(x32 + jax.vmap(lambda k: jax.random.gumbel(k, (v,)))(keys))
  x32 = np.asarray(x32)
  nt = -(-v // tile)
  out = []
  for r in range(b):
    padded = np.full(nt * tile, -np.inf, np.float32)
    padded[:v] = s[r]
    lane_best = padded.reshape(nt, tile).max(axis=0)
    lanes = np.lexsort((np.arange(tile), -lane_best))
    toks = np.concatenate([np.arange(j, v, tile) for j in lanes[:f]])
    order = np.lexsort((toks, -s[r][toks]))
    pos = toks[order[:f]]
    inner = s[r][toks[order[f]]] if len(order) > f else -np.inf
    xr = x32[r].astype(np.float64)
    w = np.exp(xr - xr.max())
    out.append((pos, np.array([w[xr > xr[p]].sum() for p in pos]), w.sum(),
                max(inner, lane_best[lanes[f]])))
  return out


@pytest.mark.parametrize("v,tile,dtype,collide", [(203, 16, "float32", True), (1000, 64, "float32", False),
                                                  (517, 128, "bfloat16", False), (5, 16, "float32", False)])
def test_kernel_candidates_and_sums_against_numpy(v, tile, dtype, collide):
  """Positions, the sums above each (strictly: tokens whose quotient equals the candidate's
  are not above it, ``collide`` plants such twins), the totals and the bound; rows shorter
  than F (v = 5), ``-inf`` entries, bf16 logits."""
  b, t, f = 6, 0.7, 6
  rng = np.random.default_rng(v)
  l = (rng.normal(size=(b, v)) * 2).astype(np.float32)
  if collide:  # every other token: the next float32 above its neighbour, with the same quotient
    odd = l[:, 1::2].shape[1]
    up = np.nextafter(l[:, 0::2], np.float32(np.inf))[:, :odd]
    same = (up / np.float32(t)) == (l[:, 0::2][:, :odd] / np.float32(t))
    l[:, 1::2] = np.where(same, up, l[:, 1::2])
    assert same.mean() > 0.1
  l[rng.random(size=l.shape) < 0.1] = -np.inf
  l[:, 0] = 0.0
  logits = jnp.asarray(l, dtype)
  keys = sampling_keys(jnp.uint32(v), jnp.arange(b, dtype=jnp.int32), jnp.int32(4))
  pos, above, total, bound = small_jit(lambda lg, kd: sampler_kernel.score_candidates(
      lg, kd, temperature=t, f=f, tile=tile, interpret=True))(logits, jax.random.key_data(keys))
  l32 = np.asarray(logits.astype(jnp.float32))
  if collide:  # some candidate has a twin: another token with the same quotient
    x32 = l32 / np.float32(t)
    assert sum(int((x32[r] == x32[r, p]).sum()) - 1 for r in range(b) for p in np.asarray(pos[r])) > 0
  for r, (want_pos, want_above, want_total, want_bound) in enumerate(
      _kernel_reference(l32, keys, t, f, tile)):
    # Candidates of score -inf (rows with fewer finite tokens than F) may repeat a position.
    n = int(np.isfinite(l32[r, want_pos]).sum())
    np.testing.assert_array_equal(np.asarray(pos[r])[:n], want_pos[:n])
    np.testing.assert_allclose(np.asarray(above[r])[:n] / want_total, want_above[:n] / want_total,
                               atol=2e-6)
    np.testing.assert_allclose(float(total[r]), want_total, rtol=2e-6)
    assert float(bound[r]) == want_bound or abs(float(bound[r]) - want_bound) <= (
        sampler_kernel.NOISE_ERROR), r  # equal where both are -inf (no other token)


def test_kernel_draw_decides_typical_rows_and_the_gpu_default_uses_it_from_kernel_min_batch():
  """Flat and peaked rows: every row decided, the reference's tokens. The GPU default exports
  with the kernel (and no sort of the vocabulary) at 128 rows, without it at 8."""
  rng = np.random.default_rng(6)
  keys = sampling_keys(jnp.uint32(2), jnp.arange(8, dtype=jnp.int32), jnp.int32(0))
  params = SamplingParams(0.7, top_p=0.9)
  config = _kernel(64)
  run = small_jit(lambda x: (_kernel_score_draw(x, keys, params, config),
                             sample_reference(x, keys, params)))
  for scale in (0.01, 1.0, 8.0):
    (ok, token), expected = run(jnp.asarray(rng.normal(size=(8, 2053)) * scale, jnp.float32))
    assert bool(jnp.all(ok)), scale
    np.testing.assert_array_equal(np.asarray(token), np.asarray(expected))
  v = 128256
  for b, used in ((8, False), (128, True)):
    k = sampling_keys(jnp.uint32(0), jnp.arange(b, dtype=jnp.int32), jnp.int32(0))
    fn = small_jit(lambda l, k: sample(l, k, params, default_sampler_config("gpu")))
    text = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        jax.ShapeDtypeStruct((b, v), jnp.float32), k).mlir_module()
    assert ("sampler_score_candidates" in text) == used, b
    sorts = [ln for ln in text.splitlines() if '"stablehlo.sort"' in ln or "chlo.top_k" in ln]
    assert not any(f"tensor<{b}x{v}x" in ln for ln in sorts)
