"""The Llama decoder in Flax NNX: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Covers Llama 2, Llama 3.x, CodeLlama, SmolLM2, Mistral, Qwen2/2.5 (``config.qkv_bias``: q/k/v
biases ``q_bias [Hq, D]``, ...), Qwen3 (``config.qk_norm``: ``q_norm``/``k_norm``, RMSNorm
over each head before RoPE) and Gemma 2 (``(1 + w)`` norms, four per layer, scaled embeddings,
a GELU-tanh MLP, its attention scale, soft-capped scores and logits, sliding-window layers)
and MPT (LayerNorm, an ungated GELU MLP, ALiBi instead of RoPE); see :mod:`models.model.config`
and :mod:`models.model.families`. Each layer's attention variants (``scale``, ``softcap``,
``local_window_size``, ``alibi_slopes``: :meth:`Attention.variants`) go to every
``jax_shared_attn`` call it makes, with or without a cache.
Layout ``[batch, seq, heads, head_dim]``; parameters and activations in
``config.dtype``; RMSNorm statistics, RoPE angles and the logits in float32.

Projection weights are ``[in, out]`` (q_proj ``[hidden, Hq, D]``, o_proj ``[Hq, D, hidden]``,
gate ``[hidden, F]``, ...), as in Flax's ``Linear``: a product reads its weight as it lies.
Checkpoints store PyTorch's ``[out, in]``; :mod:`models.checkpoints.loading` transposes each tensor (or
each block a device holds) once, as it is read. On a CPU this matters: XLA's YNNPACK matrix
products repack an ``[out, in]`` weight into a new buffer the first time a program runs, and
decode is slower with it; GPUs and TPUs read either orientation. The embedding stays
``[V, hidden]`` (a lookup reads its rows; the tied output projection reads it in place).

    >>> model = random_init(preset("tiny"), seed=0)           # random weights
    >>> logits = model(tokens)                               # [B, T] -> float32 [B, T, vocab]
    >>> logits, cache = model(tokens, cache=cache)           # with a KV cache (models.generation.cache)

With a cache, the decoder writes each layer's new K/V with ``cache.write(layer, k, v)`` and
attends with ``cache.attention(q, layer, t, settings, sharding, **variants)``: the contiguous
:class:`models.generation.cache.KVCache` or the serving engine's paged cache
(:mod:`models.serving.paged_cache`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jax_shared_attn import attention_with_lse
from jax_shared_attn.sharding import AttentionSharding
from models.generation.cache import KVCache, per_shard
from models.generation.settings import GenerationSettings
from models.model.config import LlamaConfig
from models.model.rope import apply_rope, inverse_frequencies
from models.parallel.sharding import write_per_shard

Array = jax.Array


# Our layout of each projection = the checkpoint's ``[out, in]`` tensor, heads split out
# (q_proj ``[Hq, D, hidden]``, o_proj ``[hidden, Hq, D]``), transposed by this permutation.
CHECKPOINT_PERMS = {
    "self_attn.q_proj": (2, 0, 1), "self_attn.k_proj": (2, 0, 1), "self_attn.v_proj": (2, 0, 1),
    "self_attn.o_proj": (1, 2, 0),
    "mlp.gate_proj": (1, 0), "mlp.up_proj": (1, 0), "mlp.down_proj": (1, 0),
}


def _precision(dtype) -> lax.Precision:
  # float32 weights get true float32 products (TF32 on GPUs costs ~1e-3
  # relative error and would break the float32 parity checks).
  return lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else lax.Precision.DEFAULT


def _einsum(spec: str, x: Array, w: nnx.Param) -> Array:
  w = w[...]
  return jnp.einsum(spec, x, w, precision=_precision(w.dtype))


# The head projections multiply by their weights seen as one matrix, ``[hidden, Hq * D]`` and
# ``[Hq * D, hidden]`` (a reshape: no data moves). With the 3-D weights, XLA's CPU backend
# transposes each one into a new buffer on every decode step.
def _heads_in(x: Array, w: nnx.Param) -> Array:
  """``x [B, T, hidden]`` times ``w [hidden, H, D]`` -> ``[B, T, H, D]``."""
  w = w[...]
  hidden, h, d = w.shape
  y = jnp.einsum("btc,cn->btn", x, w.reshape(hidden, h * d), precision=_precision(w.dtype))
  return y.reshape(x.shape[:2] + (h, d))


def _heads_out(x: Array, w: nnx.Param) -> Array:
  """``x [B, T, H, D]`` times ``w [H, D, hidden]`` -> ``[B, T, hidden]``."""
  w = w[...]
  h, d, hidden = w.shape
  return jnp.einsum("btn,nc->btc", x.reshape(x.shape[:2] + (h * d,)), w.reshape(h * d, hidden),
                    precision=_precision(w.dtype))


def _normal(rngs: Optional[nnx.Rngs], shape, dtype, std=0.02) -> nnx.Param:
  """``N(0, std)`` drawn from ``rngs``; ``rngs=None``: only the shape and dtype (see build)."""
  if rngs is None:
    return nnx.Param(jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype)))
  return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


# XLA's GPU dot merger turns the q, k and v projections (three products of one operand) into
# one product over the concatenated weights, and inside the decode loop it concatenates the
# weights again at every step (they are loop-invariant, but the concatenation is not hoisted).
# Giving the k and v products their own copies of the operand (an optimization barrier: no data
# moves) keeps three products. From this many rows (batch x tokens) on; below, XLA merges them
# without the copies.
SEPARATE_PROJECTIONS_MIN_ROWS = 512


def _unshared(x: Array, n: int) -> tuple[Array, ...]:
  """``n`` values equal to ``x`` that XLA cannot see as one operand (no copy is made)."""
  return lax.optimization_barrier((x,) * n)


class RMSNorm(nnx.Module):
  """``weight * x / sqrt(mean(x^2) + eps)``, statistics in float32 (as transformers).

  ``plus_one`` (Gemma): ``(1 + weight) * x / ...``, the product in float32 and then cast, as
  transformers' Gemma RMSNorm; else the normalized value is cast first (Llama's).
  ``weight`` starts at ones (zeros with ``plus_one``: the identity scale either way);
  ``abstract=True``: only its shape and dtype (see build).
  """

  def __init__(self, dim: int, eps: float, dtype, *, abstract: bool = False,
               plus_one: bool = False):
    self.weight = nnx.Param(jax.ShapeDtypeStruct((dim,), jnp.dtype(dtype)) if abstract
                            else (jnp.zeros if plus_one else jnp.ones)((dim,), dtype))
    self.eps = eps
    self.plus_one = plus_one

  def __call__(self, x: Array) -> Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    if self.plus_one:
      return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
    return self.weight[...] * normed.astype(x.dtype)


class LayerNorm(nnx.Module):
  """``weight * (x - mean(x)) / sqrt(var(x) + eps)`` with no bias (MPT's), statistics in
  float32; ``weight`` starts at ones."""

  def __init__(self, dim: int, eps: float, dtype, *, abstract: bool = False):
    self.weight = nnx.Param(jax.ShapeDtypeStruct((dim,), jnp.dtype(dtype)) if abstract
                            else jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x: Array) -> Array:
    x32 = x.astype(jnp.float32)
    centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    normed = centered * lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + self.eps)
    return (normed * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def _norm(config: LlamaConfig, dim: int, abstract: bool) -> RMSNorm | LayerNorm:
  if config.norm_type == "layer":
    return LayerNorm(dim, config.rms_norm_eps, config.param_dtype, abstract=abstract)
  return RMSNorm(dim, config.rms_norm_eps, config.param_dtype, abstract=abstract,
                 plus_one=config.norm_plus_one)


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE over a (shared-segment) KV cache."""

  def __init__(self, config: LlamaConfig, layer: int, *, rngs: Optional[nnx.Rngs]):
    c, dt = config, config.param_dtype
    self.q_proj = _normal(rngs, (c.hidden_size, c.num_heads, c.head_dim), dt)
    self.k_proj = _normal(rngs, (c.hidden_size, c.num_kv_heads, c.head_dim), dt)
    self.v_proj = _normal(rngs, (c.hidden_size, c.num_kv_heads, c.head_dim), dt)
    self.o_proj = _normal(rngs, (c.num_heads, c.head_dim, c.hidden_size), dt)
    if c.qkv_bias:  # [H, D]: added to the projection's output heads
      self.q_bias = _normal(rngs, (c.num_heads, c.head_dim), dt)
      self.k_bias = _normal(rngs, (c.num_kv_heads, c.head_dim), dt)
      self.v_bias = _normal(rngs, (c.num_kv_heads, c.head_dim), dt)
    if c.qk_norm:  # one weight [D] shared by the heads
      self.q_norm = _norm(c, c.head_dim, rngs is None)
      self.k_norm = _norm(c, c.head_dim, rngs is None)
    self.qkv_bias, self.qk_norm = c.qkv_bias, c.qk_norm
    self.layer = layer
    # ALiBi (MPT) replaces RoPE: no rotation, the slopes go to the attention.
    self.alibi = c.alibi_slopes()
    self.inv_freq = (None if self.alibi is not None
                     else tuple(float(f) for f in inverse_frequencies(config)))
    self.scale = None if c.query_pre_attn_scalar is None else c.attention_scale
    self.softcap = c.attn_logit_softcapping
    self.window = c.local_window(layer)

  def variants(self) -> dict[str, Any]:
    """This layer's keyword arguments of the ``jax_shared_attn`` calls: its ``scale``,
    ``softcap``, ``local_window_size`` and ``alibi_slopes`` (float32 ``[Hq]``), each only
    when the config sets it (the API's defaults otherwise)."""
    out = dict(scale=self.scale, softcap=self.softcap, local_window_size=self.window)
    out = {k: v for k, v in out.items() if v is not None}
    if self.alibi is not None:
      out["alibi_slopes"] = jnp.asarray(self.alibi, jnp.float32)
    return out

  def __call__(self, x: Array, positions: Array, cache: Optional[Any], *,
               skip_attention: bool, settings: GenerationSettings,
               sharding: Optional[AttentionSharding] = None,
               layer_index=None) -> tuple[Array, Optional[KVCache]]:
    """``layer_index``: this layer's index in ``cache`` (default its own; a traced int32 when
    the layers run under one ``lax.scan``, see :meth:`Llama.__call__`)."""
    layer = self.layer if layer_index is None else layer_index
    xq = _heads_in(x, self.q_proj)  # (bs, seqlen, n_heads, head_dim)
    rows = x.shape[0] * x.shape[1]
    x_k, x_v = _unshared(x, 2) if rows >= SEPARATE_PROJECTIONS_MIN_ROWS else (x, x)
    keys = _heads_in(x_k, self.k_proj)  # (bs, seqlen, n_kv_heads, head_dim)
    values = _heads_in(x_v, self.v_proj)
    if self.qkv_bias:
      xq, keys, values = xq + self.q_bias[...], keys + self.k_bias[...], values + self.v_bias[...]
    if self.qk_norm:
      xq, keys = self.q_norm(xq), self.k_norm(keys)
    if self.inv_freq is not None:
      inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
      xq, keys = apply_rope(xq, positions, inv_freq), apply_rope(keys, positions, inv_freq)
    variants = self.variants()
    if skip_attention:
      out = _no_attention(xq, keys, values)
    elif cache is None and settings.causal_attention is not None:
      if sharding is not None:
        raise ValueError("settings.causal_attention runs without a mesh only")
      if variants:
        raise ValueError(f"settings.causal_attention is plain causal attention; layer "
                         f"{self.layer} of this model needs {sorted(variants)}")
      out = settings.causal_attention(xq, keys, values)
    elif cache is None:
      out, _ = per_shard(attention_with_lse, sharding)(xq, keys, values, causal=True,
                                                        impl=settings.impl, config=settings.config,
                                                        **variants)
    else:
      cache = (cache.write(layer, keys, values) if sharding is None
               else write_per_shard(cache, layer, keys, values, sharding))
      out = cache.attention(xq, layer, x.shape[1], settings, sharding, **variants)
    return _heads_out(out, self.o_proj), cache


def _no_attention(xq: Array, keys: Array, values: Array) -> Array:
  """The "no attention" ceiling (paper Sec. 4.1): no scores, no cache.

  Returns something cheap that depends on q, k and v, so that XLA keeps the
  q/k/v projections (and RoPE) the paper keeps in this baseline.
  """
  group = xq.shape[2] // keys.shape[2]
  return xq + jnp.repeat(keys + values, group, axis=2)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
               "gelu": lambda x: jax.nn.gelu(x, approximate=False)}


