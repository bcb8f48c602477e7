"""RoPE: frequencies (incl. llama3/linear scaling) and the relative-position property."""

import jax.numpy as jnp
import numpy as np
import pytest

from models.model.config import RopeScaling, preset
from models.model.rope import apply_rope, inverse_frequencies


def test_llama3_frequencies_match_transformers():
  transformers = pytest.importorskip("transformers")
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  hf = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, rope_parameters=dict(
      rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
      high_freq_factor=4.0, original_max_position_embeddings=8192))
  ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
  config = preset("llama-3.1-8b").replace(hidden_size=512, num_heads=4, num_kv_heads=4, head_dim=128)
  ours = inverse_frequencies(config)
  np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)
  assert not np.allclose(ours, inverse_frequencies(config.replace(rope_scaling=None)), rtol=1e-3)


def test_linear_scaling_divides_every_frequency():
  base = preset("tiny")
  np.testing.assert_allclose(
      inverse_frequencies(base.replace(rope_scaling=RopeScaling("linear", 4.0))),
      inverse_frequencies(base) / 4, rtol=1e-7)


def test_scores_depend_only_on_the_relative_position_and_norms_are_kept():
  config = preset("tiny").replace(head_dim=32, rope_theta=500.0)
  inv = inverse_frequencies(config)
  rng = np.random.default_rng(0)
  q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 32)), jnp.float32) for _ in range(2))
  at = lambda x, p: apply_rope(x, jnp.asarray([[p]], jnp.int32), inv)[0, 0, 0]
  score = lambda i, j: float(jnp.dot(at(q, i), at(k, j)))
  assert score(10, 3) == pytest.approx(score(107, 100), rel=1e-4)
  assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-3)
  assert float(jnp.linalg.norm(at(q, 77))) == pytest.approx(float(jnp.linalg.norm(q)), rel=1e-5)
