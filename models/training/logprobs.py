"""Teacher-forced log-probs of completions under a shared prompt (a :class:`PromptTree`).

    >>> prompts = prompt_arrays(PromptTree.from_prompts([prompt], 8))     # 8 samples of one prompt
    >>> logp = completion_logprobs(model, prompts, completions)          # float32 [8, T]
    >>> jax.grad(lambda m: completion_logprobs(m, prompts, completions).sum())(model)

Every prompt segment runs through the model ONCE (its K/V computed and kept once, as
:func:`models.generation.loop.prefill` stores it for decoding); the completions then run as
per-sample suffixes of ``T`` tokens, the ``T`` causal queries of each attending to the
shared segments through :func:`jax_shared_attn.hierarchical_attention` (Hydragen) and to
their own tokens. Sample b's suffix is ``[last_tokens[b], c_0, ..., c_{T-2}]``: position t
predicts ``c_t``. Everything is differentiable with respect to the parameters, through the
prompt's K/V as well (the gradient of a shared segment's K/V sums over every sample that
reads it).

``attention="standard"`` is the baseline a training loop would otherwise run: each sample's
whole sequence (prompt + completion) through the model on its own, the prompt recomputed
per sample. The two give the same log-probs.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_shared_attn.sharding import AttentionSharding
from models.generation import cache as cache_lib
from models.generation.cache import KVCache, SegmentLevel
from models.generation.prompt_tree import PromptTree
from models.generation.settings import GenerationSettings, resolve
from models.model.llama import Llama

Array = jax.Array
MODES = ("hydragen", "standard")
PAD_ID = -1  # as models.generation.loop: positions after a completion's end


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptArrays:
  """A :class:`PromptTree` as arrays with static shapes (a pytree: jit takes it as an argument).

  Attributes:
    tokens: per level, int32 ``[N_l, W_l]``: the level's segments, right-padded with 0.
    lengths: per level, int32 ``[N_l]``.
    ancestors: per level l, int32 ``[l, N_l]``: row a is each node's ancestor at level a.
    node_of_seq: per level, int32 ``[B]``: the node each sample continues (-1: none).
    last_tokens: int32 ``[B]``: each sample's final prompt token (the first suffix token).
    contexts: int32 ``[B]``: each sample's shared context length (prompt minus one token).
    all_share: per level, static: one segment continued by every sample.
  """

  tokens: tuple[Array, ...]
  lengths: tuple[Array, ...]
  ancestors: tuple[Array, ...]
  node_of_seq: tuple[Array, ...]
  last_tokens: Array
  contexts: Array
  all_share: tuple[bool, ...] = dataclasses.field(default=(), metadata=dict(static=True))

  @property
  def num_samples(self) -> int:
    return self.last_tokens.shape[0]

  @property
  def widths(self) -> tuple[int, ...]:
    return tuple(t.shape[1] for t in self.tokens)


def prompt_arrays(tree: PromptTree, *, pad_multiple: int = 1) -> PromptArrays:
  """The arrays of ``tree``; segment widths rounded up to ``pad_multiple`` (fewer recompiles)."""
  if int(pad_multiple) != pad_multiple or pad_multiple < 1:
    raise ValueError(f"pad_multiple must be a positive int; got {pad_multiple!r}")
  tokens, lengths, ancestors, nodes, all_share = [], [], [], [], []
  for l in range(tree.num_levels):
    lens = tree.lengths(l)
    width = -(-int(lens.max()) // pad_multiple) * pad_multiple
    level = np.zeros((len(lens), width), np.int32)
    for n, seg in enumerate(tree.segments[l]):
      level[n, :len(seg)] = seg
    tokens.append(jnp.asarray(level))
    lengths.append(jnp.asarray(lens))
    ancestors.append(jnp.asarray(np.stack([tree.ancestor(a, l) for a in range(l)])
                                 if l else np.zeros((0, len(lens)), np.int32)))
    node = tree.node_of_sample(l)
    nodes.append(jnp.asarray(node))
    all_share.append(len(lens) == 1 and not node.any())
  return PromptArrays(tuple(tokens), tuple(lengths), tuple(ancestors), tuple(nodes),
                      jnp.asarray(tree.last_tokens, jnp.int32),
                      jnp.asarray(tree.context_lengths()), tuple(all_share))


def completion_logprobs(model: Llama, prompts: PromptArrays, completions: Array, *,
                        attention: str = "hydragen",
                        settings: Optional[GenerationSettings] = None,
                        temperature: float = 1.0, remat: bool = False,
                        sharding: Optional[AttentionSharding] = None,
                        impl: Optional[str] = None) -> Array:
  """Log-probs of each completion token given its prompt and the tokens before it.

  Args:
    model: a :class:`models.model.llama.Llama`.
    prompts: :func:`prompt_arrays` of the samples' :class:`PromptTree`.
    completions: int32 ``[B, T]`` (B = the tree's samples); ``PAD_ID`` (-1) after a
      completion's end (as :func:`models.generation.loop.generate` returns them).
    attention: ``"hydragen"`` (prompt segments once, completions as suffixes) or
      ``"standard"`` (each sample's prompt + completion on its own).
    settings: the attention fields (``impl``, ``config``, ``causal_attention``) of a
      :class:`models.generation.settings.GenerationSettings` (default: ``"auto"``); ``impl``:
      shorthand for ``settings.impl``.
    temperature: log-probs of ``softmax(logits / temperature)`` (the sampling policy).
    remat: recompute each layer's activations in the backward pass (``jax.checkpoint``).
    sharding: on a mesh, the completions' layout (:func:`models.parallel.sharding.attention_sharding`);
      the prompt segments then run replicated over "data".

  Returns:
    float32 ``[B, T]``: ``log p(c_t | prompt, c_<t)``; 0 at padded positions.
  """
  if attention not in MODES:
    raise ValueError(f"attention must be one of {MODES}; got {attention!r}")
  settings = resolve(settings, "completion_logprobs", impl=impl).attention_only()
  b, t = completions.shape
  if b != prompts.num_samples:
    raise ValueError(f"completions: {b} rows, but the prompt tree has {prompts.num_samples} "
                     "samples (one completion per sample)")
  targets = jnp.maximum(completions, 0)
  if attention == "hydragen":
    inputs = jnp.concatenate([prompts.last_tokens[:, None], targets[:, :-1]], axis=1)
    levels = _prefill(model, prompts, settings, remat, sharding)
    cache = cache_lib.empty(model.config, b, t, levels=levels)
    hidden, _ = _hidden(model, inputs, None, cache, settings, remat, sharding)
  else:
    sequences, positions = _concatenated(prompts, targets)
    hidden = _hidden(model, sequences, None, None, settings, remat, sharding)
    hidden = jnp.take_along_axis(hidden, positions[:, :, None], axis=1)
  logp = _token_logprobs(model, hidden, targets, temperature)
  return jnp.where(completions >= 0, logp, 0.0)


def _token_logprobs(model: Llama, hidden: Array, targets: Array, temperature: float) -> Array:
  logits = model.logits(model.norm(hidden)) / temperature  # float32 [B, T, V]
  picked = jnp.take_along_axis(logits, targets[:, :, None], axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def _hidden(model: Llama, tokens: Array, positions, cache: Optional[KVCache],
            settings: GenerationSettings, remat: bool, sharding) -> Array | tuple[Array, KVCache]:
  """The decoder's final hidden states (before the norm); with a cache, ``(h, cache)``.

  :meth:`Llama.__call__`'s layer loop, with each layer optionally under ``jax.checkpoint``
  and without the output projection (the callers need it on other rows, or not at all).
  """
  b, t = tokens.shape
  if positions is None:
    start = cache.context_lengths() if cache is not None else jnp.zeros((b,), jnp.int32)
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  x = model.embed(tokens)
  for layer in model.layers:
    graphdef, state = nnx.split(layer)

    def run(state, x, cache, graphdef=graphdef):
      return nnx.merge(graphdef, state)(x, positions, cache, skip_attention=False,
                                        settings=settings, sharding=sharding)

    x, cache = (jax.checkpoint(run) if remat else run)(state, x, cache)
  return x if cache is None else (x, cache.advance(t))


def _prefill(model: Llama, prompts: PromptArrays, settings: GenerationSettings, remat: bool,
             sharding) -> tuple[SegmentLevel, ...]:
  """Every prompt segment's K/V, level by level, each causally over its ancestors (once)."""
  from models.parallel import sharding as sharding_lib
  seg_sharding = (None if sharding is None
                  else sharding_lib.attention_sharding(sharding.mesh, batch_sharded=False))
  stored = []
  for l, tokens in enumerate(prompts.tokens):
    n, w = tokens.shape
    ancestors = tuple(SegmentLevel(lv.k, lv.v, lv.lengths, prompts.ancestors[l][a])
                      for a, lv in enumerate(stored))
    own = cache_lib.empty(model.config, n, w, levels=ancestors)
    if seg_sharding is not None:
      own = jax.lax.with_sharding_constraint(
          own, sharding_lib.cache_shardings(own, sharding.mesh, batch_sharded=False))
    _, own = _hidden(model, tokens, None, own, settings, remat, seg_sharding)
    stored.append(SegmentLevel(own.k, own.v, prompts.lengths[l], prompts.node_of_seq[l],
                               all_share=prompts.all_share[l]))
  return tuple(stored)


def _concatenated(prompts: PromptArrays, targets: Array) -> tuple[Array, Array]:
  """Each sample's prompt + completion as one row, and the rows' positions predicting c_t.

  Row b is ``context(b) + [last_token] + c_0 .. c_{T-1}`` left-aligned and right-padded
  with 0 (padding comes after every valid token: causal attention never sees it).
  """
  b, t = targets.shape
  # Whole blocks of 64 for flash-attention kernels (cuDNN); the padding comes after every token.
  width = -(-(sum(prompts.widths) + 1 + t) // 64) * 64
  rows = jnp.zeros((b, width), jnp.int32)
  offset = jnp.zeros((b,), jnp.int32)
  cols = jnp.arange(width)[None, :]
  for tokens, lengths, nodes in zip(prompts.tokens, prompts.lengths, prompts.node_of_seq):
    node = jnp.maximum(nodes, 0)
    seg = tokens[node]  # [B, W_l]
    seg_len = jnp.where(nodes >= 0, lengths[node], 0)
    rows = _place(rows, seg, seg_len, offset, cols)
    offset = offset + seg_len
  rows = _place(rows, prompts.last_tokens[:, None], jnp.ones_like(offset), offset, cols)
  rows = _place(rows, targets, jnp.full_like(offset, t), offset + 1, cols)
  # The hidden state at the token before c_t (the last prompt token for t = 0) predicts c_t.
  positions = offset[:, None] + jnp.arange(t)[None, :]
  return rows, positions


def _place(rows: Array, values: Array, lengths: Array, offset: Array, cols: Array) -> Array:
  """``rows[b, offset[b] + i] = values[b, i]`` for ``i < lengths[b]`` (a masked gather)."""
  idx = cols - offset[:, None]
  inside = (idx >= 0) & (idx < lengths[:, None])
  picked = jnp.take_along_axis(values, jnp.clip(idx, 0, values.shape[1] - 1), axis=1)
  return jnp.where(inside, picked, rows)