class MLP(nnx.Module):
  """Gated: ``down(act(gate(x)) * up(x))``, ``act`` SiLU (SwiGLU) or GELU-tanh (Gemma);
  with ``config.gated_mlp`` False, ``down(act(up(x)))`` (MPT: exact GELU)."""

  def __init__(self, config: LlamaConfig, *, rngs: Optional[nnx.Rngs]):
    c, dt = config, config.param_dtype
    if c.gated_mlp:
      self.gate_proj = _normal(rngs, (c.hidden_size, c.intermediate_size), dt)
    self.up_proj = _normal(rngs, (c.hidden_size, c.intermediate_size), dt)
    self.down_proj = _normal(rngs, (c.intermediate_size, c.hidden_size), dt)
    self.act, self.gated = c.hidden_act, c.gated_mlp

  def __call__(self, x: Array) -> Array:
    act = ACTIVATIONS[self.act]
    if self.gated:
      hidden = act(_einsum("btd,df->btf", x, self.gate_proj))
      hidden = hidden * _einsum("btd,df->btf", x, self.up_proj)
    else:
      hidden = act(_einsum("btd,df->btf", x, self.up_proj))
    return _einsum("btf,fd->btd", hidden, self.down_proj)


class DecoderLayer(nnx.Module):
  """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``.

  With ``config.sandwich_norms`` (Gemma 2) the sublayer outputs are normalized too:
  ``h = x + post_attention_layernorm(attn(input_layernorm(x)))``,
  ``out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``.
  """

  def __init__(self, config: LlamaConfig, layer: int, *, rngs: Optional[nnx.Rngs]):
    abstract = rngs is None
    self.input_layernorm = _norm(config, config.hidden_size, abstract)
    self.self_attn = Attention(config, layer, rngs=rngs)
    self.post_attention_layernorm = _norm(config, config.hidden_size, abstract)
    if config.sandwich_norms:
      self.pre_feedforward_layernorm = _norm(config, config.hidden_size, abstract)
      self.post_feedforward_layernorm = _norm(config, config.hidden_size, abstract)
    self.sandwich_norms = config.sandwich_norms
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x, positions, cache, *, skip_attention, settings, sharding=None,
               layer_index=None):
    attn_out, cache = self.self_attn(self.input_layernorm(x), positions, cache,
                                     skip_attention=skip_attention, settings=settings,
                                     sharding=sharding, layer_index=layer_index)
    if not self.sandwich_norms:
      h = x + attn_out
      return h + self.mlp(self.post_attention_layernorm(h)), cache
    h = x + self.post_attention_layernorm(attn_out)
    return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))), cache


