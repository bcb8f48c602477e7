"""The Pallas backward kernels (Triton and Mosaic TPU, interpreted): many tiles against the XLA
backward (itself checked against the float64 oracle in test_backward.py), and lowering of every
visibility mode for CUDA and TPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_shared_attn import SharedLevel, hierarchical_attention, shared_prefix_attention
from jax_shared_attn import backward as bw
from jax_shared_attn.testing import rel_err, tolerance
from pallas_kernels.config import GpuConfig
from pallas_kernels.gpu import backward as gb
from pallas_kernels.tpu import backward as tb
from strategies import SEEDS, count_case, small_jit

XLA = bw.BackwardConfig(block_rows=5, block_keys=7, kernels="xla")
TILES = gb.BackwardKernelConfig(block_rows=16, block_keys=16)
# Jitted, the interpreted kernels compile once per shape instead of running op by op.
KERNELS = {
    "triton": small_jit(lambda *a, **kw: gb.part_grads(*a, config=TILES, interpret=True, **kw),
                         static_argnames=("scale", "causal", "group", "tq", "sparse")),
    "tpu": small_jit(lambda *a, sparse=False, **kw: tb.part_grads(*a, block_rows=16,
                                                                  interpret=True, **kw),
                      static_argnames=("scale", "causal", "group", "tq", "sparse")),
}
REFERENCE = jax.jit(bw.part_grads, static_argnames=("scale", "causal", "group", "tq", "config"))


def _skip_off_platform(family):
  if family == "tpu" and jax.default_backend() == "gpu":
    pytest.skip("the TPU simulator is for CPU and TPU hosts")


def _inputs(rng, z, h, r, k, d, dtype):
  x = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  lse = x(z, h, r) + 2.0
  lse = jnp.where(jnp.asarray(rng.random((z, h, r)) < 0.1), -jnp.inf, lse)  # rows with no key
  return (x(z, h, r, d).astype(dtype), x(z, h, r, d).astype(dtype), lse, x(z, h, r),
          x(z, k, h, d).astype(dtype), x(z, k, h, d).astype(dtype))


def _bound(dtype: str) -> float:
  """Kernel against the XLA backward: float32 inputs differ by float32 accumulation order (the
  project's float32 tolerance); 16-bit inputs round P and dS alike in both, so a tenth of it."""
  return tolerance(dtype) if dtype == "float32" else tolerance(dtype) / 10


# One shape per test (several row and key tiles, partial last tiles): each interpreted compile
# costs seconds.
@pytest.mark.parametrize("family", sorted(KERNELS))
@settings(max_examples=8)
@given(shape=st.just((2, 37, 145, 24)),
       dtype=st.sampled_from(["float32", "bfloat16"]), seed=SEEDS, data=st.data())
def test_segment_visibility_matches_xla(family, shape, dtype, seed, data):
  _skip_off_platform(family)
  h, r, k, d = shape
  rng = np.random.default_rng(seed)
  args = _inputs(rng, 1, h, r, k, d, dtype)
  n_seg = data.draw(st.integers(1, 3))
  row_seg = jnp.asarray(rng.integers(-1, n_seg, r), jnp.int32)
  key_seg = jnp.asarray(rng.integers(-2, n_seg, k), jnp.int32)
  want = REFERENCE(*args, scale=0.3, row_seg=row_seg, key_seg=key_seg, config=XLA)
  got = KERNELS[family](*args, scale=0.3, row_seg=row_seg, key_seg=key_seg, sparse=True)
  for g, w in zip(got, want):
    assert rel_err(g, w) <= _bound(dtype)
  count_case(f"backward kernel ({family}, segments)")


@pytest.mark.parametrize("family", sorted(KERNELS))
@settings(max_examples=8)
@given(shape=st.just((3, 5, 4, 2, 140, 32)),
       dtype=st.sampled_from(["float32", "bfloat16"]), causal=st.booleans(), seed=SEEDS,
       data=st.data())
def test_suffix_visibility_matches_xla(family, shape, dtype, causal, seed, data):
  _skip_off_platform(family)
  z, tq, g, h, s, d = shape
  rng = np.random.default_rng(seed)
  args = _inputs(rng, z, h, tq * g, s, d, dtype)
  lens = jnp.asarray([data.draw(st.integers(0, s)) for _ in range(z)], jnp.int32)
  kw = dict(scale=0.3, lengths=lens, causal=causal, group=g, tq=tq)
  want = REFERENCE(*args, config=XLA, **kw)
  got = KERNELS[family](*args, **kw)
  for gg, w in zip(got, want):
    assert rel_err(gg, w) <= _bound(dtype)
  count_case(f"backward kernel ({family}, suffix)")


def test_kernel_config_rejects_bad_tiles():
  with pytest.raises(ValueError, match="block_rows"):
    gb.BackwardKernelConfig(block_rows=24)
  with pytest.raises(ValueError, match="kernels"):
    bw.BackwardConfig(kernels="cuda")


@pytest.mark.parametrize("dtype,tree", [("bfloat16", False), ("float32", True)])
def test_backward_kernels_lower_for_tpu(dtype, tree):
  """jax.grad on the TPU family exports with the Mosaic backward kernels (dK/dV and dQ per part)."""
  if jax.default_backend() == "gpu":
    pytest.skip("impl='pallas:tpu' is lowered from a CPU or a TPU, not from a GPU process")
  b, tq, hq, hkv, d, p, s = 4, 16, 8, 2, 128, 384, 200
  dt = jnp.dtype(dtype)

  def loss(q, pk, pv, sk, sv, n):
    if tree:
      level = SharedLevel(pk.reshape(3, p // 3, hkv, d), pv.reshape(3, p // 3, hkv, d),
                          jnp.array([100, 7, 0], jnp.int32), jnp.array([0, 2, -1, 0], jnp.int32))
      out = hierarchical_attention(q, [level], sk, sv, suffix_lengths=n, impl="pallas:tpu")
    else:
      out = shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=n, impl="pallas:tpu")
    return out.astype(jnp.float32).sum()

  exp = jax.export.export(jax.jit(jax.grad(loss, argnums=range(5))), platforms=["tpu"])(
      S((b, tq, hq, d), dt), S((p, hkv, d), dt), S((p, hkv, d), dt), S((b, s, hkv, d), dt),
      S((b, s, hkv, d), dt), S((b,), jnp.int32))
  text = exp.mlir_module()
  assert text.count("hydragen_backward_dkv") >= 2 and text.count("hydragen_backward_dq") >= 2


S = jax.ShapeDtypeStruct
CALLS = ("__gpu$xla.gpu.triton", "mosaic_gpu_v2")
TRITON_BACKWARD = GpuConfig(backward="triton")


def _export_cuda(fn, *args):
  checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in CALLS]
  return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
      *args).mlir_module()


