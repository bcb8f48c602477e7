"""MPT (the ALiBi family) equals transformers' ``MptForCausalLM`` on a tiny random configuration
(float32 CPU; 6 heads, so the slopes take MPT's rule for a head count that is not a power of
two); greedy tokens over a prompt tree equal the standard cache's and transformers'; the slopes
equal transformers'; a GGUF as llama.cpp writes an MPT loads to the same logits; MPT options
the decoder does not run get one error naming them."""

import jax.numpy as jnp
import numpy as np
import pytest

from models.checkpoints.loading import from_pretrained
from models.generation.loop import generate
from models.model.config import LlamaConfig
from models.model.families import Unsupported

from model_checks import hf_logits, rel_err, run, token_ids

MPT = dict(d_model=48, n_heads=6, n_layers=2, max_seq_len=256, vocab_size=131,
           attn_config=dict(alibi=True, alibi_bias_max=8))


def make_hf_mpt(path, seed=0, **overrides):
  """A random tiny transformers MPT written to ``path`` (weights std 0.15, norms
  ``1 + 0.2 N(0, 1)``, as the other families' tests)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(seed)
  model = transformers.MptForCausalLM(transformers.MptConfig(**{**MPT, **overrides})).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith(("norm_1.weight", "norm_2.weight", "norm_f.weight")):
        p.copy_(1 + 0.2 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.15)
  model.save_pretrained(path)
  return model


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
  path = tmp_path_factory.mktemp("mpt")
  hf = make_hf_mpt(path, seed=4)
  return hf, from_pretrained(str(path)).model


def test_logits_match_transformers_float32(loaded):
  hf, model = loaded
  c = model.config
  assert (c.norm_type, c.gated_mlp, c.hidden_act, c.alibi_bias_max) == ("layer", False, "gelu", 8)
  assert (c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (6, 6, 8, 192)
  ids = token_ids(c.vocab_size)
  err = rel_err(run(model, jnp.asarray(ids)), hf_logits(hf, ids))
  assert err < 1e-5, err


@pytest.mark.parametrize("heads", [5, 6, 8, 12])
def test_slopes_are_transformers(heads):
  """Our slopes give transformers' bias row ``slope * (j - (T - 1))`` (a constant per query
  row away from ``-slope * (i - j)``: the same softmax)."""
  pytest.importorskip("transformers")
  from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

  theirs = build_mpt_alibi_tensor(heads, 2, alibi_bias_max=8).numpy()[:, 0, 0]  # key 0 of 2
  c = LlamaConfig(vocab_size=8, hidden_size=heads * 8, num_layers=1, num_heads=heads,
                  num_kv_heads=heads, intermediate_size=8, alibi_bias_max=8.0)
  np.testing.assert_allclose(-np.asarray(c.alibi_slopes()), theirs, rtol=1e-6)


def test_greedy_tokens_hydragen_equal_standard_and_transformers(loaded):
  import torch

  hf, model = loaded
  rng = np.random.default_rng(7)
  shared = [int(t) for t in rng.integers(0, model.config.vocab_size, 11)]
  prompts = [shared + [3, 5, 7], shared + [11]]
  new = 6
  tokens = {attention: np.asarray(generate(model, prompts, num_samples=[2, 1], max_new_tokens=new,
                                           attention=attention))
            for attention in ("hydragen", "standard")}
  np.testing.assert_array_equal(tokens["hydragen"], tokens["standard"])
  for rows, prompt in ((slice(0, 2), prompts[0]), (slice(2, 3), prompts[1])):
    with torch.no_grad():
      out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                        min_new_tokens=new, pad_token_id=0, eos_token_id=None)
    np.testing.assert_array_equal(tokens["hydragen"][rows],
                                  np.broadcast_to(out[0, len(prompt):].numpy(),
                                                  (rows.stop - rows.start, new)))


@pytest.mark.parametrize("attn, top, named", [
    (dict(alibi=False), {}, "attn_config.alibi=False"),
    (dict(clip_qkv=6.0), {}, "attn_config.clip_qkv=6.0"),
    (dict(qk_ln=True), {}, "attn_config.qk_ln=True"),
    ({}, dict(no_bias=False), "no_bias=False"),
    (dict(attn_type="grouped_query_attention"), {},
     "attn_config.attn_type='grouped_query_attention'"),
])
def test_options_not_run_are_refused_by_name(attn, top, named):
  hf = dict(model_type="mpt", architectures=["MPTForCausalLM"], d_model=16, n_heads=2,
            n_layers=1, vocab_size=8, attn_config={"alibi": True, **attn}, **top)
  with pytest.raises(Unsupported, match=f"MPT with {named} is not supported"):
    LlamaConfig.from_hf(hf)


def test_gguf_matches_transformers(tmp_path):
  """An MPT GGUF as llama.cpp's converter writes it (its tensor names, the fused
  ``attn_qkv``, ``mpt.attention.max_alibi_bias``, no ``output.weight``) loads to
  transformers' logits."""
  gguf = pytest.importorskip("gguf", reason="the gguf package (llama.cpp's writer) is a test "
                             "dependency")
  from models.checkpoints.tokenizer import _bytes_to_unicode

  hf = make_hf_mpt(tmp_path / "hf", seed=6)
  c = hf.config
  names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MPT, c.n_layers)
  w = gguf.GGUFWriter(str(tmp_path / "mpt.gguf"), "mpt")
  w.add_context_length(c.max_seq_len)
  w.add_embedding_length(c.d_model)
  w.add_block_count(c.n_layers)
  w.add_feed_forward_length(4 * c.d_model)
  w.add_head_count(c.n_heads)
  w.add_layer_norm_eps(c.layer_norm_epsilon)
  w.add_max_alibi_bias(c.attn_config.alibi_bias_max)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("default")
  spelling = _bytes_to_unicode()
  w.add_token_list([spelling[b] for b in range(c.vocab_size)])
  w.add_token_types([1] * c.vocab_size)
  for name, tensor in hf.state_dict().items():
    if name != "lm_head.weight":
      w.add_tensor(names.get_name(name, try_suffixes=(".weight",)),
                   np.ascontiguousarray(tensor.float().numpy()))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  model, _, config = from_pretrained(str(tmp_path / "mpt.gguf"))
  assert (config.norm_type, config.gated_mlp, config.alibi_bias_max) == ("layer", False, 8.0)
  ids = token_ids(c.vocab_size)
  err = rel_err(run(model, jnp.asarray(ids)), hf_logits(hf, ids))
  assert err < 1e-5, err
