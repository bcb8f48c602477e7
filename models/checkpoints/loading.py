"""Checkpoints: Hugging Face safetensors directories, GGUF files, orbax save/restore.

    >>> model, tokenizer, config = from_pretrained("path/to/SmolLM2-135M-Instruct.Q4_1.gguf")
    >>> model, tokenizer, config = from_pretrained("path/to/hf_dir", dtype="bfloat16")
    >>> save_pretrained("converted/", model, tokenizer)    # orbax; from_pretrained reads it back
    >>> model, tokenizer, config = from_pretrained("path/to/hf_dir", mesh=(2, 4))  # on 8 devices

Every format is first turned into a dict of NumPy arrays under transformers'
parameter names (``model.layers.3.self_attn.q_proj.weight``, ``[out, in]``),
then :func:`model_from_tensors` places them into the NNX model, checking
every name and shape, each projection transposed to our ``[in, out]``
(:mod:`models.model.llama`); :func:`hf_tensors` is the way back. Nothing is ever downloaded. With ``mesh=`` every tensor
goes to its shards (:mod:`models.parallel.sharding`) as it is read: ``jax.device_put``
of the host array with its ``NamedSharding`` sends each device its block
only, so no device ever holds a whole copy it does not need.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.parallel import sharding as sharding_lib
from models.model import families
from models.model.config import LlamaConfig
from models.model.llama import CHECKPOINT_PERMS, Llama, build, flat_params
from models.checkpoints.tokenizer import Tokenizer

HYDRAGEN_CONFIG = "hydragen_config.json"
ORBAX_PARAMS = "params"


class CheckpointError(ValueError):
  """A checkpoint that cannot be read: missing, unreadable or malformed (the message starts with its path)."""


class Pretrained(NamedTuple):
  """What :func:`from_pretrained` returns (unpacks as ``model, tokenizer, config``)."""

  model: Llama
  tokenizer: Optional[Tokenizer]
  config: LlamaConfig


class LazyTensor:
  """A checkpoint tensor read in blocks: ``read(*slices)`` -> the NumPy block.

  ``shape`` is the tensor's shape in the file (transformers' ``[out, in]``, or
  1-D). ``np.asarray`` reads it whole; :meth:`reader` serves blocks of a
  reshaped view (our parameter layout), block by block for the devices that hold it.
  ``whole(transpose)``, where the format has it, reads the whole tensor (``transpose``: as
  ``[in, out]``) into a new aligned C-ordered array: :meth:`in_layout` uses it.
  """

  def __init__(self, shape: Sequence[int], read: Callable[..., np.ndarray],
               whole: Optional[Callable[[bool], np.ndarray]] = None):
    self.shape = tuple(int(n) for n in shape)
    self.read = read
    self.whole = whole

  def in_layout(self, view: Sequence[int], perm: Sequence[int]) -> np.ndarray:
    """The whole tensor as ``reshape(view).transpose(perm)``: with ``whole``, written in that
    order once when the permutation keeps or swaps the file's two dimensions (every
    parameter of ours), else a strided view of the tensor read whole."""
    view, perm = tuple(int(n) for n in view), tuple(int(i) for i in perm)
    shape = tuple(view[i] for i in perm)
    if self.whole is not None:
      if perm == tuple(range(len(view))):
        return self.whole(False).reshape(shape)
      split = next((k for k in range(1, len(view))
                    if int(np.prod(view[:k])) == self.shape[0]), None)
      if (len(self.shape) == 2 and split is not None
          and perm == tuple(range(split, len(view))) + tuple(range(split))):
        return self.whole(True).reshape(shape)
    return np.asarray(self).reshape(view).transpose(perm)

  def __array__(self, dtype=None, copy=None):
    x = np.asarray(self.read(*(slice(0, n) for n in self.shape)))
    return x if dtype is None else x.astype(dtype)

  def reader(self, shape: Sequence[int]) -> Callable[[tuple], np.ndarray]:
    """``read(index)`` for the view of this tensor reshaped to ``shape``.

    Each file dimension is a run of consecutive dimensions of ``shape``
    (``[H * D, hidden]`` -> ``[H, D, hidden]``). A block reads the file rows
    (columns) of whole units of the run's first dimension, e.g. whole heads,
    then takes the rest of the index in memory.
    """
    shape, groups, size = tuple(int(n) for n in shape), [], None
    for dim, n in enumerate(shape):
      if size is None:  # the next file dimension starts here
        groups.append([])
        size = 1
      groups[-1].append(dim)
      size *= n
      if len(groups) <= len(self.shape) and size == self.shape[len(groups) - 1]:
        size = None
    if size is not None or [int(np.prod([shape[d] for d in g])) for g in groups] != list(self.shape):
      raise ValueError(f"LazyTensor: shape {shape} is not a view of the file's {self.shape}")

    def read(index: tuple) -> np.ndarray:
      ranges, view, rest = [], [], []
      for group in groups:
        lead, tail = index[group[0]], [shape[d] for d in group[1:]]
        unit = int(np.prod(tail, dtype=np.int64))
        ranges.append(slice(lead.start * unit, lead.stop * unit))
        view += [lead.stop - lead.start, *tail]
        rest += [slice(None)] + [index[d] for d in group[1:]]
      return np.asarray(self.read(*ranges)).reshape(view)[tuple(rest)]

    return read


def from_pretrained(path: str, *, dtype: Optional[str] = None, progress: bool = False,
                    mesh=None) -> Pretrained:
  """Loads a model (any family of :mod:`models.model.families`), its tokenizer and config.

  Args:
    path: one of
      * a Hugging Face directory: ``config.json`` + ``model.safetensors`` (or
        a sharded ``model.safetensors.index.json``), ``tokenizer.json``;
      * a ``.gguf`` file (llama.cpp); quantized tensors are dequantized;
      * a directory written by :func:`save_pretrained` (orbax).
    dtype: parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``);
      default: the checkpoint's own (``torch_dtype``), float32 for GGUF.
    progress: show a tqdm bar while reading tensors.
    mesh: place every tensor on its shards of this device mesh as it is read
      (``(data, model)``, ``"auto"`` or a Mesh: :func:`models.parallel.sharding.make_mesh`);
      the returned config then has the KV heads the mesh needs
      (:func:`models.parallel.sharding.sharded_config`). None: the default device.

  Returns:
    ``Pretrained(model, tokenizer, config)``; ``tokenizer`` is None when the
    checkpoint has none.

  Raises:
    CheckpointError: ``path`` is missing, unreadable or not a valid checkpoint, or its
      architecture is not one of :mod:`models.model.families` (the message lists them).
  """
  path = os.fspath(path)
  if not os.path.exists(path):
    raise CheckpointError(f"{path}: no such file or directory (a .gguf file or a checkpoint "
                          "directory is needed; this is neither)")
  try:
    return _from_pretrained(path, dtype=dtype, progress=progress, mesh=mesh)
  except CheckpointError:
    raise
  except families.Unsupported as e:  # readable, but not a model we run: say which ones we do
    raise CheckpointError(f"{path}: {e}") from e
  except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
    # gguf, safetensors and json report a damaged file in their own words; name the file.
    raise _unreadable(path, e) from e
  except Exception as e:  # e.g. safetensors' SafetensorError (a plain Exception)
    if type(e).__module__.split(".")[0] not in ("safetensors", "gguf", "json"):
      raise
    raise _unreadable(path, e) from e


def _unreadable(path: str, e: Exception) -> CheckpointError:
  kind = "GGUF file" if path.endswith(".gguf") and os.path.isfile(path) else "checkpoint"
  detail = " ".join(str(e).split()) or type(e).__name__
  return CheckpointError(f"{path}: not a readable {kind} ({type(e).__name__}: {detail[:300]})")


def _from_pretrained(path: str, *, dtype, progress, mesh) -> Pretrained:
  if os.path.isfile(path) and path.endswith(".gguf"):
    return load_gguf(path, dtype=dtype, progress=progress, mesh=mesh)
  if not os.path.isdir(path):
    raise ValueError(f"from_pretrained: path must be a .gguf file or a checkpoint directory; "
                     f"{path!r} is neither")
  if os.path.exists(os.path.join(path, HYDRAGEN_CONFIG)):
    return restore(path, dtype=dtype, mesh=mesh)
  if os.path.exists(os.path.join(path, "config.json")):
    return load_hf(path, dtype=dtype, progress=progress, mesh=mesh)
  raise ValueError(f"from_pretrained: {path!r} has no config.json (Hugging Face) or "
                   f"{HYDRAGEN_CONFIG} (save_pretrained)")


# -- placing tensors into the model -------------------------------------------------------------

class Slot(NamedTuple):
  """Where a checkpoint tensor goes: our ``path``; ``view``, the file's ``[out, in]`` tensor
  with its heads split out (a reshape); our layout is ``view.transpose(perm)``."""

  path: str
  view: tuple[int, ...]
  perm: tuple[int, ...]

  @property
  def shape(self) -> tuple[int, ...]:
    """Our parameter's shape."""
    return tuple(self.view[i] for i in self.perm)


