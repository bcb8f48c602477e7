"""pallas_kernels/tpu/shared.py (the fused decomposition) against the float64 oracle.

A prefix, tree levels with uneven fan-out and -1 nodes, and the causal suffix, in the
TPU simulator with small blocks, states handed between kernels in kernel layout.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_shared_attn.testing import check_attention, lse_err, oracle_tree, rel_err
from pallas_kernels.tpu import BlockSizes, shared
from strategies import SEEDS, count_case, lengths, rand, small_jit

SMALL = BlockSizes(prefix_rows=16, prefix_keys=16, suffix_keys=16, suffix_step_bytes=16 << 10)
# ((B, Tq, Hq, Hkv, D, S), prefix P or None, levels ((N, T), ...), dtype, causal)
CASES = (
    ((5, 1, 8, 1, 128, 21), 37, (), "bfloat16", True),
    ((6, 2, 6, 2, 80, 9), 20, ((3, 17),), "float32", True),
    ((4, 3, 4, 2, 256, 0), None, ((2, 5), (3, 18)), "float16", False),
)


@functools.lru_cache(maxsize=None)
def run(kinds, causal, scale):
  """One jitted program per part structure (the kinds are static strings)."""

  def fn(q, arrays, sk, sv, slen):
    parts = [(kind,) + tuple(a) for kind, a in zip(kinds, arrays)]
    return shared.shared_attention(q, parts, sk, sv, kv_lengths=slen, causal=causal, scale=scale,
                                   block_sizes=SMALL, interpret=True)

  return small_jit(fn)


@settings(max_examples=8)
@given(data=st.data(), seed=SEEDS, case=st.sampled_from(CASES))
def test_shared_attention(data, seed, case):
  count_case("tpu_shared")
  (b, tq, hq, hkv, d, s), p, structure, dtype, causal = case
  rng = np.random.default_rng(seed)
  parts, seg_k, seg_v = [], [[] for _ in range(b)], [[] for _ in range(b)]
  if p is not None:
    pk, pk64 = rand(rng, (p, hkv, d), dtype)
    pv, pv64 = rand(rng, (p, hkv, d), dtype)
    plen = data.draw(st.integers(0, p))
    parts.append(("prefix", pk, pv, jnp.int32(plen), None))
    for i in range(b):
      seg_k[i].append(pk64[:plen])
      seg_v[i].append(pv64[:plen])
  for n, t in structure:
    k, k64 = rand(rng, (n, t, hkv, d), dtype)
    v, v64 = rand(rng, (n, t, hkv, d), dtype)
    lens = lengths(data.draw, n, t)
    nodes = np.array([data.draw(st.integers(-1, n - 1)) for _ in range(b)], np.int32)
    parts.append(("segments", k, v, jnp.asarray(lens), jnp.asarray(nodes)))
    for i, node in enumerate(nodes):
      if node >= 0:
        seg_k[i].append(k64[node, :lens[node]])
        seg_v[i].append(v64[node, :lens[node]])
  slen = lengths(data.draw, b, s)
  q, q64 = rand(rng, (b, tq, hq, d), dtype)
  sk, sk64 = rand(rng, (b, s, hkv, d), dtype)
  sv, sv64 = rand(rng, (b, s, hkv, d), dtype)
  out, lse = run(tuple(part[0] for part in parts), causal, d**-0.5)(
      q, [part[1:] for part in parts], sk, sv, jnp.asarray(slen))
  assert out.dtype == q.dtype and lse.dtype == jnp.float32 and lse.shape == (b, tq, hq)
  ref_out, ref_lse = oracle_tree(q64, seg_k, seg_v, sk64, sv64, slen, causal=causal)
  assert not np.isnan(np.asarray(out, np.float32)).any()
  check_attention(np.asarray(out, np.float32), lse, ref_out, ref_lse, dtype)


def test_merge_rows_is_the_lse_merge():
  rng = np.random.default_rng(0)
  outs = [jnp.asarray(rng.normal(size=(2, 5, 128)), jnp.float32) for _ in range(3)]
  lse = [jnp.asarray(rng.normal(size=(2, 5)), jnp.float32) for _ in range(3)]
  lse[1] = lse[1].at[0].set(-jnp.inf)
  lse = [x.at[1, 2].set(-jnp.inf) for x in lse]  # a row empty in every part
  states = [(o, jnp.broadcast_to(l[..., None], (2, 5, 128))) for o, l in zip(outs, lse)]
  out, merged = shared.merge_rows(states)
  stack = np.stack([np.asarray(x, np.float64) for x in lse])
  with np.errstate(divide="ignore"):
    ref_lse = np.logaddexp.reduce(stack, axis=0)
  w = np.where(np.isneginf(stack), 0, np.exp(stack - np.where(np.isneginf(ref_lse), 0, ref_lse)))
  ref_out = sum(w[i][..., None] * np.asarray(outs[i], np.float64) for i in range(3))
  assert np.all(np.asarray(merged) == np.asarray(merged)[..., :1])  # still lane-replicated
  assert lse_err(np.asarray(merged)[..., 0], ref_lse) <= 1e-6
  assert rel_err(out, ref_out) <= 1e-6
  assert np.all(np.asarray(out)[1, 2] == 0)
