"""The LSE merge: splitting the keys anywhere and merging gives full attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_shared_attn import attention_with_lse, merge_attention_states
from jax_shared_attn.testing import check_attention, lse_err, oracle_full, rel_err, tolerance
from strategies import DTYPES, SEEDS, count_case, rand, small_jit

part_jit = small_jit(attention_with_lse, static_argnames=("causal", "impl", "scale"))
# The parts' outputs in float32, then the public merge.
merge_jit = small_jit(lambda outs, lses: merge_attention_states(
    [o.astype(jnp.float32) for o in outs], lses))


@settings(max_examples=200)
@given(data=st.data(), seed=SEEDS, dtype=st.sampled_from(DTYPES), n_parts=st.integers(1, 5))
def test_merge_of_any_split_is_full_attention(data, seed, dtype, n_parts):
  """Cut the keys at random points (empty parts allowed) and merge the parts' results."""
  count_case("merge_split")
  rng = np.random.default_rng(seed)
  b, tq, hq, hkv, d, tk = 2, 2, 4, 2, 64, 24
  q, q64 = rand(rng, (b, tq, hq, d), dtype)
  k, k64 = rand(rng, (b, tk, hkv, d), dtype)
  v, v64 = rand(rng, (b, tk, hkv, d), dtype)
  cuts = sorted(data.draw(st.lists(st.integers(0, tk), min_size=n_parts - 1,
                                   max_size=n_parts - 1)))
  bounds = [0] + cuts + [tk]
  outs, lses = [], []
  k_np, v_np = np.asarray(k), np.asarray(v)  # (slices in NumPy: eager ones compile per size)
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    # Each part is a fixed-capacity buffer holding keys [lo, hi): the rest is masked.
    kp, vp = np.zeros_like(k_np), np.zeros_like(v_np)
    kp[:, :hi - lo], vp[:, :hi - lo] = k_np[:, lo:hi], v_np[:, lo:hi]
    o, l = part_jit(q, kp, vp, kv_lengths=jnp.full((b,), hi - lo, jnp.int32), impl="xla")
    outs.append(o)
    lses.append(l)
  out, lse = merge_jit(outs, lses)
  ref_out, ref_lse = oracle_full(q64, k64, v64)
  check_attention(out, lse, ref_out, ref_lse, dtype)


@settings(max_examples=100)
@given(seed=SEEDS, n=st.integers(1, 6), p_empty=st.floats(0, 1))
def test_merge_matches_float64_formula_with_empty_parts(seed, n, p_empty):
  """The public merge (the GPU kernels' split merge: tests/kernels/test_pallas_gpu_kernels.py)."""
  count_case("merge_formula")
  rng = np.random.default_rng(seed)
  shape = (3, 2, 5)
  outs = [rng.normal(size=shape + (16,)).astype(np.float32) for _ in range(n)]
  lses = [np.where(rng.random(shape) < p_empty, -np.inf, rng.normal(size=shape) * 30).astype(
      np.float32) for _ in range(n)]
  # Jitted: one program per part count (called op by op, each op compiles per shape; the
  # eager call is test_merged_lse_is_float32_exact_whatever_the_dtype_of_outs).
  out, lse = merge_jit([jnp.asarray(o) for o in outs], [jnp.asarray(l) for l in lses])
  L = np.stack(lses).astype(np.float64)
  with np.errstate(divide="ignore", invalid="ignore"):
    ref_lse = np.logaddexp.reduce(L, axis=0)
    w = np.where(np.isneginf(L), 0.0, np.exp(L - np.where(np.isneginf(ref_lse), 0, ref_lse)))
  ref_out = np.einsum("n...,n...d->...d", w, np.stack(outs).astype(np.float64))
  assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(lse)).any()
  assert rel_err(out, ref_out) <= 1e-6
  assert lse_err(lse, ref_lse) <= 1e-6
  empty = np.isneginf(ref_lse)
  assert np.all(np.asarray(out)[empty] == 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_merged_lse_is_float32_exact_whatever_the_dtype_of_outs(dtype):
  """The merged LSE is float32 arithmetic on the float32 ``lses`` whatever the dtype of
  ``outs`` (16-bit outs are not cast first, as a model's partial results may not be): within
  a few float32 ulps of the float64 oracle; the output within the dtype's tolerance."""
  rng = np.random.default_rng(7)
  shape, n = (4, 3, 5), 4
  outs64 = [rng.normal(size=shape + (16,)) for _ in range(n)]
  lses = [np.where(rng.random(shape) < 0.2, -np.inf, rng.normal(size=shape) * 10).astype(
      np.float32) for _ in range(n)]
  outs = [jnp.asarray(o, dtype) for o in outs64]
  out, lse = merge_attention_states(outs, [jnp.asarray(l) for l in lses])
  assert out.dtype == jnp.dtype(dtype) and lse.dtype == jnp.float32
  L = np.stack(lses).astype(np.float64)
  with np.errstate(divide="ignore", invalid="ignore"):
    ref_lse = np.logaddexp.reduce(L, axis=0)
    w = np.where(np.isneginf(L), 0.0, np.exp(L - np.where(np.isneginf(ref_lse), 0, ref_lse)))
  ref_out = np.einsum("n...,n...d->...d", w, np.stack([f64_of(o) for o in outs]))
  assert np.array_equal(np.isneginf(np.asarray(lse)), np.isneginf(ref_lse))
  assert lse_err(lse, ref_lse) <= 1e-6  # float32 LSE arithmetic: a few ulps of max(1, |lse|)
  assert rel_err(out, ref_out) <= tolerance(dtype)


def f64_of(x):
  return np.asarray(x.astype(jnp.float32)).astype(np.float64)  # exact from any float dtype


def test_merge_all_empty_is_zero_and_neg_inf_with_finite_grad():
  outs = [jnp.ones((2, 3, 4)), jnp.full((2, 3, 4), 2.0)]
  lses = [jnp.full((2, 3), -jnp.inf)] * 2
  out, lse = merge_attention_states(outs, lses)
  assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
  g = jax.grad(lambda o: merge_attention_states([o, outs[1]], lses)[0].sum())(outs[0])
  assert np.all(np.isfinite(np.asarray(g)))


def test_merge_dtype_promotion_and_single_part():
  o = jnp.ones((2, 3, 8), jnp.bfloat16)
  l = jnp.zeros((2, 3), jnp.float32)
  out, lse = merge_attention_states([o], [l])
  assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out, np.float32), 1.0)


@pytest.mark.parametrize("outs, lses, match", [
    ([], [], "at least one"),
    ([jnp.ones((2, 4))], [], "same length"),
    ([jnp.ones((2, 4)), jnp.ones((3, 4))], [jnp.ones((2,)), jnp.ones((3,))], r"outs\[1\]"),
    ([jnp.ones((2, 4))], [jnp.ones((2, 4))], r"lses\[0\] must have shape \[2\]"),
    ([jnp.ones((2, 4), jnp.int32)], [jnp.ones((2,))], r"outs\[0\] must have a floating dtype"),
])
def test_merge_bad_input(outs, lses, match):
  with pytest.raises((ValueError, TypeError), match=match):
    merge_attention_states(outs, lses)


def test_merge_rejects_stacked_array():
  with pytest.raises(TypeError, match="sequences"):
    merge_attention_states(jnp.ones((2, 3, 4)), jnp.ones((2, 3)))
