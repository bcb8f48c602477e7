"""Sharding: the mesh spec and partition rules (in this 1-device process), and the 8-device
tests (tests/attention/test_sharding_devices.py) in a subprocess that starts JAX with 8 CPU devices.

XLA reads the device count once, when JAX's CPU backend starts, and the rest of the suite
runs on 1 device in the same worker processes; so the multi-device tests get their own
interpreter instead of a flag flipped here.
"""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh, PartitionSpec as P

from models.parallel import sharding as S
from models.model.config import preset
from models.model.llama import param_shapes
from strategies import DEVICE_FLAGS  # also what tests/test_models_training.py imports from here

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_eight_device_suite_in_a_subprocess():
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + DEVICE_FLAGS).strip())
  env.pop("PYTEST_XDIST_WORKER", None)
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
       "tests/attention/test_sharding_devices.py"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
  report = proc.stdout[-8000:] + proc.stderr[-2000:]
  assert proc.returncode == 0, report
  summary = proc.stdout.strip().splitlines()[-1]
  passed = re.search(r"(\d+) passed", summary)
  assert passed and int(passed.group(1)) >= 14 and "skipped" not in summary, report


def abstract(d, m):
  return AbstractMesh((d, m), ("data", "model"))


def test_make_mesh_specs_and_errors():
  n = len(jax.devices())
  mesh = S.make_mesh("auto")
  assert isinstance(mesh, Mesh) and mesh.axis_names == ("data", "model")
  assert dict(mesh.shape) == {"data": n, "model": 1}
  assert dict(S.make_mesh((-1, 1)).shape) == {"data": n, "model": 1}
  assert dict(S.make_mesh([1, 1]).shape) == {"data": 1, "model": 1}
  assert S.make_mesh(mesh) is mesh
  with pytest.raises(ValueError, match=f"needs {n + 1} devices; there are {n}"):
    S.make_mesh((n + 1, 1))
  for bad in ("big", (2,), (0, 1), (-1, -1), (1.5, 1), (1, 2, 3)):
    with pytest.raises(ValueError, match="mesh must be"):
      S.make_mesh(bad)
  with pytest.raises(ValueError, match="needs the axes"):
    S.make_mesh(Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("batch", "tensor")))


@pytest.mark.parametrize("hkv, m, r", [(8, 8, 1), (8, 2, 1), (2, 8, 4), (2, 4, 2), (1, 8, 8),
                                       (3, 2, 2), (6, 4, 2), (3, 3, 1)])
def test_kv_replication_makes_the_model_axis_divide_the_kv_heads(hkv, m, r):
  assert S.kv_replication(hkv, m) == r
  hq = hkv * m  # any query-head count that the model axis and GQA both allow
  config = preset("tiny").replace(num_heads=hq, num_kv_heads=hkv, head_dim=16,
                                  intermediate_size=32 * m)
  new = S.sharded_config(config, abstract(1, m))
  assert new.num_kv_heads == hkv * r and new.num_kv_heads % m == 0
  # GQA stays the same function: query head h reads replicated head h // (Hq / Hkv'),
  # which is a copy of original head (h // (Hq / Hkv')) // r == h // (Hq / Hkv).
  g, g_new = hq // hkv, hq // new.num_kv_heads
  assert all((h // g_new) // r == h // g for h in range(hq))


def test_replication_is_announced(caplog):
  S._warn_replication.cache_clear()
  with caplog.at_level(logging.WARNING, logger="models.parallel.sharding"):
    S.sharded_config(preset("tiny"), abstract(1, 4))  # 2 KV heads, 4 shards
  assert "each KV head is replicated 2 times" in caplog.text


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m", "llama-2-7b", "llama-3-8b"])
def test_every_parameter_of_every_preset_has_a_rule_that_divides(name):
  config = preset(name)
  m = 3 if config.num_heads % 4 else 4  # smollm2: 9 heads
  mesh = abstract(2, m)
  sharded = S.sharded_config(config, mesh)
  for path, spec in param_shapes(sharded).items():
    rule = S.param_spec(path, sharded, mesh)
    assert len(rule) <= len(spec.shape), (path, rule)
    for size, axis in zip(spec.shape, rule):
      assert axis in (None, "model"), (path, rule)
      assert axis is None or size % m == 0, (path, spec.shape, rule)
    if "proj" in path:  # every projection is split over the model axis
      assert "model" in tuple(rule), (path, rule)


def test_rules_table():
  config = preset("llama-3-8b")  # 32 query heads, 8 KV heads, vocab 128256
  mesh = abstract(2, 4)
  rule = lambda path: S.param_spec(path, config, mesh)
  assert rule("layers.0.self_attn.q_proj") == P(None, "model", None)  # [hidden, H, D]
  assert rule("layers.7.self_attn.k_proj") == P(None, "model", None)
  assert rule("layers.0.self_attn.o_proj") == P("model", None, None)  # [H, D, hidden]
  assert rule("layers.0.mlp.gate_proj") == P(None, "model")  # [hidden, F]
  assert rule("layers.0.mlp.down_proj") == P("model", None)  # [F, hidden]
  assert rule("embed_tokens") == rule("lm_head") == P("model", None)  # vocab-parallel
  assert rule("layers.0.input_layernorm.weight") == rule("norm.weight") == P()
  odd = config.replace(vocab_size=32001)
  assert S.param_spec("embed_tokens", odd, mesh) == P()  # replicated when V % m != 0
  with pytest.raises(ValueError, match="no partition rule"):
    S.param_spec("layers.0.self_attn.bias", config, mesh)
  with pytest.raises(ValueError, match="num_heads=9 is not a multiple of the model axis"):
    S.sharded_config(preset("smollm2-135m"), abstract(1, 2))


def test_the_model_on_a_one_device_mesh_is_laid_out_by_the_rules():
  from models.model.llama import flat_params, random_init

  mesh = S.make_mesh((1, 1))
  model = S.shard_model(random_init(preset("tiny"), seed=0), mesh)
  for path, x in flat_params(model).items():
    assert x.sharding.spec == S.param_spec(path, model.config, mesh), path
  assert S.shard_model(model, mesh) is model  # placed already: nothing to do


def test_a_placed_model_is_checked_by_its_shardings_alone_until_one_changes(monkeypatch):
  """After the first check a placed model is not walked again (a decode call on a mesh places
  its model each call); a weight moved off its sharding is placed again."""
  from flax import nnx

  from models.model.llama import flat_params, random_init

  mesh = S.make_mesh((1, 1))
  model = S.shard_model(random_init(preset("tiny"), seed=0), mesh)
  assert S.shard_model(model, mesh) is model
  splits = []
  real_split = nnx.split
  monkeypatch.setattr(nnx, "split", lambda *a, **k: splits.append(1) or real_split(*a, **k))
  assert S.shard_model(model, mesh) is model and splits == []
  weight = model.layers[0].self_attn.q_proj
  weight.set_value(jax.device_put(np.asarray(weight.get_value())))  # off the mesh
  placed = S.shard_model(model, mesh)
  assert splits and placed is not model
  for path, x in flat_params(placed).items():
    assert x.sharding.spec == S.param_spec(path, placed.config, mesh), path
