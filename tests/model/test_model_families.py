"""Qwen2/2.5, Qwen3 and Mistral (with and without sliding windows) equal transformers' own
implementations on tiny random configurations (float32 CPU), decode the same greedy tokens with
hydragen and standard attention (and as transformers' greedy ``generate``), and their training
log-probs under a prompt tree equal the plain model's; the family registry's errors."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from models.checkpoints.loading import (CheckpointError, from_pretrained, hf_tensors,
                                        model_from_tensors)
from models.generation.loop import generate
from models.model.llama import build, flat_params

from model_checks import check_tree_logprobs, hf_logits, make_hf_llama, rel_err, run, token_ids

# family -> transformers config fields (on top of make_hf_llama's tiny sizes)
CASES = {
    # Qwen2.5-0.5B's traits: tied embeddings, RoPE theta 1e6, q/k/v biases.
    "qwen2": dict(family="qwen2", tie_word_embeddings=True, rope_theta=1e6),
    # Qwen3: head_dim (24) unrelated to hidden / heads (64 / 4), q/k norms, GQA 3:1.
    "qwen3": dict(family="qwen3", hidden_size=64, num_attention_heads=6, num_key_value_heads=2,
                  head_dim=24),
    # Mistral without a window; one as long as the context (it hides nothing); one of 9 tokens
    # on every layer (shorter than the 37-token sequence).
    "mistral": dict(family="mistral", sliding_window=None),
    "mistral_full_window": dict(family="mistral", sliding_window=256, max_position_embeddings=256),
    "mistral_window": dict(family="mistral", sliding_window=9),
    # Qwen2's window from max_window_layers on: layer 1 of 2.
    "qwen2_window": dict(family="qwen2", use_sliding_window=True, sliding_window=9,
                         max_window_layers=1),
}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
  """case -> (transformers model, our model), each loaded from its safetensors directory."""
  out = {}
  for case, fields in CASES.items():
    path = tmp_path_factory.mktemp(case)
    hf = make_hf_llama(path, seed=len(out), **fields)
    out[case] = hf, from_pretrained(str(path)).model
  return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_float32(loaded, case):
  hf, model = loaded[case]
  c = model.config
  family = CASES[case]["family"]
  assert (c.qkv_bias, c.qk_norm) == (family == "qwen2", family == "qwen3")
  windowed = {"mistral_window": [0, 1], "qwen2_window": [1]}.get(case, [])
  assert [i for i in range(c.num_layers) if c.local_window(i) == (8, 0)] == windowed
  if family == "qwen3":
    assert (c.head_dim, c.num_heads, c.num_kv_heads) == (24, 6, 2)
  ids = token_ids(c.vocab_size)
  err = rel_err(run(model, jnp.asarray(ids)), hf_logits(hf, ids))
  assert err < 1e-4, err


def test_the_family_parameters_are_used(loaded):
  """Zeroing the q/k/v biases (Qwen2) or setting the q/k norms to ones (Qwen3) moves the
  logits far from transformers': the parity above rests on them."""
  for case, names in (("qwen2", ("q_bias", "k_bias", "v_bias")),
                      ("qwen3", ("q_norm.weight", "k_norm.weight"))):
    hf, model = loaded[case]
    params = flat_params(model)
    for path in params:
      if path.split(".self_attn.")[-1] in names:
        x = params[path]
        params[path] = jnp.zeros_like(x) if "bias" in path else jnp.ones_like(x)
    ids = token_ids(model.config.vocab_size)
    assert rel_err(run(build(model.config, params), jnp.asarray(ids)), hf_logits(hf, ids)) > 1e-2


def test_checkpoint_tensors_round_trip(loaded):
  """hf_tensors writes transformers' names and shapes (biases [H * D], norms [D]) and
  model_from_tensors reads them back to the same parameters."""
  for case in ("qwen2", "qwen3"):
    hf, model = loaded[case]
    params = flat_params(model)
    tensors = hf_tensors(params, model.config)
    theirs = {k: v.shape for k, v in hf.state_dict().items() if k != "lm_head.weight" or
              not model.config.tie_word_embeddings}
    assert ({k: tuple(v.shape) for k, v in tensors.items()}
            == {k: tuple(s) for k, s in theirs.items()})
    back = flat_params(model_from_tensors(model.config, tensors))
    for path, value in params.items():
      np.testing.assert_array_equal(np.asarray(back[path]), np.asarray(value), err_msg=path)


def hf_greedy(hf, prompt, n):
  import torch
  with torch.no_grad():
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                      pad_token_id=0, eos_token_id=None)
  return out[0, len(prompt):].numpy()


@pytest.mark.parametrize("case", ["qwen2", "qwen3", "mistral_window"])
def test_greedy_tokens_hydragen_equal_standard_and_transformers(loaded, case):
  hf, model = loaded[case]
  rng = np.random.default_rng(7)
  shared = [int(t) for t in rng.integers(0, model.config.vocab_size, 11)]
  prompts = [shared + [3, 5, 7], shared + [11]]  # a shared segment and two own parts
  new = 6
  tokens = {attention: np.asarray(generate(model, prompts, num_samples=[2, 1], max_new_tokens=new,
                                           attention=attention))
            for attention in ("hydragen", "standard")}
  np.testing.assert_array_equal(tokens["hydragen"], tokens["standard"])
  for rows, prompt in ((slice(0, 2), prompts[0]), (slice(2, 3), prompts[1])):
    want = hf_greedy(hf, prompt, new)
    np.testing.assert_array_equal(tokens["hydragen"][rows],
                                  np.broadcast_to(want, (rows.stop - rows.start, new)))


@pytest.mark.parametrize("case", ["qwen2", "qwen3"])
def test_training_logprobs_under_a_tree_equal_the_plain_model(loaded, case):
  """completion_logprobs (shared prompt segments once, hydragen) equals log_softmax of the
  plain model run on each sample's whole sequence."""
  check_tree_logprobs(loaded[case][1], root_len=9, completion_len=4)


def test_unsupported_checkpoints_get_one_clear_error(tmp_path):
  hf = dict(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=32, max_position_embeddings=128)
  cases = {
      "phi3": (dict(hf, model_type="phi3", architectures=["Phi3ForCausalLM"]),
               "model_type 'phi3'.*supported: LlamaForCausalLM.*MistralForCausalLM.*"
               "Qwen2ForCausalLM.*Qwen3ForCausalLM.*Gemma2ForCausalLM.*MptForCausalLM"),
  }
  for name, (config, message) in cases.items():
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"{tmp_path / name}: config.json: {message}"):
      from_pretrained(str(tmp_path / name))