def _layer_slots(c: LlamaConfig) -> dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]]:
  """HF suffix -> (module path inside a layer, the file's view, the permutation to ours)."""
  h, d = c.hidden_size, c.head_dim
  views = {"self_attn.q_proj": (c.num_heads, d, h), "self_attn.k_proj": (c.num_kv_heads, d, h),
           "self_attn.v_proj": (c.num_kv_heads, d, h), "self_attn.o_proj": (h, c.num_heads, d),
           "mlp.gate_proj": (c.intermediate_size, h), "mlp.up_proj": (c.intermediate_size, h),
           "mlp.down_proj": (h, c.intermediate_size)}
  if not c.gated_mlp:
    del views["mlp.gate_proj"]
  slots = {f"{path}.weight": (path, view, CHECKPOINT_PERMS[path]) for path, view in views.items()}
  norms = ["input_layernorm", "post_attention_layernorm"]
  if c.sandwich_norms:
    norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
  for norm in norms:
    slots[f"{norm}.weight"] = (f"{norm}.weight", (h,), (0,))
  if c.qkv_bias:  # the file's [H * D] as our [H, D]
    for x, heads in (("q", c.num_heads), ("k", c.num_kv_heads), ("v", c.num_kv_heads)):
      slots[f"self_attn.{x}_proj.bias"] = (f"self_attn.{x}_bias", (heads, d), (0, 1))
  if c.qk_norm:
    for norm in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
      slots[norm] = (norm, (d,), (0,))
  return slots


