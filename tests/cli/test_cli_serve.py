"""``hydragen serve``: bad flags are one line and exit status 2; a served process answers
once loaded, and SIGTERM lets the answer in progress finish, then exits 0."""

import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from models.bench.common import counting_compiles
from models.cli import app as cli
from models.server.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("argv, words", [
    (["--page-size", "0"], "--page-size"),
    (["--num-pages", "1"], "--num-pages"),
    (["--max-running", "-2"], "--max-running"),
    (["--max-logprobs", "-1"], "--max-logprobs"),
    (["--max-logprobs", "21"], "--max-logprobs"),
    (["--prefill-ticks", "0"], "--prefill-ticks"),
    (["--batch-buckets", "16,4"], "--batch-buckets"),
    (["--precompile", "--level-buckets", "1"],
     "--precompile needs --segment-buckets, --page-buckets"),
    (["--max-running", "64", "--batch-buckets", "16,32"], "--batch-buckets"),
    (["--page-buckets", "8,x"], "--page-buckets"),
    (["--port", "70000"], "--port"),
    (["--impl", "magic"], "--impl"),
    (["--model", "/no/such/model.gguf"], "--model"),
    (["--drain-timeout", "-1"], "--drain-timeout"),
    (["--mesh", "2x2"], "--mesh"),
    (["--mesh", "two"], "--mesh"),
    (["--bogus"], "--bogus"),
])
def test_bad_flags_are_one_line_and_status_2(capsys, argv, words):
  assert cli.main(["serve", *argv]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("hydragen serve: error: ") and words in err[0]


def test_engine_flags_reach_the_engine_config():
  import argparse

  from models.bench import engine_flags
  p = argparse.ArgumentParser()
  engine_flags.add_engine_arguments(p)
  args = p.parse_args(["--max-logprobs", "3", "--page-size", "8", "--no-cascade",
                       "--prefill-ticks", "4", "--scan-layers", "--batch-buckets", "16,64",
                       "--max-running", "64", "--page-buckets", "128", "--level-buckets",
                       "1,2"])
  engine_flags.check_engine_args(args)
  config = engine_flags.engine_config(args)
  assert (config.max_logprobs, config.page_size, config.cascade, config.prefill_ticks,
          config.scan_layers) == (3, 8, False, 4, True)
  assert (config.batch_buckets, config.page_buckets, config.level_buckets,
          config.own_page_buckets) == ((16, 64), (128,), (1, 2), None)
  default = engine_flags.engine_config(p.parse_args([]))
  assert (default.max_logprobs, default.scan_layers) == (20, None)
  assert engine_flags.engine_config(p.parse_args(["--no-scan-layers"])).scan_layers is False


def test_precompile_compiles_every_program_before_serving(tiny_dir):
  """``--precompile``: the loader runs ``Engine.warmup`` (every program of the buckets); a
  request after it compiles nothing."""
  import argparse

  from models.bench import engine_flags
  from models.serving import Request
  p = argparse.ArgumentParser()
  engine_flags.add_engine_arguments(p)
  args = p.parse_args([
      "--model", tiny_dir, "--impl", "xla", "--dtype", "float32", "--page-size", "4",
      "--num-pages", "64", "--max-running", "2", "--max-prefill-tokens", "8", "--decode-steps",
      "2", "--max-logprobs", "0", "--batch-buckets", "2", "--prefill-buckets", "8",
      "--prefill-row-buckets", "2", "--level-buckets", "1", "--segment-buckets", "1",
      "--page-buckets", "4", "--own-page-buckets", "16"])
  engine, _ = engine_flags.loader(args, precompile=True)()
  with counting_compiles() as events:
    (out,) = engine.generate([Request(list(range(40, 50)), n=2, max_tokens=4, ignore_eos=True)])
  assert [len(s.token_ids) for s in out.samples] == [4, 4] and events == []


def test_serve_answers_on_a_mesh_then_drains_on_sigterm(tiny_dir):
  """The served process runs tensor parallel over two CPU devices (``--mesh 1x2``)."""
  port = free_port()
  url = f"http://127.0.0.1:{port}"
  cmd = [sys.executable, "-m", "models.cli", "serve", "--model", tiny_dir, "--port", str(port),
         "--impl", "xla", "--dtype", "float32", "--page-size", "8", "--num-pages", "64",
         "--max-running", "4", "--decode-steps", "2", "--log-level", "warning", "--mesh", "1x2"]
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                                    + " --xla_force_host_platform_device_count=2").strip())
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env)
  try:
    wait = threading.Event()
    for _ in range(3000):  # the port opens, then /health turns 200 once the model is loaded
      try:
        if httpx.get(url + "/health", timeout=5).status_code == 200:
          break
      except httpx.TransportError:
        pass
      assert proc.poll() is None, proc.communicate()[1][-2000:]
      wait.wait(0.05)
    (model,) = httpx.get(url + "/v1/models").json()["data"]
    assert model["id"] == os.path.basename(tiny_dir)
    assert "hydragen_model_shards 2.0" in httpx.get(url + "/metrics").text
    body = dict(model=model["id"], prompt="drain me", max_tokens=200, temperature=0.0,
                stream=True)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
      lines = r.iter_lines()
      first = next(line for line in lines if line.startswith("data: "))
      proc.send_signal(signal.SIGTERM)  # mid-stream: the answer still ends whole
      rest = [line for line in lines if line.startswith("data: ")]
    chunks = [json.loads(x[6:]) for x in [first] + rest[:-1]]
    assert rest[-1] == "data: [DONE]"
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert proc.wait(timeout=120) == 0, proc.communicate()[1][-2000:]
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
