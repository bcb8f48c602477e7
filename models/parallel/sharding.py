"""Sharded multi-device decoding: a ("data", "model") device mesh and the partition rules.

    >>> mesh = make_mesh((2, 4))          # 2 data shards x 4 model shards; or "auto", or a Mesh
    >>> model = shard_model(model, mesh)  # every parameter on its shards (KV heads replicated if needed)
    >>> tokens = models.generate(model, prompt, num_samples=64, max_new_tokens=32, mesh=mesh)

Axes: ``"data"`` splits the sequences (batch), ``"model"`` splits the heads
(tensor parallelism, Megatron style: the q/k/v/o heads and the MLP hidden
units). Everything is a ``NamedSharding`` on one mesh; ``jax.jit`` partitions
the dense layers from these shardings, and attention (Pallas kernels, which
XLA cannot partition) runs per shard under ``shard_map``
(:mod:`jax_shared_attn.sharding`).

Rules (our layouts: projection weights are ``[in, out]`` (:mod:`models.model.llama`); ``m`` = model-axis size):

=============================  ====================  ==========================
parameter / array              shape                 PartitionSpec
=============================  ====================  ==========================
``q_proj``                     ``[hidden, Hq, D]``   ``(None, "model", None)``
``k_proj``, ``v_proj``         ``[hidden, Hkv', D]`` ``(None, "model", None)``
``o_proj``                     ``[Hq, D, hidden]``   ``("model", None, None)``
``gate_proj``, ``up_proj``     ``[hidden, F]``       ``(None, "model")``
``down_proj``                  ``[F, hidden]``       ``("model", None)``
``embed_tokens``, ``lm_head``  ``[V, hidden]``       ``("model", None)`` (vocab-parallel; replicated if ``V % m``)
norms                          ``[hidden]``          replicated
own K/V (per layer)            ``[B, S, Hkv', D]``   ``("data", None, "model", None)``
shared segment K/V (per layer) ``[N, T, Hkv', D]``   ``(None, None, "model", None)``: replicated over data
lengths, node_of_seq, tokens   ``[B]``               ``("data",)``
out                            ``[B, new]``          ``("data", None)``
step, seed, segment lengths    scalar / ``[N]``      replicated
=============================  ====================  ==========================

Activations: the residual stream ``[B, T, hidden]`` is ``("data", None,
None)`` (replicated over "model": one all-reduce after ``o_proj`` and one
after ``down_proj`` per layer); q/k/v and the attention output ``[B, T, H,
D]`` are ``("data", None, "model", None)``; the MLP hidden ``[B, T, F]`` is
``("data", None, "model")``; the logits ``[B, T, V]`` are ``("data", None,
"model")`` and the sampler reduces over the vocabulary (greedy and
categorical draws are arg-max reductions: a small all-reduce). Prefill runs
the shared segments with the batch replicated over "data" (every data shard
computes the same segments: no communication, and the result is already
laid out as the shared-segment rule wants).

The embedding is vocab-parallel rather than hidden-parallel: with a tied
output projection (SmolLM2) a hidden-parallel table would make the logits a
partial sum to all-reduce, ``B x V`` floats per step; vocab-parallel gives
each shard its slice of the logits for free, and the lookup is a local
masked gather plus an all-reduce of ``B x hidden``.

KV heads: shard ``i`` of the model axis holds query heads ``[i Hq/m, (i+1)
Hq/m)``; for GQA (query head h reads KV head ``h // G``) it needs their KV
heads. When ``Hkv`` is not a multiple of ``m`` (fewer KV heads than shards),
every KV head is repeated ``r = lcm(Hkv, m) / Hkv`` times (``k_proj``/
``v_proj`` heads, hence the cache): the model becomes the same function with
``Hkv' = r Hkv`` KV heads, replicated head ``j`` being original head ``j //
r``, so query head h reads ``h // (Hq / Hkv') `` = original ``h // G``.
Each device then stores ``Hkv' / m`` KV heads (e.g. one), the cache's
global arrays are ``r`` times larger, and a warning says so.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_shared_attn.sharding import AttentionSharding, shard_map
from models.generation.cache import KVCache, SegmentLevel
from models.model.config import LlamaConfig

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)
MeshSpec = Union[Mesh, str, Sequence[int]]

log = logging.getLogger(__name__)

# Parameter path suffix -> PartitionSpec (vocab tables: see vocab_spec).
PARAM_RULES = (
    ("self_attn.q_proj", P(None, MODEL, None)),
    ("self_attn.k_proj", P(None, MODEL, None)),
    ("self_attn.v_proj", P(None, MODEL, None)),
    ("self_attn.o_proj", P(MODEL, None, None)),
    ("mlp.gate_proj", P(None, MODEL)),
    ("mlp.up_proj", P(None, MODEL)),
    ("mlp.down_proj", P(MODEL, None)),
    ("norm.weight", P()),  # input_layernorm, post_attention_layernorm, the final norm
)
VOCAB_PARAMS = ("embed_tokens", "lm_head")


# -- the mesh -------------------------------------------------------------------------------------

def make_mesh(spec: MeshSpec = "auto", *, devices: Optional[Sequence[Any]] = None) -> Mesh:
  """A ``("data", "model")`` mesh from a simple spec.

  Args:
    spec: ``(d, m)``: d data shards x m model shards, the first ``d * m``
      devices (one entry may be -1: "the rest"); ``"auto"``: every device on
      "data" (``(n, 1)``: decoding a large batch needs no communication
      then; give ``(d, m)`` when the parameters or the shared cache need
      splitting); or a ``jax.sharding.Mesh`` with axes named "data" and
      "model" (returned as is).
    devices: the devices to use (default ``jax.devices()``: TPU, GPU or CPU).

  Raises:
    ValueError: a malformed spec, more devices asked for than exist, or a
      Mesh without the two axis names.
  """
  if isinstance(spec, Mesh):
    missing = [a for a in AXES if a not in spec.axis_names]
    if missing:
      raise ValueError(f"mesh: a Mesh needs the axes {AXES}; {tuple(spec.axis_names)} lacks "
                       f"{missing}")
    _check_spans_processes(spec)
    return spec
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if isinstance(spec, str):
    if spec != "auto":
      raise ValueError(f"mesh must be 'auto', (data, model) or a Mesh; got {spec!r}")
    shape = (n, 1)
  else:
    shape = tuple(spec) if isinstance(spec, (tuple, list)) else ()
    if (len(shape) != 2 or not all(isinstance(s, (int, np.integer)) for s in shape)
        or any(s == 0 or s < -1 for s in shape) or shape == (-1, -1)):
      raise ValueError(f"mesh must be 'auto', (data, model) with positive sizes (one may be -1) "
                       f"or a Mesh; got {spec!r}")
    if -1 in shape:
      known = shape[0] * shape[1] * -1
      if n % known:
        raise ValueError(f"mesh {spec}: {n} devices do not split into shards of {known}")
      shape = tuple(n // known if s == -1 else int(s) for s in shape)
    shape = (int(shape[0]), int(shape[1]))
  if shape[0] * shape[1] > n:
    raise ValueError(f"mesh {shape} needs {shape[0] * shape[1]} devices; there are {n} "
                     f"({devices[0].platform})")
  grid = _device_grid(shape, devices[:shape[0] * shape[1]])
  auto = getattr(jax.sharding, "AxisType", None)
  if auto is None:  # older JAX: every axis is "auto" (the SPMD partitioner decides)
    mesh = Mesh(grid, AXES)
  else:  # Auto axes: jit partitions the dense layers from the arrays' NamedShardings (the rules)
    mesh = Mesh(grid, AXES, axis_types=(auto.Auto, auto.Auto))
  _check_spans_processes(mesh)
  return mesh


def _check_spans_processes(mesh: Mesh) -> None:
  """Under jax.distributed every process runs every program: the mesh must hold all devices.

  A process with no device in the mesh would compute nothing while the
  others wait for it in a collective. The check needs no communication:
  every process sees the same global device list, so all of them raise.
  """
  if jax.process_count() == 1:
    return
  n = jax.device_count()
  if mesh.devices.size != n or {d.id for d in mesh.devices.flat} != {d.id for d in jax.devices()}:
    raise ValueError(
        f"mesh {tuple(mesh.devices.shape)}: under jax.distributed the mesh must span every "
        f"process's devices ({jax.process_count()} processes, {n} devices, "
        f"{jax.local_device_count()} per process); it holds {mesh.devices.size}. Use a "
        f"(data, model) shape whose product is {n}, e.g. ({n}, 1) or "
        f"({jax.process_count()}, {jax.local_device_count()})")


def _device_grid(shape: tuple[int, int], devices: list) -> np.ndarray:
  """Devices as a ``[data, model]`` array; topology-aware where JAX knows the topology."""
  try:
    from jax.experimental import mesh_utils
    return mesh_utils.create_device_mesh(shape, devices=devices)
  except Exception:  # CPU devices, a subset mesh_utils cannot place: plain order
    return np.asarray(devices, dtype=object).reshape(shape)


def axis_sizes(mesh: Mesh) -> tuple[int, int]:
  """``(data, model)`` sizes."""
  return mesh.shape[DATA], mesh.shape[MODEL]


def mesh_of(tree: Any) -> Optional[Mesh]:
  """The ("data", "model") mesh the first sharded leaf of ``tree`` lives on, or None."""
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and all(a in sharding.mesh.axis_names for a in AXES):
      return sharding.mesh
  return None


# -- parameters -----------------------------------------------------------------------------------

def kv_replication(num_kv_heads: int, model_size: int) -> int:
  """How many times each KV head is repeated so that the model axis divides them.

  ``lcm(Hkv, m) / Hkv``: 1 when ``Hkv % m == 0``; ``m / Hkv`` when ``m`` is a
  multiple of ``Hkv`` (each shard holds one KV head).
  """
  return math.lcm(num_kv_heads, model_size) // num_kv_heads


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


def place_param(path: str, value: Any, config: LlamaConfig, mesh: Mesh, dtype=None) -> jax.Array:
  """``value`` on its shards of ``mesh``: cast, KV heads repeated if needed, then placed.

  A host (NumPy) array is cast on the host and ``jax.device_put`` sends each
  device only its shard: no full copy lands on one device first. ``config``
  may be the original or the sharded one (:func:`sharded_config`): KV heads
  are repeated up to ``lcm(value heads, m)``, so placing twice is a no-op.
  """
  dtype = jnp.dtype(config.param_dtype if dtype is None else dtype)
  if isinstance(value, jax.Array):
    xp = jnp  # already on devices (shard_model): repeat there, then reshard
  else:
    value, xp = np.asarray(value), np
  if value.dtype != dtype:
    value = value.astype(dtype)
  if path.endswith(("self_attn.k_proj", "self_attn.v_proj")):  # [hidden, Hkv, D]
    r = kv_replication(value.shape[1], mesh.shape[MODEL])
    if r > 1:
      value = xp.repeat(value, r, axis=1)  # head j of the result is original head j // r
  return jax.device_put(value, NamedSharding(mesh, param_spec(path, config, mesh)))


def place_param_from(path: str, shape: Sequence[int], read, config: LlamaConfig, mesh: Mesh,
                     dtype=None) -> jax.Array:
  """Parameter ``path`` on its shards of ``mesh``, each block read by ``read`` as it is needed.

  ``read(index)`` returns the block ``index`` (a tuple of slices into
  ``shape``, the parameter's own shape) as a NumPy array. Every process
  calls ``read`` only for the blocks its own devices hold (each sent by an
  explicit ``device_put`` to its device), so under ``jax.distributed`` no host
  reads tensors or parts of them that it does not place. KV heads are repeated
  (:func:`kv_replication`) from the original heads each block covers.
  """
  dtype = jnp.dtype(config.param_dtype if dtype is None else dtype)
  shape = tuple(int(n) for n in shape)
  r = (kv_replication(shape[1], mesh.shape[MODEL])  # [hidden, Hkv, D]
       if path.endswith(("self_attn.k_proj", "self_attn.v_proj")) else 1)
  global_shape = shape if r == 1 else (shape[0], shape[1] * r) + shape[2:]

  blocks = {}  # devices holding the same block (replicas over "data") read it once

  def block(index):
    index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, global_shape))
    key = tuple((s.start, s.stop) for s in index)
    if key not in blocks:
      if r == 1:
        x = np.asarray(read(index))
      else:  # replicated head j is original head j // r
        lo, hi = index[1].start, index[1].stop
        first = lo // r
        x = np.repeat(np.asarray(read((index[0], slice(first, -(-hi // r))) + index[2:])), r,
                      axis=1)
        x = x[:, lo - first * r:hi - first * r]
      blocks[key] = x.astype(dtype, copy=False)
    return blocks[key]

  # As jax.make_array_from_callback, with each block sent by an explicit device_put.
  sharding = NamedSharding(mesh, param_spec(path, config, mesh))
  arrays = [jax.device_put(block(index), device)
            for device, index in sharding.addressable_devices_indices_map(global_shape).items()]
  return jax.make_array_from_single_device_arrays(global_shape, sharding, arrays)


def shard_model(model, mesh: MeshSpec):
  """``model`` with every parameter on its shards of ``mesh`` (see the rules table).

  Returns the model itself when it is laid out so already; otherwise a new
  model of the same class (with ``num_kv_heads`` replicated where the model
  axis needs it: :func:`sharded_config`). Works on any NNX module built as
  ``cls(config, rngs=...)`` whose parameter paths the rules name, so this
  module needs no import of :mod:`models.model.llama` (which imports this one).
  """
  mesh = make_mesh(mesh)
  config = sharded_config(model.config, mesh)
  graphdef, state = nnx.split(model)
  tree = nnx.to_pure_dict(state)
  dotted = lambda keypath: ".".join(str(k.key) for k in keypath)
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  if config == model.config and all(
      getattr(v, "sharding", None) == NamedSharding(mesh, param_spec(dotted(p), config, mesh))
      for p, v in leaves):
    return model
  placed = jax.tree_util.tree_map_with_path(
      lambda p, v: place_param(dotted(p), v, model.config, mesh), tree)
  if config != model.config:  # new KV head count: the graph of the model with those heads
    graphdef, state = nnx.split(nnx.eval_shape(lambda: type(model)(config, rngs=nnx.Rngs(0))))
  nnx.replace_by_pure_dict(state, placed)
  return nnx.merge(graphdef, state)


# -- caches and the decode state ------------------------------------------------------------------

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


def shard_state(state, mesh: Mesh):
  """``state`` placed by :func:`state_shardings` (arrays already in place are not copied)."""
  check_batch(state.batch_size, mesh, "the decode state's batch")
  return jax.device_put(state, state_shardings(state, mesh))


def empty_cache(config: LlamaConfig, batch_size: int, capacity: int, mesh: Mesh, *,
                levels: Sequence[SegmentLevel] = (), lengths=None, dtype=None,
                batch_sharded: bool = True) -> KVCache:
  """:func:`models.generation.cache.empty` with every own buffer created on its shards (never whole)."""
  dtype = config.param_dtype if dtype is None else jnp.dtype(dtype)
  own = own_kv_sharding(mesh, batch_sharded=batch_sharded)
  shape = (batch_size, capacity, config.num_kv_heads, config.head_dim)
  lengths = (np.zeros((batch_size,), np.int32) if lengths is None
             else np.asarray(lengths, np.int32))
  layers = range(config.num_layers)
  return KVCache(tuple(levels), tuple(jnp.zeros(shape, dtype, device=own) for _ in layers),
                 tuple(jnp.zeros(shape, dtype, device=own) for _ in layers),
                 jax.device_put(lengths, NamedSharding(mesh, P(own.spec[0]))))


def write_per_shard(cache: KVCache, layer: int, k_new: jax.Array, v_new: jax.Array,
                    sharding: AttentionSharding) -> KVCache:
  """:meth:`KVCache.write` with each device scattering its own block (sequences x KV heads).

  Left to the SPMD partitioner, the scatter into a batch-sharded buffer
  all-gathers the new tokens' K/V and indices over "data" every layer and
  step; per shard it is a local in-place scatter with no communication.
  """
  own = P(sharding.batch_axis, None, sharding.head_axis, None)

  def local(k_buf, v_buf, lengths, k, v):
    shard = KVCache((), (k_buf,), (v_buf,), lengths).write(0, k, v)
    return shard.k[0], shard.v[0]

  k_layer, v_layer = shard_map(local, sharding.mesh, (own, own, P(sharding.batch_axis), own, own),
                               (own, own))(cache.k[layer], cache.v[layer], cache.lengths,
                                           k_new, v_new)
  k, v = list(cache.k), list(cache.v)
  k[layer], v[layer] = k_layer, v_layer
  return dataclasses.replace(cache, k=tuple(k), v=tuple(v))


def sample_on_mesh(logits: jax.Array, keys: jax.Array, params, config=None, *,
                   mesh: Mesh) -> jax.Array:
  """:func:`models.generation.sampling.sample` for vocab-parallel logits ``[B, V]`` (rows on "data").

  Greedy and plain temperature draws are arg-max reductions over the split
  vocabulary (a tiny all-reduce). top-k/top-p sort each row's whole
  vocabulary: each data shard gathers its own rows over "model" and samples
  them locally (left to the partitioner, ``top_k`` gathered every row of the
  batch onto every device). Same tokens either way: rows are independent.
  """
  from models.generation.sampling import sample

  if params.top_k is None and params.top_p is None:
    return sample(logits, keys, params, config)
  rows = P(DATA)
  return shard_map(lambda l, k: sample(l, k, params, config), mesh, (P(DATA, None), rows), rows)(
      logits, keys)
