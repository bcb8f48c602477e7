"""Checkpoints: sharded safetensors, dtypes, GGUF (written here, and SmolLM2 vs transformers), orbax."""

import importlib.metadata
import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

from models.model.config import preset
from models.model.llama import flat_params, random_init
from models.checkpoints.loading import (from_pretrained, hf_name_map, hf_tensors, model_from_tensors, save_pretrained,
                            unpermute_rope_rows)
from models.checkpoints.tokenizer import Tokenizer, _bytes_to_unicode
from model_checks import hf_logits, make_hf_llama, rel_err, run, smollm2_gguf, token_ids
from gguf_writer import llama_cpp_permute


def same_params(a, b) -> bool:
  pa, pb = flat_params(a), flat_params(b)
  return pa.keys() == pb.keys() and all(np.array_equal(np.asarray(pa[k]), np.asarray(pb[k]))
                                        for k in pa)


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path):
  hf = make_hf_llama(tmp_path / "one")
  hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
  index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 1
  one, _, _ = from_pretrained(str(tmp_path / "one"))
  sharded, _, _ = from_pretrained(str(tmp_path / "sharded"))
  assert same_params(one, sharded)


def test_dtype_argument_overrides_the_checkpoint(tmp_path):
  make_hf_llama(tmp_path)
  model, _, config = from_pretrained(str(tmp_path), dtype="bfloat16")
  assert config.dtype == "bfloat16"
  assert all(x.dtype == jnp.bfloat16 for x in flat_params(model).values())


def test_orbax_round_trip(tmp_path):
  model = random_init(preset("tiny"), seed=4)
  spelling = _bytes_to_unicode()
  tokenizer = Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "gpt2",
                                          "tokenizer.ggml.tokens": [spelling[b] for b in range(256)],
                                          "tokenizer.ggml.eos_token_id": 10})
  save_pretrained(str(tmp_path / "ckpt"), model, tokenizer)
  restored, tok, config = from_pretrained(str(tmp_path / "ckpt"))
  assert config == model.config and same_params(model, restored)
  assert tok.eos_id == 10 and tok.encode("héllo") == tokenizer.encode("héllo")
  half, _, _ = from_pretrained(str(tmp_path / "ckpt"), dtype="bfloat16")
  assert half.config.dtype == "bfloat16"
  np.testing.assert_array_equal(np.asarray(half.norm.weight[...]),
                                np.asarray(model.norm.weight[...]).astype(jnp.bfloat16))


@pytest.mark.parametrize("n_head", [1, 3, 8])
def test_unpermute_inverts_llama_cpps_permutation(n_head):
  w = np.random.default_rng(0).normal(size=(n_head * 16, 5))
  permuted = llama_cpp_permute(w, n_head)
  assert not np.array_equal(permuted, w)
  np.testing.assert_array_equal(unpermute_rope_rows(permuted, n_head), w)


def llama3_rope_factors(theta, dim, factor, low, high, old_context):
  """convert_hf_to_gguf.py's rope_freqs.weight for Llama 3.1 (written independently of models.model.rope)."""
  factors = []
  for i in range(0, dim, 2):
    wavelen = 2 * math.pi * theta ** (i / dim)
    if wavelen < old_context / high:
      factors.append(1.0)
    elif wavelen > old_context / low:
      factors.append(factor)
    else:
      smooth = (old_context / wavelen - low) / (high - low)
      factors.append(1 / ((1 - smooth) / factor + smooth))
  return np.asarray(factors, np.float32)


