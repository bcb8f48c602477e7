"""Gemma 2 equals transformers' ``Gemma2ForCausalLM`` on a tiny random configuration whose every
piece matters (float32 CPU): sliding-window layers with a window shorter than the sequence and
global ones, attention and final soft-caps small enough to bend the scores, a
``query_pre_attn_scalar`` other than ``head_dim``, ``head_dim`` other than hidden / heads, the
``(1 + w)`` norms, four per layer, scaled and tied embeddings, the GELU-tanh MLP. Greedy tokens
over a prompt tree (the window hiding part of the shared level) equal the standard cache's,
transformers' and the serving engine's; training log-probs under a tree equal the plain model's;
a GGUF written as llama.cpp's converter writes a Gemma 2 loads to the same logits."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.checkpoints.loading import from_pretrained, hf_tensors, model_from_tensors
from models.generation.loop import generate
from models.model.config import LlamaConfig, preset
from models.model.llama import build, flat_params

from model_checks import (SEQ, check_tree_logprobs, hf_logits, make_hf_llama, rel_err, run,
                          token_ids)

WINDOW = 9  # < SEQ (37) and < the greedy test's prompts: the window hides keys everywhere
GEMMA = dict(family="gemma2", num_hidden_layers=3, head_dim=24, query_pre_attn_scalar=20,
             sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
             attn_implementation="eager")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
  """(transformers model, our model loaded from its safetensors directory)."""
  path = tmp_path_factory.mktemp("gemma2")
  hf = make_hf_llama(path, seed=5, **GEMMA)
  return hf, from_pretrained(str(path)).model


def test_config_from_transformers(loaded):
  hf, model = loaded
  c = model.config
  assert WINDOW < SEQ
  assert hf.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
  assert c.layer_types == tuple(hf.config.layer_types)
  assert [c.local_window(i) for i in range(3)] == [(WINDOW - 1, 0), None, (WINDOW - 1, 0)]
  assert (c.head_dim, c.attention_scale, c.hidden_act) == (24, 20**-0.5, "gelu_tanh")
  assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (5.0, 3.0)
  assert c.norm_plus_one and c.sandwich_norms and c.scale_embeddings and c.tie_word_embeddings
  # A config.json without layer_types (older transformers): the even layers are local.
  old = {k: v for k, v in hf.config.to_dict().items() if k != "layer_types"}
  assert LlamaConfig.from_hf(old).layer_types == c.layer_types
  assert LlamaConfig.from_dict(json.loads(c.to_json())) == c  # (save_pretrained's file)
  # The preset: Gemma 2 2B's 2,614,341,888 parameters.
  assert preset("gemma-2-2b").num_params == 2_614_341_888


def test_checkpoint_tensors_round_trip(loaded):
  """hf_tensors writes transformers' names and shapes (the four norms per layer) and
  model_from_tensors reads them back to the same parameters."""
  hf, model = loaded
  params = flat_params(model)
  tensors = hf_tensors(params, model.config)
  assert ({k: tuple(v.shape) for k, v in tensors.items()}
          == {k: tuple(v.shape) for k, v in hf.state_dict().items() if k != "lm_head.weight"})
  back = flat_params(model_from_tensors(model.config, tensors))
  for path, value in params.items():
    np.testing.assert_array_equal(np.asarray(back[path]), np.asarray(value), err_msg=path)


def test_logits_match_transformers_float32(loaded):
  hf, model = loaded
  ids = token_ids(model.config.vocab_size)
  err = rel_err(run(model, jnp.asarray(ids)), hf_logits(hf, ids))
  assert err < 1e-5, err


@pytest.mark.parametrize("change", [
    dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None),
    dict(sliding_window=None, layer_types=None), dict(query_pre_attn_scalar=None)])
def test_every_variant_moves_the_logits(loaded, change):
  """Each attention variant, turned off, moves the logits far from transformers': the parity
  above rests on it being applied."""
  hf, model = loaded
  other = build(model.config.replace(**change), flat_params(model))
  ids = token_ids(model.config.vocab_size)
  assert rel_err(run(other, jnp.asarray(ids)), hf_logits(hf, ids)) > 1e-2


def _prompts(vocab):
  rng = np.random.default_rng(7)
  shared = [int(t) for t in rng.integers(0, vocab, 13)]  # longer than the window
  return [shared + [3, 5, 7], shared + [11]]


def hf_greedy(hf, prompt, n):
  import torch
  with torch.no_grad():
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                      pad_token_id=0, eos_token_id=None)
  return out[0, len(prompt):].numpy()


@pytest.fixture(scope="module")
def greedy(loaded):
  """(prompts, new tokens, {attention: greedy tokens [3, new]}): two prompts sharing a segment
  longer than the window, sampled 2 and 1 times; the contexts grow past two windows."""
  _, model = loaded
  prompts, new = _prompts(model.config.vocab_size), 8
  return prompts, new, {attention: np.asarray(generate(model, prompts, num_samples=[2, 1],
                                                       max_new_tokens=new, attention=attention))
                        for attention in ("hydragen", "standard")}


def test_greedy_tokens_hydragen_equal_standard_and_transformers(loaded, greedy):
  hf, _ = loaded
  prompts, new, tokens = greedy
  np.testing.assert_array_equal(tokens["hydragen"], tokens["standard"])
  for rows, prompt in ((slice(0, 2), prompts[0]), (slice(2, 3), prompts[1])):
    want = hf_greedy(hf, prompt, new)
    np.testing.assert_array_equal(tokens["hydragen"][rows],
                                  np.broadcast_to(want, (rows.stop - rows.start, new)))


def test_serving_engine_tokens_equal_generate(loaded, greedy):
  """The serving engine (paged cache, the shared prompt in pages read once per step)."""
  from models.serving import Engine, EngineConfig, Request

  _, model = loaded
  prompts, new, tokens = greedy
  engine = Engine(model, config=EngineConfig(
      page_size=4, num_pages=32, max_running=4, max_prefill_tokens=8, decode_steps=3,
      min_shared_tokens=4, batch_buckets=(4,), prefill_row_buckets=(4,), prefill_buckets=(8,),
      level_buckets=(2,), segment_buckets=(2,), page_buckets=(8,), own_page_buckets=(8,)))
  outs = engine.generate([Request(p, n=n, max_tokens=new, ignore_eos=True)
                          for p, n in zip(prompts, (2, 1))])
  got = [list(s.token_ids) for out in outs for s in out.samples]
  np.testing.assert_array_equal(np.asarray(got), tokens["hydragen"])


def test_training_logprobs_under_a_tree_equal_the_plain_model(loaded):
  """completion_logprobs under a tree equals the plain model; the shared segment (12 tokens)
  is longer than the window."""
  check_tree_logprobs(loaded[1], root_len=12, completion_len=5)


def write_gemma2_gguf(path, hf) -> str:
  """``hf`` as llama.cpp's ``convert_hf_to_gguf.py`` writes a Gemma 2: its tensor names (the
  gguf package's map), the norm weights stored as ``1 + w``, the soft-caps and window in the
  metadata, no ``output.weight`` (tied)."""
  import gguf

  from models.checkpoints.tokenizer import _bytes_to_unicode

  c = hf.config
  names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA2, c.num_hidden_layers)
  w = gguf.GGUFWriter(str(path), "gemma2")
  w.add_name("tiny-gemma2")
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_block_count(c.num_hidden_layers)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  w.add_key_length(c.head_dim)
  w.add_value_length(c.head_dim)
  w.add_attn_logit_softcapping(c.attn_logit_softcapping)
  w.add_final_logit_softcapping(c.final_logit_softcapping)
  w.add_sliding_window(c.sliding_window)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("default")
  spelling = _bytes_to_unicode()
  w.add_token_list([spelling[b] for b in range(c.vocab_size)])
  w.add_token_types([1] * c.vocab_size)
  w.add_eos_token_id(1)
  for name, tensor in hf.state_dict().items():
    if name == "lm_head.weight":
      continue
    x = tensor.float().numpy()
    if name.endswith("norm.weight"):
      x = x + 1
    w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(x))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


def test_gguf_matches_transformers(tmp_path):
  """llama.cpp's attention scale for Gemma 2 (all but the 27B) is head_dim ** -0.5: the GGUF
  does not store query_pre_attn_scalar, so this model has it at head_dim."""
  pytest.importorskip("gguf", reason="the gguf package (llama.cpp's writer) is a test dependency")
  hf = make_hf_llama(tmp_path / "hf", seed=6, **{**GEMMA, "query_pre_attn_scalar": 24})
  model, _, config = from_pretrained(write_gemma2_gguf(tmp_path / "gemma2.gguf", hf))
  ours = LlamaConfig.from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
  assert config.rms_norm_eps == pytest.approx(ours.rms_norm_eps, rel=1e-7)  # float32 in GGUF
  keep = ("bos_token_id", "eos_token_id", "name", "rms_norm_eps")
  assert config.replace(**{k: getattr(ours, k) for k in keep}) == ours
  ids = token_ids(hf.config.vocab_size)
  err = rel_err(run(model, jnp.asarray(ids)), hf_logits(hf, ids))
  assert err < 1e-5, err



def test_on_a_mesh_the_variants_reach_every_shard(loaded):
  """On a (one-device) mesh attention runs through jax_shared_attn.sharded: the logits are
  the unsharded model's, so the soft-cap and window were passed on."""
  from models.parallel.mesh import make_mesh
  from models.parallel.rules import attention_sharding

  _, model = loaded
  sharding = attention_sharding(make_mesh((1, 1), devices=jax.devices()[:1]))
  ids = jnp.asarray(token_ids(model.config.vocab_size))
  got = nnx.jit(lambda m, x: m(x, sharding=sharding))(model, ids)
  assert rel_err(got, run(model, ids)) < 1e-6


@pytest.mark.parametrize("change, field", [
    (dict(hidden_act="relu"), "hidden_act"), (dict(norm_type="batch"), "norm_type"),
    (dict(attn_logit_softcapping=0.0), "attn_logit_softcapping"),
    (dict(final_logit_softcapping=float("inf")), "final_logit_softcapping"),
    (dict(query_pre_attn_scalar=-1.0), "query_pre_attn_scalar"),
    (dict(alibi_bias_max=float("nan")), "alibi_bias_max"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(layer_types=("full_attention",)), "layer_types must hold num_layers = 26"),
    (dict(layer_types=("global",) * 26), "layer_types"),
    (dict(sliding_window=None), "layer_types has sliding_attention layers but sliding_window"),
])
def test_bad_config_values_name_the_field(change, field):
  with pytest.raises(ValueError, match=f"LlamaConfig: {field}"):
    preset("gemma-2-2b", **change)
