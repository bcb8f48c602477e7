"""Sampling follows the definitions of greedy, temperature, top-k and top-p on fixed logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.sampling import SamplingParams, filter_logits, sample, sampling_keys

# Probabilities 0.4, 0.25, 0.15, 0.1, 0.06, 0.04 (sorted order scrambled on purpose).
PROBS = np.array([0.1, 0.4, 0.04, 0.25, 0.06, 0.15])
LOGITS = jnp.asarray(np.log(PROBS)[None], jnp.float32)
DRAWS = 4000


def kept(params: SamplingParams) -> set[int]:
  return set(np.flatnonzero(np.isfinite(np.asarray(filter_logits(LOGITS, params))[0])))


def draw(params: SamplingParams, logits=LOGITS, n=DRAWS, seed=0) -> np.ndarray:
  """n draws from one row of logits, each with its own key."""
  keys = sampling_keys(jnp.uint32(seed), jnp.arange(n, dtype=jnp.int32), jnp.int32(0))
  return np.asarray(jax.jit(sample, static_argnums=2)(jnp.repeat(logits, n, axis=0), keys, params))


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