def hf_name_map(config: LlamaConfig) -> dict[str, Slot]:
  """transformers' tensor names -> :class:`Slot` (our parameter path, the file's view, the
  permutation from it to our layout)."""
  v, h = config.vocab_size, config.hidden_size
  names = {"model.embed_tokens.weight": Slot("embed_tokens", (v, h), (0, 1)),
           "model.norm.weight": Slot("norm.weight", (h,), (0,))}
  if not config.tie_word_embeddings:
    names["lm_head.weight"] = Slot("lm_head", (v, h), (0, 1))
  for i in range(config.num_layers):
    for suffix, (path, view, perm) in _layer_slots(config).items():
      names[f"model.layers.{i}.{suffix}"] = Slot(f"layers.{i}.{path}", view, perm)
  return names


def hf_tensors(params: Mapping[str, Any], config: LlamaConfig) -> dict[str, np.ndarray]:
  """transformers-named ``[out, in]`` NumPy tensors of ``params`` (:func:`models.model.llama.flat_params`):
  what :func:`model_from_tensors` reads back into the same model."""
  out = {}
  for name, slot in hf_name_map(config).items():
    x = np.asarray(params[slot.path]).transpose(np.argsort(slot.perm))  # the file's view
    rows = x.shape[0] * x.shape[1] if slot.perm == (2, 0, 1) else x.shape[0]
    out[name] = np.ascontiguousarray(x.reshape(-1) if name.endswith(".bias")
                                     else x.reshape(rows, -1) if x.ndim > 1 else x)
  return out


