"""``models.model.graph``: a model split once, its weights read live at every call."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.model import graph as model_graph
from models.model.config import preset
from models.model.llama import random_init


def test_split_is_kept_per_model_and_merges_back_to_the_same_model():
  model = random_init(preset("tiny"), seed=0)
  graph, weights = model_graph.split(model)
  again, weights2 = model_graph.split(model)
  assert again is graph and hash(again) == hash(graph)
  assert all(a is b for a, b in zip(weights, weights2))
  merged = graph.merge(weights)
  for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(merged))):
    assert a is b
  # Another model of the same structure: an equal graph (one program), a distinct split.
  other, _ = model_graph.split(random_init(preset("tiny"), seed=1))
  assert other is not graph and other == graph and hash(other) == hash(graph)


def test_weights_are_read_at_every_call_and_a_jitted_program_traces_once():
  model = random_init(preset("tiny"), seed=0)
  traces = []

  @jax.jit
  def total(weights):
    traces.append(1)
    return sum(jnp.sum(w.astype(jnp.float32)) for w in weights)

  run = lambda: float(total(model_graph.split(model)[1]))
  before = run()
  nnx.update(model, jax.tree.map(lambda x: x * 0, nnx.state(model)))  # in place
  assert run() == 0.0 != before
  assert len(traces) == 1


def test_the_cache_lets_go_of_a_model_and_forget_drops_its_split():
  model = random_init(preset("tiny"), seed=0)
  graph, _ = model_graph.split(model)
  model_graph.forget(model)
  assert model_graph.split(model)[0] is not graph
  key = id(model)
  del model, graph
  gc.collect()
  assert key not in model_graph._SPLITS


def test_a_variable_set_in_place_is_seen_and_a_replaced_one_after_forget():
  model = random_init(preset("tiny"), seed=0)
  weight = model.layers[0].self_attn.q_proj
  index = next(i for i, w in enumerate(model_graph.split(model)[1]) if w is weight.get_value())
  new = np.asarray(weight.get_value()) + 1
  weight.set_value(jnp.asarray(new))  # in place: seen at once
  np.testing.assert_array_equal(np.asarray(model_graph.split(model)[1][index]), new)
  replaced = np.asarray(weight.get_value()) + 1
  model.layers[0].self_attn.q_proj = nnx.Param(jnp.asarray(replaced))  # a new variable
  np.testing.assert_array_equal(np.asarray(model_graph.split(model)[1][index]), new)  # kept
  model_graph.forget(model)
  np.testing.assert_array_equal(np.asarray(model_graph.split(model)[1][index]), replaced)
