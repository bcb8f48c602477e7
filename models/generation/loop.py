"""Generation: prefill each shared segment once, then decode in ONE jitted loop.

    >>> tokens = generate(model, prompt, num_samples=16, max_new_tokens=64)     # [16, 64]
    >>> settings = GenerationSettings(temperature=0.7, top_p=0.9)
    >>> tokens = generate(model, [few_shot + p1, few_shot + p2], num_samples=[8, 4],
    ...                   max_new_tokens=64, settings=settings)                    # [12, 64]

How tokens are drawn and which attention runs is one value, a
:class:`models.generation.settings.GenerationSettings`; ``temperature``, ``top_k``, ``top_p``
and ``impl`` are also taken one by one (applied on top of ``settings``).

Three attention modes (the paper's Sec. 4.1 comparison):

``"hydragen"``  every prompt segment's K/V stored once (:mod:`models.generation.cache`);
                decoding attends to it with the queries of all the samples
                that share it (:func:`jax_shared_attn.hierarchical_attention`).
``"standard"``  the baseline: the prompt is prefilled once (batch 1) and its
                K/V copied into every sample's own cache, which each sample
                attends to on its own (:func:`jax_shared_attn.attention_with_lse`).
``"none"``      no attention at all (the throughput ceiling; wrong tokens,
                for benchmarks only): no prefill, no K/V.

The lower-level API separates the phases, for benchmarks that time decoding
only (paper App. D.1)::

    state = prefill(model, prompt, num_samples=1024, max_new_tokens=128)
    state = decode(model, state, 1)           # compiles; steps is a runtime value
    state = decode(model, state, 127)         # the same program, no host call per token
    tokens = state.completions()              # [1024, 128] in the caller's order

``decode`` donates the state: its cache is updated in place and the state
passed in must not be used again.

Output: int32 ``[num_samples, max_new_tokens]``. After a sample emits
``eos_id`` (kept in the output) the rest of its row is ``pad_id``
(default :data:`PAD_ID` = -1, never a real token).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_shared_attn.ops import segment_alignment, suffix_alignment
from models.generation import cache as cache_lib
from models.generation.cache import KVCache, SegmentLevel
from models.generation.programs import ProgramStore
from models.generation.prompt_tree import PromptTree
from models.generation.sampling import sample, sampling_keys
from models.generation.settings import GenerationSettings, resolve
from models.model import graph as model_graph
from models.model.llama import Llama
from models.parallel import distributed
from models.parallel import sharding as sharding_lib

Array = jax.Array
ATTENTION_MODES = ("hydragen", "standard", "none")
PAD_ID = -1

Prompts = Union[PromptTree, Sequence[int], Sequence[Sequence[int]], np.ndarray, Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Everything the decode loop carries (a pytree; rows in decode order).

  Attributes:
    cache: the :class:`models.generation.cache.KVCache`.
    tokens: int32 ``[B]``: the token each row feeds next (at step 0 the
      prompt's last token).
    out: int32 ``[B, max_new_tokens]``: sampled tokens so far, ``pad_id`` elsewhere.
    finished: bool ``[B]``: the row has emitted ``eos_id``.
    step: int32 scalar: decode steps done.
    sample_ids: int32 ``[B]``: each row's index in the caller's order.
    seed: uint32 scalar: the sampling seed.
    attention: the mode it was prefilled for (static).
  """

  cache: KVCache
  tokens: Array
  out: Array
  finished: Array
  step: Array
  sample_ids: Array
  seed: Array
  attention: str = dataclasses.field(default="hydragen", metadata=dict(static=True))

  @property
  def batch_size(self) -> int:
    return self.tokens.shape[0]

  @property
  def max_new_tokens(self) -> int:
    return self.out.shape[1]

  def completions(self) -> Array:
    """int32 ``[num_samples, max_new_tokens]`` in the caller's sample order."""
    return self.out[jnp.argsort(self.sample_ids)]


# -- the public entry points ----------------------------------------------------------------------

