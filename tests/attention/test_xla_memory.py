"""The XLA path holds no whole score tensor: compiled temporaries (``memory_analysis``, nothing
runs) of the forward and of ``jax.grad`` against the float32 scores of the prefix, and the
tiles of ``XlaConfig`` as the plan carries them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_shared_attn import XlaConfig, explain, shared_prefix_attention
from models.bench.memory import measure
from pallas_kernels import xla


def test_grad_temporaries_within_a_quarter_of_the_prefix_scores():
  """Prefill of 8 completions' last 256 tokens on a 2K prompt (q and out are 1/32 of the prefix
  scores each): the gradient's temporaries stay within a quarter of the scores, while the
  reference formula's forward alone holds more than them (the measure sees a score tensor)."""
  row = measure(8, 256, 2048, q_heads=8, kv_heads=2, head_dim=64,
                config=XlaConfig(block_rows=64, block_keys=128))
  scores = row["scores_bytes"]
  assert row["reference_forward_bytes"] > scores
  assert row["forward_bytes"] <= scores / 4
  assert row["grad_bytes"] <= scores / 4, row


def test_long_prompt_prefill_within_a_few_tiles():
  """A 4K-token prompt alone (``attention_with_lse``, causal): the gradient's temporaries are
  under an eighth of the prompt's scores, the reference forward's over them."""
  row = measure(1, 4096, 0, q_heads=8, kv_heads=2, head_dim=64)
  assert row["reference_forward_bytes"] > row["scores_bytes"]
  assert row["grad_bytes"] <= row["scores_bytes"] / 8, row


def test_the_plan_carries_the_tiles_to_the_forward(monkeypatch):
  """``explain`` shows the XlaConfig a call runs with, and every tiled part of the call gets its
  tiles (the default where the call passes none)."""
  q = jnp.zeros((2, 3, 4, 16), jnp.float32)
  pk = jnp.zeros((7, 2, 16), jnp.float32)
  sk = jnp.zeros((2, 3, 2, 16), jnp.float32)
  seen = []
  real = xla.tiled_attention

  def spy(*args, block_rows, block_keys, **kwargs):
    seen.append((block_rows, block_keys))
    return real(*args, block_rows=block_rows, block_keys=block_keys, **kwargs)

  monkeypatch.setattr(xla, "tiled_attention", spy)
  for config, want in ((XlaConfig(block_rows=2, block_keys=3), (2, 3)),
                       (None, (XlaConfig().block_rows, XlaConfig().block_keys))):
    plan = explain(shared_prefix_attention, q, pk, pk, sk, sk, impl="xla", config=config)
    assert plan.backend == (config or XlaConfig())
    assert f"{want[0]} query tokens x {want[1]} keys" in str(plan)
    seen.clear()
    out = jax.jit(lambda *a: shared_prefix_attention(*a, impl="xla", config=config))(
        q, pk, pk, sk, sk)
    assert seen == [want, want] and np.isfinite(np.asarray(out)).all()  # prefix, suffix


@pytest.mark.parametrize("field", ["block_rows", "block_keys"])
@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_bad_tiles_name_the_field(field, value):
  with pytest.raises(ValueError, match=f"XlaConfig: {field} must be a positive int"):
    XlaConfig(**{field: value})


def test_rows_without_a_key_keep_minus_inf_through_every_tile():
  """Sequences whose suffix is empty and prefix length 0: ``(0, -inf)`` on every row, for tiles
  that split the rows and keys."""
  rng = np.random.default_rng(0)
  x = lambda *s: jnp.asarray(rng.normal(size=s), jnp.bfloat16)
  q, pk, sk = x(3, 2, 4, 16), x(9, 2, 16), x(3, 5, 2, 16)
  out, lse = jax.jit(lambda q, pk, sk: shared_prefix_attention(
      q, pk, pk, sk, sk, prefix_length=0, suffix_lengths=jnp.array([0, 5, 0]),
      return_lse=True, impl="xla", config=XlaConfig(block_rows=1, block_keys=2)))(q, pk, sk)
  lse = np.asarray(lse)
  assert np.isneginf(lse[[0, 2]]).all() and np.isfinite(lse[1]).all()
  assert (np.asarray(out, np.float32)[[0, 2]] == 0).all()