def _our_block(read: Callable[[tuple], np.ndarray], perm: tuple[int, ...]):
  """``read`` of blocks of the file's view -> ``read`` of blocks of our layout."""
  inverse = tuple(int(i) for i in np.argsort(perm))
  return lambda index: np.asarray(read(tuple(index[j] for j in inverse))).transpose(perm)


def model_from_tensors(config: LlamaConfig,
                       tensors: Union[Mapping[str, Any], Iterable[tuple[str, Any]]], *,
                       dtype: Optional[str] = None, mesh=None) -> Llama:
  """Builds a :class:`Llama` from transformers-named tensors (``[out, in]`` each).

  ``tensors``: a mapping, or an iterable of ``(name, array)`` pairs consumed
  one at a time (each tensor is converted, and with ``mesh`` placed on its
  shards, before the next is read); a :class:`LazyTensor` is read, with
  ``mesh``, only in the blocks this process's devices hold. Raises ValueError naming any missing,
  unexpected or mis-shaped tensor. ``lm_head.weight`` is ignored when the
  embeddings are tied.
  """
  if dtype is not None:
    config = config.replace(dtype=str(jnp.dtype(dtype)))
  names = hf_name_map(config)
  if mesh is not None:
    mesh = sharding_lib.make_mesh(mesh)
  items = tensors.items() if isinstance(tensors, Mapping) else tensors
  values, seen, extra = {}, set(), []
  for name, t in items:
    if name not in names:
      if name != "lm_head.weight" and not name.endswith("rotary_emb.inv_freq"):
        extra.append(name)
      continue
    path, view, perm = slot = names[name]
    if int(np.prod(t.shape)) != int(np.prod(view)):
      raise ValueError(f"model_from_tensors: {name} has shape {tuple(t.shape)}; the config needs "
                       f"{int(np.prod(view))} values, as {view}")
    if mesh is not None and isinstance(t, LazyTensor):  # each process reads only its blocks
      values[path] = sharding_lib.place_param_from(
          path, slot.shape, _our_block(t.reader(view), perm), config, mesh)
    else:  # our layout: written so by the reader, or a strided view that the copy converting
      # or placing it transposes
      value = (t.in_layout(view, perm) if isinstance(t, LazyTensor)
               else np.asarray(t).reshape(view).transpose(perm))
      values[path] = value if mesh is None else sharding_lib.place_param(path, value, config, mesh)
    seen.add(name)
  missing, extra = sorted(set(names) - seen), sorted(extra)
  if missing or extra:
    raise ValueError(f"model_from_tensors: tensors do not match the config ({config.name or 'llama'}"
                     f", {config.num_layers} layers): missing {missing[:5]}{'...' * (len(missing) > 5)}"
                     f", unexpected {extra[:5]}{'...' * (len(extra) > 5)}")
  return build(config if mesh is None else sharding_lib.sharded_config(config, mesh), values)


# -- Hugging Face directories -------------------------------------------------------------------

def load_hf(path: str, *, dtype: Optional[str] = None, progress: bool = False,
            mesh=None) -> Pretrained:
  """A transformers checkpoint directory (safetensors, single file or sharded)."""
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  config = LlamaConfig.from_hf(hf)
  if dtype is not None:
    config = config.replace(dtype=str(jnp.dtype(dtype)))
  tensors = read_safetensors_dir(path)
  if families.hf_family(hf).name == "mpt":
    tensors = mpt_tensors(tensors)
  tensors = _iter_progress(tensors, progress, "loading tensors", total=None)
  model = model_from_tensors(config, tensors, mesh=mesh)  # one tensor at a time
  tokenizer = (Tokenizer.from_dir(path)
               if os.path.exists(os.path.join(path, "tokenizer.json")) else None)
  return Pretrained(model, tokenizer, model.config)


def read_safetensors_dir(path: str) -> Iterable[tuple[str, "LazyTensor"]]:
  """Yields ``(name, LazyTensor)`` from ``model.safetensors`` or the sharded index's files.

  Each tensor is read with safetensors' ``get_slice`` (only the requested
  block leaves the file) while its file is open: use it before the next.
  """
  from safetensors import safe_open

  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  elif os.path.exists(os.path.join(path, "model.safetensors")):
    files = ["model.safetensors"]
  else:
    raise ValueError(f"from_pretrained: {path!r} has neither model.safetensors nor "
                     "model.safetensors.index.json (only safetensors checkpoints are read)")
  for file in files:
    with safe_open(os.path.join(path, file), framework="numpy") as f:
      for name in f.keys():
        part = f.get_slice(name)
        yield name, LazyTensor(part.get_shape(), lambda *ranges, part=part: part[ranges])


