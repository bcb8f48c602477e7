"""The TPU family through the public API (impl="pallas:tpu") and get_ops' dispatch.

On this CPU machine ``impl="pallas:tpu"`` lowers each kernel through
``platform_dependent``'s default branch (Pallas' HLO interpreter) with the block
sizes a TPU of unknown kind would use (v5e's); one shape per function exceeds
a 512-key block so block boundaries are crossed here too. Everything is compared
with the float64 oracle of full attention over the concatenated context.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_shared_attn import attention_with_lse, hierarchical_attention, shared_prefix_attention
from jax_shared_attn import ops as ops_lib
from jax_shared_attn.testing import oracle_full, oracle_tree, rel_err
from pallas_kernels import tpu
from strategies import (SEEDS, assert_close, count_case, lengths, rand, random_tree,
                        small_jit)

STATIC = ("causal", "impl", "return_lse", "scale")
INTERPRETED = jax.default_backend() != "tpu"
prefix_jit = small_jit(shared_prefix_attention, INTERPRETED, static_argnames=STATIC)
tree_jit = small_jit(hierarchical_attention, INTERPRETED, static_argnames=STATIC)
full_jit = small_jit(attention_with_lse, INTERPRETED, static_argnames=("causal", "impl", "scale"))

# ((B, Tq, Hq, Hkv, D, P, S), dtype, causal): G 8/2/3/1/8, D 64/80/128/256, empty prefix,
# empty suffix, Tq > suffix length; the last one crosses 512-key blocks (v5e sizes).
PREFIX_CASES = (
    ((4, 1, 8, 1, 128, 40, 9), "bfloat16", True),
    ((3, 2, 4, 2, 80, 23, 6), "float32", True),
    ((2, 3, 6, 2, 256, 13, 4), "float16", False),
    ((5, 1, 4, 1, 64, 0, 7), "bfloat16", True),
    ((4, 2, 8, 2, 128, 31, 0), "float32", True),
    ((3, 1, 8, 1, 64, 530, 520), "bfloat16", True),
)
# ((B, Tq, Hq, Hkv, D, S), levels as ((N, T), ...), dtype, causal)
TREE_CASES = (
    ((4, 1, 8, 1, 128, 6), ((1, 9),), "bfloat16", True),
    ((6, 2, 4, 2, 80, 4), ((1, 12), (3, 5)), "float32", True),
    ((5, 1, 6, 2, 256, 3), ((2, 6), (4, 3), (3, 2)), "bfloat16", False),
    ((7, 3, 16, 2, 64, 0), ((4, 7),), "float32", True),
    ((9, 1, 8, 1, 64, 5), ((1, 530), (3, 7)), "bfloat16", True),
)
# ((B, Tq, Hq, Hkv, D, Tk), dtype, causal)
FULL_CASES = (
    ((3, 1, 8, 1, 128, 33), "bfloat16", True),
    ((2, 3, 4, 2, 80, 12), "float32", True),
    ((2, 4, 16, 2, 64, 0), "float32", False),
    ((2, 2, 8, 4, 128, 700), "bfloat16", True),
)


@settings(max_examples=24)
@given(data=st.data(), seed=SEEDS, case=st.sampled_from(PREFIX_CASES))
def test_shared_prefix_attention(data, seed, case):
  count_case("tpu_api_shared_prefix")
  (b, tq, hq, hkv, d, p, s), dtype, causal = case
  rng = np.random.default_rng(seed)
  plen = data.draw(st.integers(0, p))
  slen = lengths(data.draw, b, s)
  q, q64 = rand(rng, (b, tq, hq, d), dtype)
  pk, pk64 = rand(rng, (p, hkv, d), dtype)
  pv, pv64 = rand(rng, (p, hkv, d), dtype)
  sk, sk64 = rand(rng, (b, s, hkv, d), dtype)
  sv, sv64 = rand(rng, (b, s, hkv, d), dtype)
  out, lse = prefix_jit(q, pk, pv, sk, sv, prefix_length=jnp.int32(plen), suffix_lengths=slen,
                        causal=causal, impl="pallas:tpu", return_lse=True)
  assert out.dtype == q.dtype and lse.dtype == jnp.float32
  ref = oracle_tree(q64, [[pk64[:plen]]] * b, [[pv64[:plen]]] * b, sk64, sv64, slen,
                    causal=causal)
  assert_close(out, lse, *ref, dtype)


@settings(max_examples=20)
@given(data=st.data(), seed=SEEDS, case=st.sampled_from(TREE_CASES))
def test_hierarchical_attention(data, seed, case):
  count_case("tpu_api_hierarchical")
  (b, tq, hq, hkv, d, s), structure, dtype, causal = case
  rng = np.random.default_rng(seed)
  levels, seg_k, seg_v = random_tree(data.draw, rng, b, hkv, d, dtype, structure)
  slen = lengths(data.draw, b, s)
  q, q64 = rand(rng, (b, tq, hq, d), dtype)
  sk, sk64 = rand(rng, (b, s, hkv, d), dtype)
  sv, sv64 = rand(rng, (b, s, hkv, d), dtype)
  out, lse = tree_jit(q, levels, sk, sv, suffix_lengths=slen, causal=causal, impl="pallas:tpu",
                      return_lse=True)
  ref = oracle_tree(q64, seg_k, seg_v, sk64, sv64, slen, causal=causal)
  assert_close(out, lse, *ref, dtype)


@settings(max_examples=12)
@given(data=st.data(), seed=SEEDS, case=st.sampled_from(FULL_CASES))
def test_attention_with_lse(data, seed, case):
  count_case("tpu_api_full")
  (b, tq, hq, hkv, d, tk), dtype, causal = case
  rng = np.random.default_rng(seed)
  kv_len = lengths(data.draw, b, tk)
  q, q64 = rand(rng, (b, tq, hq, d), dtype)
  k, k64 = rand(rng, (b, tk, hkv, d), dtype)
  v, v64 = rand(rng, (b, tk, hkv, d), dtype)
  out, lse = full_jit(q, k, v, kv_lengths=kv_len, causal=causal, impl="pallas:tpu")
  assert_close(out, lse, *oracle_full(q64, k64, v64, kv_len, causal=causal), dtype)


def test_resolve_maps_pallas_tpu_to_this_family():
  ops = ops_lib.resolve("pallas:tpu", "test")
  assert ops.name == "pallas:tpu"


def test_get_ops_rejects_unknown_chip():
  with pytest.raises(ValueError, match="chip must be one of"):
    tpu.get_ops(chip="v4")


def test_lowering_time_choice_equals_forced_simulator():
  """interpret=None (HLO interpreter here) and interpret=True (TPU simulator) run the same
  kernel: identical results."""
  rng = np.random.default_rng(0)
  q, _ = rand(rng, (3, 2, 4, 64), "float32")
  k, _ = rand(rng, (3, 21, 2, 64), "float32")
  prior = (jnp.asarray(rng.normal(size=(3, 2, 4, 64)), jnp.float32),
           jnp.asarray(rng.normal(size=(3, 2, 4)), jnp.float32))
  lens = jnp.array([21, 0, 5], jnp.int32)
  bs = tpu.BlockSizes(suffix_keys=16)
  results = [tpu.get_ops(interpret=i, block_sizes=bs).suffix_attention(
      q, k, k, kv_lengths=lens, causal=True, scale=0.125, prior=prior) for i in (None, True)]
  for a, b in zip(*results):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_native_is_refused_on_cpu():
  if jax.default_backend() == "tpu":
    pytest.skip("a TPU runs the native kernel")
  q = jnp.zeros((1, 1, 1, 128), jnp.float32)
  k = jnp.zeros((4, 1, 128), jnp.float32)
  with pytest.raises(Exception, match="interpret"):
    jax.block_until_ready(tpu.get_ops(interpret=False).prefix_attention(
        q, k, k, kv_length=jnp.int32(4), scale=1.0))


def test_grad_through_the_tpu_family_is_the_reference_vjp():
  rng = np.random.default_rng(4)
  q, _ = rand(rng, (2, 1, 4, 64), "float32")
  pk, _ = rand(rng, (9, 2, 64), "float32")
  sk, _ = rand(rng, (2, 5, 2, 64), "float32")
  lens = jnp.array([5, 2], jnp.int32)
  loss = lambda impl: lambda q: jnp.sum(shared_prefix_attention(
      q, pk, pk, sk, sk, suffix_lengths=lens, impl=impl) ** 2)
  np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(loss("pallas:tpu")))(q)),
                             np.asarray(jax.jit(jax.grad(loss("xla")))(q)), rtol=1e-5, atol=1e-6)


def test_empty_batch_and_query_length():
  ops = tpu.get_ops()
  ones = lambda *s: jnp.ones(s, jnp.float32)
  for b, tq in ((2, 0), (0, 1)):
    out, lse = ops.prefix_attention(ones(b, tq, 4, 64), ones(5, 2, 64), ones(5, 2, 64),
                                    kv_length=jnp.int32(3), scale=1.0)
    assert out.shape == (b, tq, 4, 64) and lse.shape == (b, tq, 4)
    out, lse = ops.suffix_attention(ones(b, tq, 4, 64), ones(b, 5, 2, 64), ones(b, 5, 2, 64),
                                    kv_lengths=jnp.ones((b,), jnp.int32), causal=True, scale=1.0)
    assert out.shape == (b, tq, 4, 64) and lse.shape == (b, tq, 4)
    out, lse = ops.segment_attention(ones(b, tq, 4, 64), ones(1, 5, 2, 64), ones(1, 5, 2, 64),
                                     lengths=jnp.array([3]), node_of_seq=jnp.zeros((b,), jnp.int32),
                                     scale=1.0)
    assert out.shape == (b, tq, 4, 64) and lse.shape == (b, tq, 4)


def test_traced_lengths_out_of_range_are_clamped_like_the_api():
  rng = np.random.default_rng(6)
  q, _ = rand(rng, (2, 1, 4, 64), "float32")
  k, _ = rand(rng, (2, 5, 2, 64), "float32")
  lens = jnp.array([9, -3], jnp.int32)
  ops = tpu.get_ops()
  out, lse = jax.jit(lambda n: ops.suffix_attention(q, k, k, kv_lengths=n, causal=False,
                                                    scale=1.0))(lens)
  ref_out, ref_lse = oracle_full(np.asarray(q, np.float64), np.asarray(k, np.float64),
                                 np.asarray(k, np.float64), np.array([5, 0]), scale=1.0)
  assert_close(out, lse, ref_out, ref_lse, "float32")


@pytest.mark.parametrize("impl", ["pallas:tpu", "pallas:triton"])
def test_grad_with_bfloat16_inputs(impl):
  native = {"pallas:tpu": "tpu", "pallas:triton": "gpu"}[impl]
  if jax.default_backend() not in ("cpu", native):
    pytest.skip(f"{impl} runs on {native} or interpreted on a CPU")
  rng = np.random.default_rng(5)
  q, _ = rand(rng, (2, 1, 4, 64), "bfloat16")
  pk, _ = rand(rng, (9, 2, 64), "bfloat16")
  sk, _ = rand(rng, (2, 5, 2, 64), "bfloat16")
  lens = jnp.array([5, 2], jnp.int32)
  loss = lambda impl: lambda q: jnp.sum(shared_prefix_attention(
      q, pk, pk, sk, sk, suffix_lengths=lens, impl=impl).astype(jnp.float32) ** 2)
  got = jax.jit(jax.grad(loss(impl)))(q)
  want = jax.jit(jax.grad(loss("xla")))(q)
  assert rel_err(np.asarray(got, np.float32), np.asarray(want, np.float32)) <= 2e-2


def test_family_provides_the_fused_decomposition():
  assert tpu.get_ops().shared_attention is not None
  assert ops_lib.resolve("pallas:tpu", "test").shared_attention is not None
