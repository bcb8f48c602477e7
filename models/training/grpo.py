"""The GRPO objective: group-normalised advantages, clipped importance ratio, k3 KL.

For G completions ``o_1..o_G`` of one prompt with rewards ``r_i`` (Shao et al. 2024,
DeepSeekMath, Sec. 4.1)::

    A_i     = (r_i - mean(r)) / (std(r) + eps)                 (population std; optional)
    rho_it  = exp(logp_it - old_logp_it)                      (importance ratio per token)
    J_it    = min(rho_it A_i, clip(rho_it, 1 - clip_eps, 1 + clip_eps) A_i)
    KL_it   = exp(ref_it - logp_it) - (ref_it - logp_it) - 1  (the k3 estimator, >= 0)
    loss    = -mean over completions of (1/|o_i|) sum_t (J_it - kl_coef KL_it)

``loss_agg="token"`` averages over every valid token of the batch instead (DAPO). With
``old_logp`` the current log-probs held fixed (one step per batch), rho = 1 and the gradient
is the plain group-baselined policy gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array
LOSS_AGGREGATIONS = ("sequence", "token")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """The objective's settings (hashable: static under jit).

  Attributes:
    group_size: G, completions per prompt (consecutive samples form a group).
    clip_eps: PPO clip range of the importance ratio.
    kl_coef: weight of the k3 KL to the reference policy (0: no reference needed).
    adv_eps: added to the group's reward std.
    normalize_std: divide the advantages by the group's std (False: Dr. GRPO's mean-only).
    loss_agg: ``"sequence"`` (mean per completion, then over completions) or ``"token"``.
    temperature: the sampling temperature; log-probs are those of ``softmax(logits / T)``.
  """

  group_size: int
  clip_eps: float = 0.2
  kl_coef: float = 0.0
  adv_eps: float = 1e-6
  normalize_std: bool = True
  loss_agg: str = "sequence"
  temperature: float = 1.0

  def __post_init__(self):
    if int(self.group_size) != self.group_size or self.group_size < 2:
      raise ValueError(f"GRPOConfig: {self.group_size=} must be an int >= 2 (advantages are "
                       "relative to the group)")
    if not self.clip_eps > 0:
      raise ValueError(f"GRPOConfig: {self.clip_eps=} must be > 0")
    if not self.kl_coef >= 0:
      raise ValueError(f"GRPOConfig: {self.kl_coef=} must be >= 0")
    if not self.adv_eps > 0:
      raise ValueError(f"GRPOConfig: {self.adv_eps=} must be > 0")
    if self.loss_agg not in LOSS_AGGREGATIONS:
      raise ValueError(f"GRPOConfig: {self.loss_agg=} must be one of {LOSS_AGGREGATIONS}")
    if not self.temperature > 0:
      raise ValueError(f"GRPOConfig: {self.temperature=} must be > 0")


def group_advantages(rewards: Array, group_size: int, *, eps: float = 1e-6,
                     normalize_std: bool = True) -> Array:
  """float32 ``[B]``: each reward minus its group's mean (over its std + eps), B = groups * G."""
  r = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
  adv = r - r.mean(axis=1, keepdims=True)
  if normalize_std:
    adv = adv / (r.std(axis=1, keepdims=True) + eps)
  return adv.reshape(-1)


def grpo_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array,
              config: GRPOConfig, ref_logp: Optional[Array] = None) -> tuple[Array, dict]:
  """The GRPO loss (module docstring) and per-batch statistics.

  Args:
    logp, old_logp, ref_logp: float32 ``[B, T]`` log-probs of the completion tokens under the
      current, sampling and reference policies (``ref_logp`` needed iff ``kl_coef > 0``).
    advantages: float32 ``[B]``.
    mask: ``[B, T]``: 1 at valid completion tokens.

  Returns:
    ``(loss, stats)``: a scalar and a dict of scalars (kl, clip_fraction, ratio_mean).
  """
  mask = mask.astype(jnp.float32)
  ratio = jnp.exp(logp - old_logp)
  adv = advantages[:, None]
  clipped = jnp.clip(ratio, 1.0 - config.clip_eps, 1.0 + config.clip_eps)
  objective = jnp.minimum(ratio * adv, clipped * adv)
  if config.kl_coef > 0:
    if ref_logp is None:
      raise ValueError(f"grpo_loss: kl_coef={config.kl_coef} needs ref_logp (the reference "
                       "policy's log-probs)")
    delta = ref_logp - logp
    kl = jnp.exp(delta) - delta - 1.0
    objective = objective - config.kl_coef * kl
  else:
    kl = jnp.zeros_like(logp)
  tokens = mask.sum(axis=1)
  per_token = lambda x: _aggregate(x * mask, tokens, config.loss_agg)
  loss = -per_token(objective)
  stats = dict(kl=per_token(kl), clip_fraction=per_token((clipped != ratio).astype(jnp.float32)),
               ratio_mean=per_token(ratio))
  return loss, stats


def _aggregate(x: Array, tokens: Array, how: str) -> Array:
  """Mean of the masked ``x [B, T]``: per completion then over completions, or per token."""
  if how == "token":
    return x.sum() / jnp.maximum(tokens.sum(), 1.0)
  return jnp.mean(x.sum(axis=1) / jnp.maximum(tokens, 1.0))
