"""GenerationSettings: one value for sampling, attention and the sampler; validated, static under
jit, and its attention config reaches jax_shared_attn from the model."""

import dataclasses

import numpy as np
import pytest

from jax_shared_attn import GpuConfig
from models.generation import cache as cache_lib
from models.generation.loop import decode, generate, prefill
from models.generation.sampling import SamplerConfig
from models.generation.settings import GenerationSettings
from models.model import llama
from models.model.config import preset
from models.model.llama import random_init


@pytest.fixture(scope="module")
def tiny():
  return random_init(preset("tiny").replace(num_heads=4, num_kv_heads=2, head_dim=16), seed=2,
                     std=0.12)


PROMPTS = [[5, 9, 3, 7, 1, 2, 8, 4, 6, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
           [5, 9, 3, 7, 1, 2, 8, 4, 6, 11, 12, 13, 14, 15, 16, 17, 18, 19, 30, 31, 32]]


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_k", 0), ("top_p", 1.5),
                                         ("impl", "nope"), ("config", "fast"),
                                         ("sampler", dict(chunk=128)),
                                         ("causal_attention", 3)])
def test_a_bad_field_is_named(field, value):
  with pytest.raises(ValueError, match=field):
    GenerationSettings(**{field: value})


def test_frozen_hashable_and_normalised():
  a = GenerationSettings(temperature=1, top_p=1.0, config=GpuConfig())
  assert a == GenerationSettings(temperature=1.0, config=GpuConfig()) and hash(a) == hash(
      GenerationSettings(temperature=1.0, config=GpuConfig()))
  assert a.top_p is None and a.sampling.temperature == 1.0  # top_p=1 keeps every token
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.impl = "xla"
  assert a.attention_only() == GenerationSettings(config=GpuConfig())


def test_settings_and_the_old_keywords_give_the_same_tokens(tiny):
  kw = dict(num_samples=[2, 3], max_new_tokens=6, seed=4)
  old = generate(tiny, PROMPTS, temperature=0.9, top_k=40, top_p=0.9, impl="xla", **kw)
  settings = GenerationSettings(temperature=0.9, top_k=40, top_p=0.9, impl="xla")
  new = generate(tiny, PROMPTS, settings=settings, **kw)
  np.testing.assert_array_equal(np.asarray(old), np.asarray(new))
  # A keyword on top of settings replaces that field only.
  greedy = generate(tiny, PROMPTS, settings=settings, temperature=0.0, **kw)
  np.testing.assert_array_equal(np.asarray(greedy),
                                np.asarray(generate(tiny, PROMPTS, impl="xla", **kw)))
  with pytest.raises(TypeError, match="temprature"):
    generate(tiny, PROMPTS, temprature=1.0, **kw)
  with pytest.raises(TypeError, match="settings must be a GenerationSettings"):
    generate(tiny, PROMPTS, settings=dict(temperature=1.0), **kw)


def test_the_attention_config_reaches_jax_shared_attn(tiny, monkeypatch):
  """prefill and decode: every attention call of the decoder gets ``config=`` (and ``impl=``)
  of the settings, on the hydragen (hierarchical) and standard (attention_with_lse) paths."""
  seen = []

  def spy(fn):
    def wrapped(*args, **kwargs):
      seen.append((fn.__name__, kwargs.get("impl"), kwargs.get("config")))
      return fn(*args, **kwargs)
    return wrapped

  # The cache-less forward calls attention in the decoder, the cached one in KVCache.attention.
  monkeypatch.setattr(cache_lib, "hierarchical_attention", spy(cache_lib.hierarchical_attention))
  monkeypatch.setattr(cache_lib, "attention_with_lse", spy(cache_lib.attention_with_lse))
  monkeypatch.setattr(llama, "attention_with_lse", spy(llama.attention_with_lse))
  config = GpuConfig(backward="triton")  # a config the spy can tell from the default
  settings = GenerationSettings(temperature=0.7, impl="xla", config=config)
  for attention in ("hydragen", "standard"):
    seen.clear()
    state = prefill(tiny, PROMPTS, num_samples=2, max_new_tokens=4, attention=attention,
                    settings=settings, seed=1)
    decode(tiny, state, settings=settings)
    # hydragen: the root segment's prefill has no shared level above it (attention_with_lse)
    names = {name for name, _, _ in seen}
    assert names == ({"attention_with_lse", "hierarchical_attention"} if attention == "hydragen"
                     else {"attention_with_lse"}), names
    assert seen and all(impl == "xla" and c is config for _, impl, c in seen), seen


def test_a_caller_supplied_causal_attention_replaces_the_plain_path(tiny):
  """``causal_attention`` (a benchmark's baseline) runs instead of jax_shared_attn for the
  cache-less forward; the model has no branch of its own for it."""
  import jax
  import jax.numpy as jnp
  calls = []

  def reference(q, k, v):
    calls.append(q.shape)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)

  tokens = jnp.asarray([PROMPTS[0]], jnp.int32)
  ours = tiny(tokens, settings=GenerationSettings(impl="xla"))
  theirs = tiny(tokens, settings=GenerationSettings(causal_attention=reference))
  assert calls and np.allclose(np.asarray(ours), np.asarray(theirs), rtol=2e-4, atol=2e-4)


def test_the_sampler_config_reaches_sample(tiny, monkeypatch):
  from models.generation import loop
  seen = []
  real = loop.sample
  monkeypatch.setattr(loop, "sample", lambda l, k, p, c=None: seen.append(c) or real(l, k, p, c))
  sampler = SamplerConfig(candidates=0, search_width=3)
  generate(tiny, PROMPTS, num_samples=1, max_new_tokens=3, seed=9,
           settings=GenerationSettings(temperature=1.0, top_p=0.8, sampler=sampler))
  assert seen and all(c is sampler for c in seen)
