"""Per-row sampling rules (models.serving.sampling): each row draws the token that
models.generation.sampling.sample draws for its rule alone, in one program for any mix."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from models.generation.sampling import SamplerConfig, SamplingParams, sample
from models.serving.sampling import RowRules, sample_rows
from strategies import small_jit

RULES = [SamplingParams(), SamplingParams(1.0), SamplingParams(0.7, top_k=1),
         SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_k=40),
         SamplingParams(0.9, top_p=0.5), SamplingParams(1.0, top_p=0.95),
         SamplingParams(0.8, top_k=20, top_p=0.9), SamplingParams(1.0, top_k=300, top_p=0.7)]
CONFIGS = {"cpu": None, "search": SamplerConfig(candidates=0, search_width=15)}

# Small programs compiled at -O0 (tests/strategies.py): both sides alike.
_sample = small_jit(sample, static_argnums=(2, 3))
_rows = small_jit(sample_rows, static_argnums=3)


@settings(max_examples=4, deadline=None)
# Every row filtered: the draw from the candidates' noise; a plain temperature row: categorical.
@example(1000, "cpu", [3, 4, 5, 7, 2, 6, 8, 3], 11, False)
@example(256, "cpu", [1, 3, 0, 8, 0, 0, 1, 1], 12, True)
@given(st.sampled_from([256, 1000]), st.sampled_from(sorted(CONFIGS)),
       st.lists(st.integers(0, len(RULES) - 1), min_size=8, max_size=8),
       st.integers(0, 2**31 - 1), st.booleans())
def test_each_row_draws_the_token_of_its_rule_alone(vocab, config_name, rule_ids, seed, ties):
  config = CONFIGS[config_name]
  rng = np.random.default_rng(seed)
  b = len(rule_ids)
  logits = rng.normal(size=(b, vocab)).astype(np.float32) * 3
  if ties:  # few distinct values: ties at the k-th value and in the top-p sums
    logits = np.round(logits)
  keys = jax.vmap(jax.random.key)(jnp.arange(b, dtype=jnp.uint32) + seed)
  rules = [RULES[i] for i in rule_ids]
  got = np.asarray(_rows(logits, keys, RowRules.of(rules), config))
  for r, rule in enumerate(rules):
    want = int(_sample(logits[r:r + 1], keys[r:r + 1], rule, config)[0])
    assert got[r] == want, f"row {r} ({rule}): {got[r]} != {want}"


def test_the_draws_follow_the_rules():
  """Kept sets by their definition: greedy is the argmax, top-k draws only among the k
  largest, top-p only among the smallest most-likely set reaching p."""
  rng = np.random.default_rng(0)
  vocab, b = 64, 512
  logits = jnp.asarray(np.tile(rng.normal(size=(1, vocab)).astype(np.float32) * 2, (b, 1)))
  keys = jax.vmap(jax.random.key)(jnp.arange(b, dtype=jnp.uint32))
  order = np.argsort(-np.asarray(logits[0]))
  probs = np.asarray(jax.nn.softmax(logits[0]))[order]
  nucleus = int(np.searchsorted(np.cumsum(probs), 0.6) + 1)
  for rule, allowed in [(SamplingParams(), order[:1]), (SamplingParams(1.0, top_k=3), order[:3]),
                        (SamplingParams(1.0, top_p=0.6), order[:nucleus]),
                        (SamplingParams(1.0), order)]:
    got = np.asarray(_rows(logits, keys, RowRules.of([rule] * b), None))
    assert set(got.tolist()) <= set(allowed.tolist())
    if len(allowed) > 1:
      assert len(set(got.tolist())) > 1  # it does sample
