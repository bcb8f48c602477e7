"""The TPU family's paged path: each sequence's own pages read in place by the paged suffix
kernel (:func:`pallas_kernels.tpu.paged.paged_suffix_head_major`), interpreted on a CPU
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

from jax_shared_attn import PagedLevel, explain, paged_attention
from jax_shared_attn.testing import oracle_tree
from pallas_kernels import base, tpu
from pallas_kernels.tpu import common, paged
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
def paged_suffix_jit(q, kp, vp, table, lens, prior, *, causal):
  return paged.paged_suffix_attention(q, kp, vp, table, kv_lengths=lens, causal=causal,
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
  out, lse = paged_suffix_jit(q, kp, vp, jnp.asarray(table), jnp.asarray(own), prior,
                              causal=tq > 1)
  sk64 = kp64[table].reshape(b, o * ps, hkv, d)
  sv64 = vp64[table].reshape(b, o * ps, hkv, d)
  assert_close(out, lse, *oracle_tree(q64, seg_k, seg_v, sk64, sv64, own, causal=tq > 1),
               dtype)


def oracle_own_variants(q, ctx_k, ctx_v, causal, scale, slopes, softcap, window):
  """Float64 attention of each sequence's queries (the last Tq positions of its own keys) over
  its own keys ``ctx_k[b] [L_b, Hkv, D]`` with ALiBi ``slopes [B, Hq]``, ``softcap``, ``window
  (left, right)``; (0, -inf) where a query sees nothing."""
  b, tq, hq, _ = q.shape
  out, lse = np.zeros_like(q), np.full((b, tq, hq), -np.inf)
  for i in range(b):
    k, v = ctx_k[i], ctx_v[i]
    n, g = len(k), hq // k.shape[1]
    kpos = np.arange(n)
    for t in range(tq):
      qpos = n - tq + t
      vis = (kpos <= qpos) if causal else np.ones(n, bool)
      vis &= (kpos >= qpos - window[0]) & (kpos <= qpos + window[1])
      if not vis.any():
        continue
      for h in range(hq):
        s = scale * (k[vis, h // g] @ q[i, t, h])
        s = softcap * np.tanh(s / softcap) - slopes[i, h] * (qpos - kpos[vis])
        m = s.max()
        p = np.exp(s - m)
        lse[i, t, h] = m + np.log(p.sum())
        out[i, t, h] = (p / p.sum()) @ v[vis, h // g]
  return out, lse


@settings(max_examples=3, deadline=None)
@given(data=st.data(), seed=SEEDS)
def test_paged_suffix_kernel_applies_the_variants(data, seed):
  """ALiBi, softcap and a sliding window together over shuffled pages, causal Tq = 2: the
  window skips whole pages, the positions count from each sequence's own length."""
  count_case("tpu_paged_suffix_variants")
  b, tq, hq, hkv, d, ps, o, scale = 3, 2, 4, 2, 128, 8, 4, 0.3
  rng = np.random.default_rng(seed)
  kp, kp64 = rand(rng, (b * o + 1, ps, hkv, d), "float32")
  vp, vp64 = rand(rng, (b * o + 1, ps, hkv, d), "float32")
  table = rng.permutation(b * o + 1)[:b * o].reshape(b, o).astype(np.int32)
  own = np.maximum(lengths(data.draw, b, o * ps), tq).astype(np.int32)
  slopes = rng.uniform(-0.5, 1.0, size=(b, hq)).astype(np.float32)
  mods = base.ScoreMods(alibi_slopes=jnp.asarray(slopes), softcap=1.5, window=(9, 0))
  q, q64 = rand(rng, (b, tq, hq, d), "float32")
  out, lse = paged.paged_suffix_attention(q, kp, vp, jnp.asarray(table), kv_lengths=own,
                                           causal=True, scale=scale, block_sizes=BLOCK_SIZES,
                                           mods=mods)
  ctx = lambda x64, i: x64[table[i]].reshape(-1, hkv, d)[:own[i]]
  ref = oracle_own_variants(q64, [ctx(kp64, i) for i in range(b)], [ctx(vp64, i) for i in range(b)],
                            True, scale, slopes.astype(np.float64), 1.5, (9, 0))
  assert_close(out, lse, *ref, "float32")


