"""Score variants (ALiBi, soft-capping, sliding windows) in the Pallas kernels, against a float64
NumPy oracle of each sequence's explicit context.

The oracle (written here, sharing no code with the library) concatenates each sequence's
context (its segments in level order, then its own keys), puts its queries at the context's last
Tq positions and applies the formulas there: it sees no decomposition, so the positions each
kernel is given, windows that hide whole levels (LSE -inf for that part) and the merges are all
checked. Every test goes through the public API with ``impl="pallas:triton"``
(``TestTritonInterpret``) or ``impl="pallas:tpu"`` (``TestTpuInterpret``), interpreted on a CPU;
``TestTritonNative`` and ``TestTpuNative``, the same classes, run the compiled kernels on a CUDA
GPU or a TPU (skipped elsewhere). The GPU tests assert, with ``explain``, that the path they
mean to check is the one planned; ``test_tpu_kernels_with_variants_lower_to_mosaic`` lowers
the TPU kernels with the variants for a TPU from the CPU. The shapes are fixed per test and the static choices few, so each test compiles one
program and its hypothesis examples only draw values (lengths, trees, slopes).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_shared_attn import (PagedLevel, SharedLevel, attention_with_lse, explain,
                             hierarchical_attention, paged_attention, shared_prefix_attention)
from jax_shared_attn.testing import check_attention
from strategies import SEEDS, count_case, lengths, rand, small_jit

BACKEND = jax.default_backend()
SCALE = 0.4
B, TQ, HQ, HKV, D = 3, 2, 4, 2, 16
A100, H100 = "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"
# (slopes?, softcap, window, causal): the compositions, each one compiled program per test.
ALIBI_WINDOW = (True, None, (3, 0), True)
SOFTCAP_WINDOW = (False, 1.5, (5, 1), False)
ALL_THREE = (True, 2.0, (4, 1), True)
ALIBI_ONLY = (True, None, None, False)
SOFTCAP_ONLY = (False, 0.8, None, True)


def oracle(q, ctx_k, ctx_v, own, causal, scale, slopes, softcap, window):
  """Float64 attention with the variants over explicit contexts.

  ``ctx_k[b], ctx_v[b]``: sequence b's keys in context order ``[C_b, Hkv, D]``; its last
  ``own[b]`` keys are its own (``causal`` applies to them; every shared key is visible). Query
  t of sequence b sits at position ``C_b - Tq + t``, key c at c. ``slopes [B, Hq]``, ``softcap``
  and ``window = (left, right)``: None where off. Returns ``out``, ``lse`` (-inf where a query
  sees no key)."""
  b, tq, hq, _ = q.shape
  out = np.zeros_like(q)
  lse = np.full((b, tq, hq), -np.inf)
  for i in range(b):
    k, v = ctx_k[i], ctx_v[i]
    n = len(k)
    g = hq // k.shape[1]
    kpos = np.arange(n)
    for t in range(tq):
      qpos = n - tq + t
      vis = np.ones(n, bool)
      if causal:
        vis &= (kpos < n - own[i]) | (kpos <= qpos)
      if window is not None:
        vis &= (kpos >= qpos - window[0]) & (kpos <= qpos + window[1])
      if not vis.any():
        continue
      for h in range(hq):
        s = scale * (k[vis, h // g] @ q[i, t, h])
        if softcap is not None:
          s = softcap * np.tanh(s / softcap)
        if slopes is not None:
          s = s - slopes[i, h] * (qpos - kpos[vis])
        m = s.max()
        p = np.exp(s - m)
        lse[i, t, h] = m + np.log(p.sum())
        out[i, t, h] = (p / p.sum()) @ v[vis, h // g]
  return out, lse


def draw_slopes(rng, with_alibi, per_seq=True):
  """Random ALiBi slopes (some negative: the signed distance matters) as the API takes them
  (``[B, Hq]`` or ``[Hq]``) and as the oracle does (``[B, Hq]`` float64); None, None without."""
  if not with_alibi:
    return None, None
  s = rng.uniform(-0.5, 1.0, size=(B, HQ) if per_seq else (HQ,)).astype(np.float32)
  return jnp.asarray(s), np.broadcast_to(s, (B, HQ)).astype(np.float64)


def variant_kw(softcap, window):
  return dict(softcap=softcap, local_window_size=window)


class TestTritonInterpret:
  """The Triton kernels interpreted on a CPU; :class:`TestTritonNative` runs the same tests
  compiled on a GPU."""

  impl = "pallas:triton"
  native_backend = "gpu"
  interpret = True
  examples = 10
  # The compositions each test runs here (each is one more compiled program).
  variants = {"tree": (ALIBI_WINDOW, SOFTCAP_WINDOW), "suffix": (ALIBI_ONLY, SOFTCAP_ONLY)}

  def setup_method(self):
    if not self.interpret and BACKEND != self.native_backend:
      pytest.skip(f"needs a {self.native_backend.upper()}")

  def only(self, test: str, variant) -> None:
    if variant not in self.variants[test]:
      pytest.skip(f"{self.impl}: this composition is checked on the other family")

  @pytest.mark.parametrize("variant", [ALIBI_WINDOW, SOFTCAP_WINDOW],
                           ids=["alibi+window", "softcap+window"])
  def test_tree_prefix_segment_suffix(self, variant):
    """A one-segment level (the prefix kernel), a level of three segments (the segment kernel)
    and the own keys (the suffix kernel merging both levels in its epilogue)."""
    self.only("tree", variant)
    alibi, softcap, window, causal = variant
    p_cap, n_seg, t_seg, s_cap = 9, 3, 7, 4

    @functools.partial(small_jit, small=self.interpret)
    def run(q, levels, sk, sv, lens, slopes):
      return hierarchical_attention(q, levels, sk, sv, suffix_lengths=lens, causal=causal,
                                    scale=SCALE, impl=self.impl, return_lse=True, alibi_slopes=slopes,
                                    **variant_kw(softcap, window))

    @settings(max_examples=self.examples, deadline=None)
    @given(data=st.data(), seed=SEEDS)
    def prop(data, seed):
      rng = np.random.default_rng(seed)
      count_case("kernel_variants_tree")
      q, q64 = rand(rng, (B, TQ, HQ, D), "float32")
      pk, pk64 = rand(rng, (1, p_cap, HKV, D), "float32")
      pv, pv64 = rand(rng, (1, p_cap, HKV, D), "float32")
      segk, segk64 = rand(rng, (n_seg, t_seg, HKV, D), "float32")
      segv, segv64 = rand(rng, (n_seg, t_seg, HKV, D), "float32")
      sk, sk64 = rand(rng, (B, s_cap, HKV, D), "float32")
      sv, sv64 = rand(rng, (B, s_cap, HKV, D), "float32")
      p_len = lengths(data.draw, 1, p_cap)
      seg_len = lengths(data.draw, n_seg, t_seg)
      nodes = np.array([data.draw(st.integers(-1, n_seg - 1)) for _ in range(B)], np.int32)
      own = lengths(data.draw, B, s_cap)
      slopes, slopes64 = draw_slopes(rng, alibi)
      levels = [SharedLevel(pk, pv, jnp.asarray(p_len), jnp.zeros((B,), jnp.int32)),
                SharedLevel(segk, segv, jnp.asarray(seg_len), jnp.asarray(nodes))]
      plan = explain(hierarchical_attention, q, levels, sk, sv, suffix_lengths=jnp.asarray(own),
                     causal=causal, impl=self.impl, alibi_slopes=slopes, **variant_kw(softcap, window))
      assert plan.impl == self.impl and plan.backward == "xla", plan
      if self.impl == "pallas:triton":
        assert plan.backend.path == "split" and plan.backend.prefixes[0].kernel == "triton"
        assert plan.backend.segments[1] is not None, plan
      out, lse = run(q, levels, sk, sv, jnp.asarray(own), slopes)

      def ctx(x0, x1, x2, i):
        parts = [x0[0, :p_len[0]]] + ([x1[nodes[i], :seg_len[nodes[i]]]] if nodes[i] >= 0
                                       else []) + [x2[i, :own[i]]]
        return np.concatenate(parts)

      ref = oracle(q64, [ctx(pk64, segk64, sk64, i) for i in range(B)],
                   [ctx(pv64, segv64, sv64, i) for i in range(B)], own, causal, SCALE,
                   slopes64, softcap, window)
      check_attention(out, lse, *ref, "float32")

    prop()

  @pytest.mark.parametrize("variant", [ALL_THREE], ids=["alibi+softcap+window"])
  def test_flat(self, variant):
    """Few sequences: shared then own keys in the one flat kernel (slopes ``[Hq]``)."""
    if self.impl != "pallas:triton":
      pytest.skip("the flat kernel is the Triton family's")
    alibi, softcap, window, causal = variant
    p_cap, s_cap = 8, 5

    @functools.partial(small_jit, small=self.interpret)
    def run(q, pk, pv, sk, sv, p_len, lens, slopes):
      return shared_prefix_attention(q, pk, pv, sk, sv, prefix_length=p_len,
                                     suffix_lengths=lens, causal=causal, scale=SCALE, impl=self.impl,
                                     return_lse=True, alibi_slopes=slopes,
                                     **variant_kw(softcap, window))

    @settings(max_examples=self.examples, deadline=None)
    @given(data=st.data(), seed=SEEDS)
    def prop(data, seed):
      rng = np.random.default_rng(seed)
      count_case("kernel_variants_flat")
      q, q64 = rand(rng, (B, TQ, HQ, D), "float32")
      pk, pk64 = rand(rng, (p_cap, HKV, D), "float32")
      pv, pv64 = rand(rng, (p_cap, HKV, D), "float32")
      sk, sk64 = rand(rng, (B, s_cap, HKV, D), "float32")
      sv, sv64 = rand(rng, (B, s_cap, HKV, D), "float32")
      p_len = int(lengths(data.draw, 1, p_cap)[0])
      own = lengths(data.draw, B, s_cap)
      slopes, slopes64 = draw_slopes(rng, alibi, per_seq=False)
      args = (q, pk, pv, sk, sv)
      plan = explain(shared_prefix_attention, *args, prefix_length=jnp.int32(p_len),
                     suffix_lengths=jnp.asarray(own), causal=causal, impl=self.impl,
                     alibi_slopes=slopes, **variant_kw(softcap, window))
      assert plan.impl == self.impl and plan.backend.path == "flat", plan
      out, lse = run(*args, jnp.int32(p_len), jnp.asarray(own), slopes)
      ref = oracle(q64, [np.concatenate([pk64[:p_len], sk64[i, :own[i]]]) for i in range(B)],
                   [np.concatenate([pv64[:p_len], sv64[i, :own[i]]]) for i in range(B)], own,
                   causal, SCALE, slopes64, softcap, window)
      check_attention(out, lse, *ref, "float32")

    prop()

  @pytest.mark.parametrize("variant", [ALL_THREE], ids=["alibi+softcap+window"])
  def test_paged(self, variant):
    """Page pools: a one-segment level (gathered for the prefix kernel), a level of two
    segments and the own keys read in place (the segment and suffix kernels; on the TPU the
    levels are gathered and the own pages read in place by the paged suffix kernel)."""
    alibi, softcap, window, causal = variant
    page, pages, width = 2, 20, 3  # up to 6 keys per segment and per sequence

    @functools.partial(small_jit, small=self.interpret)
    def run(q, kp, vp, table, lens, levels, slopes):
      return paged_attention(q, kp, vp, table, lens, levels=levels, causal=causal, scale=SCALE,
                             impl=self.impl, return_lse=True, alibi_slopes=slopes,
                             **variant_kw(softcap, window))

    @settings(max_examples=self.examples, deadline=None)
    @given(data=st.data(), seed=SEEDS)
    def prop(data, seed):
      rng = np.random.default_rng(seed)
      count_case("kernel_variants_paged")
      q, q64 = rand(rng, (B, TQ, HQ, D), "float32")
      kp, kp64 = rand(rng, (pages, page, HKV, D), "float32")
      vp, vp64 = rand(rng, (pages, page, HKV, D), "float32")
      perm = rng.permutation(pages)[:(1 + 2 + B) * width].reshape(1 + 2 + B, width)
      tables = [perm[:1], perm[1:3], perm[3:]]
      lens0 = lengths(data.draw, 1, width * page)
      lens1 = lengths(data.draw, 2, width * page)
      nodes1 = np.array([data.draw(st.integers(-1, 1)) for _ in range(B)], np.int32)
      own = lengths(data.draw, B, width * page)
      slopes, slopes64 = draw_slopes(rng, alibi)
      levels = [PagedLevel(jnp.asarray(tables[0], jnp.int32), jnp.asarray(lens0),
                           jnp.zeros((B,), jnp.int32)),
                PagedLevel(jnp.asarray(tables[1], jnp.int32), jnp.asarray(lens1),
                           jnp.asarray(nodes1))]
      table = jnp.asarray(tables[2], jnp.int32)
      plan = explain(paged_attention, q, kp, vp, table, jnp.asarray(own), levels=levels,
                     causal=causal, impl=self.impl, alibi_slopes=slopes, **variant_kw(softcap, window))
      assert plan.impl == self.impl, plan
      if self.impl == "pallas:triton":
        assert plan.backend.path == "paged" and plan.backend.segments[1] is not None, plan
      out, lse = run(q, kp, vp, table, jnp.asarray(own), levels, slopes)

      def tokens(pool, row, n):
        return pool[row].reshape(-1, HKV, D)[:n]

      def ctx(pool, i):
        parts = [tokens(pool, tables[0][0], lens0[0])]
        if nodes1[i] >= 0:
          parts.append(tokens(pool, tables[1][nodes1[i]], lens1[nodes1[i]]))
        return np.concatenate(parts + [tokens(pool, tables[2][i], own[i])])

      ref = oracle(q64, [ctx(kp64, i) for i in range(B)], [ctx(vp64, i) for i in range(B)], own,
                   causal, SCALE, slopes64, softcap, window)
      check_attention(out, lse, *ref, "float32")

    prop()

  @pytest.mark.parametrize("variant", [ALIBI_ONLY, SOFTCAP_ONLY], ids=["alibi", "softcap"])
  def test_suffix_alone(self, variant):
    """No shared part (``attention_with_lse``): the suffix kernel alone, each variant alone."""
    self.only("suffix", variant)
    alibi, softcap, window, causal = variant
    s_cap = 7

    @functools.partial(small_jit, small=self.interpret)
    def run(q, k, v, lens, slopes):
      return attention_with_lse(q, k, v, kv_lengths=lens, causal=causal, scale=SCALE, impl=self.impl,
                                alibi_slopes=slopes, **variant_kw(softcap, window))

    @settings(max_examples=self.examples, deadline=None)
    @given(data=st.data(), seed=SEEDS)
    def prop(data, seed):
      rng = np.random.default_rng(seed)
      count_case("kernel_variants_suffix")
      q, q64 = rand(rng, (B, TQ, HQ, D), "float32")
      k, k64 = rand(rng, (B, s_cap, HKV, D), "float32")
      v, v64 = rand(rng, (B, s_cap, HKV, D), "float32")
      own = lengths(data.draw, B, s_cap)
      slopes, slopes64 = draw_slopes(rng, alibi)
      out, lse = run(q, k, v, jnp.asarray(own), slopes)
      ref = oracle(q64, [k64[i, :own[i]] for i in range(B)], [v64[i, :own[i]] for i in range(B)],
                   own, causal, SCALE, slopes64, softcap, window)
      check_attention(out, lse, *ref, "float32")

    prop()

  def test_window_hides_a_level_and_whole_rows(self):
    """A level wholly outside every query's window adds nothing (its LSE -inf, no NaN), and a
    query that sees no key at all gets ``out = 0``, ``lse = -inf``: a fixed case, so that it
    is always checked (the property tests reach it by chance)."""
    rng = np.random.default_rng(7)
    q, q64 = rand(rng, (B, TQ, HQ, D), "float32")
    pk, pk64 = rand(rng, (8, HKV, D), "float32")
    sk, sk64 = rand(rng, (B, 5, HKV, D), "float32")
    own = np.array([5, 0, 3], np.int32)  # sequence 1: its queries sit on the prefix's last keys
    window = (1, 0)
    out, lse = shared_prefix_attention(q, pk, pk, sk, sk, suffix_lengths=jnp.asarray(own),
                                       causal=True, scale=SCALE, impl=self.impl, return_lse=True,
                                       local_window_size=window)
    ref = oracle(q64, [np.concatenate([pk64, sk64[i, :own[i]]]) for i in range(B)],
                 [np.concatenate([pk64, sk64[i, :own[i]]]) for i in range(B)], own, True, SCALE,
                 None, None, window)
    check_attention(out, lse, *ref, "float32")
    # and with no shared keys in reach and no own key, nothing at all: (0, -inf)
    own = np.array([0, 1, 5], np.int32)
    out, lse = attention_with_lse(q, sk, sk, kv_lengths=jnp.asarray(own), causal=False,
                                  scale=SCALE, impl=self.impl, local_window_size=(0, 0))
    ref = oracle(q64, [sk64[i, :own[i]] for i in range(B)], [sk64[i, :own[i]] for i in range(B)],
                 own, False, SCALE, None, None, (0, 0))
    check_attention(out, lse, *ref, "float32")
    lse = np.asarray(lse)
    assert np.isneginf(lse[0]).all() and not np.isnan(np.asarray(out)).any()
    assert (np.asarray(out)[0] == 0).all() and np.isneginf(lse[1, 0]).all()
    assert np.isfinite(lse[1, 1]).all() and np.isfinite(lse[2]).all()

  def test_gradients_route_to_the_xla_backward(self):
    """``jax.grad`` of a Triton forward with variants: the XLA backward, from the kernels'
    out and LSE, equals the gradient of the all-XLA call (itself checked against the float64
    oracle's gradient in tests/attention/test_variants.py)."""
    if self.impl != "pallas:triton":
      pytest.skip("the backward route is the same for every family: checked once")
    rng = np.random.default_rng(11)
    q, _ = rand(rng, (2, TQ, HQ, D), "float32")
    pk, _ = rand(rng, (6, HKV, D), "float32")
    sk, _ = rand(rng, (2, 4, HKV, D), "float32")
    lens = jnp.asarray([4, 2], jnp.int32)
    slopes = jnp.asarray(rng.uniform(0.0, 1.0, (HQ,)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(2, TQ, HQ, D)), jnp.float32)

    def loss(impl, q, pk, sk, slopes):
      out = shared_prefix_attention(q, pk, pk, sk, sk, suffix_lengths=lens, scale=SCALE,
                                    impl=impl, alibi_slopes=slopes, local_window_size=(3, 0))
      return jnp.sum(out * w)

    grads = {impl: small_jit(jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2, 3)),
                             small=self.interpret)(q, pk, sk, slopes)
             for impl in (self.impl, "xla")}
    for got, want in zip(grads[self.impl], grads["xla"]):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


