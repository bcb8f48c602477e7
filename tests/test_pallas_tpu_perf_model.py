"""pallas_kernels/tpu/perf_model.py: the table of docs/tpu.md is consistent with the IO model."""

from jax_shared_attn.iomodel import AttentionShape
from pallas_kernels.tpu import common, perf_model


def test_kernel_bytes_cover_the_io_model():
  """Our kernels move at least the IO model's bytes (prefix once, suffixes once, q, out) and
  at most what re-reading the prefix once per row block, the float32 state, the
  lane-replicated LSE and padding add."""
  for chip in common.CHIPS:
    for row in perf_model.rows_for(chip):
      assert row["ours_MB"] >= 0.999 * row["ideal_MB"]
      hq, hkv, d = perf_model.SHAPES[row["shape"]]
      shape = AttentionShape(row["B"], row["P"], row["S"], hq, hkv, d)
      cost = perf_model.kernel_cost(shape, chip)
      rows = row["B"] * hq
      row_blocks = -(-(rows // hkv) // cost.prefix_block[0])
      extra = (row_blocks - 1) * row["P"] * hkv * d * 4 + rows * 4096 + 2 * 16 * hkv * 1024
      assert cost.bytes <= shape.shared_bytes() + extra
      assert cost.flops >= shape.flops()
      assert row["speedup_api"] <= row["speedup"]
      assert (row["relayout_MB"] == 0) == (hkv == 1)


def test_floor_is_at_least_each_ceiling():
  shape = AttentionShape(batch=64, prefix=4096, suffix=128, q_heads=32, kv_heads=8, head_dim=128)
  chip = common.CHIPS["v5e"]
  cost = perf_model.kernel_cost(shape, "v5e")
  floor = cost.floor_s(chip.hbm_bytes_per_s, chip.bf16_flops_per_s)
  assert floor >= cost.bytes / chip.hbm_bytes_per_s
  assert floor >= cost.flops / chip.bf16_flops_per_s


def test_markdown_lists_every_configuration():
  text = perf_model.markdown()
  assert text.count("\n| 1024 | 16384 | 512 |") == len(common.CHIPS) * len(perf_model.SHAPES)
  assert len([line for line in text.splitlines() if line.startswith("| 16 |")]) == 3 * 2 * 6
