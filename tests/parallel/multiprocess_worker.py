"""One process of tests/parallel/test_multiprocess.py (run as a script, never collected by pytest).

    python tests/parallel/multiprocess_worker.py write CKPT                 # the tiny safetensors checkpoint
    python tests/parallel/multiprocess_worker.py run CKPT OUT [PORT N I]    # greedy tokens (+ bad inputs)
    python tests/parallel/multiprocess_worker.py devices PORT N I           # initialize only

``run`` without PORT is one process on all its devices: the reference, with and without a mesh.
With PORT, N and I it is process I of N under jax.distributed on localhost. Every process
writes its own JSON: tokens per case, and the error each bad input raised.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

# 8 query heads, 2 KV heads: a model axis of 4 replicates each KV head twice.
CONFIG = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, head_dim=16, intermediate_size=128,
              max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
              model_type="llama", hidden_act="silu", dtype="float32")
NEW = 6


def prompt_of(n, seed):
  return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def cases():
  from models.generation.prompt_tree import PromptTree

  shared = prompt_of(23, 1)
  tree = PromptTree.from_prompts([shared + prompt_of(12, 2), shared + prompt_of(5, 3)], [3, 5],
                                 min_shared_tokens=4)
  return {"hydragen-one-prompt": (prompt_of(19, 0), 8, "hydragen"),
          "hydragen-two-level-tree": (tree, None, "hydragen"),
          "standard": (prompt_of(19, 0), 8, "standard")}


def write(ckpt):
  """A safetensors checkpoint of a random float32 model, in transformers' names and layout."""
  from safetensors.numpy import save_file

  from models.checkpoints.loading import hf_tensors
  from models.model.config import LlamaConfig
  from models.model.llama import flat_params, random_init

  config = LlamaConfig.from_hf(CONFIG)
  tensors = hf_tensors(flat_params(random_init(config, seed=3, std=0.12)), config)
  os.makedirs(ckpt, exist_ok=True)
  save_file(tensors, os.path.join(ckpt, "model.safetensors"))
  with open(os.path.join(ckpt, "config.json"), "w") as f:
    json.dump(CONFIG, f)
  from models.checkpoints.loading import from_pretrained, save_pretrained
  from models.checkpoints.tokenizer import Tokenizer, _bytes_to_unicode

  spelling = _bytes_to_unicode()  # a byte-level tokenizer for the command line's text
  Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "gpt2",
                              "tokenizer.ggml.tokens": [spelling[b] for b in range(256)]}
                             ).save(ckpt)
  save_pretrained(os.path.join(ckpt, "orbax"), from_pretrained(ckpt).model)
  write_gguf(os.path.join(ckpt, "model.gguf"), config, tensors)