@pytest.mark.gpu
class TestTritonNative(TestTritonInterpret):
  interpret = False
  examples = 6


class TestTpuInterpret(TestTritonInterpret):
  """The TPU kernels interpreted on a CPU (fewer compositions: the kernels' variant code is
  one function, :func:`pallas_kernels.tpu.common.update_state`); :class:`TestTpuNative` runs
  them compiled on a TPU."""

  impl = "pallas:tpu"
  native_backend = "tpu"
  variants = {"tree": (ALIBI_WINDOW,), "suffix": (SOFTCAP_ONLY,)}


class TestTpuNative(TestTpuInterpret):
  interpret = False
  examples = 6
  variants = TestTritonInterpret.variants


def _shapes(b=2, tq=1, hq=8, hkv=1, d=128, p=256, s=128):
  f = jax.ShapeDtypeStruct
  return (f((b, tq, hq, d), jnp.bfloat16), f((p, hkv, d), jnp.bfloat16),
          f((p, hkv, d), jnp.bfloat16), f((b, s, hkv, d), jnp.bfloat16),
          f((b, s, hkv, d), jnp.bfloat16))


SLOPES8 = jax.ShapeDtypeStruct((8,), jnp.float32)


@pytest.mark.parametrize("kind", [A100, H100])
@pytest.mark.parametrize("batch", [2, 64])
def test_pallas_and_auto_plan_the_triton_kernels_on_gpus(kind, batch):
  """On a GPU ``impl="pallas"`` and ``"auto"`` run variant calls on the Triton kernels (Hopper
  included: its Mosaic GPU kernels lack them), never a Mosaic GPU kernel, with the XLA
  backward."""
  kw = dict(platform="gpu", device_kind=kind, alibi_slopes=SLOPES8, local_window_size=(63, 0))
  plan = explain(shared_prefix_attention, *_shapes(b=batch), impl="pallas", **kw)
  assert plan.impl == "pallas:triton" and plan.backward == "xla", plan
  assert plan.backend.path in ("flat", "split"), plan
  assert all(p is None or p.kernel == "triton" for p in plan.backend.prefixes), plan
  text = str(plan)
  assert "alibi_slopes [%d, 8], local_window_size=(63, 0)" % batch in text, text
  assert ("Mosaic GPU kernels lack them" in text) == (kind == H100), text
  auto = explain(shared_prefix_attention, *_shapes(b=batch), **kw)
  assert auto.impl == "pallas:triton" and auto.backward == "xla", auto
  assert "impl='auto' on a GPU: the Triton kernels" in str(auto), auto
  assert ("Mosaic GPU kernels lack them" in str(auto)) == (kind == H100), auto
  # without variants Hopper plans its own kernels
  if kind == H100:
    assert explain(shared_prefix_attention, *_shapes(b=batch), platform="gpu",
                   device_kind=kind).impl == "pallas:mosaic_gpu"


