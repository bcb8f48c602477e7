"""The cuDNN backward engine (``pallas_kernels.gpu.cudnn``) against the float64 oracle.

cuDNN runs only on a CUDA GPU, so on a CPU the wrapper (rows folded for a shared segment, rows
shifted for a causal suffix shorter than its buffer, rows of sequences without a segment,
rows without any key) runs around an emulation of cuDNN's backward with the contract it is
called with (top-left causal mask, padding by lengths, ``rowsum(dO * O)`` from the O it is given,
16-bit P and dS before their products, gradients returned in the input dtype, the gradient
rows of padding keys left unwritten: NaN here). The native class
runs cuDNN itself through the public API (``-m gpu``, docs/gpu-tests.md) and checks that the
compiled gradient calls it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_shared_attn import GpuConfig
from jax_shared_attn import backward as bw
from jax_shared_attn import ops as ops_lib
from jax_shared_attn.testing import rel_err
from pallas_kernels.gpu import cudnn
from strategies import SEEDS, count_case, small_jit
from test_backward import assert_matches_oracle, draw_case, make_vjp, vjp_fn

# ((B, Tq, Hq, Hkv, D, S), levels, causal, scale): a causal suffix as long as its queries
# (teacher forcing), GQA and MQA, a prefix (all_share), a level of one segment that some
# sequences lack, a non-causal suffix, and a level of three segments (the Triton kernels').
SHAPES = (
    ((4, 6, 4, 2, 16, 6), ((1, 13, True),), True, None),
    ((3, 5, 8, 1, 32, 5), ((1, 9, False), (1, 4, True)), True, 0.3),
    ((5, 3, 4, 4, 16, 7), ((1, 11, True),), False, None),
    ((4, 4, 6, 3, 16, 4), ((1, 6, True), (3, 5, False)), True, None),
)


def emulated_bwd(q, k, v, o, do, stats, q_seqlen, kv_seqlen, *, causal, scale):
  """cuDNN's backward as ``cudnn.attention_bwd`` calls it, in float32 with 16-bit P and dS."""
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  f = lambda x: x.astype(jnp.float32)
  kx, vx = (jnp.repeat(f(x), g, axis=2) for x in (k, v))
  hi = jax.lax.Precision.HIGHEST
  sc = jnp.einsum("bthd,bshd->bhts", f(q), kx, precision=hi) * scale
  rows, keys = jnp.arange(t)[None, :, None], jnp.arange(s)[None, None, :]
  mask = (rows < q_seqlen[:, None, None]) & (keys < kv_seqlen[:, None, None])
  if causal:
    mask = mask & (keys <= rows)
  mask = mask[:, None]
  p = jnp.where(mask, jnp.exp(jnp.where(mask, sc, 0.0) - stats[..., None]), 0.0)
  r16 = lambda x: x.astype(q.dtype).astype(jnp.float32)
  dv = jnp.einsum("bhts,bthd->bshd", r16(p), f(do), precision=hi)
  dp = jnp.einsum("bthd,bshd->bhts", f(do), vx, precision=hi)
  delta = jnp.moveaxis(jnp.sum(f(do) * f(o), -1), -1, 1)
  ds = r16(p * (dp - delta[..., None]))
  dq = jnp.einsum("bhts,bshd->bthd", ds, kx, precision=hi) * scale
  dk = jnp.einsum("bhts,bthd->bshd", ds, f(q), precision=hi) * scale
  group = lambda x: x.reshape(b, s, hkv, g, d).sum(3)
  # cuDNN leaves the gradient rows of padding keys unwritten: here, garbage (NaN)
  pad = (jnp.arange(s)[None, :] >= kv_seqlen[:, None])[..., None, None]
  dk, dv = (jnp.where(pad, jnp.nan, group(x)) for x in (dk, dv))
  return dq.astype(q.dtype), dk.astype(q.dtype), dv.astype(q.dtype)


