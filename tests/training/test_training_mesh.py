"""The GRPO step sharded on 8 CPU devices equals the one-device step.

Needs ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX starts; the suite runs
it in a subprocess (tests/training/test_grpo_training.py). Alone::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/training/test_training_mesh.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from models.generation.prompt_tree import PromptTree
from models.model.config import preset
from models.model.llama import flat_params, random_init
from models.parallel import sharding as S
from models.training.grpo import GRPOConfig
from models.training.logprobs import completion_logprobs, prompt_arrays
from models.training.step import init_train_state, make_batch, train_step

if jax.device_count() < 8 or jax.default_backend() != "cpu":
  pytest.skip("needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8); "
              "tests/training/test_grpo_training.py runs this module in such a subprocess",
              allow_module_level=True)

# 2 KV heads: a model axis of 2 splits them without replication (the same parameters).
CONFIG = preset("tiny").replace(num_heads=4, num_kv_heads=2, head_dim=16)


def tokens(n, seed):
  return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


@pytest.fixture(scope="module")
def unsharded():
  """The model, batch, optimizer, reference parameters and the one-device step's result
  ``(state, metrics)``: computed once, the reference of every mesh shape."""
  model = random_init(CONFIG, seed=2, std=0.15)
  root = tokens(10, 0)
  tree = PromptTree.from_prompts([root + tokens(4, 1), root + tokens(4, 2)], 4,
                                 min_shared_tokens=4)
  comp = np.random.default_rng(3).integers(0, 256, (8, 5)).astype(np.int32)
  comp[2, 2:] = -1
  rewards = np.random.default_rng(4).standard_normal(8)
  config = GRPOConfig(group_size=4, kl_coef=0.05)
  old = nnx.jit(completion_logprobs)(model, prompt_arrays(tree), jnp.asarray(comp)) - 0.1
  batch = make_batch(tree, comp, rewards, config, CONFIG, old_logprobs=old)
  # SGD with momentum: the update is linear in the gradients (Adam's first step, g / |g|,
  # would magnify rounding in near-zero gradients), and momentum is optimizer state to place.
  opt = optax.sgd(0.1, momentum=0.9)
  reference = nnx.split(model)[1]
  one = train_step(init_train_state(model, opt), batch, config, optimizer=opt,
                   reference=reference)
  return model, batch, config, opt, one


@pytest.mark.parametrize("mesh_shape", [(4, 2), (8, 1)])
def test_sharded_step_equals_the_unsharded_step(unsharded, mesh_shape):
  model, batch, config, opt, (one, m1) = unsharded
  mesh = S.make_mesh(mesh_shape)
  state = init_train_state(model, opt, mesh=mesh)
  ref_sharded = nnx.split(S.shard_model(model, mesh))[1]
  many, m8 = train_step(state, batch, config, optimizer=opt, reference=ref_sharded, mesh=mesh)

  for k in m1:
    np.testing.assert_allclose(float(m8[k]), float(m1[k]), rtol=1e-5, atol=1e-6, err_msg=k)
  got, want, start = flat_params(many.model()), flat_params(one.model()), flat_params(model)
  for path in want:
    before = np.asarray(start[path])
    step = np.asarray(want[path]) - before
    # 1e-5 of the largest update (gradient sums reordered by sharding) plus the rounding of
    # the parameter itself (norm weights near 1: one float32 ulp is 1.2e-7).
    tol = 1e-5 * np.abs(step).max() + 2 * np.finfo(np.float32).eps * np.abs(before).max()
    np.testing.assert_allclose(np.asarray(got[path]) - before, step, atol=tol, rtol=0,
                               err_msg=path)
    sharding = got[path].sharding  # the step keeps every parameter on its rule's shards
    assert isinstance(sharding, NamedSharding), path
    assert sharding.is_equivalent_to(NamedSharding(mesh, S.param_spec(path, CONFIG, mesh)),
                                     got[path].ndim), path
  for leaf, param in zip(jax.tree.leaves(many.opt_state), jax.tree.leaves(many.params)):
    assert leaf.sharding.is_equivalent_to(param.sharding, param.ndim)  # momentum = its param
