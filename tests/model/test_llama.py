"""The NNX decoder equals transformers' LlamaForCausalLM, and its cache paths equal its plain path."""

import numpy as np
import pytest

import jax.numpy as jnp
from flax import nnx

from models.checkpoints.loading import from_pretrained
from models.generation import cache as cache_lib
from models.generation.cache import SegmentLevel
from models.model.config import preset
from models.model.llama import build, flat_params, random_init

from model_checks import BATCH, SEQ, hf_logits, make_hf_llama, rel_err, run, token_ids

HF_CASES = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=24),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),
    "tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "llama3_rope": dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=16)),
    "linear_rope": dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters=dict(
        rope_type="linear", rope_theta=10000.0, factor=4.0)),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_logits_match_transformers_float32(case, tmp_path):
  hf = make_hf_llama(tmp_path, **HF_CASES[case])
  model, _, config = from_pretrained(str(tmp_path))
  assert config.num_kv_heads == HF_CASES[case]["num_key_value_heads"]
  ids = token_ids(config.vocab_size)
  logits = run(model, jnp.asarray(ids))
  assert logits.dtype == jnp.float32 and logits.shape == (BATCH, SEQ, config.vocab_size)
  assert rel_err(logits, hf_logits(hf, ids)) < 1e-4


def test_rope_scaling_is_what_makes_the_llama3_case_match(tmp_path):
  """The llama3 case is sensitive to the scaling: without it the logits are far off."""
  hf = make_hf_llama(tmp_path, **HF_CASES["llama3_rope"])
  model, _, config = from_pretrained(str(tmp_path))
  unscaled = build(config.replace(rope_scaling=None), flat_params(model))
  ids = token_ids(config.vocab_size)
  assert rel_err(run(unscaled, jnp.asarray(ids)), hf_logits(hf, ids)) > 1e-2


def test_bfloat16_error_is_that_of_transformers_in_bfloat16(tmp_path):
  """bf16 checkpoint: our error vs float32 is at most ~that of transformers' own bf16 run."""
  hf32 = make_hf_llama(tmp_path / "f32")
  hf16 = make_hf_llama(tmp_path / "bf16", dtype="bfloat16")
  model, _, config = from_pretrained(str(tmp_path / "bf16"))  # dtype from config.json
  assert config.dtype == "bfloat16" and model.embed_tokens[...].dtype == jnp.bfloat16
  ids = token_ids(config.vocab_size)
  ref = hf_logits(hf32, ids)
  ours, theirs = rel_err(run(model, jnp.asarray(ids)), ref), rel_err(hf_logits(hf16, ids), ref)
  assert ours <= 2 * theirs + 1e-3, (ours, theirs)


# -- the cache paths give the plain forward's logits -----------------------------------------

@pytest.fixture(scope="module")
def tiny():
  config = preset("tiny").replace(num_heads=6, num_kv_heads=2, head_dim=16)
  return random_init(config, seed=1, std=0.12)  # larger than 0.02: sharper attention


def test_incremental_cache_equals_full_forward(tiny):
  ids = jnp.asarray(token_ids(256, shape=(3, 23)))
  full = run(tiny, ids)
  cache = cache_lib.empty(tiny.config, 3, 23)
  first, cache = run(tiny, ids[:, :15], cache)
  second, cache = run(tiny, ids[:, 15:19], cache)
  third, cache = run(tiny, ids[:, 19:], cache)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [23, 23, 23])
  got = jnp.concatenate([first, second, third], axis=1)
  assert rel_err(got, full) < 1e-5


def test_shared_level_cache_equals_full_forward(tiny):
  """Two shared segments of a level, three sequences, each with its own continuation."""
  rng = np.random.default_rng(2)
  prefixes = rng.integers(0, 256, (2, 11)).astype(np.int32)
  prefix_lengths = np.array([11, 7], np.int32)
  cache = cache_lib.empty(tiny.config, 2, 11)
  _, cache = run(tiny, jnp.asarray(prefixes), cache)  # segment K/V (segment 1 padded)
  node_of_seq = np.array([1, 0, 1], np.int32)
  level = SegmentLevel(cache.k, cache.v, jnp.asarray(prefix_lengths), jnp.asarray(node_of_seq))
  own = rng.integers(0, 256, (3, 6)).astype(np.int32)
  decode_cache = cache_lib.empty(tiny.config, 3, 8, levels=[level])
  got, decode_cache = run(tiny, jnp.asarray(own[:, :3]), decode_cache)
  got2, _ = run(tiny, jnp.asarray(own[:, 3:]), decode_cache)
  # References: each full sequence, right-padded to one length (causal: padding is unseen).
  full_ids = np.zeros((3, 17), np.int32)
  for b in range(3):
    seg = prefixes[node_of_seq[b], :prefix_lengths[node_of_seq[b]]]
    full_ids[b, :len(seg) + 6] = np.concatenate([seg, own[b]])
  full = run(tiny, jnp.asarray(full_ids))
  for b in range(3):
    p = prefix_lengths[node_of_seq[b]]
    assert rel_err(jnp.concatenate([got[b], got2[b]]), full[b, p:p + 6]) < 1e-5


def test_no_attention_mode_keeps_projections_but_mixes_no_tokens(tiny):
  """The "none" ceiling: position t's logits depend on token t (and its position) only."""
  ids = token_ids(256, shape=(2, 9))
  ids[1, :8] = (ids[0, :8] + 1) % 256  # different context ...
  ids[1, 8] = ids[0, 8]  # ... same last token
  cache = cache_lib.empty(tiny.config, 2, 0)
  logits, cache = run(tiny, jnp.asarray(ids), cache, skip_attention=True)
  np.testing.assert_allclose(logits[0, -1], logits[1, -1], rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [9, 9])
  assert rel_err(logits, run(tiny, jnp.asarray(ids))) > 1e-2
  # q, k and v projections all reach the output (XLA cannot drop them).
  for name in ("q_proj", "k_proj", "v_proj"):
    params = flat_params(tiny)
    params[f"layers.0.self_attn.{name}"] = 2 * params[f"layers.0.self_attn.{name}"]
    tweaked = build(tiny.config, params)
    other, _ = run(tweaked, jnp.asarray(ids), cache_lib.empty(tiny.config, 2, 0),
                   skip_attention=True)
    assert rel_err(other, logits) > 1e-3, name


@pytest.mark.parametrize("min_rows,separate", [(0, True), (2**62, False), (None, False)])
def test_projections_kept_apart_from_the_row_threshold(tiny, monkeypatch, min_rows, separate):
  """From SEPARATE_PROJECTIONS_MIN_ROWS rows on, the k and v products take their operand through
  an optimization barrier (so XLA's GPU dot merger cannot concatenate the weights at every decode
  step); the logits are bit-identical either way. ``None``: the default threshold, above the 46
  rows here."""
  import jax
  import models.model.llama as llama
  if min_rows is not None:
    monkeypatch.setattr(llama, "SEPARATE_PROJECTIONS_MIN_ROWS", min_rows)
  assert llama.SEPARATE_PROJECTIONS_MIN_ROWS > 46 or min_rows is not None
  ids = jnp.asarray(token_ids(256, shape=(2, 23)))
  text = str(jax.make_jaxpr(lambda m, i: m(i))(tiny, ids))
  assert ("optimization_barrier" in text) == separate
  logits = tiny(ids)
  monkeypatch.setattr(llama, "SEPARATE_PROJECTIONS_MIN_ROWS", 0 if not separate else 2**62)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(tiny(ids)))