def check(grads, c, shape, dtype, with_lse):
  """The oracle check, with cuDNN's rounding of each part's dQ before the parts are summed."""
  assert_matches_oracle(grads, c, shape[2], dtype, with_lse=with_lse, part_rounding=True)


CUDNN = bw.BackwardConfig(kernels="cudnn")


@settings(max_examples=24, deadline=None)
@given(data=st.data(), shape=st.sampled_from(SHAPES),
       dtype=st.sampled_from(["bfloat16", "float16"]), seed=SEEDS)
def test_wrapper_around_emulated_cudnn_matches_oracle(data, shape, dtype, seed):
  c = draw_case(data.draw, np.random.default_rng(seed), shape, dtype)
  if data.draw(st.booleans()):  # every suffix full: the unshifted branch
    s = c["sk"].shape[1]
    c["lens"], c["lens64"] = jnp.full_like(c["lens"], s), np.full_like(c["lens64"], s)
    c["contexts"] = [[x for x in ctx if x[0] != "suffix"] + [("suffix", i * s + j)
                                                            for j in range(s)]
                     for i, ctx in enumerate(c["contexts"])]
  with pytest.MonkeyPatch.context() as mp:  # traced once per shape: the emulation stays in
    mp.setattr(cudnn, "attention_bwd", emulated_bwd)
    grads = vjp_fn("xla", shape[2], c["scale"], CUDNN, False)(
        c["q"], c["levels"], c["sk"], c["sv"], c["lens"], c["do"], c["dl"])
  check(grads, c, shape, dtype, with_lse=False)
  count_case("backward cudnn wrapper (emulated cuDNN)")


@settings(max_examples=1, deadline=None)  # routing, traced afresh per example: one suffices
@given(data=st.data(), seed=SEEDS)
def test_engine_runs_only_where_the_lse_is_unused(data, seed):
  """With the LSE's cotangent given (cuDNN cannot take it) no part runs on cuDNN, and the
  gradients are still right; with the LSE unused the supported parts do."""
  calls = []

  def counted(*a, **kw):
    calls.append(kw["causal"])
    return emulated_bwd(*a, **kw)

  shape = SHAPES[0]
  c = draw_case(data.draw, np.random.default_rng(seed), shape, "bfloat16")
  args = (c["q"], c["levels"], c["sk"], c["sv"], c["lens"], c["do"], c["dl"])
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(cudnn, "attention_bwd", counted)
    with_lse = make_vjp("xla", True, c["scale"], CUDNN, True)(*args)  # traced here
    assert calls == []
    without = make_vjp("xla", True, c["scale"], CUDNN, False)(*args)
    assert sorted(set(calls)) == [False, True]  # the prefix (non-causal), the causal suffix
  check(with_lse, c, shape, "bfloat16", with_lse=True)
  check(without, c, shape, "bfloat16", with_lse=False)


def test_public_api_hands_cudnn_the_parts_when_the_lse_is_not_returned(monkeypatch):
  """Through ``shared_prefix_attention`` on the GPU family (Triton, interpreted here) with cuDNN
  said to be available: ``return_lse=False`` runs the prefix and the causal suffix on cuDNN
  (emulated), ``return_lse=True`` with the LSE in the loss on the Triton kernels; both give
  the XLA path's gradients."""
  from jax_shared_attn import shared_prefix_attention
  calls = []

  def counted(*a, **kw):
    calls.append(kw["causal"])
    return emulated_bwd(*a, **kw)

  monkeypatch.setattr(cudnn, "available", lambda: True)
  monkeypatch.setattr(cudnn, "attention_bwd", counted)
  rng = np.random.default_rng(0)
  x = lambda *s: jnp.asarray(rng.normal(size=s), jnp.bfloat16)
  q, pk, pv, sk, sv = x(3, 5, 4, 16), x(11, 2, 16), x(11, 2, 16), x(3, 5, 2, 16), x(3, 5, 2, 16)
  lens = jnp.array([5, 2, 4], jnp.int32)

  def loss(impl, with_lse):
    def f(q, pk, pv, sk, sv):
      res = shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=lens, causal=True,
                                    impl=impl, return_lse=with_lse)
      out, lse = res if with_lse else (res, None)
      total = jnp.sum(out.astype(jnp.float32) ** 2)
      return total + (jnp.sum(jnp.sin(lse)) if with_lse else 0.0)
    return small_jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))

  for with_lse, want_calls in ((False, [False, True]), (True, [])):
    calls.clear()
    got = loss("pallas:triton", with_lse)(q, pk, pv, sk, sv)
    want = loss("xla", with_lse)(q, pk, pv, sk, sv)
    assert sorted(set(calls)) == want_calls
    for g, w in zip(got, want):
      assert rel_err(np.asarray(g, np.float32), np.asarray(w, np.float32)) < 2e-2