def test_pallas_on_hopper_and_triton_explicit_plan_triton():
  for impl in ("pallas", "pallas:triton"):
    plan = explain(shared_prefix_attention, *_shapes(), platform="gpu", device_kind=H100,
                   impl=impl, softcap=30.0)
    assert plan.impl == "pallas:triton" and plan.backward == "xla", plan


def test_mosaic_gpu_raises_and_tpu_plans_its_kernels():
  """The Mosaic GPU kernels lack the variants: the explicit impl raises naming them. On a TPU
  ``impl="pallas:tpu"`` plans the TPU kernels, with the XLA backward, and ``auto`` the XLA
  path."""
  with pytest.raises(ValueError, match=r"softcap, local_window_size run on the xla kernels, the "
                                       r"triton kernels and the tpu kernels only; "
                                       r"impl='pallas:mosaic_gpu'"):
    explain(shared_prefix_attention, *_shapes(), platform="cpu", impl="pallas:mosaic_gpu",
            softcap=30.0, local_window_size=4)
  tpu = dict(platform="tpu", device_kind="TPU v5 lite", softcap=30.0)
  plan = explain(shared_prefix_attention, *_shapes(), impl="pallas:tpu", **tpu)
  assert plan.impl == "pallas:tpu" and plan.backward == "xla", plan
  assert "score variants (softcap=30.0): the tpu kernels apply them" in str(plan), plan
  assert explain(shared_prefix_attention, *_shapes(), **tpu).impl == "xla"


