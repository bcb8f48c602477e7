"""pallas_kernels/tpu/common.py: chips, the block-size heuristic, padding helpers."""

import numpy as np
import pytest

from pallas_kernels.tpu import common
from pallas_kernels.tpu.common import BlockSizes


def test_chip_of_device_kind():
  assert common.chip_of_device_kind("TPU v5 lite") == "v5e"
  assert common.chip_of_device_kind("TPU v5e") == "v5e"
  assert common.chip_of_device_kind("TPU v5") == "v5p"
  assert common.chip_of_device_kind("TPU v5p") == "v5p"
  assert common.chip_of_device_kind("TPU v6 lite") == "v6e"
  assert common.chip_of_device_kind("cpu") == common.DEFAULT_CHIP


def test_block_sizes_follow_the_ridge_and_the_mxu():
  """Prefix row blocks: the smallest MXU multiple >= 2x the chip's FLOPs per K/V byte."""
  for name, chip in common.CHIPS.items():
    bs = common.block_sizes_for(name)
    assert bs.prefix_rows % chip.mxu == 0
    assert 2 * chip.ridge <= bs.prefix_rows < 2 * chip.ridge + chip.mxu
    assert bs.min_parallel_steps == chip.tensorcores
    assert bs.vmem_limit_bytes is None and bs.vmem_budget_bytes < chip.vmem_bytes // 4
    # A full row block of keys is >= 0.75 us of MXU work at D = 128 (>> the step cost).
    assert 4 * bs.prefix_rows * bs.prefix_keys * 128 / chip.bf16_flops_per_s >= 0.75e-6
    # ... and the smallest such power of two (>= 512): a larger block only pads short prefixes.
    half = bs.prefix_keys // 2
    assert bs.prefix_keys & (bs.prefix_keys - 1) == 0 and bs.prefix_keys % bs.compute_keys == 0
    assert half < 512 or 4 * bs.prefix_rows * half * 128 / chip.bf16_flops_per_s < 0.75e-6
    # Double-buffered K and V blocks (bf16, D = 128) fit the step's VMEM budget.
    assert 2 * 2 * bs.prefix_keys * 128 * 2 <= bs.vmem_budget_bytes


def test_block_sizes_reject_misaligned_blocks():
  with pytest.raises(ValueError, match="prefix_keys must be a positive multiple of 16"):
    BlockSizes(prefix_keys=100)
  with pytest.raises(ValueError, match="multiple of compute_keys"):
    BlockSizes(prefix_keys=768, compute_keys=512)


@pytest.mark.parametrize("n,max_block", [(1, 512), (24, 16), (513, 512), (1000, 512), (8192, 1280),
                                         (2048, 384), (40, 16)])
def test_balanced_block(n, max_block):
  block = common.balanced_block(n, max_block)
  blocks = -(-n // block)
  assert block % common.ROW_ALIGN == 0 and block <= max(max_block, common.ROW_ALIGN)
  fewest = -(-n // max_block)
  if n % block == 0 and block % common.ROW_ALIGN == 0:  # an exact divisor: no padding
    assert fewest <= blocks <= 2 * fewest
  else:
    assert blocks == fewest  # as few blocks as the maximum allows
    assert blocks * block - n < common.ROW_ALIGN * blocks  # padding < 16 per block


def test_balanced_block_prefers_exact_divisors():
  assert common.balanced_block(2048, 384) == 256  # not 6 blocks of 352 (padding 64 rows)
  assert common.balanced_block(8192, 1280) == 1024
  assert common.balanced_block(1000, 512) == 512  # no divisor fits: 2 padded blocks


def test_pad_to_pads_with_zeros_at_the_end():
  x = np.arange(6, dtype=np.float32).reshape(2, 3)
  y = np.asarray(common.pad_to(x, (3, 5)))
  assert y.shape == (3, 5) and np.array_equal(y[:2, :3], x) and y.sum() == x.sum()
