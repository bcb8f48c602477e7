"""Every bad input to the CLI is one line ``hydragen <command>: error: ...``, exit status 2.

One test per class of bad input (files, sampling parameters, lengths, impl, dtype, argparse),
``--debug`` (the traceback instead), Ctrl-C (status 130, no traceback) and ``--stream``.
"""

import json
import os
import signal
import subprocess
import sys

import jax.numpy as jnp
import pytest

from models.cli import app as cli
from models.cli import generate as generate_command
from models.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def error_line(capsys, *argv, command="generate") -> str:
  """Runs ``hydragen <command> argv``; asserts status 2 and one stderr line; returns it."""
  base = ["--no-progress", "--compile-cache", ""] if command == "generate" else []
  assert cli.main([*command.split(), *argv, *base]) == 2
  err = capsys.readouterr().err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in err, err
  assert lines[0].startswith(f"hydragen {command}: error: "), lines[0]
  return lines[0]


def test_missing_model_file(capsys, tmp_path):
  line = error_line(capsys, "--prompt", "hi", "--model", str(tmp_path / "nope.gguf"))
  assert "--model" in line and "nope.gguf" in line and "no such file" in line


@pytest.mark.parametrize("name, content", [("garbage.gguf", b"GGUF\x03\x00\x00\x00" + b"\xff" * 64),
                                           ("notes.txt", b"hello"),
                                           ("empty.gguf", b"")])
def test_malformed_or_unreadable_gguf(capsys, tmp_path, name, content):
  path = tmp_path / name
  path.write_bytes(content)
  line = error_line(capsys, "--prompt", "hi", "--model", str(path))
  assert f"--model {path}" in line


def test_unreadable_file(capsys, tmp_path):
  if os.geteuid() == 0:
    pytest.skip("root reads any file")
  path = tmp_path / "locked.gguf"
  path.write_bytes(b"GGUF")
  path.chmod(0)
  line = error_line(capsys, "--prompt", "hi", "--model", str(path))
  assert f"--model {path}" in line


