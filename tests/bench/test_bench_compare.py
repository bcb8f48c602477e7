"""`hydragen bench compare` and `hydragen bench sampler` write their reports (small, CPU)."""

import json
import os

import pytest

from models.bench import compare as bench_compare
from models.cli import main
from model_checks import smollm2_gguf

pytestmark = pytest.mark.device  # runs the model's attention path (docs/gpu-tests.md)


def test_bench_compare_report(tmp_path, monkeypatch, capsys):
  """The table's plumbing with stand-in runners (a real run loads two 135M models)."""
  smollm2_gguf()  # skips without the model package
  calls = []

  def fake(impl, whole):
    def run(path, ids, samples, new_tokens, args, loaded, programs=None):
      calls.append((impl, samples, new_tokens, args.temperature, args.top_p, len(ids)))
      row = dict(whole_s=whole * samples, decode_tokens_per_s=1.0)
      return dict(row, compile_s=0.5) if impl == "hydragen" else dict(row, first_token_s=0.1)
    return run
  monkeypatch.setattr(bench_compare, "run_ours", fake("hydragen", 1.0))
  monkeypatch.setattr(bench_compare, "run_transformers", fake("transformers", 2.0))
  assert main(["bench", "compare", "--samples", "2,4", "--new-tokens", "8", "--out", str(tmp_path),
               "--compile-cache", ""]) == 0
  report = json.load(open(os.path.join(tmp_path, "compare.json")))
  # Every row of ours before torch is imported, then transformers'; the table pairs them.
  assert [(c[0], c[1], c[3], c[4]) for c in calls] == [
      ("hydragen", 2, 0.7, 0.9), ("hydragen", 4, 0.7, 0.9),
      ("transformers", 2, 0.7, 0.9), ("transformers", 4, 0.7, 0.9)]
  assert [(r["impl"], r["samples"]) for r in report["rows"]] == [
      ("hydragen", 2), ("transformers", 2), ("hydragen", 4), ("transformers", 4)]
  assert calls[0][5] == report["info"]["prompt_tokens"] > 10  # the chat-rendered prompt
  ours = [r for r in report["rows"] if r["impl"] == "hydragen"]
  assert all(r["vs_transformers"] == 2.0 for r in ours)
  assert ours[0]["whole_tokens_per_s"] == 2 * 8 / 2.0
  md = open(os.path.join(tmp_path, "compare.md")).read()
  assert "| hydragen | 2 | 8 | 8.00 |" in md and "temperature 0.7, top-p 0.9" in md
  assert "Load average (1 min) " in md and report["info"]["load_average_end"] is not None


def test_bench_compare_rejects_bad_input(capsys):
  assert main(["bench", "compare", "--impls", "vllm"]) == 2
  assert "--impls" in capsys.readouterr().err
  assert main(["bench", "compare", "--temperature", "0"]) == 2
  assert "--temperature" in capsys.readouterr().err


def test_bench_sampler_tiny(tmp_path):
  assert main(["bench", "sampler", "--shapes", "4x300", "--settings", "t0.7 k50 p0.9",
               "--distributions", "peaked", "--configs", "search:3,candidates:16", "--trials", "1",
               "--out", str(tmp_path)]) == 0
  report = json.load(open(os.path.join(tmp_path, "sampler.json")))
  assert [(r["distribution"], r["setting"]) for r in report["rows"]] == [("peaked", "t0.7 k50 p0.9")]
  for r in report["rows"]:
    for name in ("reference", "search:3", "candidates:16"):
      assert isinstance(r[f"{name}_us"], float) and r[f"{name}_us"] > 0
    assert not any(k.endswith("_mismatches") for k in r)
  assert "Every variant drew the reference's tokens." in open(os.path.join(tmp_path, "sampler.md")).read()


def test_bench_sampler_parses_the_kernel_config():
  from models.bench.sampler import parse_config
  from models.errors import UsageError
  config = parse_config("kernel:64")
  assert config.kernel and config.kernel_tile == 64 and config.kernel_min_batch == 1
  assert parse_config("kernel").kernel_tile == 2048
  with pytest.raises(UsageError, match="kernel:1000"):
    parse_config("kernel:1000")
