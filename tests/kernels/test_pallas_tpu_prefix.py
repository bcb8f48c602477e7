"""pallas_kernels/tpu/prefix.py against the float64 oracle (property tests).

``TestInterpret`` runs the kernel in the TPU simulator (``interpret=True`` ->
``pltpu.InterpretParams()``: out-of-bounds block reads raise, uninitialised VMEM
is NaN) with small blocks, so every case crosses row and key block boundaries;
``TestNative`` is the same class with the flag flipped, for a TPU (skipped
elsewhere).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_shared_attn.testing import check_attention, oracle_tree
from pallas_kernels.tpu import BlockSizes, prefix
from strategies import SEEDS, count_case, rand, small_jit

# (B, Tq, Hq, Hkv, D, P, dtype): G = 8, 3, 2, 1, 8, 3, 7; D 64/80/128/256; P off the
# 16-key blocks, 1 and 0; rows B*Tq*G off the 16-row blocks.
CASES = (
    (3, 1, 8, 1, 128, 40, "bfloat16"),
    (2, 3, 6, 2, 80, 37, "float32"),
    (5, 1, 4, 2, 64, 33, "float16"),
    (1, 1, 1, 1, 256, 20, "bfloat16"),
    (4, 2, 16, 2, 128, 1, "float32"),
    (2, 1, 3, 1, 64, 0, "bfloat16"),
    (1, 3, 7, 1, 64, 17, "float32"),
)
SMALL = BlockSizes(prefix_rows=16, prefix_keys=32, compute_keys=16)  # 2 chunks per block


def check(out, lse, ref_out, ref_lse, dtype):
  assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
  assert not np.isnan(np.asarray(out)).any()
  check_attention(out, lse, ref_out, ref_lse, dtype)


class TestInterpret:
  interpret = True

  def setup_method(self):
    if not self.interpret and jax.default_backend() != "tpu":
      pytest.skip("needs a TPU")
    self.prefix = small_jit(functools.partial(prefix.prefix_attention, block_sizes=SMALL,
                                               interpret=self.interpret),
                             small=self.interpret, static_argnames=("scale",))

  @settings(max_examples=24)
  @given(data=st.data(), seed=SEEDS, case=st.sampled_from(CASES))
  def test_prefix_attention(self, data, seed, case):
    count_case("tpu_prefix")
    rng = np.random.default_rng(seed)
    b, tq, hq, hkv, d, p, dtype = case
    plen = data.draw(st.sampled_from(sorted({0, min(1, p), p})) | st.integers(0, p))
    q, q64 = rand(rng, (b, tq, hq, d), dtype)
    k, k64 = rand(rng, (p, hkv, d), dtype)
    v, v64 = rand(rng, (p, hkv, d), dtype)
    out, lse = self.prefix(q, k, v, kv_length=jnp.int32(plen), scale=d**-0.5)
    assert out.shape == (b, tq, hq, d) and lse.shape == (b, tq, hq)
    empty = np.zeros((b, 0, hkv, d))
    ref = oracle_tree(q64, [[k64[:plen]]] * b, [[v64[:plen]]] * b, empty, empty, causal=False)
    check(out, lse, *ref, dtype)


class TestNative(TestInterpret):
  interpret = False


def test_blocks_are_balanced_and_fit():
  """Rows and keys pad by less than one 16-row group per block; blocks never exceed the
  knobs; a VMEM-heavy shape is shrunk under the budget."""
  bs = BlockSizes(prefix_rows=512, prefix_keys=1024, compute_keys=512)
  for rows, keys in [(1, 1), (24, 40), (513, 1000), (8192, 16385), (100, 300)]:
    r, k, c = prefix.prefix_blocks(rows, keys, 128, 2, bs)
    assert r <= 512 and k <= 1024 and r % 16 == 0 and k % c == 0 and c % 16 == 0
    assert -(-rows // r) * r - rows < 16 * -(-rows // r)
    assert -(-keys // k) * k - keys < c * -(-keys // k)  # a multi-chunk block pads < a chunk
  tight = BlockSizes(prefix_rows=1024, prefix_keys=1024, vmem_budget_bytes=4 << 20)
  r, k, c = prefix.prefix_blocks(4096, 4096, 256, 4, tight)
  assert prefix.vmem_bytes(r, k, c, 256, 4) <= tight.vmem_budget_bytes


def test_head_major_kernel_rejects_unpadded_shapes():
  q = jnp.zeros((1, 24, 128), jnp.float32)
  k = jnp.zeros((1, 32, 128), jnp.float32)
  with pytest.raises(ValueError, match="block_rows=16"):
    prefix.prefix_attention_head_major(q, k, k, jnp.array([3], jnp.int32), scale=1.0,
                                       block_rows=16, block_keys=16)
