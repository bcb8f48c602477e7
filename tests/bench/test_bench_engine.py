"""``hydragen bench engine`` on the tiny model (CPU, XLA): every mode serves the whole
workload, its timed run compiles nothing (the warm-up covered every shape), and the report
holds its rows, ratios and the attention floors."""

import argparse
import json

import pytest

from models.bench import engine as be
from models.cli import main
from models.model.config import preset


def _relay(out, requests: int, output: int, max_running: int, num_pages: int, *flags) -> int:
  """``hydragen bench engine`` on the tiny model's relay workload (a 24-token system prompt,
  3 user tokens), the XLA path."""
  return main(["bench", "engine", "--model", "tiny", "--requests", str(requests),
               "--system-prompt", "24", "--input", "3", "--output", str(output),
               "--max-running", str(max_running), "--page-size", "4",
               "--num-pages", str(num_pages), "--max-prefill-tokens", "32", "--decode-steps", "2",
               "--impl", "xla", "--page-buckets", "8", "--own-page-buckets", "4,16", *flags,
               "--out", str(out)])


def test_engine_bench_serves_every_mode(tmp_path):
  out = tmp_path / "engine"
  rc = _relay(out, 6, 4, 8, 128, "--modes", "cascade,no-cascade,no-sharing")
  assert rc == 0
  report = json.loads((out / "engine-relay.json").read_text())
  rows = {r["mode"]: r for r in report["rows"]}
  assert set(rows) == {"cascade", "no-cascade", "no-sharing"}
  for r in rows.values():
    assert r["tokens"] == 6 * 4 and r["requests_per_s"] > 0 and r["decode_calls"] > 0
    assert r["compiles"] == 0
    assert r["row_steps_per_token"] >= 1  # padded rows and finished rows' steps included
  assert rows["cascade"]["prefix_hit_rate"] > 0 and rows["no-sharing"]["prefix_hit_rate"] == 0
  assert report["info"]["dtype"] == "bfloat16"  # the bench's default: what GPUs serve
  floors = report["info"]["floors"]
  assert floors["no_cascade_GB"] > floors["cascade_GB"] and floors["floor_ratio"] >= 1
  # The step's floors add the weights (read once, multiplied for every sequence) to both.
  assert 1 <= floors["step_floor_ratio"] <= floors["floor_ratio"]
  assert floors["step_floor_cascade_ms"] >= floors["floor_cascade_ms"]
  md = (out / "engine-relay.md").read_text()
  assert "| cascade |" in md and "| no-sharing |" in md and "| compiles |" in md
  assert (out / "engine-relay.png").stat().st_size > 0


def test_rollouts_static_batches_compile_nothing_when_timed(tmp_path):
  # Each static batch decodes to its own longest sample: the warm-up compiles every batch
  # shape, so the timed run compiles nothing; the engine serves every sample its max_tokens.
  out = tmp_path / "engine"
  rc = main(["bench", "engine", "--model", "tiny", "--workload", "rollouts", "--prompts", "2",
             "--samples", "3", "--prompt-len", "8", "--output-range", "2,9",
             "--max-running", "6", "--static-batch", "2", "--page-size", "4",
             "--num-pages", "64", "--max-prefill-tokens", "16", "--decode-steps", "2",
             "--impl", "xla", "--page-buckets", "2", "--own-page-buckets", "4,8",
             "--modes", "cascade,static", "--out", str(out)])
  assert rc == 0
  report = json.loads((out / "engine-rollouts.json").read_text())
  rows = {r["mode"]: r for r in report["rows"]}
  assert rows["static"]["batch"] == 2 and rows["static"]["compiles"] == 0
  assert rows["cascade"]["compiles"] == 0
  assert rows["static"]["tokens"] == rows["cascade"]["tokens"]  # the same useful tokens
  # Static decodes each batch of 2 to its longest sample: its row steps over the useful tokens.
  requests = be.requests_of(argparse.Namespace(workload="rollouts", prompts=2, samples=3,
                                               prompt_len=8, output_range=[2, 9], seed=0),
                             preset("tiny").vocab_size)
  longest = [max(r.max_tokens for r in requests[i:i + 2]) for i in range(0, 6, 2)]
  assert rows["static"]["row_steps_per_token"] == pytest.approx(
      2 * sum(longest) / sum(r.max_tokens for r in requests))


def test_profile_reports_each_modes_device_time(tmp_path, monkeypatch):
  # --profile serves the workload once more under the profiler; a CPU trace has no device
  # plane, so the device's events are stood in for here: the row and the Markdown carry their
  # busy time, categories (a weight copy is a "copy") and busiest kernels.
  from models.bench import profile

  events = [profile.Event("hydragen_paged_suffix_attention", 0, 2e9, "Stream #14"),
            profile.Event("MemcpyD2D", 1e9, 3e9, "Stream #67"),
            profile.Event("gemm_fusion_dot_4", 5e9, 1e9, "Stream #14")]
  calls = []

  def fake_device_events(fn):
    fn()  # the run itself happens
    calls.append(1)
    return events

  monkeypatch.setattr(profile, "device_events", fake_device_events)
  out = tmp_path / "engine"
  rc = _relay(out, 3, 2, 4, 64, "--modes", "cascade,static", "--profile")
  assert rc == 0 and len(calls) == 1  # the engine mode only
  report = json.loads((out / "engine-relay.json").read_text())
  rows = {r["mode"]: r for r in report["rows"]}
  p = rows["cascade"]["profile"]
  assert p["busy_us"] == 4e6 + 1e6  # [0, 4 s) and [5, 6 s): overlapping streams count once
  assert p["by_category_us"] == {"attention": 2e6, "copy": 3e6, "matmul": 1e6}
  assert [k["name"] for k in p["kernels"]][0] == "MemcpyD2D" and "profile" not in rows["static"]
  md = (out / "engine-relay.md").read_text()
  step = 2e3 / (rows["cascade"]["decode_calls"] * 2)  # 2 s of attention over the decode steps
  floor = report["info"]["floors"]["floor_cascade_ms"]
  assert (f"| cascade | 5.00 | 2.00 | 1.00 | 3.00 | 0.00 | {step:.2f} | {floor:.2f} | MemcpyD2D "
          "(1), hydragen_paged_suffix_attention (1), gemm_fusion_dot_4 (1) |") in md
  assert "No-cascade's attention took" not in md


def test_profile_names_a_baseline_faster_than_its_floor(tmp_path, monkeypatch):
  # No-cascade's attention under its HBM floor (its shared pages served by a cache): the
  # report says so, with the factor, since the floors' ratio then does not bound the run.
  from models.bench import profile

  events = [profile.Event("hydragen_paged_suffix_attention", 0, 1, "Stream #14")]  # 1 ns
  monkeypatch.setattr(profile, "device_events", lambda fn: (fn(), events)[1])
  out = tmp_path / "engine"
  assert _relay(out, 3, 2, 4, 64, "--modes", "no-cascade", "--profile") == 0
  report = json.loads((out / "engine-relay.json").read_text())
  row, floors = report["rows"][0], report["info"]["floors"]
  step = 1e-6 / (row["decode_calls"] * 2)
  md = (out / "engine-relay.md").read_text()
  assert (f"No-cascade's attention took {step:.2f} ms a step, "
          f"{floors['floor_no_cascade_ms'] / step:.2f}x faster") in md
