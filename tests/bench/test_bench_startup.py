"""The start-up benchmark runs and writes its report (CPU, a tiny GGUF; no timing asserted)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("gguf", reason="the tiny GGUF is written with the gguf package")

from models.bench.startup import run_startup_bench  # noqa: E402
from gguf_writer import write_tiny_llama_gguf  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_startup_bench_times_loading_and_the_command(tmp_path):
  path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
  out = tmp_path / "report"
  report = run_startup_bench(path, runs=1, out=str(out), num_samples=2, max_new_tokens=2,
                             compile_cache=str(tmp_path / "xla"))
  saved = json.loads((out / "startup.json").read_text())
  assert saved["info"]["model"] == path and saved["medians"] == report["medians"]
  for key in ("open_s", "tokenizer_s", "load_s", "imports_s", "warm_wall_s", "warm_load_s",
              "warm_prefill_s", "warm_decode_s"):
    assert saved["medians"][key] > 0, key
  assert len(saved["warm"]) == 1 and saved["cold"]["cache_requests"] > 0
  md = (out / "startup.md").read_text()
  assert "| from_pretrained (all of loading) |" in md and "whole command (wall clock)" in md


def test_startup_bench_runs_as_a_module(tmp_path):
  path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
  done = subprocess.run([sys.executable, "-m", "models.bench.startup", "--model", path,
                         "--runs", "1", "--no-command", "--out", str(tmp_path / "r")],
                        env=env, capture_output=True, text=True, cwd=ROOT)
  assert done.returncode == 0, done.stderr
  assert "| build the tokenizer |" in done.stdout
  assert set(json.loads((tmp_path / "r" / "startup.json").read_text())["medians"]) == {
      "open_s", "tokenizer_s", "load_s"}
  bad = subprocess.run([sys.executable, "-m", "models.bench.startup", "--runs", "0",
                        "--no-command", "--out", str(tmp_path / "r")],
                       env=env, capture_output=True, text=True, cwd=ROOT)
  assert bad.returncode == 2 and "--runs must be >= 1" in bad.stderr
