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
``q_bias`` (Qwen2)             ``[Hq, D]``           ``("model", None)``
``k_bias``, ``v_bias``         ``[Hkv', D]``         ``("model", None)``
``gate_proj``, ``up_proj``     ``[hidden, F]``       ``(None, "model")``
``down_proj``                  ``[F, hidden]``       ``("model", None)``
``embed_tokens``, ``lm_head``  ``[V, hidden]``       ``("model", None)`` (vocab-parallel; replicated if ``V % m``)
norms                          ``[hidden]``, ``[D]`` replicated
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

The code follows the data flow: :mod:`models.parallel.mesh` (the mesh),
:mod:`models.parallel.rules` (the PartitionSpecs), :mod:`models.parallel.placement` (values onto
their shards), :mod:`models.parallel.per_shard` (decode steps under ``shard_map``); this module
gathers their names. The empty cache on a mesh is :func:`models.generation.cache.empty` with
``sharding=``.
"""

# The jax names and the warn-once helpers the module held before the split (callers use them).
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: F401

from models.parallel.mesh import (AXES, DATA, MODEL, MeshSpec, axis_sizes,  # noqa: F401
                                  make_mesh, mesh_of)
from models.parallel.per_shard import sample_on_mesh, write_per_shard  # noqa: F401
from models.parallel.placement import (place_param, place_param_from, shard_model,  # noqa: F401
                                       shard_state)
from models.parallel.rules import (PARAM_RULES, VOCAB_PARAMS, attention_sharding,  # noqa: F401
                                   cache_shardings, check_batch, kv_head_axis, kv_replication,
                                   own_kv_sharding, param_spec, rows_sharding,
                                   shared_kv_sharding, sharded_config, state_shardings,
                                   vocab_spec)
from models.parallel.rules import _warn_replication, _warn_vocab  # noqa: F401