class Llama(nnx.Module):
  """The decoder: embedding, ``num_layers`` blocks, final norm, output projection.

  Parameter names follow transformers' (``embed_tokens``, ``layers[i].self_attn.q_proj``,
  ...) so that checkpoints map one to one. ``rngs=None`` builds the abstract model: every
  parameter a ``jax.ShapeDtypeStruct`` given by the config, nothing drawn or traced
  (:func:`build` fills it).
  """

  def __init__(self, config: LlamaConfig, *, rngs: Optional[nnx.Rngs]):
    dt = config.param_dtype
    self.config = config
    self.embed_tokens = _normal(rngs, (config.vocab_size, config.hidden_size), dt)
    self.layers = nnx.List([DecoderLayer(config, i, rngs=rngs) for i in range(config.num_layers)])
    self.norm = _norm(config, config.hidden_size, rngs is None)
    self.lm_head = (None if config.tie_word_embeddings
                    else _normal(rngs, (config.vocab_size, config.hidden_size), dt))

  def __call__(self, tokens: Array, *, positions: Optional[Array] = None,
               cache: Optional[KVCache] = None, skip_attention: bool = False,
               settings: Optional[GenerationSettings] = None, impl: Optional[str] = None,
               sharding: Optional[AttentionSharding] = None,
               stacked_layers: Optional[tuple[Any, Any]] = None):
    """Runs the decoder on int ``tokens [B, T]``.

    Args:
      tokens: int32 ``[B, T]``.
      positions: int32 ``[B, T]`` absolute positions; default ``arange(T)``
        without a cache, and each sequence's context length onward with one.
      cache: a :class:`models.generation.cache.KVCache`; the T new tokens' K/V are written
        at each sequence's own length and attend causally over its shared
        levels and own tokens. ``None``: plain causal attention over ``tokens``.
      skip_attention: the "no attention" throughput ceiling (wrong outputs;
        benchmarks only): no K/V is written or read, only the lengths (and so
        the positions) advance.
      settings: a :class:`models.generation.settings.GenerationSettings`; the decoder reads
        its attention fields (``impl``, ``config`` for :mod:`jax_shared_attn`,
        ``causal_attention``). Default: ``GenerationSettings()``.
      impl: shorthand for ``settings.replace(impl=impl)``.
      sharding: on a device mesh, where the batch and heads live
        (:func:`models.parallel.sharding.attention_sharding`); attention then runs
        per shard under ``shard_map``. The parameters, tokens and cache must
        be laid out by the rules of :mod:`models.parallel.sharding`. None: no mesh.
      stacked_layers: ``(graphdef, weights)`` of :func:`stack_layers`: the layers run as one
        ``lax.scan`` over these weights (each ``[num_layers, ...]``), the layer's index a
        traced int the cache must take (the serving engine's one-pool cache), instead of the
        unrolled ``self.layers`` (whose weights are then unused). One layer's code per
        program: compiling does not grow with the layer count.

    Returns:
      float32 logits ``[B, T, vocab]``; with a cache, ``(logits, new_cache)``
      with the cache's lengths advanced by T.
    """
    settings = settings or GenerationSettings()
    if impl is not None:
      settings = settings.replace(impl=impl)
    b, t = tokens.shape
    if positions is None:
      start = cache.context_lengths() if cache is not None else jnp.zeros((b,), jnp.int32)
      positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    x = self.embed(tokens)
    if stacked_layers is None:
      for layer in self.layers:
        x, cache = layer(x, positions, cache, skip_attention=skip_attention, settings=settings,
                         sharding=sharding)
    else:
      layer_def, weights = stacked_layers

      def body(carry, xs):
        x, cache = carry
        w, index = xs
        return nnx.merge(layer_def, w)(x, positions, cache, skip_attention=skip_attention,
                                       settings=settings, sharding=sharding,
                                       layer_index=index), None

      n = len(self.layers)
      (x, cache), _ = lax.scan(body, (x, cache), (weights, jnp.arange(n, dtype=jnp.int32)))
    logits = self.logits(self.norm(x))
    if cache is None:
      return logits
    return logits, cache.advance(t)

  def embed(self, tokens: Array) -> Array:
    """``[B, T, hidden]`` input of the first layer for int ``tokens [B, T]`` (times
    ``sqrt(hidden_size)`` rounded to the dtype with ``config.scale_embeddings``)."""
    x = self.embed_tokens[...][tokens]
    if self.config.scale_embeddings:
      x = x * jnp.asarray(self.config.hidden_size**0.5, x.dtype)
    return x

  def logits(self, h: Array) -> Array:
    """float32 ``[B, T, vocab]`` from final hidden states ``[B, T, hidden]`` (soft-capped with
    ``config.final_logit_softcapping``)."""
    w = self.embed_tokens if self.lm_head is None else self.lm_head
    w = w[...]
    logits = jnp.einsum("btd,vd->btv", h, w, precision=_precision(w.dtype),
                        preferred_element_type=jnp.float32)
    cap = self.config.final_logit_softcapping
    return logits if cap is None else cap * jnp.tanh(logits / cap)



