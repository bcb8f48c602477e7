"""GGUF files of the Qwen families, written as llama.cpp's converter writes them (``qwen2`` and
``qwen3`` architectures: q/k rows not permuted, ``attn_q.bias``, ``attn_q_norm``), load to
transformers' logits; an unsupported GGUF architecture gets one error listing ours."""

import jax.numpy as jnp
import numpy as np
import pytest

from models.checkpoints.loading import CheckpointError, from_pretrained
from models.checkpoints.tokenizer import _bytes_to_unicode

from model_checks import hf_logits, make_hf_llama, rel_err, run, token_ids

LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
NAMES = {"model.embed_tokens.weight": "token_embd.weight",
         "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def write_gguf(path, hf, arch: str, *, quantized: bool = False):
  """``hf`` as llama.cpp's ``convert_hf_to_gguf.py`` writes a Qwen2/Qwen3 (its RoPE for these
  architectures rotates halves, as transformers does: no row permutation); a tied model has
  no ``output.weight``; with ``quantized`` every matrix is Q8_0."""
  import gguf

  c = hf.config
  w = gguf.GGUFWriter(str(path), arch)
  w.add_name(f"tiny-{arch}")
  w.add_block_count(c.num_hidden_layers)
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
  w.add_key_length(head_dim)
  w.add_value_length(head_dim)
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  w.add_rope_freq_base(c.rope_parameters["rope_theta"])
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("qwen2")
  spelling = _bytes_to_unicode()
  w.add_token_list([spelling[b] for b in range(256)])
  w.add_token_types([1] * 256)
  w.add_eos_token_id(0)
  tied = c.tie_word_embeddings
  for name, tensor in hf.state_dict().items():
    if tied and name == "lm_head.weight":
      continue
    x = np.ascontiguousarray(tensor.float().numpy())
    if name.startswith("model.layers."):
      i, rest = name[len("model.layers."):].split(".", 1)
      module, kind = rest.rsplit(".", 1)
      name = f"blk.{i}.{LAYER_NAMES[module]}.{kind}"
    else:
      name = NAMES[name]
    if quantized and x.ndim == 2:
      w.add_tensor(name, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                   raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
      w.add_tensor(name, x)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


def rounded_q8_0(hf):
  """A copy of ``hf`` whose matrices are what a Q8_0 file holds (gguf's quantize, dequantize)."""
  import copy

  import gguf
  import torch

  q8 = gguf.GGMLQuantizationType.Q8_0
  out = copy.deepcopy(hf)
  with torch.no_grad():
    for _, p in out.named_parameters():  # the tied lm_head is the embedding: rounded once
      if p.ndim == 2:
        x = p.float().numpy()
        p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x, q8), q8)
                                 .reshape(x.shape)))
  return out


@pytest.mark.parametrize("arch, fields", [
    ("qwen2", dict(tie_word_embeddings=True, rope_theta=1e6)),
    ("qwen3", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=32)),
])
def test_qwen_gguf_matches_transformers(tmp_path, arch, fields):
  pytest.importorskip("gguf", reason="the gguf package (llama.cpp's writer) is a test dependency")
  hf = make_hf_llama(tmp_path / "hf", family=arch, vocab_size=256, **fields)
  ids = token_ids(256)
  ref = hf_logits(hf, ids)
  model, tokenizer, config = from_pretrained(write_gguf(tmp_path / "f32.gguf", hf, arch))
  assert (config.qkv_bias, config.qk_norm) == (arch == "qwen2", arch == "qwen3")
  assert config.tie_word_embeddings == (arch == "qwen2")
  assert config.head_dim == (32 if arch == "qwen3" else 16)
  err = rel_err(run(model, jnp.asarray(ids)), ref)
  assert err < 1e-4, err
  # Q8_0 matrices: equal to transformers running the same weights rounded by gguf's own
  # quantize + dequantize.
  q8, _, _ = from_pretrained(write_gguf(tmp_path / "q8.gguf", hf, arch, quantized=True))
  err = rel_err(run(q8, jnp.asarray(ids)), hf_logits(rounded_q8_0(hf), ids))
  assert err < 1e-4, err
  # The qwen2 pre-tokenizer splits every digit (Llama 3's groups up to three).
  pieces = [tokenizer.decode([t]) for t in tokenizer.encode("ab 2024")]
  assert pieces == ["a", "b", " ", "2", "0", "2", "4"], pieces


def test_unsupported_gguf_architecture_lists_the_supported(tmp_path):
  gguf = pytest.importorskip("gguf")
  w = gguf.GGUFWriter(str(tmp_path / "phi3.gguf"), "phi3")
  w.add_block_count(1)
  w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(CheckpointError, match="phi3.gguf: GGUF: general.architecture 'phi3' is "
                     "not supported; supported: llama \\(.*Mistral\\), qwen2 \\(Qwen2, Qwen2.5\\), "
                     "qwen3 \\(Qwen3\\), gemma2 \\(Gemma 2\\)"):
    from_pretrained(str(tmp_path / "phi3.gguf"))
