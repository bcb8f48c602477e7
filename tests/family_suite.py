"""The oracle suite every kernel family runs (tokamax's ``test_base.py`` pattern).

:class:`FamilySuite` holds the float64-oracle tests of the three primitives (through the
family's ``AttentionOps``) and of the whole decomposition (the three public functions with
``impl=IMPL``); ``tests/kernels/test_families.py`` subclasses it once per family and sets
``IMPL``. Off their platform the kernels run in Pallas interpret mode, so the cases are small
and few (the kernels' own files test their tiles and configs); each case set still crosses a
512-key block (the TPU kernels' v5e block) and covers G 1..8, D 64/80/128/256, empty prefixes,
suffixes and segments, and every input dtype.
"""

import functools

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_shared_attn import (PagedLevel, attention_with_lse, hierarchical_attention,
                             paged_attention, shared_prefix_attention)
from jax_shared_attn import ops as ops_lib
from jax_shared_attn.testing import check_attention, oracle_full, oracle_tree
from strategies import SEEDS, assert_close, count_case, lengths, rand, random_tree, small_jit

STATIC = ("causal", "impl", "return_lse", "scale", "config")
prefix_jit = small_jit(shared_prefix_attention, static_argnames=STATIC)
tree_jit = small_jit(hierarchical_attention, static_argnames=STATIC)
full_jit = small_jit(attention_with_lse, static_argnames=("causal", "impl", "scale", "config"))
paged_jit = small_jit(paged_attention, static_argnames=STATIC)


@functools.lru_cache(maxsize=None)
def primitives(impl: str, config=None):
  """The family's three primitives, jitted once per family and config."""
  ops = ops_lib.resolve(impl, "test", config)
  return (small_jit(ops.prefix_attention, static_argnames="scale"),
          small_jit(ops.segment_attention, static_argnames="scale"),
          small_jit(ops.suffix_attention, static_argnames=("causal", "scale")))

# ((B, Tq, Hq, Hkv, D, P, S), dtype, causal): G 8/2/3/1/8, D 64/80/128/256, empty prefix,
# empty suffix, Tq > suffix length; the last one crosses 512-key blocks.
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
# ((B, Tq, Hq, Hkv, D, page_size, own pages O), levels as ((S, P), ...), dtype, causal): page
# pools with shuffled page ids; a page size that is not a power of two; a segment crossing
# 512 keys; no levels; Tq > own length.
PAGED_CASES = (
    ((5, 1, 8, 1, 128, 16, 3), ((1, 4),), "bfloat16", True),
    ((6, 2, 4, 2, 80, 4, 4), ((2, 3), (3, 2)), "float32", True),
    ((4, 3, 16, 2, 64, 6, 2), (), "float16", True),
    ((3, 1, 8, 2, 64, 64, 2), ((1, 9), (2, 1)), "bfloat16", False),
)
# ((B, Tq, Hq, Hkv, D, keys), dtype): the primitives' cases.
PRIMITIVE_CASES = (
    ((3, 1, 8, 1, 128, 37), "bfloat16"),
    ((2, 2, 4, 2, 80, 20), "float32"),
    ((2, 1, 6, 3, 64, 0), "float16"),
)


