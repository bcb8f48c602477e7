"""The checks themselves fail on a wrong result (jax_shared_attn.testing, tests/strategies.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_shared_attn import shared_prefix_attention
from jax_shared_attn.testing import (check_attention, lse_tolerance, oracle_tree, rel_err,
                                     rel_err_rows, tolerance)
from strategies import rand


@pytest.fixture(scope="module")
def big_batch():
  """B = 512 bf16 sequences sharing a prefix, their outputs and the oracle's."""
  rng = np.random.default_rng(11)
  b, hq, hkv, d, p, s = 512, 8, 1, 64, 256, 32
  q, q64 = rand(rng, (b, 1, hq, d), "bfloat16")
  pk, pk64 = rand(rng, (p, hkv, d), "bfloat16")
  pv, pv64 = rand(rng, (p, hkv, d), "bfloat16")
  sk, sk64 = rand(rng, (b, s, hkv, d), "bfloat16")
  sv, sv64 = rand(rng, (b, s, hkv, d), "bfloat16")
  lens = rng.integers(1, s + 1, size=b).astype(np.int32)
  lens[300] = 8  # the sequence whose suffix goes missing below: 8 of its 264 keys
  run = lambda lens: shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=lens, impl="xla",
                                             return_lse=True)
  ref = oracle_tree(q64, [[pk64]] * b, [[pv64]] * b, sk64, sv64, lens)
  return run, lens, ref


def test_one_wrong_sequence_among_512_is_caught(big_batch):
  """Dropping one sequence's whole suffix (8 keys after a 256-key prefix) hides in a
  batch-wide norm, not in the per-sequence check, which names the sequence."""
  run, lens, (ref_out, ref_lse) = big_batch
  out, lse = run(lens)
  check_attention(out, lse, ref_out, ref_lse, "bfloat16")
  wrong = lens.copy()
  wrong[300] = 0
  out, _ = run(wrong)
  assert rel_err(out, ref_out) <= tolerance("bfloat16")  # the batch-wide norm misses it
  assert np.argmax(rel_err_rows(out, ref_out)) == 300
  with pytest.raises(AssertionError, match="sequence 300 of 512"):
    check_attention(out, None, ref_out, ref_lse, "bfloat16")


def test_an_lse_off_by_one_percent_is_caught(big_batch):
  """An LSE 1e-2 off (every merge weight 1% off) fails for 16-bit inputs; the measured error is
  about 1.5e-7 and the tolerance is 32 float32 ulps."""
  run, lens, (ref_out, ref_lse) = big_batch
  out, lse = run(lens)
  assert lse_tolerance("bfloat16") < 1e-5
  with pytest.raises(AssertionError, match="lse off by"):
    check_attention(out, np.asarray(lse) + 1e-2, ref_out, ref_lse, "bfloat16")


def test_float16_outputs_with_bfloat16_rounding_are_caught():
  """A float16 path that rounds through bfloat16 somewhere (8x coarser) fails float16's
  tolerance, which bfloat16's 2e-2 would have let through."""
  rng = np.random.default_rng(5)
  b, hq, hkv, d, p, s = 16, 4, 2, 64, 40, 9
  q, q64 = rand(rng, (b, 1, hq, d), "float16")
  pk, pk64 = rand(rng, (p, hkv, d), "float16")
  pv, pv64 = rand(rng, (p, hkv, d), "float16")
  sk, sk64 = rand(rng, (b, s, hkv, d), "float16")
  sv, sv64 = rand(rng, (b, s, hkv, d), "float16")
  out, lse = shared_prefix_attention(q, pk, pv, sk, sv, impl="xla", return_lse=True)
  ref_out, ref_lse = oracle_tree(q64, [[pk64]] * b, [[pv64]] * b, sk64, sv64)
  check_attention(out, lse, ref_out, ref_lse, "float16")
  coarse = out.astype(jnp.bfloat16).astype(jnp.float16)
  assert rel_err(coarse, ref_out) <= tolerance("bfloat16")
  with pytest.raises(AssertionError, match="sequence"):
    check_attention(coarse, lse, ref_out, ref_lse, "float16")


def test_empty_contexts_must_be_zero_and_neg_inf():
  ref_out = np.zeros((2, 1, 1, 4))
  ref_lse = np.full((2, 1, 1), -np.inf)
  check_attention(ref_out, ref_lse, ref_out, ref_lse, "float32")
  with pytest.raises(AssertionError, match="sequence 1"):
    check_attention(ref_out + np.array([0, 1e-3])[:, None, None, None], ref_lse, ref_out, ref_lse,
                    "float32")
  with pytest.raises(AssertionError, match="lse"):
    check_attention(ref_out, np.zeros((2, 1, 1)), ref_out, ref_lse, "float32")
