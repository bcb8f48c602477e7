"""The decoder's hyperparameters, and named presets.

One frozen (hashable) dataclass covers Llama 2, Llama 3.x, CodeLlama, SmolLM2, Mistral, Qwen2,
Qwen2.5, Qwen3, Gemma 2 and MPT: they differ in sizes, RoPE base and scaling, the GQA ratio,
whether the output projection is tied to the embedding, two values of the attention
(``qkv_bias``, ``qk_norm``), sliding-window layers (Mistral, Qwen, Gemma 2), Gemma 2's pieces
(its norms, activation, embedding scale, attention scale, soft-capping) and MPT's (LayerNorm,
an ungated GELU MLP, ALiBi instead of RoPE; the families: :mod:`models.model.families`).
``LlamaConfig`` is hashable so that it can be a static argument of ``jax.jit``.

    >>> cfg = preset("llama-3-8b")                    # the shape only; weights come from loading
    >>> cfg = cfg.replace(dtype="bfloat16", max_position_embeddings=32768)
    >>> cfg = LlamaConfig.from_hf(json.load(open("config.json")))
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Optional

import jax.numpy as jnp

from models.model import families

DTYPES = ("float32", "bfloat16", "float16")
ROPE_KINDS = ("linear", "llama3")
# The MLP's activation: SiLU (SwiGLU: Llama, Mistral, Qwen), GELU with the tanh approximation
# (GeGLU: Gemma, transformers' "gelu_pytorch_tanh"), exact GELU (MPT).
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
NORM_TYPES = ("rms", "layer")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling for long contexts.

  ``kind="linear"``: every frequency divided by ``factor`` (positions
  interpolated). ``kind="llama3"``: Llama 3.1's piecewise rule: wavelengths
  longer than ``original_max_position_embeddings / low_freq_factor`` are
  divided by ``factor``, shorter than ``... / high_freq_factor`` kept, and
  interpolated smoothly in between (see :func:`models.model.rope.inverse_frequencies`).
  """

  kind: str
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.kind not in ROPE_KINDS:
      raise ValueError(f"RopeScaling: kind must be one of {ROPE_KINDS}; got {self.kind!r}")
    if not self.factor > 0:
      raise ValueError(f"RopeScaling: factor must be > 0; got {self.factor}")
    if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError("RopeScaling: llama3 scaling needs high_freq_factor > low_freq_factor; got "
                       f"{self.high_freq_factor} <= {self.low_freq_factor}")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Hyperparameters of a Llama-family decoder.

  Attributes:
    vocab_size, hidden_size, num_layers, intermediate_size: the model sizes.
    num_heads: query heads Hq; num_kv_heads: key/value heads Hkv
      (``Hq % Hkv == 0``: MHA ``Hkv = Hq``, GQA, MQA ``Hkv = 1``).
    head_dim: per-head size D (default ``hidden_size // num_heads``).
    rms_norm_eps: the norms' epsilon (RMSNorm's; LayerNorm's with ``norm_type="layer"``).
    rope_theta: RoPE base; rope_scaling: optional :class:`RopeScaling`.
    rope_freq_factors: optional per-frequency divisors (``head_dim // 2``
      floats), as llama.cpp stores Llama 3.1 scaling (``rope_freqs.weight``).
    max_position_embeddings: the context length; generation refuses to go
      beyond it (raise it with :meth:`replace` for benchmarks on random weights).
    tie_word_embeddings: the output projection is the embedding (SmolLM2, small Qwens).
    qkv_bias: the q, k and v projections add a bias (Qwen2, Qwen2.5).
    qk_norm: an RMSNorm over ``head_dim`` (weights ``[head_dim]``, ``rms_norm_eps``) on every
      query and key head before RoPE (Qwen3).
    hidden_act: the MLP's activation, one of ``ACTIVATIONS``.
    gated_mlp: the MLP is ``down(act(gate(x)) * up(x))``; False: ``down(act(up(x)))`` (MPT).
    norm_type: ``"rms"`` (RMSNorm) or ``"layer"`` (LayerNorm with a weight and no bias: the
      mean subtracted too, statistics in float32; MPT).
    norm_plus_one: every RMSNorm scales by ``1 + weight``, the product in float32 and then
      cast (Gemma's RMSNorm; its weights start at zeros); False: ``weight`` times the
      normalized value cast to the dtype (Llama's).
    sandwich_norms: each layer also normalizes its attention and MLP outputs before adding
      them (``post_attention_layernorm``, ``post_feedforward_layernorm``) and its MLP input
      with ``pre_feedforward_layernorm`` (Gemma 2); False: ``post_attention_layernorm`` is
      the MLP's input norm (Llama).
    scale_embeddings: the embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to the
      dtype, as transformers does; Gemma).
    query_pre_attn_scalar: the attention scale is ``query_pre_attn_scalar ** -0.5``
      (Gemma 2); None: ``head_dim ** -0.5``.
    attn_logit_softcapping: scores become ``c * tanh(score / c)`` before the softmax
      (Gemma 2's attention soft-capping); None: off.
    final_logit_softcapping: the same on the output logits (Gemma 2); None: off.
    sliding_window: W: a query at position i of a sliding-window layer sees the keys at
      positions ``i - W < j <= i``; None: no layer has a window.
    layer_types: one of ``LAYER_TYPES`` per layer (transformers' ``layer_types``): which
      layers have the window; None with a ``sliding_window``: every layer.
    alibi_bias_max: ALiBi instead of RoPE (MPT): each head's scores get
      ``-slope * (i - j)`` for query position i and key position j, the slopes MPT's
      (:meth:`alibi_slopes`); None: RoPE.
    dtype: parameter and activation dtype, one of ``DTYPES``; logits are
      always float32.
    bos_token_id, eos_token_id: informational (the tokenizer is authoritative).
    name: a label for printing.
  """

  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  intermediate_size: int
  head_dim: Optional[int] = None
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: Optional[RopeScaling] = None
  rope_freq_factors: Optional[tuple[float, ...]] = None
  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  hidden_act: str = "silu"
  gated_mlp: bool = True
  norm_type: str = "rms"
  norm_plus_one: bool = False
  sandwich_norms: bool = False
  scale_embeddings: bool = False
  query_pre_attn_scalar: Optional[float] = None
  attn_logit_softcapping: Optional[float] = None
  final_logit_softcapping: Optional[float] = None
  sliding_window: Optional[int] = None
  layer_types: Optional[tuple[str, ...]] = None
  alibi_bias_max: Optional[float] = None
  dtype: str = "float32"
  bos_token_id: Optional[int] = None
  eos_token_id: Optional[int] = None
  name: str = ""

  def __post_init__(self):
    if self.head_dim is None:
      object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_heads, 1))
    if isinstance(self.rope_scaling, Mapping):
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
    if self.rope_freq_factors is not None:
      object.__setattr__(self, "rope_freq_factors", tuple(float(f) for f in self.rope_freq_factors))
    if self.layer_types is not None:
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "intermediate_size", "head_dim", "max_position_embeddings"):
      value = getattr(self, field)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"LlamaConfig: {field} must be a positive int; got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"LlamaConfig: num_heads ({self.num_heads}) must be a multiple of "
                       f"num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2 and self.alibi_bias_max is None:
      raise ValueError(f"LlamaConfig: head_dim must be even for RoPE; got {self.head_dim}")
    if self.dtype not in DTYPES:
      raise ValueError(f"LlamaConfig: dtype must be one of {DTYPES}; got {self.dtype!r}")
    if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
      raise ValueError(f"LlamaConfig: rope_freq_factors must hold head_dim // 2 = "
                       f"{self.head_dim // 2} values; got {len(self.rope_freq_factors)}")
    if self.hidden_act not in ACTIVATIONS:
      raise ValueError(f"LlamaConfig: hidden_act must be one of {ACTIVATIONS}; got "
                       f"{self.hidden_act!r}")
    if self.norm_type not in NORM_TYPES:
      raise ValueError(f"LlamaConfig: norm_type must be one of {NORM_TYPES}; got "
                       f"{self.norm_type!r}")
    for field in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                  "alibi_bias_max"):
      value = getattr(self, field)
      if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
        raise ValueError(f"LlamaConfig: {field} must be a finite number > 0 or None; got "
                         f"{value!r}")
    if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                            or self.sliding_window < 1):
      raise ValueError(f"LlamaConfig: sliding_window must be a positive int or None; got "
                       f"{self.sliding_window!r}")
    if self.layer_types is not None:
      if len(self.layer_types) != self.num_layers or any(
          kind not in LAYER_TYPES for kind in self.layer_types):
        raise ValueError(f"LlamaConfig: layer_types must hold num_layers = {self.num_layers} "
                         f"values of {LAYER_TYPES}; got {self.layer_types!r}")
      if "sliding_attention" in self.layer_types and self.sliding_window is None:
        raise ValueError("LlamaConfig: layer_types has sliding_attention layers but "
                         "sliding_window is None")

  @property
  def param_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def attention_scale(self) -> float:
    """The factor of ``q . k`` in the scores."""
    return (self.head_dim if self.query_pre_attn_scalar is None
            else self.query_pre_attn_scalar) ** -0.5

  def local_window(self, layer: int) -> Optional[tuple[int, int]]:
    """``(left, right)`` keys a query of ``layer`` sees around its own position
    (``jax_shared_attn``'s ``local_window_size``), or None: every earlier key."""
    if self.sliding_window is None or (self.layer_types is not None
                                       and self.layer_types[layer] != "sliding_attention"):
      return None
    return (self.sliding_window - 1, 0)

  def alibi_slopes(self) -> Optional[tuple[float, ...]]:
    """One ALiBi slope per query head (MPT's rule: ``2 ** -(k * alibi_bias_max / n)`` for
    k = 1..n, n the power of two at or above ``num_heads``; with fewer heads, the odd k then
    the even ones, the first ``num_heads``), or None without ALiBi."""
    if self.alibi_bias_max is None:
      return None
    n = 1 << (self.num_heads - 1).bit_length()
    slopes = [2.0 ** -(k * self.alibi_bias_max / n) for k in range(1, n + 1)]
    if n != self.num_heads:
      slopes = (slopes[1::2] + slopes[::2])[:self.num_heads]
    return tuple(slopes)

  @property
  def num_params(self) -> int:
    """Parameter count (the tied output projection counted once)."""
    d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
    attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    if self.qkv_bias:
      attn += self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
    if self.qk_norm:
      attn += 2 * self.head_dim
    per_layer = attn + (3 if self.gated_mlp else 2) * d * f + (4 if self.sandwich_norms else 2) * d
    return self.num_layers * per_layer + v * d * (1 if self.tie_word_embeddings else 2) + d

  def replace(self, **changes: Any) -> "LlamaConfig":
    return dataclasses.replace(self, **changes)

  # -- serialisation ------------------------------------------------------------------------------

  def to_dict(self) -> dict:
    out = dataclasses.asdict(self)
    for field in ("rope_freq_factors", "layer_types"):
      if out[field] is not None:
        out[field] = list(out[field])
    return out

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "LlamaConfig":
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in known})

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], **overrides: Any) -> "LlamaConfig":
    """From a Hugging Face ``config.json`` dict (transformers 4.x or 5.x spelling).

    The family comes from ``model_type``/``architectures``
    (:func:`models.model.families.hf_family`: an unsupported one raises
    :class:`models.model.families.Unsupported`, listing the supported ones); its sliding
    window (:func:`models.model.families.window_fields`) becomes ``sliding_window`` and
    ``layer_types``. :func:`models.model.families.hf_fields` fills the keys the file
    leaves out with the family's defaults and translates MPT's spelling.
    transformers 5 writes ``rope_parameters = {"rope_type", "rope_theta", ...}``;
    older files write ``rope_theta`` and ``rope_scaling = {"type"|"rope_type", ...}``.
    """
    family = families.hf_family(hf)
    hf = families.hf_fields(family, hf)
    for flag in ("attention_bias", "mlp_bias"):  # Qwen2's q/k/v biases are its family's own
      if hf.get(flag):
        raise ValueError(f"LlamaConfig.from_hf: {flag}=true is not supported ({family.name} with "
                         f"biases on every projection; only Qwen2's q/k/v biases are)")
    if hf.get("use_bidirectional_attention"):
      raise ValueError(f"LlamaConfig.from_hf: use_bidirectional_attention=true is not supported "
                       f"({family.name}: the decoder is causal)")
    act_key = "hidden_activation" if "hidden_activation" in hf else "hidden_act"
    act = HF_ACTIVATIONS.get(hf.get(act_key, "silu"))
    if act is None:
      raise ValueError(f"LlamaConfig.from_hf: {act_key} must be one of {sorted(HF_ACTIVATIONS)}; "
                       f"got {hf[act_key]!r}")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
      scaling = None
    elif kind in ROPE_KINDS:
      scaling = RopeScaling(
          kind=kind, factor=float(rope["factor"]),
          low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
          high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
          original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)))
    else:
      raise ValueError(f"LlamaConfig.from_hf: rope type {kind!r} is not supported "
                       f"(supported: default, {', '.join(ROPE_KINDS)})")
    heads = int(hf["num_attention_heads"])
    eos = hf.get("eos_token_id")
    torch_dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    fields = dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        intermediate_size=int(hf["intermediate_size"]),
        head_dim=hf.get("head_dim") or int(hf["hidden_size"]) // heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        hidden_act=act,
        norm_plus_one=family.norm_plus_one,
        sandwich_norms=family.sandwich_norms,
        scale_embeddings=family.scale_embeddings,
        query_pre_attn_scalar=_optional_float(hf.get("query_pre_attn_scalar")),
        attn_logit_softcapping=_optional_float(hf.get("attn_logit_softcapping")),
        final_logit_softcapping=_optional_float(hf.get("final_logit_softcapping")),
        gated_mlp=family.gated_mlp,
        norm_type=family.norm_type,
        alibi_bias_max=_optional_float(hf.get("alibi_bias_max")),
        dtype=torch_dtype if torch_dtype in DTYPES else "float32",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        name=str(hf.get("_name_or_path", "")),
    )
    fields.update(families.window_fields(family, hf))
    fields.update(overrides)
    return cls(**fields)