def test_supports_states_what_cudnn_takes():
  x = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
  q, k = x(2, 8, 4, 64), x(2, 8, 2, 64)
  assert cudnn.supports(q, k, k, causal=True, suffix_len=8)
  assert not cudnn.supports(q, k, k, causal=True, suffix_len=3)  # causal, Tq != S
  assert cudnn.supports(q, k, k, causal=False, suffix_len=3)
  assert not cudnn.supports(x(2, 8, 4, 64, dt=jnp.float32), x(2, 8, 2, 64, dt=jnp.float32),
                            x(2, 8, 2, 64, dt=jnp.float32))  # float32
  assert not cudnn.supports(x(2, 8, 4, 60), x(2, 8, 2, 60), x(2, 8, 2, 60))  # D % 8
  assert not cudnn.supports(x(2, 8, 4, 256), x(2, 8, 2, 256), x(2, 8, 2, 256), head_dim_max=128)


def test_config_chooses_the_engine():
  assert ops_lib.backward_config("xla") is None
  assert ops_lib.backward_config("tpu") is None
  want = "cudnn" if cudnn.available() else "triton"
  assert ops_lib.backward_config("mosaic_gpu", GpuConfig()).kernels == want
  assert ops_lib.backward_config("triton", GpuConfig(backward="triton")).kernels == "triton"
  with pytest.raises(ValueError, match="backward"):
    GpuConfig(backward="flash")
  with pytest.raises(ValueError, match="kernels"):
    bw.BackwardConfig(kernels="cuDNN")


HAS_CUDNN = cudnn.available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDNN, reason="needs a CUDA GPU (compute capability >= 8.0)")
class TestNativeCudnn:
  """cuDNN itself, through the public API on the default GPU path (``impl="auto"``)."""

  @staticmethod
  def api_grad(causal, scale, config):
    """Gradients through ``hierarchical_attention(impl="auto", config=config)``, LSE unused."""
    return vjp_fn("auto", causal, scale, None, False, config)

  @settings(max_examples=300, deadline=None)
  @given(data=st.data(), shape=st.sampled_from(SHAPES),
         dtype=st.sampled_from(["bfloat16", "float16"]), seed=SEEDS)
  def test_matches_oracle(self, data, shape, dtype, seed):
    c = draw_case(data.draw, np.random.default_rng(seed), shape, dtype)
    grads = self.api_grad(shape[2], c["scale"], None)(
        c["q"], c["levels"], c["sk"], c["sv"], c["lens"], c["do"], c["dl"])
    check(grads, c, shape, dtype, with_lse=False)
    count_case("backward cudnn (native)")

  @pytest.mark.parametrize("engine,calls", [("cudnn", True), ("triton", False)])
  def test_compiled_gradient_calls_cudnn(self, engine, calls):
    shape = SHAPES[0]
    c = draw_case(lambda strategy: 3, np.random.default_rng(0), shape, "bfloat16")  # lengths 3
    hlo = self.api_grad(True, c["scale"], GpuConfig(backward=engine)).lower(
        c["q"], c["levels"], c["sk"], c["sv"], c["lens"], c["do"], c["dl"]).as_text()
    assert ("fmhaSoftmaxBackward" in hlo) == calls  # cuDNN's backward custom call
