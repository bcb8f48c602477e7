"""GRPO rollouts from the serving engine (models.training.rollouts) equal static generate's for
the same tree and seed, before and after weight updates (engine.reset(model=...))."""

import numpy as np
import optax

from models.generation.loop import generate
from models.generation.prompt_tree import PromptTree
from models.generation.settings import GenerationSettings
from models.model.config import preset
from models.model.llama import random_init
from models.serving import Engine, EngineConfig
from models.training.grpo import GRPOConfig
from models.training.rollouts import engine_rollouts
from models.training.step import init_train_state, make_batch, train_step

EOS = 117  # a token some of these samples draw (the test checks that one does)
CONFIG = preset("tiny").replace(num_heads=4, num_kv_heads=2, head_dim=16)
ENGINE = EngineConfig(page_size=4, num_pages=64, max_running=8, max_prefill_tokens=16,
                      decode_steps=3, min_shared_tokens=4, batch_buckets=(8,),
                      prefill_row_buckets=(8,),
                      prefill_buckets=(16,), level_buckets=(2,), segment_buckets=(2,),
                      page_buckets=(4,), own_page_buckets=(8,))


def tokens(n, seed):
  return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def test_engine_rollouts_equal_generate_across_weight_updates():
  system = tokens(9, 1)
  tree = PromptTree.from_prompts([system + tokens(3, 2), system + tokens(5, 3), tokens(4, 4)],
                                 [4, 2, 2], min_shared_tokens=4)
  model = random_init(CONFIG, seed=1, std=0.15)
  engine = Engine(model, config=ENGINE, settings=GenerationSettings(impl="xla"))
  config = GRPOConfig(group_size=2)
  opt = optax.adam(3e-2)
  state = init_train_state(model, opt)
  ended = 0
  for step in range(2):
    kw = dict(max_new_tokens=6, temperature=1.0, seed=step, eos_id=EOS)
    want = np.asarray(generate(state.model(), tree, impl="xla", **kw))
    got = engine_rollouts(engine, tree, **kw)
    np.testing.assert_array_equal(got, want)
    ended += int((want == -1).any(axis=1).sum())
    rewards = (np.maximum(want, 0) % 2 == 0).mean(axis=1)
    state, _ = train_step(state, make_batch(tree, want, rewards, config, CONFIG), config,
                          optimizer=opt)
    engine.reset(model=state.model())
  assert ended > 0  # the EOS rule was exercised