def test_paged_blocks_obey_the_tiling_rule():
  """Heads per step: lanes a multiple of 128 or all heads; pages per block up to suffix_keys."""
  bs = common.block_sizes_for("v5e")
  blocks = paged.paged_blocks(8, 8, 128, 16, 4, 128, 2, bs)
  assert blocks.pages == 4 and 8 % blocks.heads == 0
  assert paged.paged_blocks(8, 8, 16, 64, 4, 64, 2, bs).heads % 2 == 0
  assert paged.paged_blocks(8, 4, 16, 64, 4, 80, 2, bs).heads == 4
  assert not paged.paged_heads_legal(1, 4, 64) and paged.paged_heads_legal(2, 4, 64)


# (B, Tq, Hq, Hkv, D, page_size, own pages, level structure ((segments, pages), ...), dtype)
API_CASES = [
    (4, 1, 4, 2, 128, 8, 3, ((1, 2), (3, 2)), "float32"),  # a system prompt, then a fork
    (3, 3, 2, 1, 64, 16, 2, ((2, 2),), "bfloat16"),  # prefill chunks over pages
]
CONFIG = tpu.TpuConfig(block_sizes=BLOCK_SIZES)


@functools.partial(jax.jit, static_argnames=("causal",))
def paged_api(q, kp, vp, table, lens, levels, *, causal):
  return paged_attention(q, kp, vp, table, lens, levels=levels, causal=causal, impl="pallas:tpu",
                         return_lse=True, config=CONFIG)


@pytest.mark.parametrize("case", API_CASES, ids=["decode-levels", "chunk-level"])
@settings(max_examples=2, deadline=None)
@given(data=st.data(), seed=SEEDS)
def test_paged_attention_entry_equals_the_oracle(case, data, seed):
  """The public paged_attention on the TPU family: levels gathered once each (the prefix kernel
  for one segment, the segment kernel for several), own pages read in place; pages shuffled
  and shared between the levels and the sequences."""
  count_case("tpu_paged_attention")
  b, tq, hq, hkv, d, ps, o, structure, dtype = case
  rng = np.random.default_rng(seed)
  n_pages = 2 + b * o + sum(n * p for n, p in structure) // 2
  kp, kp64 = rand(rng, (n_pages, ps, hkv, d), dtype)
  vp, vp64 = rand(rng, (n_pages, ps, hkv, d), dtype)

  def tokens(x64, pages, length):  # float64 [length, Hkv, D] of a page list
    return x64[pages].reshape(-1, hkv, d)[:length]

  levels, seg_k, seg_v = [], [[] for _ in range(b)], [[] for _ in range(b)]
  for n, p in structure:
    t = rng.integers(0, n_pages, size=(n, p)).astype(np.int32)
    lens = lengths(data.draw, n, p * ps)
    nodes = np.asarray(data.draw(st.lists(st.integers(-1, n - 1), min_size=b, max_size=b)),
                       np.int32)
    levels.append(PagedLevel(jnp.asarray(t), jnp.asarray(lens), jnp.asarray(nodes)))
    for i, node in enumerate(nodes):
      if node >= 0:
        seg_k[i].append(tokens(kp64, t[node], lens[node]))
        seg_v[i].append(tokens(vp64, t[node], lens[node]))
  own = rng.permutation(n_pages)[:b * o].reshape(b, o).astype(np.int32)
  own_len = lengths(data.draw, b, o * ps)
  if tq > 1:
    own_len = np.maximum(own_len, tq).astype(np.int32)
  q, q64 = rand(rng, (b, tq, hq, d), dtype)
  out, lse = paged_api(q, kp, vp, jnp.asarray(own), jnp.asarray(own_len), levels,
                       causal=tq > 1)
  assert out.dtype == q.dtype and lse.dtype == jnp.float32
  sk64 = np.stack([tokens(kp64, own[i], o * ps) for i in range(b)])
  sv64 = np.stack([tokens(vp64, own[i], o * ps) for i in range(b)])
  assert_close(out, lse, *oracle_tree(q64, seg_k, seg_v, sk64, sv64, own_len, causal=tq > 1),
               dtype)


