"""A non-default ``scale`` and large logits through every kernel family, against the oracle."""

import jax
import numpy as np
import pytest

from jax_shared_attn import SharedLevel, attention_with_lse, hierarchical_attention
from jax_shared_attn.ops import resolve
from jax_shared_attn.testing import check_attention, check_rows, lse_err, oracle_full, \
    oracle_tree, tolerance
from strategies import rand, small_jit

B, HQ, HKV, D, P, N, T, S = 3, 4, 2, 64, 24, 2, 9, 7


def inputs(rng, dtype, large):
  """q, a shared prefix, a level of N segments, suffixes. ``large``: small integers near 11,
  so scores reach about 8e3 and every input and score is exact."""
  if large:
    def make(shape):
      x = np.asarray(11 + rng.integers(-2, 3, size=shape), np.float32)
      return jax.numpy.asarray(x).astype(dtype), x.astype(np.float64)
  else:
    make = lambda shape: rand(rng, shape, dtype)
  q = make((B, 1, HQ, D))
  pk, sk, lk = make((P, HKV, D)), make((B, S, HKV, D)), make((N, T, HKV, D))
  pv, sv, lv = (rand(rng, shape, dtype) for shape in ((P, HKV, D), (B, S, HKV, D), (N, T, HKV, D)))
  return q, pk, pv, sk, sv, lk, lv


@pytest.mark.parametrize("family", ["xla", "pallas:triton", "pallas:tpu", "auto"])
@pytest.mark.parametrize("scale, large", [(0.3, False), (0.5, True)])
def test_scale_and_large_logits(family, scale, large):
  try:
    resolve(family, "test")
  except ValueError:
    pytest.skip(f"{family} does not run on {jax.default_backend()}")
  dtype = "bfloat16"
  rng = np.random.default_rng(int(scale * 10) + large)
  (q, q64), (pk, pk64), (pv, pv64), (sk, sk64), (sv, sv64), (lk, lk64), (lv, lv64) = inputs(
      rng, dtype, large)
  plen, lens = 20, np.array([7, 0, 3], np.int32)
  seg_lens, nodes = np.array([9, 4], np.int32), np.array([1, -1, 0], np.int32)
  levels = [SharedLevel.shared_by_all(pk, pv, batch_size=B, length=plen),
            SharedLevel(lk, lv, jax.numpy.asarray(seg_lens), jax.numpy.asarray(nodes))]
  # jitted: one program per call, not every op compiled eagerly
  out, lse = small_jit(lambda *a: hierarchical_attention(
      *a, suffix_lengths=lens, scale=scale, impl=family, return_lse=True))(q, levels, sk, sv)
  segs_k = [[pk64[:plen]] + ([lk64[j, :seg_lens[j]]] if j >= 0 else []) for j in nodes]
  segs_v = [[pv64[:plen]] + ([lv64[j, :seg_lens[j]]] if j >= 0 else []) for j in nodes]
  ref_out, ref_lse = oracle_tree(q64, segs_k, segs_v, sk64, sv64, lens, scale=scale)
  full_out, full_lse = small_jit(lambda *a: attention_with_lse(
      *a, kv_lengths=lens, scale=scale, impl=family))(q, sk, sv)
  full_ref = oracle_full(q64, sk64, sv64, lens, causal=False, scale=scale)
  if not large:
    check_attention(out, lse, ref_out, ref_lse, dtype)
    check_attention(full_out, full_lse, *full_ref, dtype)
    return
  fin = ref_lse[np.isfinite(ref_lse)]
  assert fin.max() > 3e3  # really large logits
  # Each part's LSE is a float32 number (half an ulp at |lse|), and the merge weights
  # exp(lse_i - lse) inherit that rounding: 2 eps32 |lse| on top of the dtype's tolerance.
  bound = tolerance(dtype) + 2 * float(np.finfo(np.float32).eps) * float(np.abs(fin).max())
  check_rows(out, ref_out, bound)
  assert lse_err(lse, ref_lse) <= 1e-6, lse_err(lse, ref_lse)
  check_attention(full_out, full_lse, *full_ref, dtype)
