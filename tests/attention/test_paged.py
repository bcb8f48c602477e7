"""``paged_attention``'s arguments, plans and forward-only contract (its oracle cases are in
``tests/family_suite.py``, once per kernel family)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_shared_attn import PagedLevel, explain, paged_attention

B, TQ, HQ, HKV, D, PS, PAGES = 3, 1, 4, 2, 16, 4, 12


def inputs():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(B, TQ, HQ, D)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(PAGES, PS, HKV, D)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(PAGES, PS, HKV, D)), jnp.float32)
  own = jnp.asarray([[1, 2], [3, 4], [5, 6]], jnp.int32)
  lens = jnp.asarray([5, 8, 1], jnp.int32)
  level = PagedLevel(jnp.asarray([[7, 8], [9, 10]], jnp.int32), jnp.asarray([6, 3], jnp.int32),
                     jnp.asarray([0, 1, -1], jnp.int32))
  return q, k, v, own, lens, level


@pytest.mark.parametrize("change, message", [
    (dict(own=jnp.asarray([[1, 2], [3, 4], [5, 12]], jnp.int32)), "page_table holds page ids"),
    (dict(own=jnp.asarray([[1, 2], [3, 4]], jnp.int32)), "page_table must have 3 rows"),
    (dict(lens=jnp.asarray([5, 9, 1], jnp.int32)), "kv_lengths must lie in [0, 8]"),
    (dict(level=PagedLevel(jnp.asarray([[7, 8]], jnp.int32), jnp.asarray([6], jnp.int32),
                           jnp.asarray([0, 1, -1], jnp.int32))),
     "levels[0].segment_of_seq must lie in [-1, 0]"),
    (dict(level=PagedLevel(jnp.asarray([[7, 8], [9, 10]], jnp.int32),
                           jnp.asarray([6, 9], jnp.int32), jnp.asarray([0, 1, -1], jnp.int32))),
     "levels[0].lengths must lie in [0, 8]"),
    (dict(level=PagedLevel(jnp.asarray([[7.0, 8.0]]), jnp.asarray([6], jnp.int32),
                           jnp.asarray([0, 0, 0], jnp.int32))),
     "levels[0].page_table must be an integer array"),
    (dict(k=jnp.zeros((PAGES, PS, 3, D))), "k_pages and v_pages must have the same shape"),
])
def test_bad_arguments_name_the_argument(change, message):
  q, k, v, own, lens, level = inputs()
  args = {**dict(q=q, k=k, v=v, own=own, lens=lens, level=level), **change}
  with pytest.raises((ValueError, TypeError), match=message.replace("[", r"\[").replace(
      "]", r"\]")):
    paged_attention(args["q"], args["k"], v, args["own"], args["lens"], levels=[args["level"]])


def test_explain_shows_the_paged_kernels_or_the_gather():
  q, k, v, own, lens, level = inputs()
  gpu = explain(paged_attention, q, k, v, own, lens, levels=[level], platform="gpu",
                device_kind="NVIDIA H200")
  assert gpu.impl == "pallas:mosaic_gpu" and gpu.backend.path == "paged"
  assert gpu.backward == "none" and len(gpu.backend.segments) == 1
  assert any("read in place" in r for r in gpu.reasons)
  tpu = explain(paged_attention, q, k, v, own, lens, levels=[level], platform="tpu",
                device_kind="TPU v5 lite")
  assert tpu.impl == "pallas:tpu" and tpu.backend.path == "paged"
  assert any("read in place" in r for r in tpu.reasons)
  xla = explain(paged_attention, q, k, v, own, lens, levels=[level], impl="xla")
  assert xla.impl == "xla" and any("gathered" in r for r in xla.reasons)


def test_gradient_is_a_clear_error():
  q, k, v, own, lens, level = inputs()
  with pytest.raises(ValueError, match="forward only"):
    jax.grad(lambda q: paged_attention(q, k, v, own, lens, levels=[level]).sum())(q)