def write_gguf(path, hf, rope):
  """A GGUF as llama.cpp's converter writes one: llama.cpp names, permuted q/k rows, rope_freqs."""
  import gguf

  c = hf.config
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_name("tiny-llama3")
  w.add_block_count(c.num_hidden_layers)
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  w.add_rope_freq_base(rope["rope_theta"])
  w.add_rope_dimension_count(c.head_dim)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("default")
  spelling = _bytes_to_unicode()
  w.add_token_list([spelling[b] for b in range(256)])
  w.add_token_types([1] * 256)
  w.add_eos_token_id(0)
  names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
  layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
           "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
  for name, tensor in hf.state_dict().items():
    x = tensor.float().numpy()
    if name.startswith("model.layers."):
      i, rest = name[len("model.layers."):].split(".", 1)
      module = rest[:-len(".weight")]
      if module == "self_attn.q_proj":
        x = llama_cpp_permute(x, c.num_attention_heads)
      elif module == "self_attn.k_proj":
        x = llama_cpp_permute(x, c.num_key_value_heads)
      name = f"blk.{i}.{layer[module]}.weight"
    else:
      name = names[name]
    w.add_tensor(name, np.ascontiguousarray(x))
  w.add_tensor("rope_freqs.weight", llama3_rope_factors(
      rope["rope_theta"], c.head_dim, rope["factor"], rope["low_freq_factor"],
      rope["high_freq_factor"], rope["original_max_position_embeddings"]))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_gguf_written_like_llama_cpp_matches_transformers(tmp_path):
  pytest.importorskip("gguf", reason="the gguf package (llama.cpp's writer) is a test dependency")
  rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_position_embeddings=16)
  hf = make_hf_llama(tmp_path / "hf", vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
                     rope_parameters=rope)
  write_gguf(tmp_path / "tiny.gguf", hf, rope)
  model, tokenizer, config = from_pretrained(str(tmp_path / "tiny.gguf"))
  assert (config.num_kv_heads, config.tie_word_embeddings, config.name) == (2, False, "tiny-llama3")
  assert config.rope_freq_factors is not None
  ids = token_ids(256)
  assert rel_err(run(model, jnp.asarray(ids)), hf_logits(hf, ids)) < 1e-4
  assert tokenizer.decode(tokenizer.encode("a b\nc")) == "a b\nc"


@pytest.fixture(scope="module")
def smollm2():
  return from_pretrained(smollm2_gguf())


def test_smollm2_gguf_logits_match_transformers_own_gguf_loading(smollm2):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("accelerate")  # transformers needs it to read GGUF
  path = smollm2_gguf()
  model, tokenizer, config = smollm2
  assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
  assert config.tie_word_embeddings and model.lm_head is None
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
  text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 17 * 23? Be brief."}])
  ids = np.asarray([tokenizer.encode(text)], np.int32)
  err = rel_err(run(model, jnp.asarray(ids)), hf_logits(hf, ids))
  assert err < 1e-4, err


def test_loading_errors_name_the_problem(tmp_path):
  with pytest.raises(ValueError, match="neither"):
    from_pretrained(str(tmp_path / "missing"))
  with pytest.raises(ValueError, match="no config.json"):
    from_pretrained(str(tmp_path))
  config = preset("tiny")
  ours = flat_params(random_init(config))
  tensors = hf_tensors(ours, config)
  model_from_tensors(config, tensors)  # complete: fine
  with pytest.raises(ValueError, match="missing \\['model.norm.weight'\\]"):
    model_from_tensors(config, {k: v for k, v in tensors.items() if k != "model.norm.weight"})
  with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight has shape"):
    model_from_tensors(config, dict(tensors, **{"model.layers.1.mlp.up_proj.weight": np.zeros((3, 3))}))
  with pytest.raises(ValueError, match="unexpected \\['model.layers.9.mlp.up_proj.weight'\\]"):
    model_from_tensors(config, dict(tensors, **{"model.layers.9.mlp.up_proj.weight": np.zeros(1)}))