_MPT_NAMES = {"transformer.wte.weight": "model.embed_tokens.weight",
              "transformer.norm_f.weight": "model.norm.weight"}
_MPT_LAYER_NAMES = {"norm_1": "input_layernorm", "norm_2": "post_attention_layernorm",
                    "attn.out_proj": "self_attn.o_proj", "ffn.up_proj": "mlp.up_proj",
                    "ffn.down_proj": "mlp.down_proj"}


def mpt_tensors(tensors: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
  """An MPT checkpoint's tensors under transformers' Llama names: ``transformer.wte`` the
  embedding, ``blocks.{i}.norm_1``/``norm_2`` the two norms, ``attn.out_proj``,
  ``ffn.up_proj``/``down_proj``, and the fused ``attn.Wqkv [3 * hidden, hidden]`` as its three
  row blocks ``q_proj``, ``k_proj``, ``v_proj`` (each read from the file on its own)."""
  for name, t in tensors:
    if name in _MPT_NAMES:
      yield _MPT_NAMES[name], t
      continue
    m = re.fullmatch(r"transformer\.blocks\.(\d+)\.(.+)\.weight", name)
    if m is None:
      yield name, t  # (lm_head.weight: the tied copy, skipped later; others: reported)
      continue
    prefix, module = f"model.layers.{m.group(1)}", m.group(2)
    if module != "attn.Wqkv":
      yield f"{prefix}.{_MPT_LAYER_NAMES.get(module, module)}.weight", t
      continue
    rows = t.shape[0] // 3
    for i, x in enumerate("qkv"):
      read = lambda r, c, t=t, off=i * rows: t.read(slice(r.start + off, r.stop + off), c)
      yield f"{prefix}.self_attn.{x}_proj.weight", LazyTensor((rows, t.shape[1]), read)


# -- GGUF ---------------------------------------------------------------------------------------

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # Qwen3
}
# Gemma 2's four norms per layer: llama.cpp's ``ffn_norm`` is its pre-feedforward norm.
_GGUF_GEMMA2_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp's Gemma 2 attention scale is query_pre_attn_scalar ** -0.5 with the scalar
# hidden_size / heads for the 27B model (46 layers), head_dim for the others (src/llama-model.cpp:
# the GGUF does not store it); its soft-caps default to 50 and 30 when the file has none.
_GEMMA2_27B_LAYERS = 46
# llama.cpp's MPT names -> MPT's own (then :func:`mpt_tensors`, as for a safetensors file).
_GGUF_MPT_NAMES = {"token_embd.weight": "transformer.wte.weight",
                   "output_norm.weight": "transformer.norm_f.weight",
                   "output.weight": "lm_head.weight"}
_GGUF_MPT_LAYER_NAMES = {"attn_norm": "norm_1", "ffn_norm": "norm_2", "attn_qkv": "attn.Wqkv",
                         "attn_output": "attn.out_proj", "ffn_up": "ffn.up_proj",
                         "ffn_down": "ffn.down_proj"}


