"""Configuration as values: validation that names the field, hashing, and a jitted function
whose behaviour follows from its static ``config`` argument."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_shared_attn import (BlockSizes, FusedDecodeOptions, GpuConfig, MosaicPrefixOptions,
                             TpuConfig, XlaConfig, shared_prefix_attention)
from jax_shared_attn.testing import rel_err


@pytest.mark.parametrize("make,field", [
    (lambda: GpuConfig(flat_max_shared_reads=-1), "flat_max_shared_reads"),
    (lambda: GpuConfig(flat_split_factor=0), "flat_split_factor"),
    (lambda: GpuConfig(max_fused_prior_splits=0), "max_fused_prior_splits"),
    (lambda: GpuConfig(fused_decode=1), "fused_decode"),
    (lambda: GpuConfig(prefix=FusedDecodeOptions()), "prefix"),
    (lambda: GpuConfig(fused=None), "fused"),
    (lambda: MosaicPrefixOptions(stages=1), "stages"),
    (lambda: MosaicPrefixOptions(wide_min_keys=-128), "wide_min_keys"),
    (lambda: FusedDecodeOptions(spread_suffix="yes"), "spread_suffix"),
    (lambda: FusedDecodeOptions(cluster_merge=None), "cluster_merge"),
    (lambda: TpuConfig(chip="v4"), "chip"),
    (lambda: TpuConfig(block_sizes=(512, 512)), "block_sizes"),
])
def test_bad_values_name_the_field(make, field):
  with pytest.raises(ValueError, match=field):
    make()


def test_configs_are_frozen_hashable_values():
  a = GpuConfig(fused=FusedDecodeOptions(stages=3))
  assert a == GpuConfig(fused=FusedDecodeOptions(stages=3)) and hash(a) == hash(GpuConfig(
      fused=FusedDecodeOptions(stages=3)))
  assert a != GpuConfig() and len({a, GpuConfig(), TpuConfig(), TpuConfig(chip="v6e")}) == 4
  with pytest.raises(AttributeError):
    a.fused_decode = False
  assert hash(TpuConfig(block_sizes=BlockSizes())) == hash(TpuConfig(block_sizes=BlockSizes()))


def test_wrong_config_type_is_rejected():
  q = jnp.zeros((2, 1, 8, 64), jnp.float32)
  pk = jnp.zeros((32, 1, 64), jnp.float32)
  sk = jnp.zeros((2, 8, 1, 64), jnp.float32)
  with pytest.raises(TypeError, match="take a TpuConfig"):
    shared_prefix_attention(q, pk, pk, sk, sk, impl="pallas:tpu", config=GpuConfig())
  with pytest.raises(TypeError, match="take a GpuConfig"):
    shared_prefix_attention(q, pk, pk, sk, sk, impl="pallas:triton", config=XlaConfig())
  with pytest.raises(TypeError,
                     match="config must be a GpuConfig, a TpuConfig, an XlaConfig or None"):
    shared_prefix_attention(q, pk, pk, sk, sk, impl="xla", config={"fused_decode": False})
  # "xla" takes an XlaConfig; a kernel family's config is accepted and changes nothing
  out = shared_prefix_attention(q, pk, pk, sk, sk, impl="xla", config=GpuConfig())
  assert out.shape == q.shape


def test_one_jitted_function_two_configs_two_plans():
  """One function jitted with ``config`` static: each config is its own trace, with the kernels
  its plan names (the flat kernel, or the prefix and suffix kernels), both exact."""
  rng = np.random.default_rng(0)
  b, hq, hkv, d, p, s = 3, 4, 1, 64, 96, 16
  q, pk, pv, sk, sv = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in
                       [(b, 1, hq, d), (p, hkv, d), (p, hkv, d), (b, s, hkv, d), (b, s, hkv, d)])

  @functools.partial(jax.jit, static_argnames="config")
  def attend(q, pk, pv, sk, sv, config):
    return shared_prefix_attention(q, pk, pv, sk, sv, impl="pallas:triton", config=config)

  flat, split = GpuConfig(), GpuConfig(flat_max_shared_reads=0)
  texts = {c: str(jax.make_jaxpr(functools.partial(attend.__wrapped__, config=c))(
      q, pk, pv, sk, sv)) for c in (flat, split)}
  assert "hydragen_flat_attention" in texts[flat] and "hydragen_prefix" not in texts[flat]
  assert "hydragen_flat_attention" not in texts[split] and "hydragen_prefix" in texts[split]
  ref = shared_prefix_attention(q, pk, pv, sk, sv, impl="xla")
  for config in (flat, split):
    assert rel_err(attend(q, pk, pv, sk, sv, config=config), ref) < 1e-5
  assert attend._cache_size() == 2
