"""Sharded decoding on 8 CPU devices: the same tokens as one device, no gather of the shared cache.

Needs ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before JAX starts, so the
suite runs this module in a subprocess (``tests/attention/test_sharding.py``); collected in a
1-device process it is skipped. Run it alone with::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/attention/test_sharding_devices.py
"""

import json
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_shared_attn import (SharedLevel, attention_with_lse, hierarchical_attention,
                             shared_prefix_attention)
from jax_shared_attn.sharding import sharded
from models.parallel import sharding as S
from models.model.config import preset
from models.generation.loop import decode, generate, lower_decode, prefill
from models.model.llama import flat_params, random_init
from models.generation.prompt_tree import PromptTree

if jax.device_count() < 8 or jax.default_backend() != "cpu":
  pytest.skip("needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8); "
              "tests/attention/test_sharding.py runs this module in such a subprocess",
              allow_module_level=True)

MESHES = [(8, 1), (1, 8), (2, 4), (4, 2)]
NEW = 8
# 8 query heads, 2 KV heads (< 8 model shards: replicated 4x on (1, 8), 2x on (2, 4)).
CONFIG = preset("tiny").replace(num_heads=8, num_kv_heads=2, head_dim=16)


def prompt_of(n, seed):
  return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


SHARED = prompt_of(23, 1)
# Two levels: the common 23 tokens, then one of two remainders (each shared by its samples).
TREE = PromptTree.from_prompts([SHARED + prompt_of(12, 2), SHARED + prompt_of(5, 3)], [3, 5],
                               min_shared_tokens=4)
CASES = {  # name -> (prompt, num_samples, attention); 8 samples each: divisible by every data axis
    "hydragen-one-prompt": (prompt_of(19, 0), 8, "hydragen"),
    "hydragen-two-level-tree": (TREE, None, "hydragen"),
    "standard": (prompt_of(19, 0), 8, "standard"),
}


@pytest.fixture(scope="module")
def model():
  return random_init(CONFIG, seed=3, std=0.12)


@pytest.fixture(scope="module")
def single_device(model):
  """Greedy tokens of every case on one device (no mesh): the reference."""
  return {name: np.asarray(generate(model, p, num_samples=n, max_new_tokens=NEW, attention=a))
          for name, (p, n, a) in CASES.items()}


