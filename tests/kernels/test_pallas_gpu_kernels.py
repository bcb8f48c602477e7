"""The Triton kernels against the float64 oracle.

``TestInterpret`` runs the kernel bodies in Pallas interpret mode on any
machine (CI); ``TestNative`` is the same class with the flag flipped and runs
the compiled kernels on a CUDA GPU (skipped elsewhere).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_shared_attn import SharedLevel, hierarchical_attention, shared_prefix_attention
from jax_shared_attn.testing import check_attention, lse_err, oracle_full, oracle_tree, rel_err, tolerance
from pallas_kernels.device import DeviceInfo
from pallas_kernels.gpu import common, merge
from pallas_kernels.gpu.config import FusedDecodeOptions, GpuConfig, MosaicPrefixOptions
from pallas_kernels.gpu.merge import merge_parts
from pallas_kernels.gpu.shared import prefix_attention, segment_attention
from pallas_kernels.gpu.suffix import SuffixConfig, flat_rows, suffix_attention
from strategies import SEEDS, count_case, lengths, rand, small_jit

HAS_GPU = jax.default_backend() == "gpu"
H100 = DeviceInfo.named("NVIDIA H100 80GB HBM3")  # the tuned device: every config below is its
MERGE = merge.default_config(H100)

# (B, Tq, Hq, Hkv, D, capacity, dtype): sizes off the block multiples, G in 1..8,
# D 64/80/128/256, 16-bit and float32.
CASES = (
    (3, 1, 8, 1, 128, 200, "bfloat16"),
    (2, 3, 6, 2, 80, 37, "float32"),
    (5, 1, 4, 2, 64, 129, "float16"),
    (1, 1, 1, 1, 256, 70, "bfloat16"),
    (4, 2, 16, 2, 128, 1, "float32"),
    (2, 1, 3, 1, 64, 0, "bfloat16"),
    (2, 40, 4, 2, 64, 90, "float32"),  # prefill-sized: Tq * G = 80 rows -> row tiles
)


def check(out, lse, ref_out, ref_lse, dtype):
  assert not np.isnan(np.asarray(out)).any()
  check_attention(out, lse, ref_out, ref_lse, dtype)


def f64(x):
  return np.asarray(x).astype(np.float64)  # exact from any float dtype, no program compiled


class TestInterpret:
  interpret = True
  examples = 20

  def setup_method(self):
    if not self.interpret and not HAS_GPU:
      pytest.skip("needs a CUDA GPU")
    jit = functools.partial(small_jit, small=self.interpret)
    self.prefix = jit(functools.partial(prefix_attention, device=H100, interpret=self.interpret),
                      static_argnames=("scale",))
    self.suffix = jit(functools.partial(suffix_attention, merge=MERGE, interpret=self.interpret),
                      static_argnames=("scale", "causal", "config"))
    self.segment = jit(functools.partial(segment_attention, device=H100,
                                         interpret=self.interpret),
                       static_argnames=("scale",))
    self.flat = jit(functools.partial(flat_rows, merge=MERGE, interpret=self.interpret),
                    static_argnames=("q_len", "causal", "scale", "out_dtype", "config",
                                     "by_sequence"))
    self.merge = jit(functools.partial(merge_parts, config=MERGE, interpret=self.interpret),
                     static_argnames=("out_dtype",))

  def run_prefix(self, data, seed, case):
    count_case("triton_prefix")
    rng = np.random.default_rng(seed)
    b, tq, hq, hkv, d, p, dtype = case
    plen = data.draw(st.integers(0, p))
    q, q64 = rand(rng, (b, tq, hq, d), dtype)
    k, k64 = rand(rng, (p, hkv, d), dtype)
    v, v64 = rand(rng, (p, hkv, d), dtype)
    out, lse = self.prefix(q, k, v, kv_length=jnp.int32(plen), scale=d**-0.5)
    ref = oracle_tree(q64, [[k64[:plen]]] * b, [[v64[:plen]]] * b, np.zeros((b, 0, hkv, d)),
                      np.zeros((b, 0, hkv, d)), causal=False)
    check(out, lse, *ref, dtype)

  def run_suffix(self, data, seed, case):
    count_case("triton_suffix")
    rng = np.random.default_rng(seed)
    b, tq, hq, hkv, d, s, dtype = case
    causal = data.draw(st.booleans())
    splits = data.draw(st.sampled_from([1, 2, 3]))
    with_prior = data.draw(st.booleans())
    kv_len = lengths(data.draw, b, s)
    q, q64 = rand(rng, (b, tq, hq, d), dtype)
    k, k64 = rand(rng, (b, s, hkv, d), dtype)
    v, v64 = rand(rng, (b, s, hkv, d), dtype)
    # A prior state (attention over 5 other keys); the expected merge is computed in float64.
    pk, pk64 = rand(rng, (5, hkv, d), dtype)
    prior = self.prefix(q, pk, pk, kv_length=jnp.int32(data.draw(st.integers(0, 5))),
                        scale=d**-0.5) if with_prior else None
    cfg = SuffixConfig(64 if d > 128 else 32, splits, 4, 2)
    out, lse = self.suffix(q, k, v, kv_lengths=kv_len, causal=causal, scale=d**-0.5, prior=prior,
                           config=cfg)
    if with_prior:
      ref_p = [f64(prior[0]), f64(prior[1])]
      ref_s = oracle_full(q64, k64, v64, kv_len, causal=causal)
      lse_all = np.logaddexp(ref_p[1], ref_s[1])
      w_p = np.where(np.isneginf(ref_p[1]), 0, np.exp(ref_p[1] - np.where(np.isneginf(lse_all), 0, lse_all)))
      w_s = np.where(np.isneginf(ref_s[1]), 0, np.exp(ref_s[1] - np.where(np.isneginf(lse_all), 0, lse_all)))
      ref = (w_p[..., None] * ref_p[0] + w_s[..., None] * ref_s[0], lse_all)
    else:
      ref = oracle_full(q64, k64, v64, kv_len, causal=causal)
    check(out, lse, *ref, dtype)

  def run_flat(self, data, seed, case):
    """Shared keys then each sequence's own in one kernel (the small-batch path), key splits
    straddling the boundary, ragged and empty own lengths, causal inside the own keys."""
    count_case("triton_flat")
    rng = np.random.default_rng(seed)
    b, tq, hq, hkv, d, s, dtype = case
    s = max(s, 1)
    if tq * hq // hkv > 64:
      s = 0  # rows per sequence beyond one tile: the path does not apply; checked to raise
    p = data.draw(st.integers(1, 150))
    plen = data.draw(st.one_of(st.sampled_from([0, 1, p]), st.integers(0, p)))
    causal = data.draw(st.booleans())
    block_n = 64 if d > 128 else data.draw(st.sampled_from([16, 32]))
    cfg = SuffixConfig(block_n, data.draw(st.sampled_from([1, 2, 3, 7])), 2, 2)
    kv_len = lengths(data.draw, b, s)
    q, q64 = rand(rng, (b, tq, hq, d), dtype)
    pk, pk64 = rand(rng, (p, hkv, d), dtype)
    pv, pv64 = rand(rng, (p, hkv, d), dtype)
    k, k64 = rand(rng, (b, s, hkv, d), dtype)
    v, v64 = rand(rng, (b, s, hkv, d), dtype)
    m = tq * hq // hkv
    by_sequence = data.draw(st.booleans())  # rows in and out [B, Hkv, M, D], else [Hkv, B, M, D]
    rows = (common.seq_rows(q, hkv) if by_sequence
            else common.fold_rows(q, hkv).reshape(hkv, b, m, d))
    call = functools.partial(self.flat, rows, pk, pv, jnp.int32(plen), k, v, jnp.asarray(kv_len),
                             q_len=tq, causal=causal, scale=d**-0.5, out_dtype=jnp.float32,
                             config=cfg, by_sequence=by_sequence)
    if s == 0:
      with pytest.raises(ValueError, match="flat_rows"):
        call()
      return
    out, lse = call()
    if by_sequence:
      out, lse = common.unfold_seq_rows(out, tq), common.unfold_seq_rows(lse, tq)
    else:
      out = common.unfold_rows(out.reshape(hkv, b * m, d), b, tq)
      lse = common.unfold_rows(lse.reshape(hkv, b * m), b, tq)
    ref = oracle_tree(q64, [[pk64[:plen]]] * b, [[pv64[:plen]]] * b, k64, v64, kv_len,
                      causal=causal)
    check(out, lse, *ref, dtype)

  def run_segment(self, data, seed, case):
    count_case("triton_segment")
    rng = np.random.default_rng(seed)
    b, tq, hq, hkv, d, t, dtype = case
    n = data.draw(st.integers(1, 4))
    k, k64 = rand(rng, (n, t, hkv, d), dtype)
    v, v64 = rand(rng, (n, t, hkv, d), dtype)
    seg_len = lengths(data.draw, n, t)
    nodes = np.array([data.draw(st.integers(-1, n - 1)) for _ in range(b)], np.int32)
    q, q64 = rand(rng, (b, tq, hq, d), dtype)
    out, lse = self.segment(q, k, v, lengths=jnp.asarray(seg_len), node_of_seq=jnp.asarray(nodes),
                            scale=d**-0.5)
    segs_k = [[k64[x, :seg_len[x]]] if x >= 0 else [] for x in nodes]
    segs_v = [[v64[x, :seg_len[x]]] if x >= 0 else [] for x in nodes]
    ref = oracle_tree(q64, segs_k, segs_v, np.zeros((b, 0, hkv, d)), np.zeros((b, 0, hkv, d)),
                      causal=False)
    check(out, lse, *ref, dtype)

  @pytest.mark.parametrize("case", CASES)
  def test_prefix_attention(self, case):
    given(data=st.data(), seed=SEEDS)(settings(max_examples=self.examples)(
        lambda data, seed: self.run_prefix(data, seed, case)))()

  @pytest.mark.parametrize("case", CASES)
  def test_suffix_attention(self, case):
    given(data=st.data(), seed=SEEDS)(settings(max_examples=self.examples)(
        lambda data, seed: self.run_suffix(data, seed, case)))()

  @pytest.mark.parametrize("case", CASES)
  def test_flat_attention(self, case):
    given(data=st.data(), seed=SEEDS)(settings(max_examples=self.examples)(
        lambda data, seed: self.run_flat(data, seed, case)))()

  @pytest.mark.parametrize("case", CASES)
  def test_segment_attention(self, case):
    given(data=st.data(), seed=SEEDS)(settings(max_examples=self.examples)(
        lambda data, seed: self.run_segment(data, seed, case)))()

  def run_merge(self, data, seed, out_dtype):
    """Stacks of partial states (random part counts, -inf parts and rows) against the float64
    merge formula: the one kernel that merges every key split."""
    count_case("triton_merge")
    rng = np.random.default_rng(seed)
    lead = (data.draw(st.integers(1, 3)), data.draw(st.integers(1, 70)))
    d = data.draw(st.sampled_from([16, 64, 80, 128]))
    counts = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    p_empty = data.draw(st.sampled_from([0.0, 0.3, 1.0]))
    stacks, outs64, lses64 = [], [], []
    for n in counts:
      o, o64 = rand(rng, (n, *lead, d), data.draw(st.sampled_from(["float32", "bfloat16"])))
      lse = np.where(rng.random((n, *lead)) < p_empty, -np.inf,
                     rng.normal(size=(n, *lead)) * 20).astype(np.float32)
      stacks.append((o, jnp.asarray(lse)))
      outs64.append(o64)
      lses64.append(lse.astype(np.float64))
    out, lse = self.merge(stacks, out_dtype=out_dtype)
    L, O = np.concatenate(lses64), np.concatenate(outs64)
    with np.errstate(divide="ignore", invalid="ignore"):
      ref_lse = np.logaddexp.reduce(L, axis=0)
      w = np.where(np.isneginf(L), 0.0, np.exp(L - np.where(np.isneginf(ref_lse), 0, ref_lse)))
    ref_out = np.einsum("n...,n...d->...d", w, O)
    assert out.dtype == jnp.dtype(out_dtype) and out.shape == (*lead, d) and lse.shape == lead
    assert not np.isnan(f64(out)).any() and not np.isnan(np.asarray(lse)).any()
    assert rel_err(out, ref_out) <= (1e-6 if out_dtype == "float32" else tolerance(out_dtype))
    assert lse_err(lse, ref_lse) <= 1e-6
    assert np.all(f64(out)[np.isneginf(ref_lse)] == 0)

  @pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
  def test_merge_kernel(self, out_dtype):
    given(data=st.data(), seed=SEEDS)(settings(max_examples=self.examples)(
        lambda data, seed: self.run_merge(data, seed, out_dtype)))()

  @pytest.mark.parametrize("flat", [True, "sequence_major", False])
  def test_public_api_through_triton(self, flat):
    """shared_prefix_attention (the small-batch flat kernel in either row layout, or the prefix +
    suffix kernels) and hierarchical_attention through the fused GPU path."""
    from pallas_kernels.gpu import dispatch
    rng = np.random.default_rng(0)
    b, tq, hq, hkv, d, p, s = 5, 2, 8, 2, 80, 45, 11
    for dtype in ("float32", "bfloat16"):
      q, q64 = rand(rng, (b, tq, hq, d), dtype)
      pk, pk64 = rand(rng, (p, hkv, d), dtype)
      pv, pv64 = rand(rng, (p, hkv, d), dtype)
      sk, sk64 = rand(rng, (b, s, hkv, d), dtype)
      sv, sv64 = rand(rng, (b, s, hkv, d), dtype)
      lens = np.array([11, 0, 1, 5, 2], np.int32)
      config = GpuConfig(flat_max_shared_reads=GpuConfig().flat_max_shared_reads if flat else 0,
                         flat_sequence_major=flat == "sequence_major")
      plan = dispatch.plan_shared(q, [("prefix", pk, pv, 40, None)], sk, device=H100,
                                  config=config)
      assert plan.path == ("flat" if flat else "split")
      out, lse = shared_prefix_attention(q, pk, pv, sk, sv, prefix_length=40,
                                         suffix_lengths=lens, impl="pallas:triton",
                                         return_lse=True, config=config)
      ref = oracle_tree(q64, [[pk64[:40]]] * b, [[pv64[:40]]] * b, sk64, sv64, lens)
      check(out, lse, *ref, dtype)
      if not flat:
        continue
      seg_k, seg_k64 = rand(rng, (3, 9, hkv, d), dtype)
      nodes = np.array([2, 0, -1, 2, 1], np.int32)
      seg_len = np.array([9, 4, 0], np.int32)
      levels = [SharedLevel.shared_by_all(pk, pv, b, 40),
                SharedLevel(seg_k, seg_k, jnp.asarray(seg_len), jnp.asarray(nodes))]
      out, lse = hierarchical_attention(q, levels, sk, sv, suffix_lengths=lens,
                                        impl="pallas:triton", return_lse=True)
      segs = [[pk64[:40]] + ([seg_k64[x, :seg_len[x]]] if x >= 0 else []) for x in nodes]
      segs_v = [[pv64[:40]] + ([seg_k64[x, :seg_len[x]]] if x >= 0 else []) for x in nodes]
      ref = oracle_tree(q64, segs, segs_v, sk64, sv64, lens)
      check(out, lse, *ref, dtype)


@pytest.mark.gpu
class TestNative(TestInterpret):
  interpret = False
  examples = 6  # every example of a new static config compiles on the GPU


# Hopper: the Mosaic GPU prefix kernel (wgmma/TMA). No interpret mode exists for it, so
# these run only on an sm_90 GPU; CI lowers it with jax.export (test_pallas_gpu_export.py).
MOSAIC_CASES = (
    (3, 1, 8, 1, 128, 256, "bfloat16"),
    (2, 2, 6, 2, 64, 384, "float16"),
    (40, 1, 4, 1, 256, 128, "bfloat16"),
    (64, 1, 32, 8, 128, 1024, "bfloat16"),
)
IS_HOPPER = HAS_GPU and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper (sm_90) GPU")
class TestNativeMosaic:
  examples = 6

  def setup_method(self):
    self.prefix = jax.jit(functools.partial(prefix_attention, device=DeviceInfo.current(),
                                            mosaic=True), static_argnames=("scale",))

  @pytest.mark.parametrize("case", MOSAIC_CASES)
  def test_prefix_attention(self, case):
    given(data=st.data(), seed=SEEDS)(settings(max_examples=self.examples)(
        lambda data, seed: TestInterpret.run_prefix(self, data, seed, case)))()

  @pytest.mark.parametrize("block_kv,splits,p,d,stages,overlap", [
      (128, 1, 640, 128, 2, False), (192, 1, 640, 128, 2, False), (192, 3, 1024, 128, 2, False),
      (192, 2, 2048, 64, 2, False), (64, 2, 448, 256, 2, False), (128, 2, 1152, 128, 3, False),
      (128, 1, 384, 64, 3, False), (128, 1, 640, 128, 2, True), (192, 3, 1024, 128, 2, True),
      (128, 2, 2048, 64, 2, True), (64, 2, 448, 256, 2, True), (128, 2, 1152, 128, 3, True)])
  def test_prefix_kernel_configs(self, block_kv, splits, p, d, stages, overlap):
    """The kernel directly, off its default configuration: key steps that do not divide P (the
    last block read past P, zero-filled by TMA, and masked), key splits, two or three K/V slots,
    the intra-warpgroup overlap, lengths 0, 1, P."""
    from pallas_kernels.gpu import prefix_mgpu as mg
    cfg = mg.MosaicPrefixConfig(64, block_kv, stages, splits, overlap)
    fn = jax.jit(mg.prefix_attention_rows_mgpu, static_argnames=("scale", "config"))

    def run(data, seed):
      count_case("mosaic_prefix_configs")
      rng = np.random.default_rng(seed)
      hkv, r = 2, 256
      plen = data.draw(st.one_of(st.sampled_from([0, 1, p - 1, p]), st.integers(0, p)))
      q, q64 = rand(rng, (hkv, r, d), "bfloat16")
      k, k64 = rand(rng, (p, hkv, d), "bfloat16")
      v, v64 = rand(rng, (p, hkv, d), "bfloat16")
      out, lse = fn(q, k, v, jnp.int32(plen), scale=d**-0.5, config=cfg)
      s = np.einsum("hrd,khd->hrk", q64, k64[:plen]) * d**-0.5
      m = s.max(-1, keepdims=True) if plen else np.zeros(s.shape[:-1] + (1,))
      w = np.exp(s - m)
      ref_lse = (np.log(w.sum(-1)) + m[..., 0]) if plen else np.full((hkv, r), -np.inf)
      ref_out = (np.einsum("hrk,khd->hrd", w, v64[:plen]) / w.sum(-1, keepdims=True)
                 if plen else np.zeros((hkv, r, d)))
      # Merge the key splits in float64 (the parts' own LSEs), then check against the oracle.
      lse_p, out_p = f64(lse), f64(out)
      top = np.max(lse_p, 0)
      wts = np.where(np.isneginf(lse_p), 0, np.exp(lse_p - np.where(np.isneginf(top), 0, top)))
      tot = wts.sum(0)
      merged = (wts[..., None] * out_p).sum(0) / np.where(tot > 0, tot, 1)[..., None]
      check(merged, np.where(tot > 0, np.log(np.where(tot > 0, tot, 1)) + top, -np.inf),
            ref_out, ref_lse, "bfloat16")

    given(data=st.data(), seed=SEEDS)(settings(max_examples=self.examples)(run))()

  def test_public_api(self):
    rng = np.random.default_rng(0)
    b, hq, hkv, d, p, s = 33, 32, 8, 128, 512, 70
    q, q64 = rand(rng, (b, 1, hq, d), "bfloat16")
    pk, pk64 = rand(rng, (p, hkv, d), "bfloat16")
    pv, pv64 = rand(rng, (p, hkv, d), "bfloat16")
    sk, sk64 = rand(rng, (b, s, hkv, d), "bfloat16")
    sv, sv64 = rand(rng, (b, s, hkv, d), "bfloat16")
    lens = rng.integers(1, s + 1, size=b).astype(np.int32)
    for impl in ("pallas:mosaic_gpu", "pallas", "auto"):
      out, lse = shared_prefix_attention(q, pk, pv, sk, sv, prefix_length=500, suffix_lengths=lens,
                                         impl=impl, return_lse=True)
      ref = oracle_tree(q64, [[pk64[:500]]] * b, [[pv64[:500]]] * b, sk64, sv64, lens)
      check(out, lse, *ref, "bfloat16")


# The one-kernel decode path (prefix + suffixes in one Mosaic GPU kernel): (B, Hq, Hkv, D, P,
# suffix capacity). G 1..16, D 64/128, one to many row tiles, key splits (few rows) and none.
FUSED_CASES = (
    (3, 8, 1, 128, 256, 64),
    (17, 4, 2, 64, 128, 192),
    (1, 16, 1, 128, 1024, 128),
    (40, 32, 8, 128, 512, 128),
    (300, 8, 1, 64, 384, 64),
    (1024, 8, 1, 128, 2048, 128),
)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper (sm_90) GPU")
class TestNativeFusedDecode:
  examples = 5
  options = None  # FusedDecodeOptions (None: the defaults); the subclasses set others
  prefix_options = None  # MosaicPrefixOptions for the prefix kernel the public API runs at G < 8

  def run(self, data, seed, case, dtype="bfloat16", config=None):
    b, hq, hkv, d, p, s = case
    count_case("fused_decode")
    rng = np.random.default_rng(seed)
    q, q64 = rand(rng, (b, 1, hq, d), dtype)
    pk, pk64 = rand(rng, (p, hkv, d), dtype)
    pv, pv64 = rand(rng, (p, hkv, d), dtype)
    sk, sk64 = rand(rng, (b, s, hkv, d), dtype)
    sv, sv64 = rand(rng, (b, s, hkv, d), dtype)
    plen = data.draw(st.one_of(st.sampled_from([0, 1, p - 1, p]), st.integers(0, p)))
    # Drawn (edges 0, 1, s favoured; empty contexts give (0, -inf)) for the first 32
    # sequences, uniform for the rest (hypothesis's data budget).
    lens = np.concatenate([lengths(data.draw, min(b, 32), s),
                           rng.integers(0, s + 1, size=max(0, b - 32)).astype(np.int32)])
    ref = oracle_tree(q64, [[pk64[:plen]]] * b, [[pv64[:plen]]] * b, sk64, sv64, lens)
    # The kernel directly (any G), and the public API (the one kernel where G >= 8).
    from pallas_kernels.gpu import shared_mgpu as fm
    from pallas_kernels.gpu import shared_mgpu_plan as fp
    options = self.options or FusedDecodeOptions()
    direct = config or fp.default_config(b * (hq // hkv), hkv, p, s, hq // hkv, device=H100,
                                         head_dim=d, options=options)
    out, lse = fm.fused_decode(q, pk, pv, jnp.int32(plen), sk, sv, jnp.asarray(lens),
                               scale=d**-0.5, config=direct, merge=MERGE)
    check(out, lse, *ref, dtype)
    if config is not None:
      return
    gpu_config = GpuConfig(fused=options, prefix=self.prefix_options or MosaicPrefixOptions())
    out, lse = shared_prefix_attention(q, pk, pv, sk, sv, prefix_length=plen,
                                       suffix_lengths=lens, impl="pallas:mosaic_gpu",
                                       return_lse=True, config=gpu_config)
    check(out, lse, *ref, dtype)

  @pytest.mark.parametrize("case", FUSED_CASES)
  def test_against_oracle(self, case):
    from pallas_kernels.gpu import shared_mgpu_plan as fp
    b, hq, hkv, d, p, s = case
    assert fp.supported(jnp.bfloat16, d, p, s, hq // hkv, fp.FusedConfig())
    given(data=st.data(), seed=SEEDS)(settings(max_examples=self.examples, deadline=None)(
        lambda data, seed: self.run(data, seed, case)))()

  def test_float16(self):
    given(data=st.data(), seed=SEEDS)(settings(max_examples=3, deadline=None)(
        lambda data, seed: self.run(data, seed, (9, 8, 2, 128, 256, 128), "float16")))()


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper (sm_90) GPU")
class TestNativeFusedDecodeEqualRanges(TestNativeFusedDecode):
  """The same cases with the key splits cutting "prefix blocks, then suffix steps" into equal
  ranges for every shape (``FusedDecodeOptions(spread_suffix=False)``)."""
  options = FusedDecodeOptions(spread_suffix=False)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper (sm_90) GPU")
class TestNativeFusedDecodeSpread(TestNativeFusedDecodeEqualRanges):
  """The same cases with every shape's splits spreading their suffix steps among their prefix
  blocks (``spread_suffix=True``; by default only few splits over a long prefix do)."""
  options = FusedDecodeOptions(spread_suffix=True)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper (sm_90) GPU")
class TestNativeFusedDecodeXlaTileMax(TestNativeFusedDecode):
  """The same cases with XLA reducing the suffix lengths to each row tile's longest before the
  kernel (``tile_max_in_kernel=False``; by default each CTA takes its sequences' longest suffix
  itself)."""
  options = FusedDecodeOptions(tile_max_in_kernel=False)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper (sm_90) GPU")
class TestNativeFusedDecodeMergeKernel(TestNativeFusedDecode):
  """The same cases with the key splits merged by the merge kernel after the one kernel
  (``cluster_merge=False``; by default two splits merge inside it, 3 of the 6 cases), and
  cluster-merging configurations set directly: 2, 3 and 4 splits, two KV heads, spread suffix
  steps, lengths reduced by XLA or in the kernel, three K/V slots."""
  options = FusedDecodeOptions(cluster_merge=False)

  @pytest.mark.parametrize("splits,extra", [
      (2, {}), (3, {"spread_suffix": True}), (4, {}), (2, {"max_concurrent_steps": 3}),
      (3, {"tile_max_in_kernel": False}), (4, {"spread_suffix": True, "max_concurrent_steps": 3})])
  def test_configs(self, splits, extra):
    from pallas_kernels.gpu import shared_mgpu_plan as fp
    case = (100, 16, 2, 128, 1024, 128)  # G = 8, 7 row tiles per KV head (the last partial)
    b, hq, hkv, d, p, s = case
    cfg = dataclasses.replace(fp.default_config(b * hq // hkv, hkv, p, s, hq // hkv, device=H100,
                                                head_dim=d),
                              splits=splits, cluster_merge=True, **extra)
    given(data=st.data(), seed=SEEDS)(settings(max_examples=4, deadline=None)(
        lambda data, seed: self.run(data, seed, case, config=cfg)))()


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper (sm_90) GPU")
class TestNativeFusedDecodeThreeStages(TestNativeFusedDecode):
  """The same cases with three K/V slots in flight in the one kernel (``stages=3``; D = 64 and
  128 both fit) and in the prefix kernel that the public API runs at G < 8."""
  options = FusedDecodeOptions(stages=3)
  prefix_options = MosaicPrefixOptions(stages=3)


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_default_configs_fit_the_shared_memory(itemsize, head_dim):
  """Every Triton kernel's default K/V staging fits the budget: the segment kernel's float32
  config of 128 keys x 128 dims x 3 stages (256 KB) failed natively on an H100."""
  import importlib
  from pallas_kernels.gpu import common
  mods = {n: importlib.import_module(f"pallas_kernels.gpu.{n}")
          for n in ("prefix", "suffix", "segment")}
  for rows in (1, 16, 1024):
    configs = (mods["prefix"].default_config(rows, 1, 4096, head_dim, device=H100,
                                             itemsize=itemsize),
               mods["suffix"].default_config(rows, 8, 512, head_dim, device=H100,
                                             itemsize=itemsize),
               mods["segment"].default_config(rows, 2, head_dim, itemsize, device=H100))
    for cfg in configs:
      staged = common.kv_staging_bytes(cfg.block_n, head_dim, itemsize, cfg.num_stages)
      assert staged <= common.KV_STAGING_BYTES, (cfg, staged)
      assert cfg.block_n >= common.MIN_DOT
  failed = common.kv_staging_bytes(128, 128, 4, 3)
  assert failed > common.KV_STAGING_BYTES


def test_mosaic_prefix_step_size():
  """The default Hopper prefix configs: every one fits a CTA's shared memory, steps are whole
  wgmma tiles, key splits never outnumber the SMs' worth of tiles nor leave a split under 4
  steps, and steps widen only with the keys per split (never at 2K keys, where wider steps were
  slower); a prefix of any multiple of the alignment is supported."""
  from pallas_kernels.gpu import prefix_mgpu as mg
  for d in (64, 128, 256):
    for kv_heads in (1, 8):
      last = 0
      for prefix in (640, 2048, 4096, 8192, 16384, 65536):
        for rows in (64, 256, 4096, 8192):
          cfg = mg.default_config(rows, kv_heads, prefix, head_dim=d, device=H100)
          tiles = -(-rows // (2 * cfg.block_q)) * kv_heads
          assert mg.smem_bytes(cfg, d) <= mg.SMEM_LIMIT, (cfg, d)
          assert cfg.block_kv % 64 == 0 and cfg.max_concurrent_steps >= 2, cfg
          assert cfg.splits == 1 or (cfg.splits * tiles <= H100.cores
                                     and prefix // cfg.splits >= 4 * cfg.block_kv), (cfg, rows)
          assert cfg.block_kv <= 128 or prefix // cfg.splits > 2048, (cfg, prefix)
        assert cfg.block_kv >= last, (cfg, prefix)  # rows fixed (8192): wider with more keys
        last = cfg.block_kv
  # The option is what decides: off keeps 128-key steps, a lower threshold widens them at 2K.
  assert mg.default_config(4096, 8, 16384, device=H100,
                           options=MosaicPrefixOptions(wide_min_keys=0)).block_kv == 128
  assert mg.default_config(4096, 8, 2048, device=H100,
                           options=MosaicPrefixOptions(wide_min_keys=2048)).block_kv == 192
  assert mg.supported(jnp.bfloat16, 128, 16384) and mg.supported(jnp.bfloat16, 128, 640)
  assert not mg.supported(jnp.bfloat16, 128, 700) and mg.supported(jnp.bfloat16, 256, 448)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_many_prefix_splits_are_merged_before_the_suffix_kernel(monkeypatch, dtype):
  """A prior with more splits than the epilogue merges (``max_fused_prior_splits``) is reduced by
  the merge kernel first: same result."""
  import dataclasses

  from pallas_kernels.gpu import dispatch
  base = dispatch.triton_prefix_config
  monkeypatch.setattr(dispatch, "triton_prefix_config",
                      lambda *a, **k: dataclasses.replace(base(*a, **k), block_n=16, splits=5))
  # flat path off: these 3 sequences would take it, and no prefix kernel would run
  config = GpuConfig(max_fused_prior_splits=2, flat_max_shared_reads=0)
  rng = np.random.default_rng(3)
  b, tq, hq, hkv, d, p, s = 3, 1, 4, 2, 64, 90, 7
  q, q64 = rand(rng, (b, tq, hq, d), dtype)
  pk, pk64 = rand(rng, (p, hkv, d), dtype)
  pv, pv64 = rand(rng, (p, hkv, d), dtype)
  sk, sk64 = rand(rng, (b, s, hkv, d), dtype)
  sv, sv64 = rand(rng, (b, s, hkv, d), dtype)
  lens = np.array([7, 0, 3], np.int32)
  plan = dispatch.plan_shared(q, [("prefix", pk, pv, 83, None)], sk, device=H100, config=config)
  assert plan.path == "split" and plan.prefixes[0].merge_first
  out, lse = shared_prefix_attention(q, pk, pv, sk, sv, prefix_length=83, suffix_lengths=lens,
                                     impl="pallas:triton", return_lse=True, config=config)
  ref = oracle_tree(q64, [[pk64[:83]]] * b, [[pv64[:83]]] * b, sk64, sv64, lens)
  check(out, lse, *ref, dtype)


def test_suffix_splits_share_the_keys_a_sequence_has_not_the_capacity():
  """The key splits of a sequence divide its own keys (rounded up to key steps), not the cache's
  capacity: early in a long generation every split has work. Capacity 512, 3 splits of 32-key
  steps: 96 keys give each split 32; 40 keys give two splits 32 and 8 and the third none. Each
  split's partial state is checked against the float64 oracle of its keys."""
  from pallas_kernels.gpu import suffix
  rng = np.random.default_rng(0)
  b, d, cap = 2, 32, 512
  q, q64 = rand(rng, (b, 1, 1, d), "float32")
  k, k64 = rand(rng, (b, cap, 1, d), "float32")
  v, v64 = rand(rng, (b, cap, 1, d), "float32")
  lens = np.array([96, 40], np.int32)
  cfg = SuffixConfig(32, 3, 4, 2)
  out, lse = common.run(
      functools.partial(suffix._call, scale=d**-0.5, cfg=cfg, head_dim=d, q_len=1, group=1,
                        causal=False, out_dtype=jnp.float32, lead=False),
      jnp.asarray(lens), q.reshape(1, b, 1, d), k, v, interpret=True)
  assert out.shape == (3, 1, b, 1, d) and lse.shape == (3, 1, b, 1)
  spans = {0: [(0, 32), (32, 64), (64, 96)], 1: [(0, 32), (32, 40), None]}
  for seq, parts in spans.items():
    for split, span in enumerate(parts):
      part_lse = np.asarray(lse[split, 0, seq, 0])
      if span is None:
        assert np.isneginf(part_lse), (seq, split)
        continue
      lo, hi = span
      ref_out, ref_lse = oracle_full(q64[seq:seq + 1], k64[seq:seq + 1, lo:hi],
                                     v64[seq:seq + 1, lo:hi], np.array([hi - lo]), causal=False)
      np.testing.assert_allclose(np.asarray(out[split, 0, seq, 0]), ref_out[0, 0, 0], atol=1e-5)
      np.testing.assert_allclose(part_lse, ref_lse[0, 0, 0], atol=1e-5)