def test_malformed_safetensors_directory(capsys, tmp_path, tiny_dir):
  broken_json = tmp_path / "json"
  broken_json.mkdir()
  (broken_json / "config.json").write_text("{not json")
  assert f"--model {broken_json}" in error_line(capsys, "--prompt", "hi", "--model", str(broken_json))
  broken_weights = tmp_path / "weights"
  broken_weights.mkdir()
  (broken_weights / "config.json").write_text(json.dumps(dict(
      model_type="llama", vocab_size=256, hidden_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)))
  (broken_weights / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
  line = error_line(capsys, "--prompt", "hi", "--model", str(broken_weights))
  assert f"--model {broken_weights}" in line
  empty = tmp_path / "empty"
  empty.mkdir()
  assert f"--model {empty}" in error_line(capsys, "--prompt", "hi", "--model", str(empty))


@pytest.mark.parametrize("flag, value", [("--top-p", "1.5"), ("--top-p", "0"),
                                         ("--temperature", "-1"), ("--temperature", "inf"),
                                         ("--top-k", "0")])
def test_sampling_parameters(capsys, tiny_dir, flag, value):
  line = error_line(capsys, "--prompt", "hi", "--model", tiny_dir, flag, value)
  assert flag in line and value in line


@pytest.mark.parametrize("flag, value", [("--num-samples", "0"), ("--max-new-tokens", "-3"),
                                         ("--max-new-tokens", "5000")])
def test_lengths(capsys, tiny_dir, flag, value):
  line = error_line(capsys, "--prompt", "hi", "--model", tiny_dir, flag, value)
  assert flag in line
  if value == "5000":
    assert "context of 1024 tokens" in line


def test_unknown_impl(capsys, tiny_dir):
  line = error_line(capsys, "--prompt", "hi", "--model", tiny_dir, "--impl", "cuda-magic")
  assert "--impl" in line and "cuda-magic" in line and "pallas" in line


def test_a_dtype_the_device_cannot_run(capsys, tiny_dir, monkeypatch):
  def unsupported(*args, **kwargs):
    raise RuntimeError("UNIMPLEMENTED: this device has no float16 tanh")
  monkeypatch.setattr(jnp, "tanh", unsupported)
  line = error_line(capsys, "--prompt", "hi", "--model", tiny_dir, "--dtype", "float16")
  assert "--dtype float16" in line and "cannot run it" in line and "UNIMPLEMENTED" in line


def test_argparse_errors_are_one_line_too(capsys):
  assert "unrecognized arguments: --bogus" in error_line(capsys, "--prompt", "hi", "--bogus")
  assert "argument --attention" in error_line(capsys, "--prompt", "hi", "--attention", "magic")
  line = error_line(capsys, "--modes", "hydragen,fast", "--model", "tiny", command="bench decode")
  assert "--modes" in line and "fast" in line


def test_debug_shows_the_traceback(tiny_dir):
  with pytest.raises(UsageError, match="--top-p"):
    cli.main(["generate", "--prompt", "hi", "--model", tiny_dir, "--top-p", "2", "--debug",
              "--no-progress", "--compile-cache", ""])


def test_stream_prints_the_first_sample_as_it_grows(tiny_dir, capsys, monkeypatch):
  shown = []
  real = generate_command._Stream.update
  monkeypatch.setattr(generate_command, "STREAM_CHUNK", 3)
  monkeypatch.setattr(generate_command._Stream, "update",
                      lambda self, row: (real(self, row), shown.append(self.shown))[0])
  assert cli.main(["generate", "--prompt", "hello", "--model", tiny_dir, "--num-samples", "2",
                   "--max-new-tokens", "10", "--stream", "--seed", "4", "--no-progress",
                   "--compile-cache", "", "--temperature", "0"]) == 0
  out = capsys.readouterr().out
  assert len(shown) == 4  # 3 + 3 + 3 + 1 steps: a print after each chunk
  assert all(b.startswith(a) for a, b in zip(shown, shown[1:]))  # it only grows
  assert out.startswith("[sample 0] " + shown[-1]) and "[sample 1] " in out
  assert out.count("[sample 0]") == 1


def test_stream_and_json_do_not_mix(capsys, tiny_dir):
  assert "--stream" in error_line(capsys, "--prompt", "hi", "--model", tiny_dir, "--stream",
                                  "--json")


def test_ctrl_c_exits_130_without_a_traceback(tiny_dir):
  """SIGINT once the first sample streams: status 130, one line, no traceback."""
  # --ignore-eos and 16 samples: the run lasts long after the first token (a random model can
  # draw its EOS early and finish before the signal arrives)
  cmd = [sys.executable, "-m", "models.cli", "generate", "--prompt", "hi", "--model", tiny_dir,
         "--max-new-tokens", "1000", "--num-samples", "16", "--ignore-eos", "--stream",
         "--no-progress", "--compile-cache", ""]
  env = dict(os.environ, PYTHONPATH=ROOT)
  # A terminal's Ctrl-C needs SIGINT at its default disposition in the child. An ignored signal
  # stays ignored across exec (pytest-xdist workers can ignore SIGINT), and then Python would
  # not install its KeyboardInterrupt handler and the run would end with status 0; a handled
  # one is reset to the default by exec. So the parent handles it while it starts the child.
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env)
  finally:
    signal.signal(signal.SIGINT, previous)
  seen = b""
  while b"[sample 0]" not in seen:
    chunk = os.read(proc.stdout.fileno(), 256)
    assert chunk, proc.stderr.read().decode()[-2000:]
    seen += chunk
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  err = err.decode()
  assert proc.returncode == 130, err[-2000:]
  assert "Traceback" not in err and err.strip().endswith("hydragen generate: interrupted")


def test_a_ctrl_c_python_swallowed_still_interrupts():
  """SIGINT whose KeyboardInterrupt never reaches the command (Python drops it inside a GC or
  host callback) is still noted: the command ends as interrupted."""
  import argparse

  from models.cli import app

  def handler(args):
    try:
      os.kill(os.getpid(), signal.SIGINT)
      sum(range(1000))  # the signal's handler runs here, at the next bytecodes
    except KeyboardInterrupt:  # as a callback's caller would drop it
      pass
    return 0

  interrupted = []
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    assert app._run_noting_sigint(argparse.Namespace(handler=handler), interrupted) == 0
  finally:
    signal.signal(signal.SIGINT, previous)
  assert interrupted == [signal.SIGINT]