# -- building models from arrays ---------------------------------------------------------------

def layers_scannable(config: LlamaConfig) -> bool:
  """Whether every layer runs the same code (one sliding window, or none, for all), so that
  the layers can run as one ``lax.scan`` (:func:`stack_layers`)."""
  return len({config.local_window(i) for i in range(config.num_layers)}) == 1


def stack_layers(model: "Llama"):
  """``(graphdef, weights)`` for ``Llama.__call__(stacked_layers=...)``: layer 0's graph and
  every layer's weights stacked on a leading axis (a copy: ``[num_layers, ...]`` each).

  Raises ValueError when the layers differ (:func:`layers_scannable`)."""
  if not layers_scannable(model.config):
    windows = sorted({str(model.config.local_window(i)) for i in range(model.config.num_layers)})
    raise ValueError(f"stack_layers: the layers run different code (sliding windows "
                     f"{', '.join(windows)}): they cannot run under one scan")
  layer_def = nnx.split(model.layers[0])[0]
  states = [nnx.split(layer)[1] for layer in model.layers]
  return layer_def, jax.tree.map(lambda *xs: jnp.stack(xs), *states)


def param_shapes(config: LlamaConfig) -> dict[str, jax.ShapeDtypeStruct]:
  """Dotted parameter path (``layers.0.self_attn.q_proj``) -> shape and dtype (from the
  config: the abstract model, nothing traced)."""
  return _flatten(nnx.to_pure_dict(nnx.state(Llama(config, rngs=None))))