@pytest.mark.parametrize("case", [
    (8, 1, 8, 2, 128, 1000, 100, 3, 77, "bfloat16", dict(softcap=30.0, local_window_size=(200, 0))),
    (3, 4, 6, 2, 80, 77, 61, 5, 33, "float32", dict(local_window_size=(20, 3))),
])
def test_tpu_kernels_with_variants_lower_to_mosaic(case):
  """The TPU kernels with ALiBi (and a cap or a window) lower to Mosaic for a TPU from this
  machine: decoding in bfloat16 (128-key chunks) and prefill in float32 (chunks that are not
  a multiple of 128 lanes: the lane-sliced rows)."""
  b, tq, hq, hkv, d, p, s, n, t, dtype, kw = case
  f = jax.ShapeDtypeStruct

  def fn(q, pk, lk, lens, nodes, sk, slen, slopes):
    levels = [SharedLevel(pk, pk, jnp.full((1,), p, jnp.int32), jnp.zeros((b,), jnp.int32)),
              SharedLevel(lk, lk, lens, nodes)]
    return hierarchical_attention(q, levels, sk, sk, suffix_lengths=slen, causal=tq > 1,
                                  impl="pallas:tpu", alibi_slopes=slopes, **kw)

  args = (f((b, tq, hq, d), dtype), f((1, p, hkv, d), dtype), f((n, t, hkv, d), dtype),
          f((n,), jnp.int32), f((b,), jnp.int32), f((b, s, hkv, d), dtype), f((b,), jnp.int32),
          f((b, hq), jnp.float32))
  text = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
  assert "callback" not in text  # no interpreter branch in the TPU program
  assert text.count("tpu_custom_call") == 3, text.count("tpu_custom_call")
