"""The model families the decoder runs, and how a checkpoint names them.

Every family is the Llama decoder with some extra pieces, each a field of
:class:`models.model.config.LlamaConfig`: ``qkv_bias`` (biases on the q, k and v projections:
Qwen2, Qwen2.5), ``qk_norm`` (an RMSNorm over ``head_dim`` of every query and key head
before RoPE: Qwen3), and Gemma 2's: ``norm_plus_one`` and ``sandwich_norms`` (its RMSNorm and
its four norms per layer), ``scale_embeddings``, the GELU-tanh MLP (``hidden_act``), the
attention scale ``query_pre_attn_scalar``, soft-capping of the attention scores and of the
output logits, and sliding-window attention on every other layer (``sliding_window``,
``layer_types``, which also carry Mistral's and Qwen's windows); and MPT's: LayerNorm (``norm_type``), an ungated GELU MLP (``gated_mlp``,
``hidden_act``) and ALiBi instead of RoPE (``alibi_bias_max``), its ``config.json`` in its own
spelling (:func:`hf_fields`). Mistral is Llama with its sliding window. A Hugging Face
``config.json`` names its family by ``model_type`` (and ``architectures``); a GGUF file by
``general.architecture`` (llama.cpp's names: Mistral is written as ``llama``).

    >>> hf_family({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}).name
    'qwen2'
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional


@dataclasses.dataclass(frozen=True)
class Family:
  """One architecture: how checkpoints name it and what it adds to Llama.

  Attributes:
    name: our name (``"qwen2"``); also transformers' ``model_type``.
    architectures: transformers' causal-LM class names in ``config.json``.
    gguf_architecture: llama.cpp's ``general.architecture``, or None (no GGUF of its own).
    qkv_bias: the q, k and v projections have biases.
    qk_norm: RMSNorm (weights ``[head_dim]``) on each query and key head before RoPE.
    gguf_rope_permuted: llama.cpp's converter permutes the q/k rows (its RoPE pairs adjacent
      dimensions for this architecture); loading undoes it.
    window_keys: how ``config.json`` turns a sliding window on: ``"always"`` (a non-null
      ``sliding_window``), ``"per_layer"`` (``layer_types``, or ``use_sliding_window`` from
      ``max_window_layers`` on), ``"alternating"`` (``layer_types``, else the even layers:
      Gemma 2's rule in transformers), None (the family has no window).
    norm_plus_one, sandwich_norms, scale_embeddings, gated_mlp, norm_type: the
      :class:`models.model.config.LlamaConfig` fields of the same names (Gemma 2, MPT).
    hf_defaults: ``(key, value)`` pairs transformers' config class assumes when
      ``config.json`` leaves the key out.
    models: the published models it covers (for messages and docs).
  """

  name: str
  architectures: tuple[str, ...]
  gguf_architecture: Optional[str]
  qkv_bias: bool = False
  qk_norm: bool = False
  gguf_rope_permuted: bool = False
  window_keys: Optional[str] = None
  norm_plus_one: bool = False
  sandwich_norms: bool = False
  scale_embeddings: bool = False
  gated_mlp: bool = True
  norm_type: str = "rms"
  hf_defaults: tuple[tuple[str, Any], ...] = ()
  models: str = ""


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM",), "llama", gguf_rope_permuted=True,
           models="Llama 2, Llama 3.x, CodeLlama, SmolLM2"),
    Family("mistral", ("MistralForCausalLM",), None, gguf_rope_permuted=True,
           window_keys="always", models="Mistral"),
    Family("qwen2", ("Qwen2ForCausalLM",), "qwen2", qkv_bias=True, window_keys="per_layer",
           models="Qwen2, Qwen2.5"),
    Family("qwen3", ("Qwen3ForCausalLM",), "qwen3", qk_norm=True, window_keys="per_layer",
           models="Qwen3"),
    # transformers' Gemma2Config defaults (a config.json written by transformers has every key).
    Family("gemma2", ("Gemma2ForCausalLM",), "gemma2", window_keys="alternating",
           norm_plus_one=True, sandwich_norms=True, scale_embeddings=True,
           hf_defaults=(("hidden_activation", "gelu_pytorch_tanh"), ("head_dim", 256),
                        ("query_pre_attn_scalar", 256), ("sliding_window", 4096),
                        ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
                        ("tie_word_embeddings", True), ("rms_norm_eps", 1e-6),
                        ("max_position_embeddings", 8192)),
           models="Gemma 2"),
    # (MosaicML's own config.json names the class MPTForCausalLM.)
    Family("mpt", ("MptForCausalLM", "MPTForCausalLM"), "mpt", gated_mlp=False, norm_type="layer",
           models="MPT"),
)
BY_NAME = {f.name: f for f in FAMILIES}


class Unsupported(ValueError):
  """A checkpoint the decoder cannot run: an architecture no family covers (the message lists
  the supported ones), or an option of its family the decoder does not run (named)."""


def supported() -> str:
  """One line naming every family, its transformers class and its GGUF architecture."""
  parts = []
  for f in FAMILIES:
    gguf = (f"GGUF {f.gguf_architecture}" if f.gguf_architecture
            else "GGUF as llama" if f.gguf_rope_permuted else "no GGUF")
    parts.append(f"{f.architectures[0]} (model_type {f.name}, {gguf}: {f.models})")
  return "; ".join(parts)


def hf_family(hf: Mapping[str, Any]) -> Family:
  """The family of a transformers ``config.json`` (by ``model_type``, else ``architectures``;
  without either, Llama). Every class in ``architectures`` must be the family's causal LM."""
  model_type, archs = hf.get("model_type"), list(hf.get("architectures") or ())
  if model_type is not None:
    family = BY_NAME.get(model_type)
  elif archs:
    family = next((f for f in FAMILIES if archs[0] in f.architectures), None)
  else:
    family = BY_NAME["llama"]
  if family is None or any(a not in family.architectures for a in archs):
    raise Unsupported(
        f"config.json: model_type {model_type!r} with architectures {archs} is not supported; "
        f"supported: {supported()}")
  return family


def gguf_family(architecture: Any) -> Family:
  """The family of a GGUF file's ``general.architecture``."""
  family = next((f for f in FAMILIES if f.gguf_architecture == architecture), None)
  if family is None:
    raise Unsupported(
        f"GGUF: general.architecture {architecture!r} is not supported; supported: "
        + ", ".join(f"{f.gguf_architecture} ({f.models}"
                    + (", Mistral" if f.name == "llama" else "") + ")"
                    for f in FAMILIES if f.gguf_architecture))
  return family


def hf_fields(family: Family, hf: Mapping[str, Any]) -> dict[str, Any]:
  """``config.json`` in Llama's spelling (``hidden_size``, ``num_attention_heads``, ...), the
  family's ``hf_defaults`` filling the keys it leaves out; MPT's keys (``d_model``,
  ``n_heads``, ``attn_config``, ...) translated. Raises :class:`Unsupported` for MPT options
  the decoder does not run."""
  hf = {**dict(family.hf_defaults), **hf}
  if family.name != "mpt":
    return hf
  attn = dict(hf.get("attn_config") or {})
  refused = {"attn_config.alibi": not attn.get("alibi", False),
             "attn_config.attn_type": attn.get("attn_type",
                                               "multihead_attention") != "multihead_attention",
             "attn_config.clip_qkv": attn.get("clip_qkv") is not None,
             "attn_config.softmax_scale": attn.get("softmax_scale") is not None,
             "attn_config.qk_ln": bool(attn.get("qk_ln")),
             "attn_config.prefix_lm": bool(attn.get("prefix_lm")),
             "no_bias": not hf.get("no_bias", True),
             "logit_scale": hf.get("logit_scale") is not None}
  bad = [f"{key}={attn.get(key.split('.')[-1]) if '.' in key else hf.get(key)!r}"
         for key, on in refused.items() if on]
  if bad:
    raise Unsupported(f"config.json: MPT with {', '.join(bad)} is not supported (the decoder "
                      f"runs MPT with ALiBi and without biases, q/k clipping, q/k LayerNorm, a "
                      f"custom softmax scale, logit scaling or a prefix LM)")
  d = int(hf["d_model"])
  return {**hf, "hidden_size": d, "num_attention_heads": int(hf["n_heads"]),
          "num_hidden_layers": int(hf["n_layers"]),
          "intermediate_size": int(hf.get("expansion_ratio", 4)) * d,
          "max_position_embeddings": int(hf.get("max_seq_len", 2048)),
          "rms_norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
          "hidden_act": "gelu", "tie_word_embeddings": True,
          "alibi_bias_max": float(attn.get("alibi_bias_max", 8))}


def window_layers(family: Family, hf: Mapping[str, Any]) -> list[int]:
  """The layers ``config.json`` gives a sliding window (none without ``sliding_window``)."""
  if family.window_keys is None or hf.get("sliding_window") is None:
    return []
  layers = int(hf["num_hidden_layers"])
  if family.window_keys == "always":
    return list(range(layers))
  if hf.get("layer_types") is not None:
    return [i for i, kind in enumerate(hf["layer_types"]) if kind == "sliding_attention"]
  if family.window_keys == "alternating":
    return list(range(0, layers, 2))
  if hf.get("use_sliding_window"):
    return list(range(int(hf.get("max_window_layers", 0)), layers))
  return []


def window_fields(family: Family, hf: Mapping[str, Any]) -> dict[str, Any]:
  """``LlamaConfig``'s ``sliding_window`` and ``layer_types`` for ``config.json``'s window, or
  nothing where no layer has one or the window is at least ``max_position_embeddings`` long
  (a query at position i sees keys j with ``i - j < window``: then every key)."""
  windowed = set(window_layers(family, hf))
  window = hf.get("sliding_window")
  if not windowed or int(window) >= int(hf.get("max_position_embeddings", 2048)):
    return {}
  layers = int(hf["num_hidden_layers"])
  return dict(sliding_window=int(window), layer_types=tuple(
      "sliding_attention" if i in windowed else "full_attention" for i in range(layers)))
