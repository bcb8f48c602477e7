"""jit, vmap and grad through every public function."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_shared_attn import (SharedLevel, attention_with_lse, hierarchical_attention,
                             merge_attention_states, shared_prefix_attention)
from jax_shared_attn.testing import rel_err
from strategies import rand, small_jit

B, TQ, HQ, HKV, D, P, S = 3, 2, 4, 2, 64, 7, 5


def inputs(seed, dtype="float32"):
  rng = np.random.default_rng(seed)
  q, _ = rand(rng, (B, TQ, HQ, D), dtype)
  pk, _ = rand(rng, (P, HKV, D), dtype)
  pv, _ = rand(rng, (P, HKV, D), dtype)
  sk, _ = rand(rng, (B, S, HKV, D), dtype)
  sv, _ = rand(rng, (B, S, HKV, D), dtype)
  lens = jnp.array([S, 2, 3], jnp.int32)  # >= Tq: the decomposition is full causal attention
  return q, pk, pv, sk, sv, lens


def full_over_concat(q, pk, pv, sk, sv, lens):
  """Reference: every sequence stores the whole context (prefix copied per sequence)."""
  k = jnp.concatenate([jnp.broadcast_to(pk, (B,) + pk.shape), sk], axis=1)
  v = jnp.concatenate([jnp.broadcast_to(pv, (B,) + pv.shape), sv], axis=1)
  return attention_with_lse(q, k, v, kv_lengths=P + lens, causal=True, impl="xla")


def loss(fn, w_out, w_lse, *xs):
  out, lse = fn(*xs)
  return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)


def test_jit_equals_eager():
  q, pk, pv, sk, sv, lens = inputs(0)
  f = lambda *a: shared_prefix_attention(*a, suffix_lengths=lens, impl="xla", return_lse=True)
  eager = f(q, pk, pv, sk, sv)
  jitted = small_jit(f)(q, pk, pv, sk, sv)
  for a, b in zip(eager, jitted):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tree", [False, True])
def test_grad_equals_grad_of_full_attention(tree):
  q, pk, pv, sk, sv, lens = inputs(1)
  rng = np.random.default_rng(5)
  w_out = jnp.asarray(rng.normal(size=(B, TQ, HQ, D)), jnp.float32)
  w_lse = jnp.asarray(rng.normal(size=(B, TQ, HQ)), jnp.float32)

  def decomposed(q, pk, pv, sk, sv):
    if tree:  # the ragged (grouped-matmul) path: two segments, every sequence on one
      level = SharedLevel(jnp.stack([pk, pk * 0.5]), jnp.stack([pv, pv]),
                          jnp.array([P, 3], jnp.int32), jnp.zeros((B,), jnp.int32))
      return hierarchical_attention(q, [level], sk, sv, suffix_lengths=lens, impl="xla",
                                    return_lse=True)
    return shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=lens, impl="xla",
                                   return_lse=True)

  full = lambda q, pk, pv, sk, sv: full_over_concat(q, pk, pv, sk, sv, lens)
  args = (q, pk, pv, sk, sv)
  # jitted: the same gradients, one program each instead of every op compiled eagerly
  g1 = small_jit(jax.grad(functools.partial(loss, decomposed, w_out, w_lse),
                          argnums=range(5)))(*args)
  g2 = small_jit(jax.grad(functools.partial(loss, full, w_out, w_lse), argnums=range(5)))(*args)
  for name, a, b in zip(["q", "prefix_k", "prefix_v", "suffix_k", "suffix_v"], g1, g2):
    assert rel_err(a, b) <= 1e-5, name


def test_grad_is_finite_on_fully_masked_rows():
  q, pk, pv, sk, sv, _ = inputs(2)
  lens = jnp.array([0, 0, 1], jnp.int32)

  def f(q, sk):
    out, lse = shared_prefix_attention(q, pk, pv, sk, sv, prefix_length=0, suffix_lengths=lens,
                                       impl="xla", return_lse=True)
    return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

  for g in small_jit(jax.grad(f, argnums=(0, 1)))(q, sk):
    assert np.all(np.isfinite(np.asarray(g)))


def test_vmap_over_layers_and_over_queries():
  layers = [inputs(10 + i) for i in range(3)]
  stacked = [jnp.stack(xs) for xs in zip(*layers)]
  f = lambda q, pk, pv, sk, sv, lens: shared_prefix_attention(q, pk, pv, sk, sv,
                                                              suffix_lengths=lens, impl="xla")
  jf = small_jit(f)  # jitted, as the mapped calls are: one program, not every op compiled
  batched = small_jit(jax.vmap(f))(*stacked)
  for i, xs in enumerate(layers):
    np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(jf(*xs)), rtol=1e-6, atol=1e-6)
  # Several query sets against one cache: only q is mapped.
  q, pk, pv, sk, sv, lens = layers[0]
  qs = jnp.stack([q, 2 * q])
  out = small_jit(jax.vmap(f, in_axes=(0, None, None, None, None, None)))(qs, pk, pv, sk, sv,
                                                                          lens)
  np.testing.assert_allclose(np.asarray(out[1]), np.asarray(jf(2 * q, pk, pv, sk, sv, lens)),
                             rtol=1e-6, atol=1e-6)


def test_vmap_attention_with_lse_and_merge():
  q, pk, pv, sk, sv, lens = inputs(3)
  f = lambda q, k, v: attention_with_lse(q, k, v, impl="xla")
  out, lse = small_jit(jax.vmap(f, in_axes=(0, 0, 0)))(q[None], sk[None], sv[None])
  ref = small_jit(f)(q, sk, sv)
  np.testing.assert_allclose(np.asarray(out[0]), np.asarray(ref[0]), rtol=1e-6, atol=1e-6)
  m = small_jit(jax.vmap(lambda a, b, la, lb: merge_attention_states([a, b], [la, lb])))
  o2, l2 = m(out, out, lse, lse)
  np.testing.assert_allclose(np.asarray(o2), np.asarray(out), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(l2), np.asarray(lse) + np.log(2.0), rtol=1e-6)


def test_vmap_hierarchical():
  q, pk, pv, sk, sv, lens = inputs(4)
  level = SharedLevel(jnp.stack([pk, pv]), jnp.stack([pv, pk]), jnp.array([P, 4], jnp.int32),
                      jnp.array([1, 0, 1], jnp.int32))
  f = lambda q, level: hierarchical_attention(q, [level], sk, sv, suffix_lengths=lens, impl="xla")
  levels = jax.tree.map(lambda x: jnp.stack([x, x]), level)
  out = small_jit(jax.vmap(f))(jnp.stack([q, -q]), levels)
  np.testing.assert_allclose(np.asarray(out[1]), np.asarray(small_jit(f)(-q, level)), rtol=1e-6,
                             atol=1e-6)
