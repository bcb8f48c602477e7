"""LlamaConfig: presets, transformers config.json (both spellings, every family), JSON round
trip, errors."""

import json

import pytest

from models.model.config import PRESETS, LlamaConfig, RopeScaling, preset


@pytest.mark.parametrize("name, params", [("llama-2-7b", 6.74e9), ("llama-3-8b", 8.03e9),
                                          ("codellama-7b", 6.74e9), ("codellama-13b", 13.0e9),
                                          ("smollm2-135m", 134.5e6),
                                          ("mistral-7b-v0.3", 7.25e9),
                                          ("qwen2.5-0.5b", 0.49e9), ("qwen3-0.6b", 0.6e9)])
def test_presets_have_the_published_sizes(name, params):
  assert abs(preset(name).num_params / params - 1) < 0.01


def test_every_preset_is_hashable_and_round_trips_through_json():
  for name, config in PRESETS.items():
    assert hash(config) == hash(LlamaConfig.from_dict(json.loads(config.to_json())))
    assert LlamaConfig.from_dict(json.loads(config.to_json())) == config, name
  assert preset("llama-3.1-8b").rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
  assert preset("tiny", dtype="bfloat16").dtype == "bfloat16"


HF = dict(model_type="llama", vocab_size=100, hidden_size=64, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=1, intermediate_size=96,
          max_position_embeddings=512, torch_dtype="bfloat16", tie_word_embeddings=True)


def test_from_hf_reads_transformers_4_and_5_spellings():
  old = LlamaConfig.from_hf(dict(HF, rope_theta=5e5, rope_scaling=dict(type="linear", factor=2.0)))
  new = LlamaConfig.from_hf(dict(HF, rope_parameters=dict(rope_type="linear", rope_theta=5e5,
                                                          factor=2.0)))
  assert old == new
  assert (old.rope_theta, old.rope_scaling) == (5e5, RopeScaling("linear", 2.0))
  assert (old.num_kv_heads, old.head_dim, old.dtype, old.tie_word_embeddings) == (1, 16, "bfloat16", True)
  llama3 = LlamaConfig.from_hf(dict(HF, rope_scaling=dict(
      rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
      original_max_position_embeddings=8192)))
  assert llama3.rope_scaling.kind == "llama3"
  assert LlamaConfig.from_hf(dict(HF, rope_scaling=None)).rope_scaling is None


@pytest.mark.parametrize("changes, message", [
    (dict(rope_scaling=dict(type="yarn", factor=2.0)), "yarn"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(model_type="gpt2"), "model_type"),
    (dict(num_key_value_heads=3), "multiple of num_kv_heads"),
])
def test_from_hf_rejects_what_it_cannot_run(changes, message):
  with pytest.raises(ValueError, match=message):
    LlamaConfig.from_hf(dict(HF, **changes))


def test_bad_fields_are_named():
  with pytest.raises(ValueError, match="dtype"):
    preset("tiny", dtype="int8")
  with pytest.raises(ValueError, match="hidden_size"):
    preset("tiny", hidden_size=0)
  with pytest.raises(ValueError, match="name must be one of"):
    preset("llama-9")


def test_from_hf_reads_each_family():
  """model_type (or, without it, architectures) picks the family and its attention values."""
  for hf, family in ((dict(HF, model_type="qwen2"), "qwen2"),
                     (dict(HF, model_type=None, architectures=["Qwen3ForCausalLM"]), "qwen3"),
                     (dict(HF, model_type="mistral", sliding_window=None), "mistral"),
                     ({k: v for k, v in HF.items() if k != "model_type"}, "llama")):
    hf = {k: v for k, v in hf.items() if v is not None}
    config = LlamaConfig.from_hf(hf)
    assert (config.qkv_bias, config.qk_norm) == (family == "qwen2", family == "qwen3"), family
    assert hash(config) == hash(LlamaConfig.from_dict(json.loads(config.to_json())))


@pytest.mark.parametrize("changes, windowed", [
    (dict(model_type="mistral", sliding_window=4096, max_position_embeddings=32768), [0, 1]),
    (dict(model_type="mistral", sliding_window=512), []),  # as long as the context
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=1),
     [1]),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=2),
     []),  # no layer from max_window_layers on
    (dict(model_type="qwen2", use_sliding_window=False, sliding_window=64), []),
    (dict(model_type="qwen3", sliding_window=64,
          layer_types=["full_attention", "sliding_attention"]), [1]),
    (dict(model_type="qwen3", sliding_window=64, use_sliding_window=True,
          layer_types=["full_attention", "full_attention"]), []),
    (dict(model_type="gemma2", sliding_window=64), [0]),  # no layer_types: the even layers
    (dict(model_type="llama", sliding_window=64), []),  # Llama has no window
])
def test_sliding_windows_where_they_hide_keys(changes, windowed):
  """config.json's window becomes sliding_window and layer_types on the layers it is on, where
  it can hide a key (shorter than max_position_embeddings); else no window."""
  config = LlamaConfig.from_hf(dict(HF, **changes))
  assert [i for i in range(config.num_layers)
          if config.local_window(i) is not None] == windowed
  if windowed:
    assert config.local_window(windowed[0]) == (changes["sliding_window"] - 1, 0)
  else:
    assert (config.sliding_window, config.layer_types) == (None, None)


@pytest.mark.parametrize("changes", [
    dict(model_type="phi3"),
    dict(model_type="qwen2", architectures=["Qwen2ForSequenceClassification"]),
    dict(model_type=None, architectures=["BloomForCausalLM"]),
])
def test_an_unsupported_architecture_gets_one_error_listing_the_families(changes):
  from models.model.families import Unsupported
  hf = {k: v for k, v in dict(HF, **changes).items() if v is not None}
  with pytest.raises(Unsupported, match=r"is not supported; supported: LlamaForCausalLM "
                     r"\(model_type llama.*MistralForCausalLM.*Qwen2ForCausalLM \(model_type "
                     r"qwen2, GGUF qwen2: Qwen2, Qwen2.5\); Qwen3ForCausalLM.*; Gemma2ForCausalLM "
                     r"\(model_type gemma2, GGUF gemma2: Gemma 2\)"):
    LlamaConfig.from_hf(hf)
