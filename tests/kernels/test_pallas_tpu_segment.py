"""pallas_kernels/tpu/segment.py against the float64 oracle (property tests).

Tree levels with uneven fan-out, sequences with no segment (-1), empty segments and
segments off the 16-key blocks, in the TPU simulator with 16-row tiles, so row tiles
straddle group boundaries (revisited output tiles). The visit table itself is checked
on many more assignments than the kernel runs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_shared_attn.testing import check_attention, oracle_tree
from pallas_kernels.tpu import BlockSizes, segment
from strategies import SEEDS, count_case, lengths, rand, small_jit

# (B, Tq, Hq, Hkv, D, N, T, dtype): G = 8, 3, 2, 1, 6, 3; N 1..5; T off the blocks and 0.
CASES = (
    (7, 1, 8, 1, 128, 3, 40, "bfloat16"),
    (6, 2, 6, 2, 80, 4, 23, "float32"),
    (5, 1, 4, 2, 64, 2, 33, "float16"),
    (3, 1, 1, 1, 256, 1, 20, "bfloat16"),
    (9, 3, 12, 2, 64, 5, 9, "float32"),
    (2, 1, 3, 1, 64, 2, 0, "bfloat16"),
)
SMALL = BlockSizes(prefix_rows=16, prefix_keys=32, compute_keys=16)  # 2 chunks per block


def check(out, lse, ref_out, ref_lse, dtype):
  assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
  assert not np.isnan(np.asarray(out)).any()
  check_attention(out, lse, ref_out, ref_lse, dtype)


def nodes_strategy(draw, b, n):
  """Uneven fan-out: a skewed mix of one popular segment, others and -1."""
  popular = draw(st.integers(-1, n - 1))
  return np.array([draw(st.one_of(st.just(popular), st.integers(-1, n - 1))) for _ in range(b)],
                  np.int32)


class TestInterpret:
  interpret = True

  def setup_method(self):
    if not self.interpret and jax.default_backend() != "tpu":
      pytest.skip("needs a TPU")
    self.segment = small_jit(functools.partial(segment.segment_attention, block_sizes=SMALL,
                                                interpret=self.interpret),
                              small=self.interpret, static_argnames=("scale",))

  @settings(max_examples=20)
  @given(data=st.data(), seed=SEEDS, case=st.sampled_from(CASES))
  def test_segment_attention(self, data, seed, case):
    count_case("tpu_segment")
    rng = np.random.default_rng(seed)
    b, tq, hq, hkv, d, n, t, dtype = case
    k, k64 = rand(rng, (n, t, hkv, d), dtype)
    v, v64 = rand(rng, (n, t, hkv, d), dtype)
    seg_len = lengths(data.draw, n, t)
    nodes = nodes_strategy(data.draw, b, n)
    q, q64 = rand(rng, (b, tq, hq, d), dtype)
    out, lse = self.segment(q, k, v, lengths=jnp.asarray(seg_len), node_of_seq=jnp.asarray(nodes),
                            scale=d**-0.5)
    assert out.shape == (b, tq, hq, d) and lse.shape == (b, tq, hq)
    segs_k = [[k64[x, :seg_len[x]]] if x >= 0 else [] for x in nodes]
    segs_v = [[v64[x, :seg_len[x]]] if x >= 0 else [] for x in nodes]
    empty = np.zeros((b, 0, hkv, d))
    check(out, lse, *oracle_tree(q64, segs_k, segs_v, empty, empty, causal=False), dtype)


class TestNative(TestInterpret):
  interpret = False


metadata = jax.jit(segment.group_metadata, static_argnums=(1, 2, 3))


# (B, N, rows per sequence, block rows): tiles holding many groups, groups spanning tiles.
TABLE_SHAPES = ((1, 1, 1, 16), (5, 2, 3, 16), (13, 6, 1, 16), (13, 2, 8, 32), (9, 6, 8, 16),
                (40, 3, 3, 32))


@settings(max_examples=120)
@given(data=st.data(), shape=st.sampled_from(TABLE_SHAPES))
def test_visit_table_covers_every_row_once(data, shape):
  count_case("tpu_segment_visits")
  b, n, rows_per_seq, block_rows = shape
  nodes = nodes_strategy(data.draw, b, n)
  m = jax.tree.map(np.asarray, metadata(jnp.asarray(nodes), n, rows_per_seq, block_rows))
  tiles = -(-b * rows_per_seq // block_rows)
  assert m.visit_group.shape == (tiles + n,)
  # Sorted by segment, -1 last, stable.
  key = np.where(nodes < 0, n, nodes)
  np.testing.assert_array_equal(m.order, np.argsort(key, kind="stable"))
  # Groups partition the padded row space; group g holds its sequences' rows.
  assert m.group_start[0] == 0 and m.group_end[-1] == tiles * block_rows
  np.testing.assert_array_equal(m.group_start[1:], m.group_end[:-1])
  np.testing.assert_array_equal((m.group_end - m.group_start)[:n],
                                np.bincount(key, minlength=n + 1)[:n] * rows_per_seq)
  # Active visits: each (tile, group) pair with shared rows once, in tile order; the
  # inactive tail repeats the last active visit (same blocks, so no DMA).
  active = m.visit_active.astype(bool)
  assert active.all() or (not active[np.argmin(active):].any())
  covered = np.zeros(tiles * block_rows, int)
  for g, t in zip(m.visit_group[active], m.visit_tile[active]):
    lo, hi = max(m.group_start[g], t * block_rows), min(m.group_end[g], (t + 1) * block_rows)
    assert lo < hi
    covered[lo:hi] += 1
  np.testing.assert_array_equal(covered, 1)
  assert np.all(np.diff(m.visit_tile[active]) >= 0)
  last = np.flatnonzero(active)[-1]
  assert np.all(m.visit_group[~active] == m.visit_group[last])
  assert np.all(m.visit_tile[~active] == m.visit_tile[last])