def test_the_tree_case_has_two_shared_levels():
  assert TREE.num_levels == 2 and len(TREE.segments[1]) == 2


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: f"mesh{s[0]}x{s[1]}")
def test_greedy_tokens_equal_the_single_device_run(model, single_device, mesh_shape):
  mesh = S.make_mesh(mesh_shape)
  sharded_model = S.shard_model(model, mesh)
  for name, (prompt, n, attention) in CASES.items():
    out = np.asarray(generate(sharded_model, prompt, num_samples=n, max_new_tokens=NEW,
                              attention=attention, mesh=mesh))
    np.testing.assert_array_equal(out, single_device[name], err_msg=f"{name} on {mesh_shape}")
  # The state really is split: each device holds its rows x heads block of the own cache
  # and its heads of every shared segment (replicated over "data").
  d, m = mesh_shape
  hkv = sharded_model.config.num_kv_heads
  assert hkv == max(CONFIG.num_kv_heads, m)  # KV heads replicated up to the model axis
  state = prefill(sharded_model, TREE, max_new_tokens=NEW, mesh=mesh)
  want = S.state_shardings(state, mesh)
  for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
    assert x.sharding.is_equivalent_to(s, x.ndim), (x.shape, x.sharding, s)
  own = state.cache.k[0]
  assert {sh.data.shape for sh in own.addressable_shards} == {(8 // d, NEW, hkv // m, 16)}
  for level in state.cache.levels:
    n_seg, t = level.k[0].shape[:2]
    assert {sh.data.shape for sh in level.k[0].addressable_shards} == {(n_seg, t, hkv // m, 16)}


def test_sampled_tokens_and_split_decoding_equal_the_single_device_run(model):
  kw = dict(max_new_tokens=NEW, temperature=0.8, top_k=40, top_p=0.9, seed=7)
  ref = np.asarray(generate(model, TREE, **kw))
  mesh = S.make_mesh((2, 4))
  np.testing.assert_array_equal(np.asarray(generate(model, TREE, mesh=mesh, **kw)), ref)
  assert len({tuple(r) for r in ref}) > 1
  # decode infers the mesh from the state; two calls share one program (runtime step count).
  sampling = {k: kw[k] for k in ("temperature", "top_k", "top_p")}
  state = prefill(model, TREE, max_new_tokens=NEW, seed=7, mesh=mesh)
  state = decode(model, state, 3, **sampling)
  assert S.mesh_of(state) is mesh and int(state.step) == 3
  state = decode(model, state, **sampling)
  np.testing.assert_array_equal(np.asarray(state.completions()), ref)
  # top-k/top-p sort whole rows: each data shard gathers only its own rows' logits.
  state = prefill(model, TREE, max_new_tokens=NEW, seed=7, mesh=mesh)
  colls = collectives(lower_decode(model, state, **sampling).compile().as_text())
  assert touching(colls, {(4, 1, CONFIG.vocab_size), (4, CONFIG.vocab_size)})
  assert not touching(colls, {(8, CONFIG.vocab_size), (8, 1, CONFIG.vocab_size)})


# -- the compiled decode program ------------------------------------------------------------------

_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][\w-]*)\((.*)$")
COLLECTIVES = ("all-gather", "all-gather-start", "all-reduce", "all-reduce-start", "all-to-all",
               "collective-permute", "collective-permute-start", "reduce-scatter")


def collectives(hlo: str) -> list[tuple[str, str, list[str]]]:
  """(op, result type, operand types) of every collective in compiled HLO text."""
  types, found = {}, []
  for line in hlo.splitlines():
    m = _INSTR.match(line)
    if m:
      name, typ, op, rest = m.groups()
      types[name] = typ
      if op in COLLECTIVES:
        found.append((op, typ, re.findall(r"%([\w.\-]+)", rest.split("),")[0])))
  return [(op, typ, [types.get(n, "?") for n in operands]) for op, typ, operands in found]


def dims(shape) -> str:
  return "[" + ",".join(str(int(s)) for s in shape) + "]"


def touching(colls, shapes) -> list:
  """The collectives whose result or an operand has one of ``shapes`` (any dtype)."""
  return [c for c in colls
          if any(dims(s) + "{" in t or t.endswith(dims(s)) for s in shapes
                 for t in [c[1], *c[2]])]


def shared_shapes(state, mesh):
  """Every shared segment buffer's shape: global and per device (heads split over "model")."""
  m = mesh.shape["model"]
  out = set()
  for level in state.cache.levels:
    n, t, h, d = level.k[0].shape
    out |= {(n, t, h, d), (n, t, h // m, d)}
  return out


@pytest.fixture(scope="module")
def compiled_tree_decode(model):
  mesh = S.make_mesh((2, 4))
  state = prefill(model, TREE, max_new_tokens=NEW, mesh=mesh)
  return state, mesh, lower_decode(model, state).compile()


def test_decode_program_never_gathers_the_shared_cache(model, compiled_tree_decode):
  state, mesh, compiled = compiled_tree_decode
  hlo = compiled.as_text()
  colls = collectives(hlo)
  assert colls  # the tensor-parallel all-reduces are there: the parser sees collectives
  shapes = shared_shapes(state, mesh)
  assert {(1, 23, 4, 16), (2, 11, 4, 16)} <= shapes  # 23 shared tokens; remainders 12, 5 minus the last
  assert not touching(colls, shapes), touching(colls, shapes)
  # Nor the own cache, nor any parameter: attention and cache writes are per shard.
  own = {state.cache.k[0].shape, (4, NEW, 1, 16)}
  assert not touching(colls, own), touching(colls, own)
  params = {x.shape for x in flat_params(S.shard_model(model, mesh)).values() if x.ndim > 1}
  assert not [c for c in touching(colls, params) if c[0].startswith("all-gather")]
  # One decode loop carrying the per-device cache (the XLA path loops over a level's segments
  # inside it), every state buffer aliased (donated), the own cache only scattered into.
  loops = [line for line in hlo.splitlines() if re.search(r"\) while\(", line)]
  assert len([line for line in loops if "f32[4,8,1,16]" in line.split(" while(")[0]]) == 1
  per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
  assert compiled.memory_analysis().alias_size_in_bytes >= per_device
  local_own = re.findall(r"%(\S+) = f32\[4,8,1,16\]\{[^}]*\} ([\w-]+)\(", hlo)
  assert local_own and all(op in ("parameter", "get-tuple-element", "scatter")
                           or (op == "fusion" and "scatter" in name) for name, op in local_own)


def test_data_parallel_decode_loop_runs_without_collectives(model):
  """On a data-only mesh each device decodes its own samples: without an EOS the loop (body
  and condition) has no collective, so no device waits for the others each step; with an EOS
  the one per step is the all-finished check (a 1-byte all-reduce)."""
  from models.parallel.hlo_collectives import loop_text, parse_collectives
  mesh = S.make_mesh((8, 1))
  state = prefill(model, prompt_of(19, 0), num_samples=8, max_new_tokens=NEW, mesh=mesh)
  free = lower_decode(model, state, eos_id=None).compile().as_text()
  assert parse_collectives(loop_text(free)) == []
  assert parse_collectives(free)  # the one check before the loop: the parser sees it
  with_eos = lower_decode(model, state, eos_id=3).compile().as_text()
  assert [(c["op"], c["type"]) for c in parse_collectives(loop_text(with_eos))] == [
      ("all-reduce", "pred[]")]


def test_the_gather_check_can_fail():
  """A shared segment split over "data" must be gathered for attention: the check sees it."""
  mesh = S.make_mesh((2, 4))
  r = np.random.default_rng(0)
  q = jnp.asarray(r.standard_normal((4, 1, 8, 16)), jnp.float32)
  sk = jnp.asarray(r.standard_normal((4, 6, 4, 16)), jnp.float32)
  seg = jnp.asarray(r.standard_normal((1, 22, 4, 16)), jnp.float32)
  wrong = NamedSharding(mesh, P(None, "data", "model", None))  # tokens split over data

  def attend(seg_k, seg_v):
    level = SharedLevel(seg_k, seg_v, jnp.array([22]), jnp.zeros((4,), jnp.int32))
    return sharded(hierarchical_attention, mesh)(q, [level], sk, sk, impl="xla")

  seg = jax.device_put(seg, wrong)
  colls = collectives(jax.jit(attend).lower(seg, seg).compile().as_text())
  assert touching(colls, {(1, 22, 1, 16)})


# -- KV head replication --------------------------------------------------------------------------

def test_kv_heads_are_replicated_consistently_and_said(model, caplog):
  with caplog.at_level(logging.WARNING, logger="models.parallel.sharding"):
    S._warn_replication.cache_clear()
    placed = S.shard_model(model, S.make_mesh((1, 8)))
  assert "replicated 4 times" in caplog.text
  k = np.asarray(placed.layers[0].self_attn.k_proj[...])
  orig = np.asarray(model.layers[0].self_attn.k_proj[...])
  np.testing.assert_array_equal(k, np.repeat(orig, 4, axis=1))  # head j = original j // 4
  # GQA stays exact: query head h reads replicated head h // 1 = original h // 4.
  ids = jnp.asarray(np.array([prompt_of(11, 5)] * 8, np.int32))
  ref = model(ids)
  for shape, cfg in (((1, 8), None), ((4, 2), CONFIG.replace(num_heads=6, num_kv_heads=3,
                                                             intermediate_size=96))):
    base = model if cfg is None else random_init(cfg, seed=1, std=0.12)
    mesh = S.make_mesh(shape)
    on_mesh = S.shard_model(base, mesh)
    if cfg is not None:  # lcm(3, 2) = 6 KV heads: each of the 3 repeated twice
      assert on_mesh.config.num_kv_heads == 6
      ref = base(ids)
    logits = jax.jit(lambda i: on_mesh(i, sharding=S.attention_sharding(mesh)))(ids)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), rtol=1e-5, atol=1e-5)


# -- loading into shards --------------------------------------------------------------------------

def write_hf_dir(path, model, model_type="llama"):
  """A transformers-style checkpoint (config.json + model.safetensors) of ``model``."""
  from safetensors.numpy import save_file

  from models.checkpoints.loading import hf_tensors
  c = model.config
  tensors = hf_tensors(flat_params(model), c)
  path.mkdir()
  save_file(tensors, str(path / "model.safetensors"))
  (path / "config.json").write_text(json.dumps(dict(
      model_type=model_type, _name_or_path=c.name, vocab_size=c.vocab_size,
      hidden_size=c.hidden_size,
      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
      num_key_value_heads=c.num_kv_heads, intermediate_size=c.intermediate_size,
      head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
      max_position_embeddings=c.max_position_embeddings, torch_dtype="float32")))


def test_loading_places_each_tensor_on_its_shards(model, tmp_path):
  from models.checkpoints.loading import from_pretrained, save_pretrained

  mesh = S.make_mesh((2, 4))
  want = S.shard_model(model, mesh)
  write_hf_dir(tmp_path / "hf", model)
  # Every host->device transfer is an explicit device_put of one tensor to its NamedSharding
  # (an implicit jnp.asarray of a whole tensor on the default device would raise here).
  with jax.transfer_guard_host_to_device("disallow"):
    loaded = from_pretrained(str(tmp_path / "hf"), mesh=mesh).model
    drawn = random_init(CONFIG, seed=3, std=0.12, mesh=mesh)
  save_pretrained(str(tmp_path / "orbax"), model)
  restored = from_pretrained(str(tmp_path / "orbax"), mesh=mesh).model
  expected = flat_params(want)
  for candidate in (loaded, drawn, restored):
    assert candidate.config == want.config
    for path, x in flat_params(candidate).items():
      spec = S.param_spec(path, want.config, mesh)
      assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (path, x.sharding)
      np.testing.assert_array_equal(np.asarray(x), np.asarray(expected[path]), err_msg=path)


def test_family_parameters_are_sharded_and_loaded_into_shards(tmp_path):
  """q/k/v biases (Qwen2; KV heads repeated with their projections' on (1, 8)) and q/k norms
  (Qwen3): sharded logits and greedy tokens equal one device's; a qwen2 checkpoint and its
  orbax copy load straight into the shards."""
  from models.checkpoints.loading import from_pretrained, save_pretrained

  base = random_init(CONFIG.replace(qkv_bias=True, qk_norm=True), seed=5, std=0.12)
  ids = jnp.asarray(np.array([prompt_of(11, 6)] * 8, np.int32))
  ref, ref_tokens = base(ids), np.asarray(generate(base, TREE, max_new_tokens=NEW))
  for shape in ((2, 4), (1, 8)):
    mesh = S.make_mesh(shape)
    on_mesh = S.shard_model(base, mesh)
    r = on_mesh.config.num_kv_heads // CONFIG.num_kv_heads
    np.testing.assert_array_equal(np.asarray(on_mesh.layers[0].self_attn.k_bias[...]),
                                  np.repeat(np.asarray(base.layers[0].self_attn.k_bias[...]), r, 0))
    logits = jax.jit(lambda i: on_mesh(i, sharding=S.attention_sharding(mesh)))(ids)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), rtol=1e-5, atol=1e-5)
  # Greedy tokens with the replicated KV heads (and biases) of (1, 8).
  np.testing.assert_array_equal(
      np.asarray(generate(on_mesh, TREE, max_new_tokens=NEW, mesh=S.make_mesh((1, 8)))), ref_tokens)
  qwen2 = random_init(CONFIG.replace(qkv_bias=True), seed=6, std=0.12)
  write_hf_dir(tmp_path / "hf", qwen2, model_type="qwen2")
  save_pretrained(str(tmp_path / "orbax"), qwen2)
  mesh = S.make_mesh((1, 8))
  want = S.shard_model(qwen2, mesh)
  with jax.transfer_guard_host_to_device("disallow"):
    loaded = from_pretrained(str(tmp_path / "hf"), mesh=mesh).model
  restored = from_pretrained(str(tmp_path / "orbax"), mesh=mesh).model
  expected = flat_params(want)
  assert any(path.endswith("k_bias") for path in expected)
  for candidate in (loaded, restored):
    assert candidate.config == want.config
    for path, x in flat_params(candidate).items():
      spec = S.param_spec(path, want.config, mesh)
      assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (path, x.sharding)
      np.testing.assert_array_equal(np.asarray(x), np.asarray(expected[path]), err_msg=path)


# -- the attention wrapper --------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["pallas:triton", "pallas:tpu", "xla"])
def test_kernels_run_per_shard(impl):
  """The Pallas kernels (interpret mode here) under shard_map equal the unsharded XLA path.

  The tree (fused shared_attention path) with every family; the other two API functions
  through the wrapper with the XLA path (interpret mode is slow; the kernels are the same).
  """
  mesh = S.make_mesh((2, 4))
  r = np.random.default_rng(1)
  rand = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  q, sk, sv = rand(4, 2, 8, 16), rand(4, 7, 4, 16), rand(4, 7, 4, 16)
  lens = jnp.array([2, 7, 3, 5])
  level = SharedLevel(rand(2, 5, 4, 16), rand(2, 5, 4, 16), jnp.array([5, 3]),
                      jnp.array([0, 1, -1, 1]))
  cases = [(hierarchical_attention, (q, [level], sk, sv),
            dict(suffix_lengths=lens, return_lse=True))]
  if impl == "xla":
    cases += [(shared_prefix_attention, (q, level.k[0], level.v[0], sk, sv),
               dict(prefix_length=4, suffix_lengths=lens, return_lse=True)),
              (attention_with_lse, (q, sk, sv), dict(kv_lengths=lens, causal=True))]
  for fn, args, kw in cases:
    ref = jax.jit(lambda *a: fn(*a, **kw, impl="xla"))(*args)
    got = jax.jit(lambda *a: sharded(fn, mesh)(*a, **kw, impl=impl))(*args)
    assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, P("data", None, "model")), 4)
    for a, b in zip(got, ref):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=2e-6,
                                 err_msg=f"{fn.__name__} {impl}")
  if impl == "xla":  # called eagerly on concrete arrays, the arrays given by keyword
    out = sharded(hierarchical_attention, mesh)(q=q, levels=level, suffix_k=sk, suffix_v=sv,
                                                suffix_lengths=lens)
    ref = jax.jit(lambda *a: hierarchical_attention(*a, suffix_lengths=lens, impl="xla"))(
        q, [level], sk, sv)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-6, atol=2e-6)