@pytest.mark.parametrize("dtype,d,tq,tree", [("bfloat16", 128, 8, False), ("float32", 80, 1, True),
                                             ("bfloat16", 64, 3, True)])
def test_backward_kernels_lower_for_cuda(dtype, d, tq, tree):
  """jax.grad on the GPU family exports with the backward kernels (dK/dV and dQ per part).

  ``backward="triton"``: on a GPU the default is cuDNN where it applies, whose calls
  ``jax.export`` refuses to store (no compatibility guarantee)."""
  b, hq, hkv, p, s = 4, 8, 2, 300, 40
  dt = jnp.dtype(dtype)

  def loss(q, pk, pv, sk, sv, n):
    if tree:
      level = SharedLevel(pk.reshape(3, p // 3, hkv, d), pv.reshape(3, p // 3, hkv, d),
                          jnp.array([100, 7, 0], jnp.int32), jnp.array([0, 2, -1, 0], jnp.int32))
      out = hierarchical_attention(q, [level], sk, sv, suffix_lengths=n, impl="pallas:triton",
                                   config=TRITON_BACKWARD)
    else:
      out = shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=n, impl="pallas:triton",
                                    config=TRITON_BACKWARD)
    return out.astype(jnp.float32).sum()

  text = _export_cuda(jax.grad(loss, argnums=range(5)), S((b, tq, hq, d), dt), S((p, hkv, d), dt),
                      S((p, hkv, d), dt), S((b, s, hkv, d), dt), S((b, s, hkv, d), dt),
                      S((b,), jnp.int32))
  calls = [line for line in text.splitlines() if CALLS[0] in line]
  # one dK/dV and one dQ kernel for the shared part and for the suffix
  assert sum("hydragen_backward_dkv" in line for line in calls) == 2
  assert sum("hydragen_backward_dq" in line for line in calls) == 2
