"""Every shipped TPU configuration lowers to Mosaic (jax.export for "tpu" on a CPU machine).

Block sizes come from a per-chip heuristic of the shape, so the sweep covers each
chip's sizes x head dims 64/80/128/256 x GQA ratios 1..8 x batch 1..1024, with P, S
and T off every block multiple, in bfloat16 and float32. Lowering runs the Pallas TPU
checks (block shapes against the Mosaic tiling rule, scalar-prefetch index maps,
supported ops and dtypes); a configuration that cannot lower fails here. The whole
jitted public functions export as ONE program holding the kernels and no trace of the
interpreter.
"""

import itertools

import jax
import jax.numpy as jnp
import pytest

from jax_shared_attn import SharedLevel, hierarchical_attention, shared_prefix_attention
from pallas_kernels import tpu
from pallas_kernels.tpu import common

MOSAIC = "tpu_custom_call"
S = jax.ShapeDtypeStruct
CHIPS = sorted(common.CHIPS)


def export_tpu(fn, *args) -> str:
  text = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
  assert "callback" not in text  # no interpreter branch in the TPU program
  return text


def kernel_program(ops, b, tq, hq, hkv, d, p, s, n, dtype):
  """prefix, a tree level and the suffix with the fused merge, as one program."""

  def fn(q, pk, pv, lk, lv, lens, nodes, sk, sv, slen, plen):
    prior = ops.prefix_attention(q, pk, pv, kv_length=plen, scale=d**-0.5)
    level = ops.segment_attention(q, lk, lv, lengths=lens, node_of_seq=nodes, scale=d**-0.5)
    merged = (prior[0] + level[0], jnp.logaddexp(prior[1], level[1]))  # any prior will do
    return ops.suffix_attention(q, sk, sv, kv_lengths=slen, causal=tq > 1, scale=d**-0.5,
                                prior=merged)

  args = (S((b, tq, hq, d), dtype), S((p, hkv, d), dtype), S((p, hkv, d), dtype),
          S((n, p // 2 + 3, hkv, d), dtype), S((n, p // 2 + 3, hkv, d), dtype),
          S((n,), jnp.int32), S((b,), jnp.int32), S((b, s, hkv, d), dtype),
          S((b, s, hkv, d), dtype), S((b,), jnp.int32), S((), jnp.int32))
  return fn, args


# (B, Tq, (Hkv, G), D, P, S, N, dtype): G 1..8, D 64/80/128/256, B 1..1024, bfloat16 and
# float32; the block-size heuristic picks different row/key blocks, heads and sequences per
# suffix step across these. Exporting costs ~0.7 s per program, hence a sample, not a product.
KERNEL_SWEEP = [
    (1, 1, (8, 4), 128, 1000, 100, 3, "bfloat16"),
    (16, 1, (1, 8), 128, 1017, 129, 3, "bfloat16"),
    (64, 1, (8, 4), 64, 4099, 511, 16, "bfloat16"),
    (256, 1, (2, 1), 256, 1000, 100, 3, "float32"),
    (1024, 1, (1, 8), 128, 16385, 513, 40, "bfloat16"),
    (1024, 1, (8, 4), 256, 1000, 128, 7, "bfloat16"),
    (3, 4, (2, 3), 80, 777, 61, 5, "float32"),
    (300, 4, (2, 5), 128, 777, 61, 5, "bfloat16"),
    (300, 1, (1, 6), 64, 777, 61, 2, "float32"),
    (7, 2, (4, 7), 128, 333, 1000, 4, "bfloat16"),
    (1000, 1, (2, 2), 256, 100, 2000, 3, "float32"),
]


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("config", KERNEL_SWEEP, ids=lambda c: "-".join(map(str, c)))
def test_kernels_export_for_tpu(chip, config):
  b, tq, (hkv, g), d, p, s, n, dtype = config
  fn, args = kernel_program(tpu.get_ops(chip=chip), b, tq, hkv * g, hkv, d, p, s, n,
                            jnp.dtype(dtype))
  text = export_tpu(fn, *args)
  assert text.count(MOSAIC) == 3


@pytest.mark.parametrize("chip", CHIPS)
def test_shipped_block_sizes_fit_vmem(chip):
  """The VMEM estimate of every exported configuration stays under the chip's budget."""
  from pallas_kernels.tpu import prefix, suffix
  bs = common.block_sizes_for(chip)
  assert bs.vmem_limit_bytes is None  # fits the default scoped VMEM: no XLA flag needed
  assert bs.vmem_budget_bytes <= common.DEFAULT_SCOPED_VMEM * 3 // 4
  for (b, tq, (hkv, g), d, p, s, n, _), itemsize in itertools.product(KERNEL_SWEEP, (2, 4)):
    dp = common.round_up(d, common.LANES)
    rows, keys, chunk = prefix.prefix_blocks(b * tq * g, p, dp, itemsize, bs)
    assert prefix.vmem_bytes(rows, keys, chunk, dp, itemsize) <= bs.vmem_budget_bytes
    assert rows <= bs.prefix_rows and keys <= bs.prefix_keys and keys % chunk == 0
    blocks = suffix.suffix_blocks(b, hkv, s, tq * g, dp, itemsize, bs)
    assert suffix.vmem_bytes(blocks, tq * g, dp, itemsize, True) <= bs.vmem_budget_bytes
    if common.CHIPS[chip].tensorcores > 1 and b * hkv > 1:  # megacore: both cores get work
      assert common.cdiv(b, blocks.batch) * (hkv // blocks.heads) >= 2


# (B, Hq, Hkv, D, P, S, Tq) through the public API, impl="pallas:tpu".
API_SWEEP = [(b, hkv * g, hkv, 128, 1000 + 17 * b % 93, 100 + b % 29, 1)
             for b, (hkv, g) in [(1, (1, 8)), (16, (8, 4)), (64, (1, 8)), (256, (8, 4)),
                                 (1024, (1, 8)), (1024, (8, 4))]]
API_SWEEP += [(3, 8, 1, 64, 777, 61, 4), (300, 8, 1, 256, 777, 61, 1)]


@pytest.mark.parametrize("b,hq,hkv,d,p,s,tq", API_SWEEP)
def test_shared_prefix_attention_exports_as_one_program(b, hq, hkv, d, p, s, tq):
  dt = jnp.bfloat16
  fn = lambda q, pk, pv, sk, sv, n: shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=n,
                                                             impl="pallas:tpu")
  text = export_tpu(fn, S((b, tq, hq, d), dt), S((p, hkv, d), dt), S((p, hkv, d), dt),
                    S((b, s, hkv, d), dt), S((b, s, hkv, d), dt), S((b,), jnp.int32))
  assert text.count(MOSAIC) == 2  # prefix kernel + suffix kernel (merge fused)
  assert "stablehlo.while" not in text  # no interpreter loop


@pytest.mark.parametrize("b,n,d", [(8, 3, 128), (1024, 16, 128), (96, 40, 64)])
def test_hierarchical_attention_exports_as_one_program(b, n, d):
  dt = jnp.bfloat16
  fn = lambda q, pk, lk, lens, nodes, sk, n_: hierarchical_attention(
      q, [SharedLevel.shared_by_all(pk, pk, b), SharedLevel(lk, lk, lens, nodes)], sk, sk,
      suffix_lengths=n_, impl="pallas:tpu")
  text = export_tpu(fn, S((b, 1, 32, d), dt), S((2400, 8, d), dt), S((n, 513, 8, d), dt),
                    S((n,), jnp.int32), S((b,), jnp.int32), S((b, 70, 8, d), dt),
                    S((b,), jnp.int32))
  assert text.count(MOSAIC) == 3  # two tree levels + suffix
  assert "stablehlo.while" not in text