def write_gguf(path, config, tensors):
  """The same weights as llama.cpp stores them: Q8_0 matrices (blocks of 32 along a row),
  q/k rows in llama.cpp's rotary order."""
  import gguf

  from models.checkpoints.tokenizer import _bytes_to_unicode

  w = gguf.GGUFWriter(path, "llama")
  w.add_block_count(config.num_layers)
  w.add_context_length(config.max_position_embeddings)
  w.add_embedding_length(config.hidden_size)
  w.add_feed_forward_length(config.intermediate_size)
  w.add_head_count(config.num_heads)
  w.add_head_count_kv(config.num_kv_heads)
  w.add_key_length(config.head_dim)
  w.add_value_length(config.head_dim)
  w.add_layer_norm_rms_eps(config.rms_norm_eps)
  w.add_rope_freq_base(config.rope_theta)
  w.add_tokenizer_model("gpt2")
  spelling = _bytes_to_unicode()
  w.add_token_list([spelling[b] for b in range(256)])
  names = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
           "lm_head.weight": "output"}
  layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
           "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
  for name, x in tensors.items():
    module = name.rsplit(".", 1)[0]
    if name.startswith("model.layers."):
      i, module = module[len("model.layers."):].split(".", 1)
      heads = {"self_attn.q_proj": config.num_heads, "self_attn.k_proj": config.num_kv_heads}
      if module in heads:  # llama.cpp's permutation: rotary pairs (i, i + D/2) -> (2i, 2i + 1)
        h = heads[module]
        x = x.reshape(h, 2, x.shape[0] // h // 2, -1).swapaxes(1, 2).reshape(x.shape)
      gname = f"blk.{i}.{layer[module]}.weight"
    else:
      gname = names[name] + ".weight"
    if x.ndim == 1:
      w.add_tensor(gname, np.ascontiguousarray(x))
    else:
      q8 = gguf.GGMLQuantizationType.Q8_0
      w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(x), q8), raw_dtype=q8)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def run(ckpt, out, port=None, n=1, i=0):
  from models.parallel import distributed

  if port is not None:
    distributed.initialize(f"localhost:{port}", int(n), int(i))
  import jax

  from models.checkpoints.loading import from_pretrained
  from models.generation.loop import generate

  result = {"process": jax.process_index(), "processes": jax.process_count(),
            "devices": jax.device_count(), "tokens": {}, "errors": {}}
  meshes = [(2, 2), (1, 4)]
  for mesh in meshes:
    model = from_pretrained(ckpt, mesh=mesh).model
    for name, (prompt, samples, attention) in cases().items():
      if mesh == (1, 4) and name != "hydragen-two-level-tree":
        continue  # the model axis across processes: one case is enough
      tokens = generate(model, prompt, num_samples=samples, max_new_tokens=NEW,
                        attention=attention, impl="xla", mesh=mesh)
      result["tokens"][f"{name} {mesh}"] = np.asarray(tokens).tolist()
  # The other formats, read per shard too: orbax (restored into the shards), GGUF (Q8_0 blocks).
  prompt, samples, attention = cases()["hydragen-one-prompt"]
  for fmt in ("orbax", "model.gguf"):
    for mesh in [(2, 2)] + [None] * (port is None):
      model = from_pretrained(os.path.join(ckpt, fmt), mesh=mesh).model
      tokens = generate(model, prompt, num_samples=samples, max_new_tokens=NEW,
                        attention=attention, impl="xla", mesh=mesh)
      result["tokens"][f"hydragen-one-prompt {fmt} {mesh}"] = np.asarray(tokens).tolist()
  if port is None:  # the reference without a mesh
    model = from_pretrained(ckpt).model
    for name, (prompt, samples, attention) in cases().items():
      tokens = generate(model, prompt, num_samples=samples, max_new_tokens=NEW,
                        attention=attention, impl="xla")
      result["tokens"][f"{name} None"] = np.asarray(tokens).tolist()
  else:  # bad inputs: each must raise the same clear error on every process, not hang
    try:
      generate(model, prompt_of(19, 0), num_samples=8, max_new_tokens=NEW, mesh=(3, 1))
    except ValueError as e:
      result["errors"]["mesh (3, 1)"] = str(e)
    prompt = prompt_of(19, 0)
    if jax.process_index() == 1:
      prompt[4] += 1
    try:
      generate(model, prompt, num_samples=8, max_new_tokens=NEW, impl="xla", mesh=(2, 2))
    except ValueError as e:
      result["errors"]["different prompts"] = str(e)
  with open(out, "w") as f:
    json.dump(result, f)
  # The command line last: process 0 prints the completions (JSON), the others nothing.
  from models.cli import main as cli
  cli(["generate", "--model", ckpt, "--prompt", "The sea, the sea", "--num-samples", "4",
       "--max-new-tokens", "5", "--temperature", "0", "--ignore-eos", "--json", "--no-progress",
       "--compile-cache", "", "--mesh", "2x2"]
      + (["--coordinator", f"localhost:{port}", "--num-processes", str(n), "--process-id", str(i)]
         if port is not None else []))


def devices(port, n, i):
  from models.parallel import distributed

  distributed.initialize(f"localhost:{port}", int(n), int(i))


if __name__ == "__main__":
  {"write": write, "run": run, "devices": devices}[sys.argv[1]](*sys.argv[2:])
