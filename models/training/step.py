"""A jit-compiled GRPO training step over shared-prompt batches, with any optax optimizer.

    >>> config = GRPOConfig(group_size=8)
    >>> state = init_train_state(model, optax.adamw(1e-5))
    >>> tree = PromptTree.from_prompts(prompts, 8)                     # G = 8 samples per prompt
    >>> completions = generate(model, tree, max_new_tokens=32, temperature=1.0, eos_id=eos)
    >>> batch = make_batch(tree, completions, rewards, config, model.config)
    >>> state, metrics = train_step(state, batch, config, optimizer=optax.adamw(1e-5))

The log-probs come from :func:`models.training.logprobs.completion_logprobs`: each prompt segment
runs once and the completions attend to its K/V as suffixes (``attention="hydragen"``), or
each sample runs its whole sequence (``"standard"``). On a mesh (:mod:`models.parallel.sharding`) the
parameters and optimizer state follow the partition rules and the completions split over
"data". ``remat=True`` recomputes each layer in the backward pass (``jax.checkpoint``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.model.config import LlamaConfig
from models.model.llama import Llama
from models.parallel import sharding as sharding_lib
from models.training.grpo import GRPOConfig, group_advantages, grpo_loss
from models.training.logprobs import (MODES, PAD_ID, PromptArrays, completion_logprobs,
                             prompt_arrays)
from models.generation.prompt_tree import PromptTree
from models.generation.settings import GenerationSettings, resolve

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GRPOBatch:
  """One step's data (a pytree; rows = samples, groups of G consecutive rows).

  Attributes:
    prompts: the samples' prompt tree as arrays (:func:`models.training.logprobs.prompt_arrays`).
    completions: int32 ``[B, T]``, ``PAD_ID`` (-1) after each completion's end.
    rewards: float32 ``[B]``.
    old_logprobs: float32 ``[B, T]`` under the sampling policy, or None (the current
      log-probs held fixed: importance ratio 1, one step per batch).
  """

  prompts: PromptArrays
  completions: Array
  rewards: Array
  old_logprobs: Optional[Array] = None

  @property
  def mask(self) -> Array:
    return self.completions >= 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  """Parameters, optimizer state and step count (a pytree; ``graphdef`` is static)."""

  params: Any
  opt_state: Any
  step: Array
  graphdef: Any = dataclasses.field(metadata=dict(static=True))

  def model(self) -> Llama:
    return nnx.merge(self.graphdef, self.params)


def default_optimizer(learning_rate: float = 1e-5) -> optax.GradientTransformation:
  """``optax.adamw`` with gradient clipping at global norm 1 (the usual RL fine-tuning start)."""
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(learning_rate))


def init_train_state(model: Llama, optimizer: optax.GradientTransformation, *,
                     mesh=None) -> TrainState:
  """The state to train ``model`` with ``optimizer`` (a copy of its parameters).

  On ``mesh``, the parameters and optimizer state are laid out by :mod:`models.parallel.sharding`.
  """
  if mesh is not None:
    model = sharding_lib.shard_model(model, sharding_lib.make_mesh(mesh))
  graphdef, params = nnx.split(model)
  # A copy: train_step donates the state, and the caller's model must stay usable. Eagerly
  # (no jit): the copies and the moments keep each parameter's sharding.
  params = jax.tree.map(jnp.copy, params)
  return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32), graphdef)


def make_batch(tree: PromptTree, completions, rewards, config: GRPOConfig,
               model_config: LlamaConfig, *, old_logprobs=None,
               pad_multiple: int = 1) -> GRPOBatch:
  """A checked :class:`GRPOBatch`.

  Raises ValueError naming the argument: ``tree`` whose samples are not groups of
  ``config.group_size`` consecutive samples of one prompt; ``completions`` of the wrong
  shape, with ids outside the vocabulary, or longer than the model's context after the
  longest prompt; ``rewards`` of the wrong shape or not finite; ``old_logprobs`` misshaped.
  """
  g = config.group_size
  completions = np.asarray(completions)
  b = tree.num_samples
  if completions.ndim != 2 or completions.shape[0] != b:
    raise ValueError(f"completions must have shape [{b}, T] (one row per sample of the tree); "
                     f"got {completions.shape}")
  if b % g:
    raise ValueError(f"tree: {b} samples are not a whole number of groups of "
                     f"group_size={g} (completion count must be G * prompts)")
  for start in range(0, b, g):
    prompts = {tuple(tree.prompt(i)) for i in range(start, start + g)}
    if len(prompts) != 1:
      raise ValueError(f"tree: samples {start}..{start + g - 1} form one group but hold "
                       f"{len(prompts)} different prompts (each group of group_size={g} "
                       "consecutive samples must share its prompt)")
  t = completions.shape[1]
  longest = int(tree.context_lengths().max()) + 1
  if longest + t > model_config.max_position_embeddings:
    raise ValueError(f"completions: {t} tokens after a prompt of {longest} exceed the model's "
                     f"context of {model_config.max_position_embeddings} tokens "
                     "(max_position_embeddings)")
  if not np.issubdtype(completions.dtype, np.integer):
    raise ValueError(f"completions must hold integer token ids; got {completions.dtype}")
  bad = (completions != PAD_ID) & ((completions < 0) | (completions >= model_config.vocab_size))
  if bad.any():
    raise ValueError(f"completions: token ids must lie in [0, {model_config.vocab_size}) or be "
                     f"PAD_ID={PAD_ID}; got {completions[bad][:4].tolist()}")
  rewards = np.asarray(rewards, np.float32)
  if rewards.shape != (b,):
    raise ValueError(f"rewards must have shape [{b}] (one per completion); got {rewards.shape}")
  if not np.isfinite(rewards).all():
    raise ValueError(f"rewards must be finite; got {rewards[~np.isfinite(rewards)][:4].tolist()} "
                     f"at rows {np.flatnonzero(~np.isfinite(rewards))[:4].tolist()}")
  if old_logprobs is not None:
    old_logprobs = jnp.asarray(old_logprobs, jnp.float32)
    if old_logprobs.shape != completions.shape:
      raise ValueError(f"old_logprobs must have the completions' shape {completions.shape}; "
                       f"got {old_logprobs.shape}")
  return GRPOBatch(prompt_arrays(tree, pad_multiple=pad_multiple),
                   jnp.asarray(completions, jnp.int32), jnp.asarray(rewards), old_logprobs)


def train_step(state: TrainState, batch: GRPOBatch, config: GRPOConfig, *,
               optimizer: optax.GradientTransformation, reference: Any = None,
               attention: str = "hydragen", settings: Optional[GenerationSettings] = None,
               remat: bool = False, mesh=None,
               impl: Optional[str] = None) -> tuple[TrainState, dict]:
  """One optimizer step on the GRPO loss of ``batch`` (``state`` is donated).

  Args:
    state: from :func:`init_train_state` (on ``mesh`` if one is given).
    batch: from :func:`make_batch`.
    config: the objective (:class:`models.training.grpo.GRPOConfig`).
    optimizer: the optax transformation ``state`` was initialised with.
    reference: the reference policy's parameters (``nnx.split(ref_model)[1]``), needed iff
      ``config.kl_coef > 0``.
    attention, settings, impl, remat: see :func:`models.training.logprobs.completion_logprobs`.
    mesh: a mesh from :func:`models.parallel.sharding.make_mesh` (the state must be laid out on it).

  Returns:
    ``(new_state, metrics)``: loss, reward mean/std, kl, clip_fraction, ratio_mean,
    grad_norm (float32 scalars).
  """
  if attention not in MODES:
    raise ValueError(f"attention must be one of {MODES}; got {attention!r}")
  settings = resolve(settings, "train_step", impl=impl).attention_only()
  if config.kl_coef > 0 and reference is None:
    raise ValueError(f"reference: config.kl_coef={config.kl_coef} needs the reference "
                     "policy's parameters")
  if batch.completions.shape[0] % config.group_size:
    raise ValueError(f"batch: {batch.completions.shape[0]} completions are not groups of "
                     f"group_size={config.group_size}")
  if mesh is not None:
    mesh = sharding_lib.make_mesh(mesh)
    sharding_lib.check_batch(batch.completions.shape[0], mesh, "batch.completions")
    batch = _place_batch(batch, mesh)
  return _train_step(state, batch, reference if config.kl_coef > 0 else None, config=config,
                     optimizer=optimizer, attention=attention, settings=settings,
                     remat=bool(remat),
                     mesh=mesh)


def _place_batch(batch: GRPOBatch, mesh) -> GRPOBatch:
  """Rows on "data"; the prompt tree replicated (every data shard prefills it)."""
  rows = lambda x: None if x is None else jax.device_put(
      x, sharding_lib.rows_sharding(mesh, x.ndim))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return GRPOBatch(jax.device_put(batch.prompts, replicated), rows(batch.completions),
                   rows(batch.rewards), rows(batch.old_logprobs))


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "attention", "settings",
                                             "remat", "mesh"), donate_argnames=("state",))
def _train_step(state: TrainState, batch: GRPOBatch, reference, *, config: GRPOConfig,
                optimizer, attention: str, settings: GenerationSettings, remat: bool, mesh):
  sharding = None if mesh is None else sharding_lib.attention_sharding(mesh)
  logprobs = functools.partial(completion_logprobs, attention=attention, settings=settings,
                               temperature=config.temperature, remat=remat, sharding=sharding)
  advantages = group_advantages(batch.rewards, config.group_size, eps=config.adv_eps,
                                normalize_std=config.normalize_std)
  ref_logp = None
  if reference is not None:
    ref_model = nnx.merge(state.graphdef, reference)
    ref_logp = jax.lax.stop_gradient(logprobs(ref_model, batch.prompts, batch.completions))

  def loss_fn(params):
    logp = logprobs(nnx.merge(state.graphdef, params), batch.prompts, batch.completions)
    old = jax.lax.stop_gradient(logp) if batch.old_logprobs is None else batch.old_logprobs
    return grpo_loss(logp, old, advantages, batch.mask, config, ref_logp)

  (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  rewards = batch.rewards.reshape(-1, config.group_size)
  metrics = dict(loss=loss, reward_mean=rewards.mean(), reward_std=rewards.std(axis=1).mean(),
                 grad_norm=optax.tree.norm(grads), **stats)
  return TrainState(params, opt_state, state.step + 1, state.graphdef), metrics