def test_gguf_blocks_equal_the_whole_tensor_dequantized():
  """Per-shard loading reads Q4_1 blocks (32 values in 20 bytes) of any rows and columns."""
  from models.checkpoints.gguf_reader import GGUFFile
  from models.checkpoints.loading import LazyTensor, _dequantize, _dequantize_block

  t = GGUFFile(smollm2_gguf()).tensors["blk.0.ffn_down.weight"]
  whole = _dequantize(t)
  rng = np.random.default_rng(0)
  for _ in range(5):  # unaligned row and column ranges
    r0, c0 = rng.integers(0, whole.shape[0] - 1), rng.integers(0, whole.shape[1] - 1)
    r1, c1 = rng.integers(r0 + 1, whole.shape[0] + 1), rng.integers(c0 + 1, whole.shape[1] + 1)
    np.testing.assert_array_equal(_dequantize_block(t, slice(r0, r1), slice(c0, c1)),
                                  whole[r0:r1, c0:c1])
  # A block of a view [hidden, 2, F / 2] of the file's [hidden, F]: whole units of its first dim.
  lazy = LazyTensor(whole.shape, lambda *r: _dequantize_block(t, *r))
  view = whole.reshape(whole.shape[0], 2, -1)
  index = (slice(3, 70), slice(1, 2), slice(5, 40))
  np.testing.assert_array_equal(lazy.reader(view.shape)(index), view[index])
  with pytest.raises(ValueError, match="is not a view"):
    lazy.reader((whole.shape[0] + 1, whole.shape[1]))


def test_checkpoint_tensors_round_trip_and_blocks_come_in_our_layout():
  """hf_tensors gives transformers' [out, in]; model_from_tensors transposes back to our
  [in, out]; a block of our layout read from the file is that block of the whole."""
  from models.checkpoints.loading import LazyTensor, _our_block

  config = preset("tiny")
  params = flat_params(random_init(config, seed=1))
  tensors = hf_tensors(params, config)
  c = config
  assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (c.num_heads * c.head_dim,
                                                                      c.hidden_size)
  assert tensors["model.layers.0.self_attn.o_proj.weight"].shape == (c.hidden_size,
                                                                      c.num_heads * c.head_dim)
  assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (c.hidden_size,
                                                                   c.intermediate_size)
  # transformers' q_proj row h * D + d, column c is our q_proj[c, h, d].
  q = params["layers.0.self_attn.q_proj"]
  np.testing.assert_array_equal(tensors["model.layers.0.self_attn.q_proj.weight"][2 * c.head_dim + 3],
                                np.asarray(q)[:, 2, 3])
  back = flat_params(model_from_tensors(config, tensors))
  for path, value in params.items():
    np.testing.assert_array_equal(np.asarray(back[path]), np.asarray(value), err_msg=path)
  rng = np.random.default_rng(0)
  for name, slot in hf_name_map(config).items():
    if not name.startswith(("model.layers.1.", "model.embed")):
      continue
    t = tensors[name]
    read = _our_block(LazyTensor(t.shape, lambda *r, t=t: t[r]).reader(slot.view), slot.perm)
    for _ in range(3):
      index = []
      for n in slot.shape:
        lo = int(rng.integers(0, n))
        index.append(slice(lo, int(rng.integers(lo + 1, n + 1))))
      index = tuple(index)
      np.testing.assert_array_equal(read(index), np.asarray(params[slot.path])[index], err_msg=name)


def test_an_orbax_checkpoint_of_other_shapes_is_refused(tmp_path):
  """orbax fills the model's shapes with a file's values in their own order: a checkpoint of
  the earlier [out, in] projections would load as garbage, so it is refused."""
  import orbax.checkpoint as ocp
  from flax import nnx

  from models.checkpoints.loading import CheckpointError

  model = random_init(preset("tiny"), seed=1)
  save_pretrained(str(tmp_path), model)
  np.testing.assert_array_equal(
      np.asarray(from_pretrained(str(tmp_path)).model.layers[0].mlp.down_proj[...]),
      np.asarray(model.layers[0].mlp.down_proj[...]))
  tree = nnx.to_pure_dict(nnx.state(model))
  tree["layers"][0]["mlp"]["down_proj"] = np.asarray(tree["layers"][0]["mlp"]["down_proj"]).T
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(str(tmp_path / "params"), tree, force=True)
  checkpointer.wait_until_finished()
  with pytest.raises(CheckpointError, match="layers.0.mlp.down_proj has shape \\(64, 128\\)"):
    from_pretrained(str(tmp_path))