# transformers' activation names -> ours (``LlamaConfig.hidden_act``).
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _optional_float(value: Any) -> Optional[float]:
  return None if value is None else float(value)


# -- presets: the shapes of published checkpoints (weights come from loading or random init) ------

_LLAMA_7B = dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                 intermediate_size=11008, rms_norm_eps=1e-5)
_LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                  num_kv_heads=8, intermediate_size=14336, rms_norm_eps=1e-5, rope_theta=500000.0,
                  bos_token_id=128000, eos_token_id=128001)

PRESETS: dict[str, LlamaConfig] = {
    # Tiny: CI and tests (GQA 2:1, every code path, compiles in seconds on a CPU).
    "tiny": LlamaConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=128, max_position_embeddings=1024, name="tiny"),
    "smollm2-135m": LlamaConfig(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                                num_kv_heads=3, intermediate_size=1536, rope_theta=100000.0,
                                max_position_embeddings=8192, tie_word_embeddings=True,
                                bos_token_id=1, eos_token_id=2, name="smollm2-135m"),
    "llama-2-7b": LlamaConfig(vocab_size=32000, **_LLAMA_7B, max_position_embeddings=4096,
                              bos_token_id=1, eos_token_id=2, name="llama-2-7b"),
    "llama-3-8b": LlamaConfig(**_LLAMA3_8B, max_position_embeddings=8192, name="llama-3-8b"),
    "llama-3.1-8b": LlamaConfig(**_LLAMA3_8B, max_position_embeddings=131072,
                                rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
                                name="llama-3.1-8b"),
    "codellama-7b": LlamaConfig(vocab_size=32016, **_LLAMA_7B, rope_theta=1e6,
                                max_position_embeddings=16384, bos_token_id=1, eos_token_id=2,
                                name="codellama-7b"),
    "codellama-13b": LlamaConfig(vocab_size=32016, hidden_size=5120, num_layers=40, num_heads=40,
                                 num_kv_heads=40, intermediate_size=13824, rms_norm_eps=1e-5,
                                 rope_theta=1e6, max_position_embeddings=16384, bos_token_id=1,
                                 eos_token_id=2, name="codellama-13b"),
    "mistral-7b-v0.3": LlamaConfig(vocab_size=32768, hidden_size=4096, num_layers=32,
                                   num_heads=32, num_kv_heads=8, intermediate_size=14336,
                                   rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=32768,
                                   bos_token_id=1, eos_token_id=2, name="mistral-7b-v0.3"),
    "qwen2.5-0.5b": LlamaConfig(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14,
                                num_kv_heads=2, intermediate_size=4864, rms_norm_eps=1e-6,
                                rope_theta=1e6, max_position_embeddings=32768,
                                tie_word_embeddings=True, qkv_bias=True, eos_token_id=151643,
                                name="qwen2.5-0.5b"),
    "qwen3-0.6b": LlamaConfig(vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16,
                              num_kv_heads=8, head_dim=128, intermediate_size=3072,
                              rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                              tie_word_embeddings=True, qk_norm=True, bos_token_id=151643,
                              eos_token_id=151645, name="qwen3-0.6b"),
    "gemma-2-2b": LlamaConfig(vocab_size=256000, hidden_size=2304, num_layers=26, num_heads=8,
                              num_kv_heads=4, head_dim=256, intermediate_size=9216,
                              rms_norm_eps=1e-6, max_position_embeddings=8192,
                              tie_word_embeddings=True, hidden_act="gelu_tanh",
                              norm_plus_one=True, sandwich_norms=True, scale_embeddings=True,
                              query_pre_attn_scalar=256.0, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0, sliding_window=4096,
                              layer_types=("sliding_attention", "full_attention") * 13,
                              bos_token_id=2, eos_token_id=1, name="gemma-2-2b"),
}


def preset(name: str, **changes: Any) -> LlamaConfig:
  """The named preset (see ``PRESETS``), with optional field changes."""
  if name not in PRESETS:
    raise ValueError(f"preset: name must be one of {', '.join(sorted(PRESETS))}; got {name!r}")
  return PRESETS[name].replace(**changes) if changes else PRESETS[name]
