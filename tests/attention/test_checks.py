"""Bad input raises a clear error at trace time that names the argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_shared_attn import (SharedLevel, attention_with_lse, hierarchical_attention,
                             shared_prefix_attention)
from jax_shared_attn.ops import resolve
from jax_shared_attn.testing import check_attention, oracle_full, oracle_tree
from strategies import rand, small_jit

B, TQ, HQ, HKV, D, P, S = 2, 1, 4, 2, 64, 8, 5
q = jnp.ones((B, TQ, HQ, D))
pk = jnp.ones((P, HKV, D))
sk = jnp.ones((B, S, HKV, D))


def spa(**kw):
  args = dict(q=q, prefix_k=pk, prefix_v=pk, suffix_k=sk, suffix_v=sk)
  args.update(kw)
  return shared_prefix_attention(args.pop("q"), args.pop("prefix_k"), args.pop("prefix_v"),
                                 args.pop("suffix_k"), args.pop("suffix_v"), **args)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(q=jnp.ones((B, HQ, D))), ValueError, r"q must have rank 4.*\[B, Tq, Hq, D\].*\[2, 4, 64\]"),
    (dict(prefix_k=jnp.ones((1, P, HKV, D))), ValueError, r"prefix_k must have rank 3"),
    (dict(prefix_v=jnp.ones((P + 1, HKV, D))), ValueError, r"prefix_k and prefix_v must have the same shape"),
    (dict(q=jnp.ones((B, TQ, 3, D))), ValueError, r"query heads of q \(3\).*multiple.*suffix_k \(2\)"),
    (dict(q=jnp.ones((B, TQ, HQ, 32))), ValueError, r"head dims.*q=32.*suffix_k=64"),
    (dict(q=jnp.ones((B + 1, TQ, HQ, D))), ValueError, r"batch sizes.*q=3.*suffix_k=2"),
    (dict(prefix_k=jnp.ones((P, 1, D)), prefix_v=jnp.ones((P, 1, D))), ValueError, r"key/value heads.*prefix_k=1.*suffix_k=2"),
    (dict(prefix_length=P + 1), ValueError, r"prefix_length must lie in \[0, 8\]"),
    (dict(prefix_length=-1), ValueError, r"prefix_length must lie in"),
    (dict(prefix_length=2.5), TypeError, r"prefix_length must have an integer dtype"),
    (dict(prefix_length=jnp.array([3])), ValueError, r"prefix_length must have shape \[\]"),
    (dict(suffix_lengths=jnp.array([1, 2, 3])), ValueError, r"suffix_lengths must have shape \[2\]; got \[3\]"),
    (dict(suffix_lengths=jnp.array([1, S + 1])), ValueError, r"suffix_lengths must lie in \[0, 5\]"),
    (dict(suffix_lengths=jnp.array([1.0, 2.0])), TypeError, r"suffix_lengths must have an integer dtype"),
    (dict(q=jnp.ones((B, TQ, HQ, D), jnp.int32)), TypeError, r"q must have a floating dtype"),
    (dict(q=jnp.ones((B, TQ, HQ, D), jnp.bfloat16)), TypeError, r"must share one dtype.*q bfloat16.*prefix_k float32"),
    (dict(impl="cuda"), ValueError, r"impl must be one of"),
    (dict(impl="pallas"), ValueError, r"impl='pallas' needs a GPU or TPU"),
    (dict(scale=-1.0), ValueError, r"scale must be a positive finite number"),
])
def test_shared_prefix_attention_errors(kw, exc, match):
  with pytest.raises(exc, match=match):
    spa(**kw)


def test_errors_are_raised_at_trace_time_under_jit():
  f = small_jit(lambda q: spa(q=q))
  with pytest.raises(ValueError, match="query heads of q"):
    f(jnp.ones((B, TQ, 3, D)))


@pytest.mark.parametrize("impl", ["xla", "pallas:triton", "pallas:tpu", "auto"])
def test_traced_lengths_are_clamped_into_the_capacity(impl):
  """Lengths outside [0, capacity] cannot be checked under jit: each is clamped into it, so
  every path gives the oracle at the clamped lengths (random inputs, varied lengths: a
  length clamped to the wrong value changes the output)."""
  try:
    resolve(impl, "test")
  except ValueError:
    pytest.skip(f"impl={impl!r} does not run on {jax.default_backend()}")
  rng = np.random.default_rng(7)
  b, hq, hkv, d, p, s, n, t = 3, 4, 2, 64, 8, 5, 2, 6
  q, q64 = rand(rng, (b, 1, hq, d), "float32")
  pk, pk64 = rand(rng, (p, hkv, d), "float32")
  pv, pv64 = rand(rng, (p, hkv, d), "float32")
  sk, sk64 = rand(rng, (b, s, hkv, d), "float32")
  sv, sv64 = rand(rng, (b, s, hkv, d), "float32")
  lk, lk64 = rand(rng, (n, t, hkv, d), "float32")
  lv, lv64 = rand(rng, (n, t, hkv, d), "float32")
  nodes = np.array([1, -1, 0], np.int32)
  prefix = small_jit(lambda n, lens: shared_prefix_attention(
      q, pk, pv, sk, sv, prefix_length=n, suffix_lengths=lens, impl=impl, return_lse=True))
  full = small_jit(lambda lens: attention_with_lse(q, sk, sv, kv_lengths=lens, impl=impl))
  tree = small_jit(lambda seg, lens: hierarchical_attention(
      q, [SharedLevel(lk, lv, seg, jnp.asarray(nodes))], sk, sv, suffix_lengths=lens, impl=impl,
      return_lse=True))
  for plen, slen, seg in [(100, [s + 3, 2, -4], [-2, t + 1]), (-5, [1, 2**30, s], [t, 2**31 - 1]),
                          (p - 3, [-1, 0, 3], [3, -7])]:
    slen, seg = np.array(slen, np.int32), np.array(seg, np.int32)
    cp, cs, cseg = np.clip(plen, 0, p), np.clip(slen, 0, s), np.clip(seg, 0, t)
    check_attention(*prefix(jnp.int32(plen), slen),
                    *oracle_tree(q64, [[pk64[:cp]]] * b, [[pv64[:cp]]] * b, sk64, sv64, cs),
                    "float32")
    check_attention(*full(slen), *oracle_full(q64, sk64, sv64, cs), "float32")
    segs_k = [[lk64[j, :cseg[j]]] if j >= 0 else [] for j in nodes]
    segs_v = [[lv64[j, :cseg[j]]] if j >= 0 else [] for j in nodes]
    check_attention(*tree(seg, slen), *oracle_tree(q64, segs_k, segs_v, sk64, sv64, cs),
                    "float32")


@pytest.mark.parametrize("kw, match", [
    (dict(k=jnp.ones((B, S, HKV))), r"k must have rank 4"),
    (dict(v=jnp.ones((B, S + 1, HKV, D))), r"k and v must have the same shape"),
    (dict(kv_lengths=jnp.array([0, S + 3])), r"kv_lengths must lie in \[0, 5\]"),
    (dict(kv_lengths=jnp.array([[1, 2]])), r"kv_lengths must have shape \[2\]"),
])
def test_attention_with_lse_errors(kw, match):
  args = dict(q=q, k=sk, v=sk)
  args.update(kw)
  with pytest.raises((ValueError, TypeError), match=match):
    attention_with_lse(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def level(n=3, t=4, nodes=(0, 2), **kw):
  fields = dict(k=jnp.ones((n, t, HKV, D)), v=jnp.ones((n, t, HKV, D)),
                lengths=jnp.full((n,), t, jnp.int32), node_of_seq=jnp.array(nodes, jnp.int32))
  fields.update(kw)
  return SharedLevel(**fields)


@pytest.mark.parametrize("lvl, match", [
    (level(nodes=(0, 3)), r"levels\[0\].node_of_seq must lie in \[-1, 2\]"),
    (level(nodes=(0, -2)), r"levels\[0\].node_of_seq must lie in"),
    (level(nodes=(0, 1, 2)), r"levels\[0\].node_of_seq must have shape \[2\]"),
    (level(node_of_seq=jnp.array([0.0, 1.0])), r"node_of_seq must be an integer array"),
    (level(lengths=jnp.array([1, 2, 9], jnp.int32)), r"levels\[0\].lengths must lie in \[0, 4\]"),
    (level(k=jnp.ones((3, 4, 1, D)), v=jnp.ones((3, 4, 1, D))), r"key/value heads"),
    (level(v=jnp.ones((3, 5, HKV, D))), r"levels\[0\].k and levels\[0\].v must have the same shape"),
    (level(k=jnp.ones((3, 4, HKV, D), jnp.bfloat16), v=jnp.ones((3, 4, HKV, D), jnp.bfloat16)),
     r"must share one dtype"),
    ("not a level", r"levels\[0\] must be a SharedLevel"),
    (level(all_share=True), r"levels\[0\].all_share=True promises every sequence continues"),
    (level(nodes=(0, 0), all_share=True), r"levels\[0\].all_share=True promises one segment"),
    (level(n=1, nodes=(0, -1), all_share=True), r"levels\[0\].node_of_seq holds values in"),
])
def test_hierarchical_errors(lvl, match):
  with pytest.raises((ValueError, TypeError), match=match):
    hierarchical_attention(q, [lvl], sk, sk)