def gguf_config(fields: Mapping[str, Any], *, has_output: bool,
                rope_freq_factors=None) -> LlamaConfig:
  """The LlamaConfig a GGUF's ``{arch}.*`` metadata describes (``general.architecture``: one
  of :mod:`models.model.families`' GGUF architectures)."""
  arch = fields.get("general.architecture")
  family = families.gguf_family(arch)
  get = lambda key, default=None: fields.get(f"{arch}.{key}", default)
  heads = int(get("attention.head_count"))
  hidden = int(get("embedding_length"))
  layers = int(get("block_count"))
  head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden // heads)))
  gemma2 = {}
  if family.name == "gemma2":
    window = int(get("attention.sliding_window", 4096))
    gemma2 = dict(
        hidden_act="gelu_tanh", norm_plus_one=True, sandwich_norms=True, scale_embeddings=True,
        query_pre_attn_scalar=float(hidden // heads if layers == _GEMMA2_27B_LAYERS else head_dim),
        attn_logit_softcapping=float(get("attn_logit_softcapping", 50.0)),
        final_logit_softcapping=float(get("final_logit_softcapping", 30.0)))
    if window < int(get("context_length", 4096)):  # (else it hides no key, as from_hf drops it)
      gemma2.update(sliding_window=window, layer_types=tuple(  # llama.cpp's pattern: even layers
          "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)))
  mpt = {}
  if family.name == "mpt":
    alibi, clamp = float(get("attention.max_alibi_bias", 0.0)), get("attention.clamp_kqv")
    if alibi <= 0 or clamp is not None:
      raise families.Unsupported(
          f"GGUF: MPT with mpt.attention.max_alibi_bias={alibi}, mpt.attention.clamp_kqv="
          f"{clamp} is not supported (the decoder runs MPT with ALiBi and without q/k clipping)")
    mpt = dict(hidden_act="gelu", gated_mlp=False, norm_type="layer", alibi_bias_max=alibi)
  eps = get("attention.layer_norm_epsilon" if family.norm_type == "layer"
            else "attention.layer_norm_rms_epsilon", 1e-5)
  vocab = get("vocab_size") or len(fields["tokenizer.ggml.tokens"])
  scaling = None
  if get("rope.scaling.type") == "linear":
    from models.model.config import RopeScaling
    scaling = RopeScaling("linear", float(get("rope.scaling.factor")))
  elif get("rope.scaling.type") not in (None, "none"):
    raise ValueError(f"load_gguf: rope scaling {get('rope.scaling.type')!r} is not supported")
  return LlamaConfig(
      vocab_size=int(vocab), hidden_size=hidden, num_layers=layers,
      num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
      intermediate_size=int(get("feed_forward_length")), head_dim=head_dim,
      rms_norm_eps=float(eps),
      rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
      rope_freq_factors=rope_freq_factors,
      max_position_embeddings=int(get("context_length", 4096)),
      tie_word_embeddings=not has_output, qkv_bias=family.qkv_bias, qk_norm=family.qk_norm,
      dtype="float32",
      bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
      eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
      name=str(fields.get("general.name", "")), **gemma2, **mpt)


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row permutation (``convert_hf_to_gguf.py``'s ``permute``).

  llama.cpp rotates adjacent pairs (2i, 2i+1); transformers rotates (i, i+D/2).
  The converter reorders each head's rows from the second layout to the
  first; this puts them back: ``[H, D/2, 2, in] -> [H, 2, D/2, in]``.
  """
  out_dim = w.shape[0]
  return (w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def load_gguf(path: str, *, dtype: Optional[str] = None, progress: bool = False,
              mesh=None) -> Pretrained:
  """A llama.cpp GGUF file: hyperparameters and tokenizer from its metadata.

  The file is memory-mapped (:class:`models.checkpoints.gguf_reader.GGUFFile`): only the
  metadata read is decoded, and each weight is dequantized from the map straight into our
  layout (:func:`models.checkpoints.gguf_dequant.dequantize`), or with ``mesh`` block by block.
  """
  from models.checkpoints.gguf_reader import GGUFFile

  file = GGUFFile(path)
  by_name = dict(file.tensors)
  freq_factors = None
  if "rope_freqs.weight" in by_name:  # Llama 3.1 scaling, precomputed per frequency
    freq_factors = tuple(np.asarray(_dequantize(by_name.pop("rope_freqs.weight")), np.float64))
  config = gguf_config(file.fields, has_output="output.weight" in by_name,
                       rope_freq_factors=freq_factors)
  family = families.gguf_family(file.fields["general.architecture"])
  layer_names = _GGUF_GEMMA2_LAYER_NAMES if family.sandwich_norms else _GGUF_LAYER_NAMES

  if family.name == "mpt":  # MPT's own names, then its Wqkv split as from safetensors
    hf_name = lambda name: _hf_name(name, _GGUF_MPT_LAYER_NAMES, _GGUF_MPT_NAMES,
                                    "transformer.blocks")
  else:
    hf_name = lambda name: _hf_name(name, layer_names)

  def tensors():  # dequantized one at a time, each placed before the next is read
    for t in _iter_progress(by_name.values(), progress, "loading tensors", total=len(by_name)):
      name = hf_name(t.name)
      read, rows = functools.partial(_dequantize_block, t), None
      if family.gguf_rope_permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
        read = functools.partial(_unpermuted_block, read, config.head_dim)  # whole heads
        rows = _unpermuted_rows(t.data.shape[0], config.head_dim)
      whole = lambda transpose, t=t, rows=rows: _dequantize(t, transpose=transpose, rows=rows)
      if family.norm_plus_one and name.endswith("norm.weight"):
        # llama.cpp's converter stores Gemma's norm weights as 1 + w (its RMSNorm multiplies by
        # the weight); ours multiplies by 1 + w, so the weight is the stored value - 1.
        read = lambda *ranges, read=read: read(*ranges) - 1.0
        whole = lambda transpose, whole=whole: whole(transpose) - 1.0
      yield name, LazyTensor(tuple(int(n) for n in reversed(t.shape)), read, whole)

  stream = mpt_tensors(tensors()) if family.name == "mpt" else tensors()
  model = model_from_tensors(config, stream, dtype=dtype or "float32", mesh=mesh)
  return Pretrained(model, Tokenizer.from_gguf_fields(file.fields), model.config)


def _hf_name(gguf_name: str, layer_names: Mapping[str, str] = _GGUF_LAYER_NAMES,
             names: Mapping[str, str] = _GGUF_NAMES, layers: str = "model.layers") -> str:
  if gguf_name in names:
    return names[gguf_name]
  m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
  if m is None or m.group(2) not in layer_names:
    raise ValueError(f"load_gguf: unexpected tensor {gguf_name!r}")
  return f"{layers}.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"


def _dequantize_block(t, rows: slice, cols: Optional[slice] = None) -> np.ndarray:
  """float32 block ``[rows, cols]`` of a GGUF tensor ``[out, in]``, read from its memory map.

  Quantized rows are runs of fixed-size blocks (e.g. 32 values in 20 bytes
  for Q4_1): only the bytes of the blocks covering ``cols`` are read.
  """
  from models.checkpoints.gguf_dequant import dequantize_block

  return dequantize_block(t, rows, cols)


def _unpermuted_block(read, head_dim: int, rows: slice, cols: slice) -> np.ndarray:
  """:func:`unpermute_rope_rows` of a block of whole heads of q_proj or k_proj."""
  if rows.start % head_dim or rows.stop % head_dim:
    raise ValueError(f"load_gguf: rows [{rows.start}, {rows.stop}) of a q/k projection are not "
                     f"whole heads of {head_dim}")
  return unpermute_rope_rows(read(rows, cols), (rows.stop - rows.start) // head_dim)


def _unpermuted_rows(n_rows: int, head_dim: int) -> np.ndarray:
  """The file rows of :func:`unpermute_rope_rows`' output rows (an index: ``w[index]``)."""
  return unpermute_rope_rows(np.arange(n_rows), n_rows // head_dim)


def _dequantize(t, *, transpose: bool = False, rows: Optional[np.ndarray] = None) -> np.ndarray:
  """float32 ``[out, in]`` (NumPy order: GGUF lists dims fastest first), or ``[in, out]``."""
  from models.checkpoints.gguf_dequant import dequantize

  x = dequantize(t, transpose=transpose, rows=rows)
  return x if transpose else x.reshape(tuple(int(n) for n in reversed(t.shape)))


# -- orbax save / restore -------------------------------------------------------------------------

def save_pretrained(path: str, model: Llama, tokenizer: Optional[Tokenizer] = None) -> None:
  """Saves the parameters with orbax, the config (and tokenizer) as JSON, into ``path``."""
  import orbax.checkpoint as ocp

  path = os.path.abspath(os.fspath(path))
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, HYDRAGEN_CONFIG), "w") as f:
    f.write(model.config.to_json())
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.join(path, ORBAX_PARAMS), nnx.state(model), force=True)
  checkpointer.wait_until_finished()
  if tokenizer is not None:
    tokenizer.save(path)


def restore(path: str, *, dtype: Optional[str] = None, mesh=None) -> Pretrained:
  """Reads a directory written by :func:`save_pretrained` (with ``mesh``: into the shards)."""
  import orbax.checkpoint as ocp

  path = os.path.abspath(os.fspath(path))
  with open(os.path.join(path, HYDRAGEN_CONFIG)) as f:
    config = LlamaConfig.from_dict(json.load(f))
  graphdef, target = nnx.split(Llama(config, rngs=None))  # shapes from the config
  if mesh is not None:  # orbax reads each parameter straight into its shards
    mesh = sharding_lib.make_mesh(mesh)
    target = _sharded_target(target, config, mesh)
  checkpointer = ocp.StandardCheckpointer()
  # orbax fills a target of another shape with the file's values in their own order: a
  # checkpoint of the earlier [out, in] weights would load as garbage. Compare first.
  want = _shapes(nnx.to_pure_dict(target))
  stored = _shapes(getattr(checkpointer.metadata(os.path.join(path, ORBAX_PARAMS)),
                           "item_metadata", {}))
  for name, shape in stored.items():
    if name in want and shape != want[name]:
      raise CheckpointError(
          f"{path}: parameter {name} has shape {shape}; the model needs {want[name]} "
          f"(an orbax checkpoint of an older release may hold the projections as [out, in]: "
          f"convert the original checkpoint again)")
  state = checkpointer.restore(os.path.join(path, ORBAX_PARAMS), target)
  model = nnx.merge(graphdef, state)
  if dtype is not None and jnp.dtype(dtype) != config.param_dtype:
    model = cast(model, dtype)
  if mesh is not None:  # repeats KV heads where the model axis needs it (on the devices)
    model = sharding_lib.shard_model(model, mesh)
  tokenizer = (Tokenizer.from_dir(path)
               if os.path.exists(os.path.join(path, "tokenizer.json")) else None)
  return Pretrained(model, tokenizer, model.config)


def _shapes(tree) -> dict[str, tuple[int, ...]]:
  """Dotted path (``layers.0.self_attn.q_proj``) -> shape, of arrays or orbax's metadata."""
  out = {}
  for keys, leaf in jax.tree_util.tree_leaves_with_path(tree):
    names = [str(getattr(k, "key", k)) for k in keys]
    if names and names[-1] == "value":  # orbax's metadata names an nnx.Param's array "value"
      names = names[:-1]
    if hasattr(leaf, "shape"):
      out[".".join(names)] = tuple(int(n) for n in leaf.shape)
  return out


def _sharded_target(target, config: LlamaConfig, mesh):
  """The abstract state with each parameter's NamedSharding (KV projections that need
  repeating first are read replicated, then repeated by shard_model)."""
  tree = nnx.to_pure_dict(target)

  def visit(node, prefix):
    for key, value in node.items():
      path = f"{prefix}{key}"
      if isinstance(value, Mapping):
        visit(value, path + ".")
        continue
      spec = sharding_lib.param_spec(path, config, mesh)
      axis = sharding_lib.kv_head_axis(path)
      if (axis is not None and sharding_lib.kv_replication(
          value.shape[axis], mesh.shape[sharding_lib.MODEL]) > 1):
        spec = sharding_lib.P()
      node[key] = jax.ShapeDtypeStruct(value.shape, value.dtype,
                                       sharding=sharding_lib.NamedSharding(mesh, spec))

  visit(tree, "")
  nnx.replace_by_pure_dict(target, tree)
  return target


def cast(model: Llama, dtype) -> Llama:
  """A copy of ``model`` with parameters (and ``config.dtype``) in ``dtype``."""
  dtype = jnp.dtype(dtype)
  return build(model.config.replace(dtype=str(dtype)), flat_params(model))


def _iter_progress(items, progress: bool, desc: str, total=None):
  if not progress:
    return items
  from tqdm.auto import tqdm
  return tqdm(items, desc=desc, total=total, unit="tensor", leave=False)
