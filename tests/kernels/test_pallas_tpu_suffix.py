"""pallas_kernels/tpu/suffix.py against the float64 oracle (property tests).

The TPU simulator (``interpret=True``) runs the kernel with 16-key blocks and a small
step budget, so steps pack several sequences and KV heads, lengths cross and stop
short of blocks (skipped blocks, ragged sequences inside one step), and the fused
merge with a prior is checked against the oracle over the concatenated keys.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_shared_attn import reference
from jax_shared_attn.testing import check_attention, oracle_tree
from pallas_kernels.tpu import BlockSizes, suffix
from strategies import SEEDS, count_case, lengths, rand, small_jit

# (B, Tq, Hq, Hkv, D, S, dtype, with_prior): G = 8, 3, 2, 1, 8, 3, 5; Tq up to 5 (> some
# lengths); S off the 16-key blocks, 1 and 0; D 64/80/128/256; the fused merge on 5 of 8.
CASES = (
    (3, 1, 8, 1, 128, 40, "bfloat16", True),
    (2, 3, 6, 2, 80, 37, "float32", True),
    (2, 3, 6, 2, 80, 37, "float32", False),
    (5, 1, 4, 2, 64, 33, "float16", False),
    (1, 1, 1, 1, 256, 20, "bfloat16", True),
    (4, 2, 16, 2, 128, 1, "float32", True),
    (2, 1, 3, 1, 64, 0, "bfloat16", True),
    (3, 5, 5, 1, 64, 18, "float32", False),
)
# A step holds up to 4 (bf16) or 2 (f32) sequence-heads of 16 keys: packing and raggedness
# inside a step are exercised.
SMALL = BlockSizes(suffix_keys=16, suffix_step_bytes=4 * 2 * 16 * 128 * 2)
PRIOR_KEYS = 5


def check(out, lse, ref_out, ref_lse, dtype):
  assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
  assert not np.isnan(np.asarray(out)).any()
  check_attention(out, lse, ref_out, ref_lse, dtype)


class TestInterpret:
  interpret = True

  def setup_method(self):
    if not self.interpret and jax.default_backend() != "tpu":
      pytest.skip("needs a TPU")
    self.suffix = small_jit(functools.partial(suffix.suffix_attention, block_sizes=SMALL,
                                               interpret=self.interpret),
                             small=self.interpret, static_argnames=("scale", "causal"))

  @settings(max_examples=30)
  @given(data=st.data(), seed=SEEDS, case=st.sampled_from(CASES), causal=st.booleans())
  def test_suffix_attention(self, data, seed, case, causal):
    count_case("tpu_suffix")
    rng = np.random.default_rng(seed)
    b, tq, hq, hkv, d, s, dtype, with_prior = case
    kv_len = lengths(data.draw, b, s)
    q, q64 = rand(rng, (b, tq, hq, d), dtype)
    k, k64 = rand(rng, (b, s, hkv, d), dtype)
    v, v64 = rand(rng, (b, s, hkv, d), dtype)
    plen = data.draw(st.integers(0, PRIOR_KEYS)) if with_prior else 0
    pk, pk64 = rand(rng, (PRIOR_KEYS, hkv, d), dtype)
    pv, pv64 = rand(rng, (PRIOR_KEYS, hkv, d), dtype)
    # The prior: attention over other keys (float32 reference); fused into the suffix.
    prior = (reference.prefix_attention(q, pk, pv, kv_length=jnp.int32(plen), scale=d**-0.5)
             if with_prior else None)
    out, lse = self.suffix(q, k, v, kv_lengths=jnp.asarray(kv_len), causal=causal,
                           scale=d**-0.5, prior=prior)
    assert out.shape == (b, tq, hq, d) and lse.shape == (b, tq, hq)
    # Oracle: full attention over [prior keys, own keys]; causal applies to the own keys.
    ref = oracle_tree(q64, [[pk64[:plen]]] * b, [[pv64[:plen]]] * b, k64, v64, kv_len,
                      causal=causal)
    check(out, lse, *ref, dtype)

  @settings(max_examples=6)
  @given(data=st.data(), seed=SEEDS)
  def test_blocks_past_a_length_are_not_computed(self, data, seed):
    """K/V past each sequence's last needed 16-key block are NaN: any computation on them
    (even masked: 0 * NaN) would show. Sequences of one step have different lengths."""
    count_case("tpu_suffix_skip")
    rng = np.random.default_rng(seed)
    b, tq, hq, hkv, d, s, dtype = 4, 1, 4, 2, 128, 50, "bfloat16"
    kv_len = lengths(data.draw, b, s)
    q, q64 = rand(rng, (b, tq, hq, d), dtype)
    k, k64 = rand(rng, (b, s, hkv, d), dtype)
    v, v64 = rand(rng, (b, s, hkv, d), dtype)
    needed = -(-kv_len // 16) * 16
    poison = (np.arange(s)[None, :] >= needed[:, None])[:, :, None, None]
    k, v = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)
    out, lse = self.suffix(q, k, v, kv_lengths=jnp.asarray(kv_len), causal=True, scale=d**-0.5)
    empty = [[]] * b
    check(out, lse, *oracle_tree(q64, empty, empty, k64, v64, kv_len, causal=True), dtype)


class TestNative(TestInterpret):
  interpret = False


def test_step_packing_heuristic():
  """Heads, then sequences, fill a step up to the byte target; megacore keeps >= 2
  parallel steps; the budget shrinks the step; padding of B is balanced."""
  bs = BlockSizes(suffix_keys=512, suffix_step_bytes=1 << 20, min_parallel_steps=1)
  # Hydragen paper shape (Hkv 1, D 128, bf16): 128 keys = 64 KiB per sequence -> 16 sequences.
  assert suffix.suffix_blocks(1024, 1, 128, 8, 128, 2, bs) == suffix.SuffixBlocks(16, 1, 128)
  # Llama-3-8B (Hkv 8), 512 keys: one head is 256 KiB -> 4 heads per step, 1 sequence.
  assert suffix.suffix_blocks(64, 8, 512, 4, 128, 2, bs) == suffix.SuffixBlocks(1, 4, 512)
  mega = BlockSizes(suffix_keys=512, suffix_step_bytes=1 << 20, min_parallel_steps=2)
  blocks = suffix.suffix_blocks(3, 1, 100, 8, 128, 2, mega)
  assert -(-3 // blocks.batch) >= 2
  blocks = suffix.suffix_blocks(1, 8, 100, 4, 128, 2, mega)
  assert 8 // blocks.heads >= 2
  assert suffix.suffix_blocks(10, 1, 100, 8, 128, 2, bs).batch == 10
  assert suffix.suffix_blocks(17, 1, 128, 8, 128, 2, bs).batch == 9  # 2 balanced blocks
  tight = BlockSizes(suffix_keys=512, suffix_step_bytes=8 << 20, vmem_budget_bytes=2 << 20)
  blocks = suffix.suffix_blocks(64, 8, 4096, 32, 256, 4, tight)
  assert suffix.vmem_bytes(blocks, 32, 256, 4, True) <= tight.vmem_budget_bytes


def test_lengths_skip_blocks_without_dma():
  """The key index map clamps at the last block of the step's longest sequence: past it
  the block index repeats (the pipeline issues no DMA) and no compute runs."""
  from pallas_kernels.tpu.prefix import last_block
  assert [int(last_block(n, 16)) for n in (0, 1, 16, 17, 40)] == [0, 0, 0, 1, 2]
  blocks = [min(j, int(last_block(17, 16))) for j in range(5)]
  assert blocks == [0, 1, 1, 1, 1]
