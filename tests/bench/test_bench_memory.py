"""The memory benchmark compiles its programs and writes its report (CPU, tiny shapes)."""

import json

import pytest

from models.bench.memory import markdown, run_memory_bench
from models.errors import UsageError


def test_memory_bench_reports_every_case(tmp_path):
  rows, info = run_memory_bench([(2, 8, 16), (1, 12, 0)], q_heads=4, kv_heads=2, head_dim=16,
                                block_rows=4, block_keys=8, time_runs=1, out=str(tmp_path))
  saved = json.loads((tmp_path / "memory.json").read_text())
  assert saved["rows"] == rows and saved["info"]["config"] == dict(block_rows=4, block_keys=8)
  assert [r["function"] for r in rows] == ["shared_prefix_attention", "attention_with_lse"]
  for r in rows:
    assert r["scores_bytes"] == r["batch"] * r["tokens"] * 4 * (r["prefix"] or r["tokens"]) * 4
    assert r["grad_bytes"] > 0 and r["forward_s"] > 0 and r["reference_forward_s"] > 0
  md = (tmp_path / "memory.md").read_text()
  assert md == markdown(rows, info) and "| 2x8x16 | shared_prefix_attention |" in md


def test_memory_bench_rejects_bad_arguments():
  with pytest.raises(UsageError, match="multiple of --kv-heads"):
    run_memory_bench([(1, 4, 4)], q_heads=6, kv_heads=4)
  with pytest.raises(UsageError, match="XlaConfig: block_keys must be a positive int"):
    run_memory_bench([(1, 4, 4)], block_keys=0)