def flat_params(model: Llama) -> dict[str, jax.Array]:
  """The model's parameters as dotted path -> array (what :func:`build` takes)."""
  return _flatten(nnx.to_pure_dict(nnx.state(model)))


def build(config: LlamaConfig, params: Mapping[str, Any]) -> Llama:
  """A :class:`Llama` holding ``params`` (dotted path -> array, every parameter).

  Raises ValueError naming a missing, unexpected or mis-shaped parameter.
  Arrays are converted to ``config.dtype``; a NumPy array already in that dtype, C-ordered
  and 64-byte aligned becomes the CPU device's buffer without a copy (it must not be
  written to afterwards).
  """
  graphdef, state = nnx.split(Llama(config, rngs=None))
  tree = nnx.to_pure_dict(state)
  expected = _flatten(tree)
  missing, extra = sorted(set(expected) - set(params)), sorted(set(params) - set(expected))
  if missing or extra:
    raise ValueError(f"build: parameters do not match the config: missing {missing[:4]}, "
                     f"unexpected {extra[:4]}")
  for path, value in params.items():
    if tuple(value.shape) != tuple(expected[path].shape):
      raise ValueError(f"build: {path} has shape {tuple(value.shape)}; the config needs "
                       f"{tuple(expected[path].shape)}")
    node, keys = tree, [int(k) if k.isdigit() else k for k in path.split(".")]
    for key in keys[:-1]:
      node = node[key]
    node[keys[-1]] = jnp.asarray(value, config.param_dtype)
  nnx.replace_by_pure_dict(state, tree)
  return nnx.merge(graphdef, state)