def test_wrapper_and_generate_errors_name_the_problem(model):
  mesh = S.make_mesh((2, 4))
  q, kv = jnp.zeros((4, 1, 8, 16)), jnp.zeros((4, 3, 2, 16))
  with pytest.raises(ValueError, match="suffix_k has 2 key/value heads.*4 shards.*'model'"):
    sharded(hierarchical_attention, mesh)(q, [], kv, kv)
  with pytest.raises(ValueError, match="q has 3 sequences.*2 shards of mesh axis 'data'"):
    sharded(attention_with_lse, mesh)(q[:3], kv[:3], kv[:3])
  with pytest.raises(ValueError, match="key/value heads of k"):  # the API's own check, global shapes
    sharded(attention_with_lse, mesh)(q, kv[..., :1, :].repeat(3, 2), kv[..., :1, :].repeat(3, 2))
  with pytest.raises(TypeError, match="fn must be"):
    sharded(jnp.dot, mesh)
  with pytest.raises(ValueError, match="num_samples: 6 samples.*4 shards"):
    prefill(model, prompt_of(9, 0), num_samples=6, max_new_tokens=2, mesh=(4, 2))
  with pytest.raises(ValueError, match="num_heads=8 is not a multiple of the model axis"):
    S.shard_model(model, S.make_mesh((1, 3)))
