"""Training: completion log-probs under a prompt tree, the GRPO objective, the optax step.

The oracle for the log-probs is the plain model run on each sample's whole sequence
(prompt + completion), one sample at a time; gradients are compared the same way.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models.generation.loop import generate
from models.generation.prompt_tree import PromptTree
from models.model.config import preset
from models.model.llama import random_init
from models.training.grpo import GRPOConfig, group_advantages, grpo_loss
from models.training.logprobs import completion_logprobs, prompt_arrays
from models.training.step import init_train_state, make_batch, train_step
from strategies import small_jit

ROOT = Path(__file__).resolve().parents[2]
CONFIG = preset("tiny").replace(num_heads=4, num_kv_heads=2, head_dim=16)
# float32 log-probs of a 256-token vocabulary through two layers: a few ulps of ~5.
LOGP_ATOL = 2e-5


@pytest.fixture(scope="module")
def tiny():
  return random_init(CONFIG, seed=1, std=0.15)


def tokens(n, seed):
  return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def a_tree():
  """Three levels of sharing, a sample with no shared context, uneven segment lengths."""
  root, mid = tokens(9, 1), tokens(5, 2)
  prompts = [root + mid + tokens(3, 3), root + mid + tokens(6, 4), root + tokens(4, 5),
             tokens(1, 6)]
  return PromptTree.from_prompts(prompts, [2, 2, 2, 2], min_shared_tokens=4)


def completions_for(tree, t, seed):
  rng = np.random.default_rng(seed)
  c = rng.integers(0, 256, (tree.num_samples, t)).astype(np.int32)
  c[1, 3:] = -1  # ended early (PAD_ID after the end, as generate returns them)
  c[4, 1:] = -1
  return c


class Frozen:
  """A NumPy array as a hashable static argument of jit (by identity)."""

  def __init__(self, array):
    self.array = array

  def __array__(self, dtype=None, copy=None):
    return self.array


def per_sequence_logprobs(model, tree, completions):
  """The oracle: each sample's prompt + completion as its own row of the plain model.

  Rows are built in NumPy and right-padded (causal attention never sees the padding), so
  the model runs once on ``[B, width]``; nothing of the prompt is shared between rows.
  """
  completions = np.asarray(completions)
  b, t = completions.shape
  seqs = [tree.prompt(i) + [int(c) for c in completions[i] if c >= 0] for i in range(b)]
  rows = np.zeros((b, max(len(tree.prompt(i)) for i in range(b)) + t), np.int32)
  at = np.zeros((b, t), np.int32)
  for i, seq in enumerate(seqs):
    rows[i, :len(seq)] = seq
    at[i] = len(tree.prompt(i)) - 1 + np.arange(t)  # the position whose logits predict c_t
  logp = jax.nn.log_softmax(model(jnp.asarray(rows)), axis=-1)
  picked = jnp.take_along_axis(
      jnp.take_along_axis(logp, jnp.asarray(at)[:, :, None], axis=1),
      jnp.asarray(np.maximum(completions, 0))[:, :, None], axis=2)[..., 0]
  return jnp.where(jnp.asarray(completions) >= 0, picked, 0.0)


def test_tree_has_the_shapes_the_test_means(tiny):
  tree = a_tree()
  assert tree.num_levels == 3 and (-1, -1) in tree.leaves
  pa = prompt_arrays(tree)
  assert pa.widths == tuple(int(tree.lengths(l).max()) for l in range(3))
  assert prompt_arrays(tree, pad_multiple=8).widths == (16, 8, 8)


@pytest.mark.parametrize("attention", ["hydragen", "standard"])
def test_logprobs_equal_the_per_sequence_model(tiny, attention):
  tree = a_tree()
  comp = completions_for(tree, 5, 0)
  expected = nnx.jit(per_sequence_logprobs, static_argnums=(1, 2))(tiny, tree, Frozen(comp))
  got = nnx.jit(completion_logprobs, static_argnames="attention")(
      tiny, prompt_arrays(tree, pad_multiple=4), jnp.asarray(comp), attention=attention)
  assert got.shape == comp.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(got, expected, atol=LOGP_ATOL, rtol=0)
  assert np.all(np.asarray(got)[comp < 0] == 0)
  assert float(jnp.min(expected)) < -7  # not a near-uniform distribution


def test_logprob_gradients_equal_the_per_sequence_model(tiny):
  """Through the prompt's K/V too: every segment's gradient sums over its readers."""
  tree = a_tree()
  comp = completions_for(tree, 4, 1)
  weights = jnp.asarray(np.random.default_rng(2).standard_normal(comp.shape), jnp.float32)
  pa, c = prompt_arrays(tree), jnp.asarray(comp)
  graphdef, params = nnx.split(tiny)
  # The arrays enter as arguments (closed-over constants would meet concrete-value checks).
  grad = lambda f: small_jit(jax.grad(lambda p, pa, c: jnp.sum(
      weights * f(nnx.merge(graphdef, p), pa, c))))(params, pa, c)
  ours = grad(completion_logprobs)
  oracle = grad(lambda m, pa, c: per_sequence_logprobs(m, tree, comp))
  remat = grad(lambda m, pa, c: completion_logprobs(m, pa, c, remat=True))
  ours, oracle, remat = (jax.tree.leaves(nnx.to_pure_dict(g)) for g in (ours, oracle, remat))
  # float32 sums over every row that reads a weight, in different orders (XLA fuses the
  # recomputed forward differently): 1e-5 of the largest entry is ~100 ulps of it.
  for a, b, c in zip(ours, oracle, remat):
    scale = float(jnp.max(jnp.abs(b)))
    np.testing.assert_allclose(a, b, atol=1e-5 * scale, rtol=0)
    np.testing.assert_allclose(c, a, atol=1e-5 * scale, rtol=0)
  assert all(float(jnp.max(jnp.abs(g))) > 0 for g in ours)  # no parameter silently detached


def test_group_advantages_match_numpy():
  rng = np.random.default_rng(0)
  r = rng.standard_normal(24).astype(np.float32)
  r[8:16] = 0.5  # a group where every completion got the same reward: advantages 0, not NaN
  g = r.reshape(3, 8).astype(np.float64)
  expected = ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-6)).reshape(-1)
  got = np.asarray(group_advantages(r, 8))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  assert np.all(got[8:16] == 0)
  centred = np.asarray(group_advantages(r, 8, normalize_std=False))
  np.testing.assert_allclose(centred, (g - g.mean(1, keepdims=True)).reshape(-1), atol=1e-6)


@pytest.mark.parametrize("loss_agg", ["sequence", "token"])
def test_grpo_loss_matches_a_direct_numpy_computation(loss_agg):
  rng = np.random.default_rng(1)
  b, t = 6, 7
  logp = rng.normal(-2, 1, (b, t))
  old = logp + rng.normal(0, 0.4, (b, t))  # ratios far enough from 1 that clipping acts
  ref = logp + rng.normal(0, 0.3, (b, t))
  adv = rng.standard_normal(b)
  mask = np.ones((b, t))
  mask[2, 4:] = 0
  mask[5, 1:] = 0
  config = GRPOConfig(group_size=3, clip_eps=0.2, kl_coef=0.05, loss_agg=loss_agg)
  loss, stats = grpo_loss(*(jnp.asarray(x, jnp.float32) for x in (logp, old, adv, mask)),
                          config, jnp.asarray(ref, jnp.float32))
  ratio = np.exp(logp - old)
  per = np.minimum(ratio * adv[:, None], np.clip(ratio, 0.8, 1.2) * adv[:, None])
  kl = np.exp(ref - logp) - (ref - logp) - 1
  per = (per - 0.05 * kl) * mask
  if loss_agg == "sequence":
    expected = -np.mean(per.sum(1) / mask.sum(1))
  else:
    expected = -per.sum() / mask.sum()
  assert 0 < float(stats["clip_fraction"]) < 1
  np.testing.assert_allclose(float(loss), expected, rtol=2e-5)


def test_config_and_bad_input_errors(tiny):
  with pytest.raises(ValueError, match="group_size"):
    GRPOConfig(group_size=1)
  with pytest.raises(ValueError, match="loss_agg"):
    GRPOConfig(group_size=2, loss_agg="mean")
  config = GRPOConfig(group_size=2)
  tree = a_tree()
  comp = completions_for(tree, 4, 0)
  rewards = np.zeros(tree.num_samples)
  with pytest.raises(ValueError, match=r"completions: 1020 tokens .* exceed the model's context"):
    make_batch(tree, np.zeros((tree.num_samples, 1020), np.int32), rewards, config, CONFIG)
  with pytest.raises(ValueError, match=r"tree: 8 samples are not a whole number of groups"):
    make_batch(tree, comp, rewards, GRPOConfig(group_size=3), CONFIG)
  shuffled = PromptTree(tree.segments, tree.parents, tree.leaves[1:] + tree.leaves[:1],
                        tree.last_tokens[1:] + tree.last_tokens[:1])
  with pytest.raises(ValueError, match=r"tree: samples 0..1 form one group but hold 2"):
    make_batch(shuffled, comp, rewards, config, CONFIG)
  with pytest.raises(ValueError, match=r"completions must have shape \[8, T\]"):
    make_batch(tree, comp[:6], rewards, config, CONFIG)
  with pytest.raises(ValueError, match=r"rewards must be finite; got \[nan\] at rows \[3\]"):
    make_batch(tree, comp, np.where(np.arange(8) == 3, np.nan, 0.0), config, CONFIG)
  with pytest.raises(ValueError, match=r"rewards must have shape \[8\]"):
    make_batch(tree, comp, rewards[:4], config, CONFIG)
  with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\)"):
    make_batch(tree, np.where(comp == -1, 300, comp), rewards, config, CONFIG)
  batch = make_batch(tree, comp, rewards, GRPOConfig(group_size=2), CONFIG)
  opt = optax.sgd(0.1)
  with pytest.raises(ValueError, match="reference: config.kl_coef=0.1 needs"):
    train_step(init_train_state(tiny, opt), batch, GRPOConfig(group_size=2, kl_coef=0.1),
               optimizer=opt)


def test_steps_decrease_the_loss_of_a_fixed_batch(tiny):
  """Fixed old log-probs (the sampling policy) and rewards: the clipped objective improves."""
  tree = a_tree()
  comp = completions_for(tree, 5, 3)
  rewards = np.random.default_rng(4).standard_normal(tree.num_samples)
  config = GRPOConfig(group_size=2, kl_coef=0.02)
  graphdef, params = nnx.split(tiny)  # one program (eagerly, each operation compiles alone)
  old = small_jit(lambda p, pa, c: completion_logprobs(nnx.merge(graphdef, p), pa, c))(
      params, prompt_arrays(tree), jnp.asarray(comp))
  batch = make_batch(tree, comp, rewards, config, CONFIG, old_logprobs=old)
  opt = optax.adamw(3e-3)
  state = init_train_state(tiny, opt)
  reference = nnx.split(tiny)[1]
  losses = []
  for _ in range(4):
    state, metrics = train_step(state, batch, config, optimizer=opt, reference=reference)
    losses.append(float(metrics["loss"]))
  assert abs(losses[0]) < 1e-6  # ratio 1 and KL 0 at the start; advantages average to 0
  assert losses[-1] < losses[0] - 0.05, losses
  assert int(state.step) == 4


def test_grpo_loop_raises_the_reward_of_a_tiny_model(tiny):
  """The example's loop (generate, score, step) at a tiny budget: reward = share of even ids."""
  config = GRPOConfig(group_size=8)
  opt = optax.adam(3e-2)
  state = init_train_state(tiny, opt)
  tree = PromptTree.from_prompts([tokens(12, 7), tokens(12, 8)], 8)
  means = []
  for step in range(6):
    comp = np.asarray(generate(state.model(), tree, max_new_tokens=6, temperature=1.0,
                               seed=step))
    rewards = (comp % 2 == 0).mean(axis=1)
    means.append(float(rewards.mean()))
    state, _ = train_step(state, make_batch(tree, comp, rewards, config, CONFIG), config,
                          optimizer=opt)
  assert np.mean(means[-2:]) > means[0] + 0.2, means


