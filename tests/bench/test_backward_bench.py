"""`python -m models.bench backward` runs end to end on a CPU (tiny sizes, the XLA
stand-in for cuDNN) and its gradients agree with the per-sequence path."""

import json
import os

import pytest

from models.bench import __main__ as cli
from models.bench import backward


def test_backward_benchmark_tiny(tmp_path):
  rc = cli.main(["backward", "--configs", "3:40:8", "--heads", "4,2,16", "--trials", "1",
                 "--impls", "ours,per_seq", "--out", str(tmp_path), "--ceiling-bytes", str(2**22), "--matmul-n", "128"])
  assert rc == 0
  data = json.load(open(os.path.join(tmp_path, "backward.json")))
  (row,) = data["rows"]
  assert data["info"]["per_seq_impl"] == "xla"
  for name in ("ours", "ours_completions", "per_seq"):
    assert isinstance(row[f"{name}_us"], float) and row[f"{name}_bytes"] > 0, name
  # bf16 inputs: the decomposition's gradients equal the per-sequence ones (prompt summed over
  # its copies) within bf16's tolerance
  assert row["err_per_seq"] < 2e-2
  assert row["per_seq_gflop"] > row["ours_gflop"] and row["floor_us"] > 0
  assert "| G | P | C |" in open(os.path.join(tmp_path, "backward.md")).read()


def test_floors_count_the_prompt_once():
  f = backward.floors(16, 2048, 512, (32, 8, 128), 2, 3e12, 800e12)
  per_pair = 4 * 32 * 128 * backward.BWD_FACTOR
  assert f["ours_gflop"] * 1e9 == pytest.approx(per_pair * (2048**2 / 2 + 16 * 512 * (2048 + 256)))
  assert f["per_seq_gflop"] * 1e9 == pytest.approx(per_pair * 16 * 2560**2 / 2)


def test_bad_configs_are_rejected():
  with pytest.raises(ValueError, match="G:P:C"):
    backward.parse_configs("16:2048")
