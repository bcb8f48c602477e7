"""The paged segment kernel with its keys split (``SegmentConfig.splits > 1``, the plan's
choice where few queries share a long segment), interpreted, against the float64 oracle."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jax_shared_attn.testing import oracle_tree
from pallas_kernels.device import DeviceInfo
from pallas_kernels.gpu import dispatch
from pallas_kernels.gpu.shared import paged_attention
from strategies import assert_close, rand


@pytest.mark.parametrize("splits, lengths", [(3, (37, 70)), (4, (0, 71)), (2, (72, 1))])
def test_key_splits_equal_the_oracle(splits, lengths):
  b, hq, hkv, d, ps = 4, 4, 2, 64, 8
  rng = np.random.default_rng(splits)
  n_pages = 1 + 2 * 9 + b * 2
  k, k64 = rand(rng, (n_pages, ps, hkv, d), "float32")
  v, v64 = rand(rng, (n_pages, ps, hkv, d), "float32")
  ids = rng.permutation(n_pages).astype(np.int32)
  seg_table, own = ids[:18].reshape(2, 9), ids[18:18 + 2 * b].reshape(b, 2)
  nodes = np.array([0, 1, -1, 1], np.int32)
  own_len = np.array([3, 16, 0, 9], np.int32)
  q, q64 = rand(rng, (b, 1, hq, d), "float32")
  levels = [(jnp.asarray(seg_table), jnp.asarray(lengths, jnp.int32), jnp.asarray(nodes))]
  plan = dispatch.plan_paged(q, [seg_table], k, own, device=DeviceInfo.named(
      "NVIDIA H100 80GB HBM3"))
  plan = dataclasses.replace(plan, segments=(dataclasses.replace(
      plan.segments[0], block_n=16, splits=splits),))
  out, lse = paged_attention(q, k, v, levels, jnp.asarray(own), jnp.asarray(own_len),
                             causal=True, scale=d**-0.5, plan=plan, interpret=True)
  tok = lambda x64, pages, n: x64[pages].reshape(-1, hkv, d)[:n]
  seg_k = [[tok(k64, seg_table[i], lengths[i])] if i >= 0 else [] for i in nodes]
  seg_v = [[tok(v64, seg_table[i], lengths[i])] if i >= 0 else [] for i in nodes]
  sk64 = np.stack([tok(k64, own[i], 2 * ps) for i in range(b)])
  sv64 = np.stack([tok(v64, own[i], 2 * ps) for i in range(b)])
  assert_close(out, lse, *oracle_tree(q64, seg_k, seg_v, sk64, sv64, own_len, causal=True),
               "float32")