@pytest.mark.slow
def test_sharded_step_in_a_subprocess():
  """tests/training/test_training_mesh.py on 8 CPU devices (the flag must precede JAX's start)."""
  from strategies import DEVICE_FLAGS
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + DEVICE_FLAGS).strip())
  env.pop("PYTEST_XDIST_WORKER", None)
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
       "tests/training/test_training_mesh.py"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  report = proc.stdout[-6000:] + proc.stderr[-2000:]
  assert proc.returncode == 0, report
  summary = proc.stdout.strip().splitlines()[-1]
  assert re.search(r"\b2 passed", summary) and "skipped" not in summary, report


def test_example_problems_reward_and_tree():
  from models.training.addition import Problem, problem_tree, problems, reward
  drawn = problems(np.random.default_rng(0), 81)
  assert len(set(drawn)) == 81 and all(1 <= p.a <= 9 and 1 <= p.b <= 9 for p in drawn)
  assert reward("The answer is 12.", 12) == 1.0 and reward("7 + 5 = 12", 12) == 0.0
  assert reward("no number", 3) == 0.0 and reward("-4", -4) == 1.0
  assert Problem(7, 5).question == "What is 7+5? Answer with a number."
  prompts = [[1, 2, 3, 7, 8, 9], [1, 2, 3, 7, 5, 6]]  # questions that start alike
  tree = problem_tree(prompts, 3, 2)
  assert tree.segments == (((1, 2, 3),), ((7, 8), (7, 5)))
  assert [tree.prompt(b) for b in range(4)] == [prompts[0]] * 2 + [prompts[1]] * 2
