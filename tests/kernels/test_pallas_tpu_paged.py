"""The TPU family's paged path: each sequence's own pages read in place by the paged suffix
kernel (:func:`pallas_kernels.tpu.suffix.paged_suffix_head_major`), interpreted on a CPU
against the float64 oracle of each sequence's explicit context, and lowered to Mosaic for a
TPU from this CPU.

Page tables are random (shuffled physical pages, some pages shared between sequences and with
the shared levels), lengths ragged (0, 1, a page boundary, full), Tq 1 and > 1 (causal), with
and without the fused prior, several pages per key block and one.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_shared_attn.testing import oracle_tree
from pallas_kernels.tpu import common, suffix
from strategies import SEEDS, assert_close, count_case, lengths, rand

S = jax.ShapeDtypeStruct
# suffix_keys 32: pages of 8 keys run 4 to a key block, pages of 32 or more one.
BLOCK_SIZES = common.BlockSizes(prefix_rows=128, prefix_keys=128, compute_keys=128,
                                suffix_keys=32, suffix_step_bytes=1 << 20)
# (B, Tq, Hq, Hkv, D, page_size, own pages, pool pages, dtype, prior)
KERNEL_CASES = [
    (3, 1, 4, 2, 128, 8, 5, 9, "float32", True),  # pages shared across sequences
    (2, 3, 4, 1, 64, 16, 3, 12, "bfloat16", False),  # causal chunk, D below the lanes
    (4, 2, 2, 2, 32, 32, 2, 10, "float32", True),  # one page per block, heads = Hkv
]


def oracle_prior(rng, b, hkv, d, dtype, q64):
  """A shared segment per sequence and its float64 attention (the prior), with the tokens."""
  n = rng.integers(0, 12)
  k, k64 = rand(rng, (b, n, hkv, d), dtype)
  v, v64 = rand(rng, (b, n, hkv, d), dtype)
  out, lse = oracle_tree(q64, [[k64[i]] for i in range(b)], [[v64[i]] for i in range(b)],
                         np.zeros((b, 0, hkv, d)), np.zeros((b, 0, hkv, d)), causal=False)
  return (jnp.asarray(out, jnp.float32), jnp.asarray(lse, jnp.float32)), k64, v64


@functools.partial(jax.jit, static_argnames=("causal",))
def paged(q, kp, vp, table, lens, prior, *, causal):
  return suffix.paged_suffix_attention(q, kp, vp, table, kv_lengths=lens, causal=causal,
                                       scale=q.shape[-1]**-0.5, prior=prior,
                                       block_sizes=BLOCK_SIZES)


@pytest.mark.parametrize("case", KERNEL_CASES, ids=["shared-pages", "causal-d64", "page-per-block"])
@settings(max_examples=2, deadline=None)
@given(data=st.data(), seed=SEEDS)
def test_paged_suffix_kernel_equals_the_oracle(case, data, seed):
  count_case("tpu_paged_suffix")
  b, tq, hq, hkv, d, ps, o, n_pages, dtype, with_prior = case
  rng = np.random.default_rng(seed)
  kp, kp64 = rand(rng, (n_pages, ps, hkv, d), dtype)
  vp, vp64 = rand(rng, (n_pages, ps, hkv, d), dtype)
  # Shuffled physical pages, drawn with replacement: sequences share some of them.
  table = rng.integers(0, n_pages, size=(b, o)).astype(np.int32)
  own = lengths(data.draw, b, o * ps)
  if tq > 1:  # a causal chunk needs its own Tq keys
    own = np.maximum(own, tq).astype(np.int32)
  q, q64 = rand(rng, (b, tq, hq, d), dtype)
  seg_k = seg_v = [[] for _ in range(b)]
  prior = None
  if with_prior:
    prior, pk64, pv64 = oracle_prior(rng, b, hkv, d, dtype, q64)
    seg_k, seg_v = [[pk64[i]] for i in range(b)], [[pv64[i]] for i in range(b)]
  out, lse = paged(q, kp, vp, jnp.asarray(table), jnp.asarray(own), prior, causal=tq > 1)
  sk64 = kp64[table].reshape(b, o * ps, hkv, d)
  sv64 = vp64[table].reshape(b, o * ps, hkv, d)
  assert_close(out, lse, *oracle_tree(q64, seg_k, seg_v, sk64, sv64, own, causal=tq > 1),
               dtype)


def test_paged_blocks_obey_the_tiling_rule():
  """Heads per step: lanes a multiple of 128 or all heads; pages per block up to suffix_keys."""
  bs = common.block_sizes_for("v5e")
  blocks = suffix.paged_blocks(8, 8, 128, 16, 4, 128, 2, bs)
  assert blocks.pages == 4 and 8 % blocks.heads == 0
  assert suffix.paged_blocks(8, 8, 16, 64, 4, 64, 2, bs).heads % 2 == 0
  assert suffix.paged_blocks(8, 4, 16, 64, 4, 80, 2, bs).heads == 4
  assert not suffix.paged_heads_legal(1, 4, 64) and suffix.paged_heads_legal(2, 4, 64)


def export_tpu(fn, *args) -> str:
  text = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
  assert "callback" not in text  # no interpreter branch in the TPU program
  return text


# (B, Tq, Hq, Hkv, D, page_size, own pages, dtype): TPU page sizes, GQA, D 64/128, Tq > 1.
EXPORT_CASES = [(4, 1, 32, 8, 128, 128, 5, "bfloat16"), (2, 3, 4, 2, 64, 16, 7, "float32"),
                (3, 1, 8, 1, 128, 64, 4, "bfloat16")]


def test_paged_suffix_kernel_lowers_to_mosaic():
  for b, tq, hq, hkv, d, ps, o, dtype in EXPORT_CASES:
    bs = common.block_sizes_for("v5e")

    def fn(q, kp, vp, table, lens, p_out, p_lse):
      return suffix.paged_suffix_attention(q, kp, vp, table, kv_lengths=lens, causal=tq > 1,
                                           scale=d**-0.5, prior=(p_out, p_lse), block_sizes=bs)

    pool = S((11, ps, hkv, d), dtype)
    text = export_tpu(fn, S((b, tq, hq, d), dtype), pool, pool, S((b, o), jnp.int32),
                      S((b,), jnp.int32), S((b, tq, hq, d), jnp.float32),
                      S((b, tq, hq), jnp.float32))
    assert text.count("tpu_custom_call") == 1
    assert "gather" not in text  # the pages are read in place