def generate(model: Llama, prompt_ids: Prompts, *, num_samples: Union[int, Sequence[int], None] = 1,
             max_new_tokens: int, settings: Optional[GenerationSettings] = None,
             eos_id: Optional[int] = None, seed: int = 0, attention: str = "hydragen",
             pad_id: int = PAD_ID, prefill_chunk: Optional[int] = None,
             progress: Optional[Callable[[int], None]] = None, mesh=None,
             programs: Optional[ProgramStore] = None, **shorthands) -> Array:
  """Samples ``max_new_tokens`` tokens for each of ``num_samples`` samples per prompt.

  Args:
    model: a :class:`models.model.llama.Llama`.
    prompt_ids: one prompt (a sequence of token ids); or a list of prompts,
      whose sharing tree is detected automatically (a radix tree,
      :mod:`models.generation.sharing`: every shared run of >= 16 tokens is prefilled and
      stored once, at any depth); or a :class:`models.generation.prompt_tree.PromptTree`
      describing the sharing explicitly (e.g. ``PromptTree.from_prompts(prompts,
      n, min_shared_tokens=4)``).
    num_samples: samples per prompt: an int, or one int per prompt (ignored
      for a PromptTree, which lists its samples).
    max_new_tokens: tokens to generate per sample (>= 1).
    settings: a :class:`~models.generation.settings.GenerationSettings`: the sampling rule
      (temperature, top_k, top_p; 0 = greedy), the attention implementation and kernel
      config for :mod:`jax_shared_attn`, the sampler's config. Default: greedy, ``"auto"``.
    eos_id: a sample stops after emitting it; the rest of its row is ``pad_id``.
    seed: sampling seed; the token of sample b (the caller's index) at step t depends only
      on (seed, b, t): not on the batch layout or decode order, and every attention mode
      draws with the same randomness.
    attention: ``"hydragen"``, ``"standard"`` or ``"none"`` (module docstring).
    pad_id: the id written after EOS (default -1).
    prefill_chunk: prefill long prompt segments this many tokens at a time.
    progress: called on the host with the number of decode steps done,
      every few steps (None: no host callback in the compiled loop).
    mesh: run sharded on a device mesh: ``(data, model)`` sizes, ``"auto"``
      or a ``jax.sharding.Mesh`` (:func:`models.parallel.sharding.make_mesh`; the
      rules: docs/sharding.md). The samples are split over "data" (their
      total must divide by it), heads and MLP over "model". None: one device.
    programs: a :class:`models.generation.programs.ProgramStore`: the prefill and decode
      programs are read from it (no tracing) or traced once and written there (one device
      only, and no ``progress``; otherwise ignored).
    **shorthands: ``temperature``, ``top_k``, ``top_p``, ``impl``: fields of ``settings``
      given one by one (they replace those of ``settings``).

  Returns:
    int32 ``[total samples, max_new_tokens]``; samples in the caller's order
    (prompt 0's samples first). With a mesh over several processes
    (``jax.distributed``, docs/multihost.md) every process returns all of
    them as a NumPy array.
  """
  settings = resolve(settings, "generate", **shorthands)
  if mesh is not None:  # placed once here, not again by prefill and decode
    mesh = sharding_lib.make_mesh(mesh)
    model = sharding_lib.shard_model(model, mesh)
  state = prefill(model, prompt_ids, num_samples=num_samples, max_new_tokens=max_new_tokens,
                  attention=attention, settings=settings, seed=seed,
                  prefill_chunk=prefill_chunk, mesh=mesh, programs=programs)
  state = decode(model, state, settings=settings, eos_id=eos_id, pad_id=pad_id,
                 progress=progress, mesh=mesh, programs=programs)
  tokens = state.completions()
  # Under jax.distributed the rows live on several processes: every process gets all of them.
  return tokens if tokens.is_fully_addressable else distributed.gather(tokens)