class FamilySuite:
  """Oracle tests of one kernel family; a subclass sets ``IMPL`` (and may scale ``EXAMPLES`` and
  set ``CONFIG``, the family's ``config=``)."""

  IMPL = None
  CONFIG = None
  EXAMPLES = dict(prefix=24, tree=20, full=12, primitive=4, paged=12)

  # -- the primitives, through the family's AttentionOps --------------------------------------

  def test_primitives(self):
    settings(max_examples=self.EXAMPLES["primitive"], deadline=None)(given(
        data=st.data(), seed=SEEDS, case=st.sampled_from(PRIMITIVE_CASES))(
            self._primitives))()

  def _primitives(self, data, seed, case):
    count_case(f"family_primitives[{self.IMPL}]")
    (b, tq, hq, hkv, d, n_keys), dtype = case
    rng = np.random.default_rng(seed)
    prefix, segment, suffix = primitives(self.IMPL, self.CONFIG)
    scale = d**-0.5
    q, q64 = rand(rng, (b, tq, hq, d), dtype)
    pk, pk64 = rand(rng, (n_keys, hkv, d), dtype)
    pv, pv64 = rand(rng, (n_keys, hkv, d), dtype)
    plen = data.draw(st.integers(0, n_keys))
    out, lse = prefix(q, pk, pv, kv_length=jnp.int32(plen), scale=scale)
    empty = np.zeros((b, 0, hkv, d))
    ref_prefix = oracle_tree(q64, [[pk64[:plen]]] * b, [[pv64[:plen]]] * b, empty, empty,
                             np.zeros(b, np.int32))
    check_attention(out, lse, *ref_prefix, dtype)
    # A tree level: 3 segments, sequences on any of them or none (-1).
    sk_, sk64_ = rand(rng, (3, max(n_keys, 1), hkv, d), dtype)
    sv_, sv64_ = rand(rng, (3, max(n_keys, 1), hkv, d), dtype)
    seg_len = lengths(data.draw, 3, max(n_keys, 1))
    nodes = np.asarray(data.draw(st.lists(st.integers(-1, 2), min_size=b, max_size=b)), np.int32)
    out, lse = segment(q, sk_, sv_, lengths=jnp.asarray(seg_len), node_of_seq=jnp.asarray(nodes),
                       scale=scale)
    segs_k = [[sk64_[i, :seg_len[i]]] if i >= 0 else [] for i in nodes]
    segs_v = [[sv64_[i, :seg_len[i]]] if i >= 0 else [] for i in nodes]
    check_attention(out, lse, *oracle_tree(q64, segs_k, segs_v, empty, empty,
                                           np.zeros(b, np.int32)), dtype)
    # The suffix with the prefix's state as its prior, causal.
    k, k64 = rand(rng, (b, n_keys, hkv, d), dtype)
    v, v64 = rand(rng, (b, n_keys, hkv, d), dtype)
    kv_len = lengths(data.draw, b, n_keys)
    prior = prefix(q, pk, pv, kv_length=jnp.int32(plen), scale=scale)
    out, lse = suffix(q, k, v, kv_lengths=jnp.asarray(kv_len), causal=True, scale=scale,
                      prior=prior)
    ref = oracle_tree(q64, [[pk64[:plen]]] * b, [[pv64[:plen]]] * b, k64, v64, kv_len,
                      causal=True)
    check_attention(out, lse, *ref, dtype)

  # -- the whole decomposition, through the public functions ---------------------------------

  def test_shared_prefix_attention(self):
    settings(max_examples=self.EXAMPLES["prefix"], deadline=None)(given(
        data=st.data(), seed=SEEDS, case=st.sampled_from(PREFIX_CASES))(self._prefix))()

  def _prefix(self, data, seed, case):
    count_case(f"family_shared_prefix[{self.IMPL}]")
    (b, tq, hq, hkv, d, p, s), dtype, causal = case
    rng = np.random.default_rng(seed)
    plen = data.draw(st.integers(0, p))
    slen = lengths(data.draw, b, s)
    q, q64 = rand(rng, (b, tq, hq, d), dtype)
    pk, pk64 = rand(rng, (p, hkv, d), dtype)
    pv, pv64 = rand(rng, (p, hkv, d), dtype)
    sk, sk64 = rand(rng, (b, s, hkv, d), dtype)
    sv, sv64 = rand(rng, (b, s, hkv, d), dtype)
    out, lse = prefix_jit(
        q, pk, pv, sk, sv, prefix_length=jnp.int32(plen), suffix_lengths=slen, causal=causal,
        impl=self.IMPL, return_lse=True, config=self.CONFIG)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    ref = oracle_tree(q64, [[pk64[:plen]]] * b, [[pv64[:plen]]] * b, sk64, sv64, slen,
                      causal=causal)
    assert_close(out, lse, *ref, dtype)

  def test_hierarchical_attention(self):
    settings(max_examples=self.EXAMPLES["tree"], deadline=None)(given(
        data=st.data(), seed=SEEDS, case=st.sampled_from(TREE_CASES))(self._tree))()

  def _tree(self, data, seed, case):
    count_case(f"family_hierarchical[{self.IMPL}]")
    (b, tq, hq, hkv, d, s), structure, dtype, causal = case
    rng = np.random.default_rng(seed)
    levels, seg_k, seg_v = random_tree(data.draw, rng, b, hkv, d, dtype, structure)
    slen = lengths(data.draw, b, s)
    q, q64 = rand(rng, (b, tq, hq, d), dtype)
    sk, sk64 = rand(rng, (b, s, hkv, d), dtype)
    sv, sv64 = rand(rng, (b, s, hkv, d), dtype)
    out, lse = tree_jit(
        q, levels, sk, sv, suffix_lengths=slen, causal=causal, impl=self.IMPL, return_lse=True,
        config=self.CONFIG)
    ref = oracle_tree(q64, seg_k, seg_v, sk64, sv64, slen, causal=causal)
    assert_close(out, lse, *ref, dtype)

  def test_attention_with_lse(self):
    settings(max_examples=self.EXAMPLES["full"], deadline=None)(given(
        data=st.data(), seed=SEEDS, case=st.sampled_from(FULL_CASES))(self._full))()

  def _full(self, data, seed, case):
    count_case(f"family_full[{self.IMPL}]")
    (b, tq, hq, hkv, d, tk), dtype, causal = case
    rng = np.random.default_rng(seed)
    kv_len = lengths(data.draw, b, tk)
    q, q64 = rand(rng, (b, tq, hq, d), dtype)
    k, k64 = rand(rng, (b, tk, hkv, d), dtype)
    v, v64 = rand(rng, (b, tk, hkv, d), dtype)
    out, lse = full_jit(
        q, k, v, kv_lengths=kv_len, causal=causal, impl=self.IMPL, config=self.CONFIG)
    assert_close(out, lse, *oracle_full(q64, k64, v64, kv_len, causal=causal), dtype)

  def test_paged_attention(self):
    settings(max_examples=self.EXAMPLES["paged"], deadline=None)(given(
        data=st.data(), seed=SEEDS, case=st.sampled_from(PAGED_CASES))(self._paged))()

  def _paged(self, data, seed, case):
    count_case(f"family_paged[{self.IMPL}]")
    (b, tq, hq, hkv, d, ps, o), structure, dtype, causal = case
    rng = np.random.default_rng(seed)
    n_pages = 1 + b * o + sum(n * p for n, p in structure)
    k, k64 = rand(rng, (n_pages, ps, hkv, d), dtype)
    v, v64 = rand(rng, (n_pages, ps, hkv, d), dtype)
    ids = iter(rng.permutation(n_pages))  # every table a random set of distinct pages

    def table(rows, width):
      return np.array([[next(ids) for _ in range(width)] for _ in range(rows)], np.int32)

    def tokens(x64, pages, length):  # float64 [length, Hkv, D] of a page list
      return x64[pages].reshape(-1, hkv, d)[:length]

    levels, seg_k, seg_v = [], [[] for _ in range(b)], [[] for _ in range(b)]
    for n, p in structure:
      t, lens = table(n, p), lengths(data.draw, n, p * ps)
      nodes = np.asarray(data.draw(st.lists(st.integers(-1, n - 1), min_size=b, max_size=b)),
                         np.int32)
      levels.append(PagedLevel(jnp.asarray(t), jnp.asarray(lens), jnp.asarray(nodes)))
      for i, node in enumerate(nodes):
        if node >= 0:
          seg_k[i].append(tokens(k64, t[node], lens[node]))
          seg_v[i].append(tokens(v64, t[node], lens[node]))
    own = table(b, o)
    own_len = lengths(data.draw, b, o * ps)
    q, q64 = rand(rng, (b, tq, hq, d), dtype)
    sk64 = np.stack([tokens(k64, own[i], o * ps) for i in range(b)])
    sv64 = np.stack([tokens(v64, own[i], o * ps) for i in range(b)])
    out, lse = paged_jit(q, k, v, jnp.asarray(own), jnp.asarray(own_len), levels=levels,
                         causal=causal, impl=self.IMPL, return_lse=True, config=self.CONFIG)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    ref = oracle_tree(q64, seg_k, seg_v, sk64, sv64, own_len, causal=causal)
    assert_close(out, lse, *ref, dtype)
