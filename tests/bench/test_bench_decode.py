"""`hydragen bench decode` runs end to end (tiny model, CPU) and writes its reports."""

import json
import os

import pytest

from models.cli import main

pytestmark = pytest.mark.device  # runs the model's attention path (docs/gpu-tests.md)


def test_bench_decode_tiny(tmp_path):
  out = str(tmp_path)
  assert main(["bench", "decode", "--model", "tiny", "--sweep", "batch", "--batch", "3",
               "--prefix", "12", "--new-tokens", "5", "--out", out, "--no-progress"]) == 0
  stem = os.path.join(out, "decode_tiny_batch")
  rows = json.load(open(stem + ".json"))["rows"]
  assert {(r["mode"], r["sampling"]) for r in rows} == {
      (m, s) for m in ("hydragen", "standard", "none") for s in ("greedy", "sampled")}
  for r in rows:
    assert isinstance(r["tokens_per_s"], float) and r["tokens_per_s"] > 0
    assert r["steps"] == 2  # 5 new tokens: a compiling step, 2 one-step calls, 2 in one call
    assert r["call_overhead_ms"] == pytest.approx(r["one_step_call_ms"] - r["step_ms"])
    assert ("vs_greedy" in r and "sampler_share" in r) == (r["sampling"] == "sampled")
  md = open(stem + ".md").read()
  assert os.path.getsize(stem + ".png") > 0 and "tokens_per_s" in md and "| sampled |" in md
  assert "call_overhead_ms" in md


def test_bench_decode_document_sweep(tmp_path):
  out = str(tmp_path)
  assert main(["bench", "decode", "--model", "tiny", "--sweep", "document", "--batch", "2",
               "--prefix", "20", "--question-tokens", "3", "--new-tokens", "4",
               "--modes", "hydragen,none", "--sampling", "greedy", "--out", out, "--no-progress"]) == 0
  rows = json.load(open(os.path.join(out, "decode_tiny_document.json")))["rows"]
  assert all(r["s_per_batch"] > 0 for r in rows)


def test_bench_decode_document_sweep_point_that_does_not_fit(tmp_path, monkeypatch):
  """A mode over the memory budget is an "x" row in every report (the plot included)."""
  from models.bench import decode as bench_decode
  monkeypatch.setattr(bench_decode, "_device_bytes", lambda: 1)
  out = str(tmp_path)
  assert main(["bench", "decode", "--model", "tiny", "--sweep", "document", "--batch", "2",
               "--prefix", "20", "--question-tokens", "3", "--new-tokens", "4",
               "--modes", "hydragen,standard", "--sampling", "sampled", "--out", out,
               "--no-progress"]) == 0
  stem = os.path.join(out, "decode_tiny_document")
  rows = json.load(open(stem + ".json"))["rows"]
  assert [r["tokens_per_s"] for r in rows] == ["x", "x"]
  assert all("s_per_batch" not in r for r in rows)
  assert os.path.getsize(stem + ".png") > 0 and "| x |" in open(stem + ".md").read()


def test_bench_decode_profile_steps(tmp_path):
  """--profile-steps runs extra steps after the timed ones (the cache is sized for them); a CPU
  trace has no device plane, so the rows carry no profile there."""
  out = str(tmp_path)
  assert main(["bench", "decode", "--model", "tiny", "--sweep", "batch", "--batch", "2",
               "--prefix", "8", "--new-tokens", "4", "--modes", "hydragen", "--profile-steps", "2",
               "--sampling", "sampled", "--out", out, "--no-progress"]) == 0
  rows = json.load(open(os.path.join(out, "decode_tiny_batch.json")))["rows"]
  assert rows[0]["steps"] == 2 and isinstance(rows[0]["tokens_per_s"], float)
  # The context limit makes room for the profiled steps too (the tiny preset allows 1024).
  assert main(["bench", "decode", "--model", "tiny", "--sweep", "batch", "--batch", "1",
               "--prefix", "1016", "--new-tokens", "5", "--modes", "hydragen", "--profile-steps",
               "4", "--sampling", "greedy", "--out", out, "--no-progress"]) == 0


def test_bench_decode_markdown_profile_table():
  from models.bench.decode import _markdown, add_ratios
  info = dict(model="m", dtype="bfloat16", device="d", jax="0", date="today")
  rows = [dict(mode="hydragen", sampling="greedy", batch=8, prefix=16, tokens_per_s=10.0,
               step_ms=1.0,
               profile=dict(busy_us=2000.0, by_category_us={"attention": 500.0, "matmul": 1500.0})),
          dict(mode="hydragen", sampling="sampled", batch=8, prefix=16, tokens_per_s=8.0,
               step_ms=1.25,
               profile=dict(busy_us=2500.0, by_category_us={"attention": 500.0, "matmul": 1600.0,
                                                            "other": 400.0})),
          dict(mode="none", sampling="greedy", batch=8, prefix=16, tokens_per_s=12.0)]
  add_ratios(rows)
  assert rows[1]["vs_greedy"] == 0.8 and abs(rows[1]["sampler_share"] - 0.2) < 1e-12
  assert abs(rows[1]["sampler_share_profiled"] - 0.2) < 1e-12
  # the matmuls' 0.1 ms of run-to-run variation is not the sampler's: its kernels are 0.4 ms
  assert abs(rows[1]["sampler_kernels_share"] - 0.16) < 1e-12
  md = _markdown(rows, info)
  assert ("| mode | sampling | batch | prefix | device_ms_per_step | attention_ms | matmul_ms | "
          "other_ms | sampler_share_profiled | sampler_kernels_share |") in md
  assert "| hydragen | greedy | 8 | 16 | 2.000 | 0.500 | 1.500 | 0.000 |  |  |" in md
  assert "| hydragen | sampled | 8 | 16 | 2.500 | 0.500 | 1.600 | 0.400 | 0.200 | 0.160 |" in md


def test_bench_decode_rejects_negative_profile_steps(tmp_path, capsys):
  assert main(["bench", "decode", "--model", "tiny", "--profile-steps", "-1",
               "--out", str(tmp_path)]) == 2
  assert "--profile-steps must be >= 0" in capsys.readouterr().err


def test_bench_decode_rejects_nonpositive_profile_top(tmp_path, capsys):
  assert main(["bench", "decode", "--model", "tiny", "--profile-steps", "1", "--profile-top", "0",
               "--out", str(tmp_path)]) == 2
  assert "--profile-top must be >= 1" in capsys.readouterr().err