def as_prompt_tree(prompt_ids: Prompts, num_samples=1) -> PromptTree:
  """Normalises ``generate``'s prompt forms to a :class:`PromptTree` (lists: detected sharing)."""
  if isinstance(prompt_ids, PromptTree):
    return prompt_ids
  if isinstance(prompt_ids, (np.ndarray, jax.Array)):
    arr = np.asarray(prompt_ids)
    if arr.ndim not in (1, 2):
      raise ValueError(f"prompt_ids must be 1-D (one prompt) or 2-D (several); got shape {arr.shape}")
    prompts = [arr.tolist()] if arr.ndim == 1 else arr.tolist()
  else:
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
      raise ValueError("prompt_ids is empty: give at least one token")
    single = all(isinstance(t, (int, np.integer)) for t in prompt_ids)
    prompts = [prompt_ids] if single else [list(p) for p in prompt_ids]
  if num_samples is None:
    num_samples = 1
  if len(prompts) == 1 and np.ndim(num_samples) == 1 and len(num_samples) != 1:
    raise ValueError(f"num_samples has {len(num_samples)} entries for 1 prompt")
  return PromptTree.from_prompts(prompts, num_samples)


def prefill(model: Llama, prompt_ids: Prompts, *, num_samples=1, max_new_tokens: int,
            attention: str = "hydragen", settings: Optional[GenerationSettings] = None,
            seed: int = 0, own_capacity: Optional[int] = None,
            prefill_chunk: Optional[int] = None,
            progress: Optional[Callable[[int], None]] = None, mesh=None,
            programs: Optional[ProgramStore] = None, impl: Optional[str] = None) -> DecodeState:
  """Prefills every prompt segment once and returns the state the decode loop starts from.

  Args:
    model, prompt_ids, num_samples, attention, settings, seed: as in :func:`generate` (prefill
      reads the attention fields of ``settings``; ``impl``: shorthand for ``settings.impl``).
    max_new_tokens: the decode steps the state has room for.
    own_capacity: per-sample K/V capacity (default: what is needed: ``max_new_tokens``
      for hydragen, rounded up to :func:`jax_shared_attn.ops.suffix_alignment`; the
      longest prompt plus that for standard).
    prefill_chunk: feed prompt segments this many tokens at a time (bounds
      prefill memory for long prompts; default: each segment in one pass).
    progress: called with the number of prompt tokens prefilled so far.
    mesh: as in :func:`generate`: the returned state (cache included) is laid
      out on it, each buffer created on its shards; the segments are
      prefilled with their batch replicated over "data" and heads on "model".
    programs: as in :func:`generate` (used without a mesh).

  Raises:
    ValueError: bad arguments, token ids outside the vocabulary, a prompt
      plus ``max_new_tokens`` beyond ``config.max_position_embeddings``, or
      ``own_capacity`` too small.
  """
  settings = resolve(settings, "prefill", impl=impl).attention_only()
  impl = settings.impl
  if mesh is not None:
    mesh = sharding_lib.make_mesh(mesh)
    # Before any check that could fail on one process only (the others would wait for it).
    distributed.check_same(mesh, prompt_ids=prompt_ids, num_samples=num_samples,
                           max_new_tokens=max_new_tokens, attention=attention, seed=seed,
                           own_capacity=own_capacity, prefill_chunk=prefill_chunk)
    model = sharding_lib.shard_model(model, mesh)  # KV heads replicated where "model" needs it
  config = model.config
  if attention not in ATTENTION_MODES:
    raise ValueError(f"attention must be one of {ATTENTION_MODES}; got {attention!r}")
  if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive int; got {max_new_tokens!r}")
  if prefill_chunk is not None and (int(prefill_chunk) != prefill_chunk or prefill_chunk < 1):
    raise ValueError(f"prefill_chunk must be a positive int or None; got {prefill_chunk!r}")
  tree = as_prompt_tree(prompt_ids, num_samples)
  _check_tokens(tree, config.vocab_size)
  contexts = tree.context_lengths()
  longest = int(contexts.max()) + 1
  if longest + max_new_tokens > config.max_position_embeddings:
    raise ValueError(
        f"max_new_tokens: a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} "
        f"exceeds the model's context of {config.max_position_embeddings} tokens "
        "(config.max_position_embeddings; raise it with config.replace(...) if you mean it)")

  order = tree.decode_order()
  if mesh is not None:
    sharding_lib.check_batch(len(order), mesh)
  graph, weights = model_graph.split(model)
  if attention == "none":
    needed, lengths = 0, contexts[order]
    levels = ()
  else:
    stored = _prefill_levels(config, graph, weights, tree, settings, progress, prefill_chunk,
                             mesh, programs)
    nodes = [np.asarray(tree.node_of_sample(l)[order]) for l in range(len(stored))]
    levels = tuple(SegmentLevel(k, v, *jax.device_put((lens, nodes[l])),
                                all_share=len(lens) == 1 and not nodes[l].any())
                   for l, (k, v, lens) in enumerate(stored))
    if attention == "hydragen":
      needed, lengths = max_new_tokens, np.zeros(len(order), np.int32)
    else:
      needed = sum(k[0].shape[1] for k, _, _ in stored) + max_new_tokens
      lengths = contexts[order]
  if own_capacity is None:
    # Hopper, G >= 8: whole 64-token blocks let decoding run prefix and suffixes in one kernel
    # (the positions past each sample's length stay zero and are masked).
    group = config.num_heads // config.num_kv_heads
    align = suffix_alignment(impl, group) if attention == "hydragen" and levels else 1
    capacity = -(-needed // align) * align
  else:
    capacity = int(own_capacity)
  if capacity < needed:
    raise ValueError(f"own_capacity={own_capacity} is too small: attention={attention!r} with "
                     f"max_new_tokens={max_new_tokens} needs {needed} tokens per sample")
  if attention == "standard" and levels:
    k, v = _copy_prompts_per_sample(levels, capacity, mesh=mesh)
    cache = KVCache((), k, v, jnp.asarray(lengths, jnp.int32))
  else:
    own = None if mesh is None else sharding_lib.own_kv_sharding(mesh)
    cache = cache_lib.empty(config, len(order), capacity,
                            levels=levels if attention == "hydragen" else (), lengths=lengths,
                            sharding=own)
  b = len(order)
  # Built on the host and copied over in one transfer (not a small device program each).
  state = DecodeState(cache=cache, attention=attention, **jax.device_put(dict(
      tokens=np.asarray(tree.last_tokens, np.int32)[order],
      out=np.full((b, max_new_tokens), PAD_ID, np.int32),
      finished=np.zeros((b,), bool),
      step=np.zeros((), np.int32),
      sample_ids=np.asarray(order, np.int32),
      seed=np.asarray(np.uint32(seed % 2**32)))))
  return state if mesh is None else sharding_lib.shard_state(state, mesh)


def decode(model: Llama, state: DecodeState, num_steps: Optional[int] = None, *,
           settings: Optional[GenerationSettings] = None, eos_id: Optional[int] = None,
           pad_id: int = PAD_ID, progress: Optional[Callable[[int], None]] = None,
           progress_every: int = 8, mesh=None,
           programs: Optional[ProgramStore] = None, **shorthands) -> DecodeState:
  """Runs ``num_steps`` decode steps (default: all that remain) in one jitted program.

  The loop is a ``lax.while_loop`` that also stops once every sample has
  emitted ``eos_id``. ``num_steps`` is a runtime value: one compiled program
  serves every count. ``state`` is donated (updated in place; do not reuse it).
  A row that has finished holds ``pad_id`` in every column after its EOS, those the loop
  did not run included.

  Args:
    settings, eos_id, pad_id, **shorthands: as in :func:`generate`.
    progress: None (no host callback in the program: the benchmark path), or
      a function called on the host with the number of steps done, every
      ``progress_every`` steps and at the end.
    mesh: the mesh to run on (default: the one the state was prefilled on,
      if any); the model is placed on it (:func:`models.parallel.sharding.shard_model`;
      a no-op for a model placed already) and the loop runs sharded.
    programs: as in :func:`generate`: the decode program read from this store or traced
      once and written there (one device, ``progress=None``; otherwise ignored).
  """
  settings = resolve(settings, "decode", **shorthands)
  # Before any check that could fail on one process only (the others would wait for it).
  distributed.check_same(sharding_lib.mesh_of(state) if mesh is None else
                         sharding_lib.make_mesh(mesh), num_steps=num_steps,
                         settings=settings, eos_id=eos_id, pad_id=pad_id,
                         progress=(progress is not None, progress_every))
  done, longest = _step_and_longest(state)
  remaining = state.max_new_tokens - done
  num_steps = remaining if num_steps is None else int(num_steps)
  if not 0 <= num_steps <= remaining:
    raise ValueError(f"num_steps must lie in [0, {remaining}] (the state was prefilled for "
                     f"max_new_tokens={state.max_new_tokens} and has done {done}); "
                     f"got {num_steps}")
  if state.attention != "none":
    worst = longest + num_steps
    if worst > state.cache.capacity:
      raise ValueError(f"num_steps={num_steps} would exceed the per-sample cache capacity of "
                       f"{state.cache.capacity} tokens ({worst} needed)")
  if int(progress_every) < 1:
    raise ValueError(f"progress_every must be >= 1; got {progress_every}")
  model, state, mesh = _on_mesh(model, state, mesh)
  graph, weights = model_graph.split(model)
  # The stop step as a host int32 (not an eager addition on the device: a program of its own).
  stop = np.int32(done + num_steps)
  static = dict(settings=settings, eos_id=eos_id, pad_id=int(pad_id), progress=progress,
                progress_every=int(progress_every), mesh=mesh)
  if programs is not None and mesh is None and progress is None:
    return programs.call("decode", _decode_loop, (graph,), (weights, state, stop),
                         static=static, out_like=lambda p, s, t: s, donate=(1,))
  return _decode_loop(graph, weights, state, stop, **static)


def _step_and_longest(state: DecodeState) -> tuple[int, int]:
  """The steps done and the longest own length, read on the host in one transfer where the
  arrays are (no eager device program, whose sharding would differ between the state of
  ``prefill`` and that of ``decode``)."""
  lengths = state.cache.lengths
  if lengths.is_fully_addressable and state.step.is_fully_addressable:
    step, lengths = jax.device_get((state.step, lengths))
    return int(step), int(np.max(lengths, initial=0))
  return int(state.step), int(jnp.max(lengths))


def lower_decode(model: Llama, state: DecodeState, *,
                 settings: Optional[GenerationSettings] = None, eos_id: Optional[int] = None,
                 pad_id: int = PAD_ID, mesh=None, **shorthands):
  """The decode program, lowered (``.compile()`` it to inspect HLO or memory)."""
  settings = resolve(settings, "lower_decode", **shorthands)
  model, state, mesh = _on_mesh(model, state, mesh)
  graph, weights = model_graph.split(model)
  return _decode_loop.lower(graph, weights, state, state.step, settings=settings,
                            eos_id=eos_id, pad_id=int(pad_id), progress=None, progress_every=1,
                            mesh=mesh)


def _on_mesh(model: Llama, state: DecodeState, mesh):
  """``(model, state, mesh)`` laid out on ``mesh`` (default: the state's own mesh, if any)."""
  mesh = sharding_lib.mesh_of(state) if mesh is None else sharding_lib.make_mesh(mesh)
  if mesh is None:
    # Committed where it lives: a state fresh from prefill (uncommitted) and one a decode call
    # returned (committed) would otherwise be two programs to compile.
    if not all(getattr(x, "committed", True) for x in jax.tree.leaves(state)):
      state = jax.device_put(state, next(iter(state.tokens.devices())))
    return model, state, None
  return sharding_lib.shard_model(model, mesh), sharding_lib.shard_state(state, mesh), mesh


# -- prefill -------------------------------------------------------------------------------------

def _check_tokens(tree: PromptTree, vocab_size: int) -> None:
  ids = [t for level in tree.segments for seg in level for t in seg] + list(tree.last_tokens)
  lo, hi = min(ids), max(ids)
  if lo < 0 or hi >= vocab_size:
    raise ValueError(f"prompt_ids: token ids must lie in [0, {vocab_size}) (the vocabulary); "
                     f"got values in [{lo}, {hi}]")


def _prefill_levels(config, graph, weights, tree: PromptTree, settings: GenerationSettings,
                    progress,
                    chunk: Optional[int] = None, mesh=None,
                    programs: Optional[ProgramStore] = None):
  """K/V of every segment, level by level, each causally over its ancestors.

  Level l's N segments run as one batch ``[N, T_l]`` (right-padded): the
  ancestors are shared levels of a prefill cache, the segments' own tokens
  its per-sequence part. The K/V left in that part IS the level. With
  ``chunk``, the segments are fed ``chunk`` tokens at a time (each chunk
  attends to the earlier ones through the cache), bounding the attention
  scores at ``[N, chunk, T_l]`` for long prompts. On a ``mesh`` the segments'
  batch is replicated over "data" and their heads split over "model": the
  result is laid out as the shared levels are (no communication).

  The width ``T`` of a level is its longest segment; a level of one segment (the batched prefix
  kernel's case) is rounded up to :func:`jax_shared_attn.ops.segment_alignment` (128 tokens on
  Hopper GPUs). Levels of several segments run on the segment kernel, which takes any width:
  padding them would only cost memory (many short segments would each grow to 128 tokens).

  Returns ``[(k, v (per layer [N, T, Hkv, D]), lengths int32 [N]), ...]``.
  """
  stored, done = [], 0
  for l in range(tree.num_levels):
    lengths = tree.lengths(l)
    # 128 on Hopper for one segment: whole blocks for the Mosaic GPU prefix kernel.
    align = segment_alignment(settings.impl) if len(lengths) == 1 else 1
    width = -(-int(lengths.max()) // align) * align
    step = width if chunk is None else min(int(chunk), width)
    width = -(-width // step) * step  # a whole number of chunks: one compiled chunk shape
    tokens = np.zeros((len(lengths), width), np.int32)
    for n, seg in enumerate(tree.segments[l]):
      tokens[n, :len(seg)] = seg
    # Host values copied over as they are (jnp.asarray would run a device program each).
    ancestors = tuple(SegmentLevel(k, v, *jax.device_put((lens, tree.ancestor(a, l))))
                      for a, (k, v, lens) in enumerate(stored))
    sharding = (None if mesh is None
                else sharding_lib.attention_sharding(mesh, batch_sharded=False))
    own = cache_lib.empty(config, len(lengths), width, sharding=(
        None if mesh is None else sharding_lib.own_kv_sharding(mesh, batch_sharded=False)))
    k, v = own.k, own.v
    for start in range(0, width, step):
      args = (weights, jax.device_put(tokens[:, start:start + step]), ancestors, k, v,
              jax.device_put(np.int32(start)))
      if programs is not None and mesh is None:
        k, v = programs.call("prefill", _prefill_chunk, (graph,), args,
                             static=dict(settings=settings, sharding=None),
                             out_like=lambda p, t, a, k, v, s: (k, v), donate=(3, 4))
      else:
        k, v = _prefill_chunk(graph, *args, settings=settings, sharding=sharding)
      if progress is not None:
        done += int(np.clip(lengths - start, 0, step).sum())
        progress(done)
    stored.append((k, v, lengths))
  return stored


@functools.partial(jax.jit, static_argnums=0, static_argnames=("settings", "sharding"),
                   donate_argnames=("k", "v"))
def _prefill_chunk(graph, weights, tokens, ancestors, k, v, start, *, settings,
                   sharding=None):
  """Segment tokens ``[N, C]`` at own positions ``start..start+C`` -> updated own K/V.

  Padded positions hold garbage K/V past each segment's length; no valid query
  sees them (causal), and the stored lengths mask them afterwards.
  """
  model = graph.merge(weights)
  lengths = jnp.full((tokens.shape[0],), start, jnp.int32)
  cache = KVCache(tuple(ancestors), k, v, lengths)
  _, cache = model(tokens, cache=cache, settings=settings, sharding=sharding)
  if sharding is not None:  # the donated buffers' layout (the shared-segment rule)
    cache = lax.with_sharding_constraint(
        cache, sharding_lib.cache_shardings(cache, sharding.mesh, batch_sharded=False))
  return cache.k, cache.v


@functools.partial(jax.jit, static_argnums=1, static_argnames=("mesh",))
def _copy_prompts_per_sample(levels: tuple[SegmentLevel, ...], capacity: int, mesh=None):
  """The standard baseline's cache: each sample's path of segments, concatenated.

  Returns own ``k, v``: per layer ``[B, capacity, Hkv, D]``. Segments are
  written level by level at the running context end, so a level's padding is
  overwritten by the next level or lies past the sample's length (masked):
  valid tokens are never overwritten, and ``capacity >= sum of level widths``
  means nothing is clamped.
  """
  nodes = jnp.stack([level.node_of_seq for level in levels], axis=1)  # [B, num_levels]

  def one_layer(layer):
    def one_sample(sample_nodes):  # int32 [num_levels]
      k = v = None
      offset = jnp.zeros((), jnp.int32)
      for level, node in zip(levels, sample_nodes):
        seg_k = level.k[layer][jnp.maximum(node, 0)]  # [T, Hkv, D]
        seg_v = level.v[layer][jnp.maximum(node, 0)]
        if k is None:
          shape = (capacity,) + seg_k.shape[1:]
          k, v = jnp.zeros(shape, seg_k.dtype), jnp.zeros(shape, seg_v.dtype)
        k = lax.dynamic_update_slice(k, seg_k, (offset, 0, 0))
        v = lax.dynamic_update_slice(v, seg_v, (offset, 0, 0))
        offset = offset + jnp.where(node >= 0, level.lengths[jnp.maximum(node, 0)], 0)
      return k, v
    return jax.vmap(one_sample)(nodes)

  per_layer = [one_layer(layer) for layer in range(len(levels[0].k))]
  k, v = tuple(k for k, _ in per_layer), tuple(v for _, v in per_layer)
  if mesh is not None:  # built on its shards: samples on "data", heads on "model"
    k, v = lax.with_sharding_constraint((k, v), sharding_lib.own_kv_sharding(mesh))
  return k, v


# -- the decode loop ------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=0,
                   static_argnames=("settings", "eos_id", "pad_id", "progress",
                                    "progress_every", "mesh"),
                   donate_argnames=("state",))
def _decode_loop(graph, weights, state: DecodeState, stop, *, settings: GenerationSettings,
                 eos_id: Optional[int], pad_id: int, progress, progress_every: int, mesh=None):
  model = graph.merge(weights)
  skip_attention = state.attention == "none"
  sharding = None if mesh is None else sharding_lib.attention_sharding(mesh)
  layout = (lambda s: s) if mesh is None else (  # the loop carry keeps the state's layout
      lambda s: lax.with_sharding_constraint(s, sharding_lib.state_shardings(s, mesh)))

  # Without an EOS no row finishes inside the loop: whether all had finished is read once,
  # here, so the loop's condition needs no collective per step on a mesh (an all-reduce of
  # `finished` over the data axis would make every device wait for the slowest each step).
  all_done = jnp.all(state.finished) if eos_id is None else None

  def running(s: DecodeState):
    if all_done is not None:
      return (s.step < stop) & ~all_done
    return (s.step < stop) & ~jnp.all(s.finished)

  def step(s: DecodeState) -> DecodeState:
    logits, cache = model(s.tokens[:, None], cache=s.cache, skip_attention=skip_attention,
                          settings=settings, sharding=sharding)
    # Keyed by the caller's sample index, never the decode row: the layout cannot move a draw.
    keys = sampling_keys(s.seed, s.sample_ids, s.step)
    draw = sample if mesh is None else functools.partial(sharding_lib.sample_on_mesh, mesh=mesh)
    new = jnp.where(s.finished, pad_id, draw(logits[:, 0], keys, settings.sampling,
                                             settings.sampler))
    out = lax.dynamic_update_slice(s.out, new[:, None], (0, s.step))
    finished = s.finished if eos_id is None else s.finished | (new == eos_id)
    done = s.step + 1
    if progress is not None:  # a host call every `progress_every` steps, never per token
      report = (done % progress_every == 0) | (done == stop) | jnp.all(finished)
      lax.cond(report, lambda: jax.debug.callback(lambda n: progress(int(n)), done),
               lambda: None)
    # Finished rows keep running (static shapes) on a valid dummy token.
    return layout(dataclasses.replace(s, cache=cache, tokens=jnp.maximum(new, 0), out=out,
                                      finished=finished, step=done))

  s = lax.while_loop(running, step, layout(state))
  # A finished row's columns after the last step run (all rows done: the loop stopped early)
  # still hold prefill's PAD_ID: they get this call's pad_id.
  unrun = s.finished[:, None] & (jnp.arange(s.out.shape[1])[None, :] >= s.step)
  return layout(dataclasses.replace(s, out=jnp.where(unrun, pad_id, s.out)))
