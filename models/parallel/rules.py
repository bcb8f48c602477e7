"""The partition rules: the PartitionSpec of every parameter and array of a sharded run (the table
in :mod:`models.parallel.sharding`), and the model's config as laid out on a mesh."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_shared_attn.sharding import AttentionSharding
from models.generation.cache import KVCache, SegmentLevel
from models.model.config import LlamaConfig
from models.parallel.mesh import DATA, MODEL

log = logging.getLogger(__name__)

# Parameter path suffix -> PartitionSpec (vocab tables: see vocab_spec).
PARAM_RULES = (
    ("self_attn.q_proj", P(None, MODEL, None)),
    ("self_attn.k_proj", P(None, MODEL, None)),
    ("self_attn.v_proj", P(None, MODEL, None)),
    ("self_attn.o_proj", P(MODEL, None, None)),
    ("self_attn.q_bias", P(MODEL, None)),  # [Hq, D] (Qwen2)
    ("self_attn.k_bias", P(MODEL, None)),
    ("self_attn.v_bias", P(MODEL, None)),
    ("mlp.gate_proj", P(None, MODEL)),
    ("mlp.up_proj", P(None, MODEL)),
    ("mlp.down_proj", P(MODEL, None)),
    ("norm.weight", P()),  # input_layernorm, post_attention_layernorm, the final norm, q/k norms
)
# Parameters holding KV heads, and their head axis (repeated there: kv_replication).
KV_HEAD_AXIS = {"self_attn.k_proj": 1, "self_attn.v_proj": 1,  # [hidden, Hkv, D]
                "self_attn.k_bias": 0, "self_attn.v_bias": 0}  # [Hkv, D]
VOCAB_PARAMS = ("embed_tokens", "lm_head")


# -- parameters -----------------------------------------------------------------------------------

def kv_replication(num_kv_heads: int, model_size: int) -> int:
  """How many times each KV head is repeated so that the model axis divides them.

  ``lcm(Hkv, m) / Hkv``: 1 when ``Hkv % m == 0``; ``m / Hkv`` when ``m`` is a
  multiple of ``Hkv`` (each shard holds one KV head).
  """
  return math.lcm(num_kv_heads, model_size) // num_kv_heads


def kv_head_axis(path: str):
  """The KV-head axis of parameter ``path``, or None when it holds no KV heads."""
  return next((axis for suffix, axis in KV_HEAD_AXIS.items() if path.endswith(suffix)), None)


def sharded_config(config: LlamaConfig, mesh: Mesh) -> LlamaConfig:
  """The config of the model as laid out on ``mesh`` (``num_kv_heads`` after replication).

  Raises ValueError when the query heads or the MLP width do not divide by
  the model axis.
  """
  m = mesh.shape[MODEL]
  for what, n in (("num_heads", config.num_heads), ("intermediate_size",
                                                    config.intermediate_size)):
    if n % m:
      raise ValueError(f"mesh: {what}={n} is not a multiple of the model axis ({m} shards); "
                       f"choose a model axis that divides it")
  r = kv_replication(config.num_kv_heads, m)
  if r == 1:
    return config
  _warn_replication(config.num_kv_heads, m, r)
  return config.replace(num_kv_heads=config.num_kv_heads * r)


@functools.lru_cache(maxsize=None)
def _warn_replication(hkv: int, m: int, r: int) -> None:
  log.warning("sharding: %d KV heads over a model axis of %d shards: each KV head is replicated "
              "%d times (%d KV heads, %d per shard; query head h still reads original KV head "
              "h // (num_heads / %d)); the KV cache's global arrays grow %dx", hkv, m, r, hkv * r,
              hkv * r // m, hkv, r)


def vocab_spec(config: LlamaConfig, mesh: Mesh) -> P:
  """Vocab-parallel embedding/lm_head when the vocabulary divides by the model axis."""
  m = mesh.shape[MODEL]
  if config.vocab_size % m == 0:
    return P(MODEL, None)
  _warn_vocab(config.vocab_size, m)
  return P()


@functools.lru_cache(maxsize=None)
def _warn_vocab(v: int, m: int) -> None:
  log.warning("sharding: vocab_size=%d is not a multiple of the model axis (%d shards): the "
              "embedding and output projection are replicated", v, m)


def param_spec(path: str, config: LlamaConfig, mesh: Mesh) -> P:
  """The PartitionSpec of parameter ``path`` (``layers.3.self_attn.q_proj``, ``embed_tokens``)."""
  if path in VOCAB_PARAMS:
    return vocab_spec(config, mesh)
  for suffix, spec in PARAM_RULES:
    if path.endswith(suffix):
      return spec
  raise ValueError(f"sharding: no partition rule for parameter {path!r}")


# -- caches, the decode state, attention ----------------------------------------------------------

def attention_sharding(mesh: Mesh, *, batch_sharded: bool = True) -> AttentionSharding:
  """The attention layout: sequences on "data" (decode) or replicated (prefill), heads on "model"."""
  return AttentionSharding(mesh, DATA if batch_sharded else None, MODEL)


def own_kv_sharding(mesh: Mesh, *, batch_sharded: bool = True) -> NamedSharding:
  """Own K/V ``[B, S, Hkv, D]``: sequences on "data" (or replicated), KV heads on "model"."""
  return NamedSharding(mesh, P(DATA if batch_sharded else None, None, MODEL, None))


def shared_kv_sharding(mesh: Mesh) -> NamedSharding:
  """Shared segments ``[N, T, Hkv, D]``: KV heads on "model", replicated over "data"."""
  return NamedSharding(mesh, P(None, None, MODEL, None))


def cache_shardings(cache: KVCache, mesh: Mesh, *, batch_sharded: bool = True) -> KVCache:
  """A KVCache-shaped pytree of NamedShardings (own K/V on data x model, shared on model)."""
  b = DATA if batch_sharded else None
  ns = lambda *spec: NamedSharding(mesh, P(*spec))
  own, shared = own_kv_sharding(mesh, batch_sharded=batch_sharded), shared_kv_sharding(mesh)
  levels = tuple(SegmentLevel(tuple(shared for _ in lv.k), tuple(shared for _ in lv.v), ns(),
                              ns(b), all_share=lv.all_share) for lv in cache.levels)
  return KVCache(levels, tuple(own for _ in cache.k), tuple(own for _ in cache.v), ns(b))


def rows_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
  """An array of ``ndim`` dims with its rows (sequences) on "data", the rest whole."""
  return NamedSharding(mesh, P(DATA, *(None,) * (ndim - 1)))


def state_shardings(state, mesh: Mesh):
  """A DecodeState-shaped pytree of NamedShardings (rows on "data")."""
  rows = rows_sharding(mesh)
  return dataclasses.replace(
      state, cache=cache_shardings(state.cache, mesh), tokens=rows,
      out=rows_sharding(mesh, 2), finished=rows, step=NamedSharding(mesh, P()),
      sample_ids=rows, seed=NamedSharding(mesh, P()))


def check_batch(batch: int, mesh: Mesh, what: str = "num_samples") -> None:
  d = mesh.shape[DATA]
  if batch % d:
    raise ValueError(f"{what}: {batch} samples in all do not split over the mesh's data axis "
                     f"({d} shards); use a multiple of {d} samples or fewer data shards")
