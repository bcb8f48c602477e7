"""The saving is real: the compiled program never holds a per-sequence copy of the prefix."""

import re

import jax
import jax.numpy as jnp
import pytest

from jax_shared_attn import SharedLevel, hierarchical_attention, shared_prefix_attention

# Distinct sizes so that shapes in the HLO can be recognised: a copy of the
# prefix per sequence would be a buffer with dims B, P and D (f32/bf16[61,509,...,192]).
B, P, D, S = 61, 509, 192, 3


def compiled(fn, *args):
  return jax.jit(fn).lower(*args).compile()


def copies_of_prefix(hlo: str):
  shapes = re.findall(r"(?:f32|bf16|f16)\[([0-9,]+)\]", hlo)
  return [s for s in shapes if {str(B), str(P), str(D)} <= set(s.split(","))]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_shared_prefix_attention_never_copies_prefix_per_sequence(dtype):
  q = jnp.ones((B, 1, 1, D), dtype)
  pk = jnp.ones((P, 1, D), dtype)
  sk = jnp.ones((B, S, 1, D), dtype)
  c = compiled(lambda *a: shared_prefix_attention(*a, impl="xla"), q, pk, pk, sk, sk)
  assert copies_of_prefix(c.as_text()) == []
  copy_bytes = B * P * D * jnp.dtype(dtype).itemsize
  temp = c.memory_analysis().temp_size_in_bytes
  assert temp < copy_bytes / 8, (temp, copy_bytes)


def test_tree_level_never_copies_segments_per_sequence():
  q = jnp.ones((B, 1, 1, D))
  level = SharedLevel(jnp.ones((2, P, 1, D)), jnp.ones((2, P, 1, D)), jnp.array([P, 100]),
                      jnp.arange(B, dtype=jnp.int32) % 2)
  sk = jnp.ones((B, S, 1, D))
  c = compiled(lambda q, l, sk: hierarchical_attention(q, [l], sk, sk, impl="xla"), q, level, sk)
  assert copies_of_prefix(c.as_text()) == []
  assert c.memory_analysis().temp_size_in_bytes < B * P * D * 4 / 8


def test_the_check_can_fail():
  """The same inspection flags the naive program that broadcasts the prefix."""
  pk = jnp.ones((P, 1, D))
  c = compiled(lambda pk: jnp.broadcast_to(pk, (B, P, 1, D)) * 2.0, pk)
  assert copies_of_prefix(c.as_text())
