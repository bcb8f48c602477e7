"""``hydragen bench train`` at a tiny size on the CPU: both modes run and report."""

import json

import pytest

from models.bench.train import main

pytestmark = pytest.mark.device  # runs the model's attention path (docs/gpu-tests.md)


def test_bench_train_writes_json_and_markdown(tmp_path):
  assert main(["--model", "tiny", "--layers", "1", "--prompt", "24", "--completion", "6",
               "--group", "4", "--steps", "1", "--impl", "xla", "--dtype", "float32",
               "--out", str(tmp_path)]) == 0
  record = json.loads((tmp_path / "train.json").read_text())
  rows = {r["mode"]: r for r in record["rows"]}
  assert set(rows) == {"hydragen", "standard"}
  assert rows["hydragen"]["tokens"] == 24 + 4 * 6 and rows["standard"]["tokens"] == 4 * 30
  for r in rows.values():
    assert r["step_s"] > 0 and r["compile_s"] > 0 and r["temp_gb"] >= 0
  # The same random batch: the two modes' losses agree (one step of the same objective).
  assert abs(rows["hydragen"]["loss"] - rows["standard"]["loss"]) < 1e-5
  text = (tmp_path / "train.md").read_text()
  assert "| hydragen | xla | 48 |" in text and "faster per step" in text
