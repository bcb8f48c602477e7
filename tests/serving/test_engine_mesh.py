"""The serving engine tensor parallel on 4 CPU devices equals the one-device engine.

Needs ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (or more) before JAX starts; the
suite runs it in a subprocess (tests/serving/test_engine.py). Alone::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/serving/test_engine_mesh.py
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import SETTINGS, assert_drained, config, expected, got, workload

from models.model.config import preset
from models.model.llama import random_init
from models.parallel.hlo_collectives import parse_collectives
from models.serving import Engine, Request, RowRules, device

if jax.device_count() < 4 or jax.default_backend() != "cpu":
  pytest.skip("needs 4 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4); "
              "tests/serving/test_engine.py runs this module in such a subprocess",
              allow_module_level=True)


# 2 KV heads: split; 4: each repeated twice; the layers unrolled or under one scan
@pytest.mark.parametrize("model_axis, scan", [(2, True), (4, True), (2, False)])
def test_tensor_parallel_engine_gives_the_one_device_tokens(model_axis, scan):
  model = random_init(preset("tiny"), seed=0)
  rng = np.random.default_rng(7)
  requests = workload(rng) + [Request(list(range(30, 41)), n=2, max_tokens=4, temperature=1.0,
                                      top_k=7, seed=3, ignore_eos=True)]
  engine = Engine(model, config=config(scan_layers=scan), settings=SETTINGS,
                  mesh=(1, model_axis))
  heads = max(2, model_axis)  # KV heads after replication
  for pool in engine._k + engine._v:
    assert pool.shape[2] == heads
    assert {s.data.shape[2] for s in pool.addressable_shards} == {heads // model_axis}
  outs = engine.generate(requests)
  for request, out in zip(requests, outs):
    assert got(out) == expected(model, request)
  assert engine.stats()["cascade_calls"] > 0
  assert_drained(engine)
  # Each layer's write and attention run per shard (shard_map: what a kernel with no
  # partitioning rule needs, e.g. a native Pallas call), and no collective carries K, V or
  # queries (their last dimension is head_dim = 16; the hidden size is 64, the vocabulary 256).
  # Under the scan the program holds one layer's.
  traced, hlo = decode_program(engine, levels=2)
  layers = 1 if scan else preset("tiny").num_layers
  assert str(traced.jaxpr).count("shard_map[") == 2 * layers
  moved = [c["type"] for c in parse_collectives(hlo) if re.search(r",16\]", c["type"])]
  assert "all-reduce" in hlo and moved == []
  engine.reset(model=random_init(preset("tiny"), seed=1))  # new weights placed on the mesh
  assert got(engine.generate(requests[:1])[0]) == expected(
      random_init(preset("tiny"), seed=1), requests[0])


def decode_program(engine, levels: int):
  """The decode program's trace and compiled HLO text at 8 rows."""
  b, s, p, o = 8, 2, 8, 8
  z = lambda *shape: np.zeros(shape, np.int32)
  args = (engine._graphdef, engine._params, engine._k, engine._v, jnp.asarray(z(b, 1)),
          z(levels, s, p), z(levels, s), np.full((levels, b), -1, np.int32), z(b, o), z(b),
          z(b), RowRules.of([None] * b), np.zeros(b, np.uint32), z(b), z(b))
  traced = device.decode.trace(*args, num_steps=engine.config.decode_steps,
                               settings=engine.settings, mesh=engine.mesh)
  return traced, traced.lower().compile().as_text()


def test_a_data_axis_is_refused():
  with pytest.raises(ValueError, match="data axis must be 1"):
    Engine(random_init(preset("tiny"), seed=0), config=config(), mesh=(2, 2))