def test_explain_names_the_paged_tpu_path():
  q = S((4, 1, 8, 128), jnp.bfloat16)
  pool = S((64, 128, 2, 128), jnp.bfloat16)
  levels = [PagedLevel(S((1, 4), jnp.int32), S((1,), jnp.int32), S((4,), jnp.int32)),
            PagedLevel(S((2, 3), jnp.int32), S((2,), jnp.int32), S((4,), jnp.int32))]
  plan = explain(paged_attention, q, pool, pool, S((4, 5), jnp.int32), S((4,), jnp.int32),
                 levels=levels, platform="tpu", device_kind="TPU v5 lite")
  assert plan.impl == "pallas:tpu" and plan.backend.path == "paged", plan
  assert isinstance(plan.backend.suffix_blocks, paged.PagedBlocks), plan
  assert plan.backend.suffix_blocks.pages == 4  # suffix_keys 512 / 128-token pages
  assert len(plan.backend.prefix_blocks) == 2 and plan.backward == "none"
  assert any("read in place by the paged suffix kernel" in r for r in plan.reasons), plan


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
      return paged.paged_suffix_attention(q, kp, vp, table, kv_lengths=lens, causal=tq > 1,
                                           scale=d**-0.5, prior=(p_out, p_lse), block_sizes=bs)

    pool = S((11, ps, hkv, d), dtype)
    text = export_tpu(fn, S((b, tq, hq, d), dtype), pool, pool, S((b, o), jnp.int32),
                      S((b,), jnp.int32), S((b, tq, hq, d), jnp.float32),
                      S((b, tq, hq), jnp.float32))
    assert text.count("tpu_custom_call") == 1 and "hydragen_paged_suffix_attention" in text
    assert "gather" not in text  # the pages are read in place


def test_paged_suffix_kernel_with_variants_lowers_to_mosaic():
  """ALiBi, softcap and a window (whose first page clamps the index maps) lower too."""
  b, tq, hq, hkv, d, ps, o = 4, 2, 8, 2, 128, 64, 6
  bs = common.block_sizes_for("v6e")

  def fn(q, kp, vp, table, lens, slopes):
    mods = base.ScoreMods(alibi_slopes=slopes, softcap=30.0, window=(100, 0))
    return paged.paged_suffix_attention(q, kp, vp, table, kv_lengths=lens, causal=True,
                                        scale=d**-0.5, block_sizes=bs, mods=mods)

  pool = S((40, ps, hkv, d), jnp.bfloat16)
  text = export_tpu(fn, S((b, tq, hq, d), jnp.bfloat16), pool, pool, S((b, o), jnp.int32),
                    S((b,), jnp.int32), S((b, hq), jnp.float32))
  assert text.count("tpu_custom_call") == 1 and "gather" not in text


def test_paged_attention_exports_as_one_tpu_program():
  """The jitted public paged_attention for a TPU: the prefix kernel (a one-segment level), the
  segment kernel (a level of two) and the paged suffix kernel, no interpreter; the only
  gathers are the levels' pages."""
  b, hq, hkv, d, ps = 8, 8, 2, 128, 64
  pool = S((200, ps, hkv, d), jnp.bfloat16)

  def fn(q, kp, vp, table, lens, t0, l0, n0, t1, l1, n1):
    levels = [PagedLevel(t0, l0, n0), PagedLevel(t1, l1, n1)]
    return paged_attention(q, kp, vp, table, lens, levels=levels, impl="pallas:tpu")

  i32 = jnp.int32
  text = export_tpu(fn, S((b, 1, hq, d), jnp.bfloat16), pool, pool, S((b, 6), i32), S((b,), i32),
                    S((1, 8), i32), S((1,), i32), S((b,), i32), S((2, 4), i32), S((2,), i32),
                    S((b,), i32))
  assert text.count("tpu_custom_call") == 3 and "hydragen_paged_suffix_attention" in text
  # Without levels nothing is gathered: the own pages are read in place.
  own_only = export_tpu(lambda q, kp, vp, table, lens: paged_attention(
      q, kp, vp, table, lens, impl="pallas:tpu"), S((b, 1, hq, d), jnp.bfloat16), pool, pool,
      S((b, 6), i32), S((b,), i32))
  assert own_only.count("tpu_custom_call") == 1 and "gather" not in own_only
