"""The TPU family's ops: get_ops' choices (chip, interpret mode), gradients, edge cases.

The oracle tests of the family's primitives and of the public functions with
``impl="pallas:tpu"`` are the shared suite's (``tests/kernels/test_families.py``). On this CPU
machine ``impl="pallas:tpu"`` lowers each kernel through ``platform_dependent``'s default branch
(Pallas' HLO interpreter) with the block sizes of v5e (the chip planned for without a TPU).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_shared_attn import shared_prefix_attention
from jax_shared_attn import ops as ops_lib
from jax_shared_attn.testing import oracle_full, rel_err
from pallas_kernels import tpu
from strategies import assert_close, rand


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
