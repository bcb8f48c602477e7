"""The server's load generator runs end to end at tiny sizes (an in-process server of the tiny
preset, cascade on and off in one run) and writes its reports; its workloads have the shapes
they claim. No timing is asserted."""

import argparse
import json

import pytest

from models.bench import serve
from models.cli import app as cli


def test_workloads_share_what_they_claim():
  args = argparse.Namespace(dataset="gsp", groups=3, prompts_per_group=4, system_tokens=10,
                            question_tokens=6, num_requests=0)
  prompts = serve.make_prompts(args, 256, 0)
  assert len(prompts) == 12 and all(len(p) == 16 for p in prompts)
  assert len({tuple(p[:10]) for p in prompts}) == 3
  args = argparse.Namespace(dataset="system-prompt", system_tokens=10, question_tokens=6,
                            num_requests=20)
  prompts = serve.make_prompts(args, 256, 0)
  assert len(prompts) == 20 and len({tuple(p[:10]) for p in prompts}) == 1
  assert all(3 <= len(p) - 10 <= 9 for p in prompts)


def test_summary_percentiles():
  results = [serve.Result(sent=0.0, first=0.1 * i, end=0.1 * i + 0.9, tokens=10)
             for i in range(1, 11)] + [serve.Result(sent=0.0, error="HTTP 400")]
  row = serve.summarize(results, wall=2.0)
  assert row["completed"] == 10 and row["failed"] == 1 and row["first_error"] == "HTTP 400"
  assert row["output_tok_s"] == 50.0 and row["tpot_p50_ms"] == pytest.approx(100.0)
  assert row["ttft_p50_ms"] == pytest.approx(550.0)


def test_bench_serve_cascade_on_and_off(tmp_path, capsys):
  out = tmp_path / "r"
  status = cli.main(["bench", "serve", "--model", "tiny", "--dtype", "float32", "--impl", "xla",
                     "--system-tokens", "24", "--question-tokens", "4", "--output-tokens", "6",
                     "--num-requests", "6", "--rates", "100,inf", "--cascade", "on,off",
                     "--warmup", "0", "--page-size", "4", "--num-pages", "128",
                     "--max-running", "8", "--decode-steps", "3", "--min-shared-tokens", "4",
                     "--out", str(out)])
  assert status == 0
  report = json.loads((out / "serve_tiny_system-prompt.json").read_text())
  rows = report["rows"]
  assert [(r["cascade"], r["rate"]) for r in rows] == [
      ("on", 100.0), ("on", float("inf")), ("off", 100.0), ("off", float("inf"))]
  for r in rows:
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["output_tok_s"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0
  assert rows[1]["cascade_call_share"] > 0 and rows[3]["cascade_call_share"] == 0
  assert (out / "serve_tiny_system-prompt.png").stat().st_size > 0
  table = capsys.readouterr().out
  assert "| cascade | rate |" in table and table.strip().splitlines()[-1].startswith("| off | inf")


@pytest.mark.parametrize("argv, words", [
    (["--rates", "0"], "--rates"), (["--rates", "x"], "--rates"),
    (["--concurrency", "4", "--rates", "2"], "not both"),
    (["--cascade", "maybe"], "--cascade"), (["--output-tokens", "0"], "--output-tokens"),
    (["--url", "http://127.0.0.1:1", "--cascade", "on,off"], "--cascade on,off"),
])
def test_bad_flags(capsys, argv, words):
  assert cli.main(["bench", "serve", *argv]) == 2
  assert words in capsys.readouterr().err


def test_a_workload_the_server_refuses_stops_at_the_warm_up(tmp_path, capsys):
  """Requests the engine can never hold (page tables past the largest bucket) are answered 400;
  the warm-up stops there with the server's message instead of timing failures."""
  status = cli.main(["bench", "serve", "--model", "tiny", "--dtype", "float32", "--impl", "xla",
                     "--system-tokens", "24", "--question-tokens", "4", "--output-tokens", "6",
                     "--num-requests", "2", "--warmup", "1", "--page-size", "4",
                     "--num-pages", "64", "--max-running", "4", "--own-page-buckets", "2,4",
                     "--out", str(tmp_path / "r")])
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert status == 2 and "refused" in err and "own_page_buckets" in err
  assert not (tmp_path / "r").exists()