def random_init(config: LlamaConfig, seed: int = 0, *, std: float = 0.02, mesh=None) -> Llama:
  """Random weights drawn on the host with NumPy (normal(0, std); norms at the identity
  scale: 1, or 0 with ``config.norm_plus_one``).

  Nothing is compiled, so small models (tests, CI) appear instantly. For
  large shapes on one accelerator, draw on the device instead: one small
  jitted ``jax.random`` draw per parameter shape. A model too large for one
  device is drawn here with ``mesh``. With ``mesh`` (see
  :func:`models.parallel.sharding.make_mesh`) each tensor goes straight to its shards
  as it is drawn, so no device receives more than its block (the same values
  as without a mesh).
  """
  rng = np.random.default_rng(seed)
  place = lambda path, x: x
  if mesh is not None:
    from models.parallel import sharding
    mesh = sharding.make_mesh(mesh)
    place = lambda path, x: sharding.place_param(path, x, config, mesh)
  params = {}
  for path, spec in param_shapes(config).items():
    if path.endswith("norm.weight"):
      fill = np.zeros if config.norm_plus_one else np.ones
      params[path] = place(path, fill(spec.shape, np.float32))
    else:
      # Drawn in the checkpoints' [out, in] order, then transposed: a seed gives the same
      # model whatever our layout.
      perm = CHECKPOINT_PERMS.get(path.split(".", 2)[-1], tuple(range(len(spec.shape))))
      view = tuple(spec.shape[perm.index(i)] for i in range(len(perm)))
      params[path] = place(path, np.ascontiguousarray(
          (std * rng.standard_normal(view, np.float32)).transpose(perm)))
  return build(config if mesh is None else sharding.sharded_config(config, mesh), params)


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      out.update(_flatten(value, name + "."))
    else:
      out[name] = value
  return out
