"""A GGUF file written as llama.cpp's converter writes a Llama, for the loading tests and the
start-up benchmark's test (the ``gguf`` package writes it)."""

import numpy as np

from models.checkpoints.loading import hf_tensors
from models.checkpoints.tokenizer import _bytes_to_unicode
from models.model.config import preset
from models.model.llama import flat_params, random_init

try:
  import gguf
  Q = gguf.GGMLQuantizationType
except ImportError:  # the tests that need it skip (pytest.importorskip)
  gguf = Q = None


def llama_cpp_permute(w, n_head):
  """convert_hf_to_gguf.py's LlamaModel.permute (transformers rows -> llama.cpp rows)."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def write_tiny_llama_gguf(path, kind: str = "Q8_0", seed: int = 2) -> str:
  """The tiny preset with random weights, written as llama.cpp's converter writes a Llama
  (q/k rows permuted, an untied output; control and user-defined tokens, merges, a chat
  template), its matrices in ``kind``."""
  config = preset("tiny")
  params = flat_params(random_init(config, seed=seed))
  kind = Q[kind]
  names = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
  layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
           "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_name("tiny")
  w.add_block_count(config.num_layers)
  w.add_context_length(config.max_position_embeddings)
  w.add_embedding_length(config.hidden_size)
  w.add_feed_forward_length(config.intermediate_size)
  w.add_head_count(config.num_heads)
  w.add_head_count_kv(config.num_kv_heads)
  w.add_layer_norm_rms_eps(config.rms_norm_eps)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("default")
  spelling = _bytes_to_unicode()
  tokens = [spelling[b] for b in range(250)] + ["<|end|>", "<|start|>", "Ġt", "he", "Ġthe", "ab"]
  w.add_token_list(tokens)
  w.add_token_types([1] * 250 + [3, 3, 1, 1, 1, 4])
  w.add_token_merges(["Ġ t", "h e", "Ġt he"])
  w.add_eos_token_id(250)
  w.add_bos_token_id(251)
  w.add_chat_template("{{ messages[0]['content'] }}")
  for name, x in hf_tensors(params, config).items():
    if name.startswith("model.layers."):
      i, rest = name[len("model.layers."):].split(".", 1)
      module = rest[:-len(".weight")]
      if module in ("self_attn.q_proj", "self_attn.k_proj"):
        x = llama_cpp_permute(x, config.num_heads if module.endswith("q_proj")
                              else config.num_kv_heads)
      name = f"blk.{i}.{layer[module]}.weight"
    else:
      name = names[name]
    x = np.ascontiguousarray(x, np.float32)
    if x.ndim == 1:
      w.add_tensor(name, x)
    elif kind == Q.F16:
      w.add_tensor(name, x.astype(np.float16))
    else:
      w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)
