"""The XLA path reads a cache only up to its contents: key blocks past a part's longest valid
key (the prefix length; the longest own length among a row block's sequences) are never
loaded. NaN written past those blocks leaves every output equal to the float64 oracle; a loop
over the whole capacity would multiply the NaN values by zero weights and return NaN."""

import numpy as np

from jax_shared_attn import XlaConfig, attention_with_lse, shared_prefix_attention
from jax_shared_attn.testing import check_attention, oracle_full, oracle_tree

BK = 8  # keys per block
CONFIG = XlaConfig(block_rows=4, block_keys=BK)  # two row blocks of 4 sequences at B = 8


def poisoned(rng, shape, valid):
  """Random keys or values whose blocks past ``valid`` (per sequence) hold NaN."""
  x = rng.standard_normal(shape).astype(np.float32)
  for b, n in enumerate(valid):
    x[b, -(-n // BK) * BK:] = np.nan
  return x


def block_max(lens, rows=4):
  """Each sequence's row block's longest length (what bounds that block's key loop)."""
  return [max(lens[i - i % rows:i - i % rows + rows]) for i in range(len(lens))]


def test_own_keys_past_the_row_blocks_longest_are_never_read():
  rng = np.random.default_rng(0)
  b, cap, hq, hkv, d = 8, 64, 4, 2, 16
  lens = np.array([3, 5, 1, 0, 13, 2, 7, 9], np.int32)
  q = rng.standard_normal((b, 1, hq, d)).astype(np.float32)
  k = poisoned(rng, (b, cap, hkv, d), block_max(lens))
  v = poisoned(rng, (b, cap, hkv, d), block_max(lens))
  out, lse = attention_with_lse(q, k, v, kv_lengths=lens, impl="xla", config=CONFIG)
  assert np.isfinite(np.asarray(out)).all()
  kv = [np.nan_to_num(x.astype(np.float64)) for x in (k, v)]
  check_attention(out, lse, *oracle_full(q.astype(np.float64), *kv, lens), "float32")


def test_prefix_keys_past_its_length_are_never_read():
  rng = np.random.default_rng(1)
  b, p, plen, cap, hq, hkv, d = 8, 64, 10, 32, 4, 2, 16
  lens = np.array([3, 5, 1, 0, 13, 2, 7, 9], np.int32)
  q = rng.standard_normal((b, 1, hq, d)).astype(np.float32)
  pk, pv = (poisoned(rng, (1, p, hkv, d), [plen])[0] for _ in range(2))
  sk = poisoned(rng, (b, cap, hkv, d), block_max(lens))
  sv = poisoned(rng, (b, cap, hkv, d), block_max(lens))
  out, lse = shared_prefix_attention(q, pk, pv, sk, sv, prefix_length=plen, suffix_lengths=lens,
                                     impl="xla", return_lse=True, config=CONFIG)
  assert np.isfinite(np.asarray(out)).all()
  f64 = lambda x: np.nan_to_num(x.astype(np.float64))
  ref = oracle_tree(q.astype(np.float64), [[f64(pk)[:plen]]] * b, [[f64(pv)[:plen]]] * b,
                    f64(sk), f64(sv), lens)
  check_attention(out, lse, *ref, "float32")
