"""Real processes under jax.distributed: 2 processes x 2 CPU devices on localhost (gloo).

Greedy tokens from a safetensors checkpoint (each process reads only its shards) on meshes
over both processes equal one process on 4 devices, and no mesh (orbax and GGUF too);
``hydragen generate`` prints on process 0 only; bad launches (a mesh that
does not span the processes, processes that disagree on the prompt, processes with different
device counts) raise a clear error on every process instead of hanging. Every process is
started in its own process group and killed when a test fails or times out.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import multiprocess_worker

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "parallel" / "multiprocess_worker.py")
# Fast CPU compiles (LLVM -O0): the programs are tiny, compiling dominates.
FAST = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
TIMEOUT_S = 150


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def launch(args_per_process, devices_per_process, timeout=TIMEOUT_S):
  """Starts one worker per entry, waits for all; returns [(returncode, stdout, stderr)].

  The processes are killed (their whole process groups) if any is still running when the
  time is up or the test fails.
  """
  procs = []
  try:
    for args, n in zip(args_per_process, devices_per_process):
      env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
                 XLA_FLAGS=f"--xla_force_host_platform_device_count={n} {FAST}")
      env.pop("PYTEST_XDIST_WORKER", None)
      procs.append(subprocess.Popen([sys.executable, WORKER, *map(str, args)], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True))
    deadline = time.monotonic() + timeout
    outputs = []
    for p in procs:
      try:
        out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pytest.fail(f"a worker did not finish within {timeout} s (a hang)")
      outputs.append((p.returncode, out, err))
    return outputs
  finally:
    for p in procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
        p.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The checkpoint; then 2 processes x 2 devices and 1 process x 4 devices, side by side."""
  tmp = tmp_path_factory.mktemp("multiprocess")
  ckpt = tmp / "ckpt"
  multiprocess_worker.write(str(ckpt))  # here: one process fewer to start
  port = free_port()
  outs = [tmp / f"p{i}.json" for i in range(2)] + [tmp / "ref.json"]
  results = launch([["run", ckpt, outs[0], port, 2, 0], ["run", ckpt, outs[1], port, 2, 1],
                    ["run", ckpt, outs[2]]], [2, 2, 4])
  for rc, _, err in results:
    assert rc == 0, err[-4000:]
  return [json.loads(p.read_text()) for p in outs], [out for _, out, _ in results]


@pytest.mark.slow
def test_two_processes_give_the_tokens_of_one_process_and_of_no_mesh(runs):
  p0, p1, ref = runs[0]
  assert (p0["process"], p1["process"], p0["processes"], p0["devices"]) == (0, 1, 2, 4)
  assert ref["processes"] == 1 and ref["devices"] == 4
  assert set(p0["tokens"]) == {
      "hydragen-one-prompt (2, 2)", "hydragen-two-level-tree (2, 2)", "standard (2, 2)",
      "hydragen-two-level-tree (1, 4)", "hydragen-one-prompt orbax (2, 2)",
      "hydragen-one-prompt model.gguf (2, 2)"}
  for case, tokens in p0["tokens"].items():
    assert p1["tokens"][case] == tokens, case  # every process returns all the rows
    assert ref["tokens"][case] == tokens, case  # = one process on 4 devices
    assert ref["tokens"][case.rsplit(" (", 1)[0] + " None"] == tokens, case  # = no mesh
    assert len(tokens) == 8 and len({t for row in tokens for t in row}) > 4  # not degenerate
  # orbax holds the same float32 weights; GGUF's Q8_0 blocks round them (other tokens).
  assert p0["tokens"]["hydragen-one-prompt orbax (2, 2)"] == p0["tokens"][
      "hydragen-one-prompt (2, 2)"]


@pytest.mark.slow
def test_the_command_line_prints_on_process_0_only(runs):
  # gloo's C++ library prints its connection log lines to stdout itself (NCCL does not), in
  # pieces that other writes split: runs showed "[Gloo] Rank ", "2 is connected to 3 peer
  # ranks. " and "Expected number of connected peer ranks is : 3" each on a line of its own.
  out0, out1, ref = runs[1]
  assert all(GLOO_PIECES.fullmatch(l) for l in out1.splitlines(keepends=True)), out1
  out0, ref = _without_gloo(out0), _without_gloo(ref)
  completions = _json_in(out0)["completions"]
  assert len(completions) == 4 and all(len(c["token_ids"]) == 5 for c in completions)
  assert completions == _json_in(ref)["completions"]


# A line made only of the words of gloo's "[Gloo] Rank 2 is connected to 3 peer ranks. Expected
# number of connected peer ranks is : 3" (whole or in pieces, several interleaved).
GLOO_PIECES = re.compile(r"(?:\[Gloo\]|Rank|is|connected|to|peer|ranks\.?|Expected|number|of|:|\d+|\s)+")


def _without_gloo(out: str) -> str:
  """``out`` without gloo's pieces (lines of its words, not of numbers alone: JSON has those)."""
  return "".join(l for l in out.splitlines(keepends=True)
                 if not (GLOO_PIECES.fullmatch(l) and re.search(r"[A-Za-z:]", l)))


def test_the_gloo_filter_takes_its_lines_however_split_and_keeps_ours():
  line = "[Gloo] Rank 2 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
  for cut in (12, 44, len(line)):
    pieces = f"{line[:cut]}\n{line[cut:]}\n" if cut < len(line) else line + "\n"
    text = pieces + "[Gloo] Rank [Gloo] Rank 1 is\n"
    assert all(GLOO_PIECES.fullmatch(l) for l in text.splitlines(keepends=True)), cut
    assert _without_gloo('{\n "ids": [\n  17\n ]\n}\n' + text) == '{\n "ids": [\n  17\n ]\n}\n'
  assert not GLOO_PIECES.fullmatch("Rank 2 of 4: done\n")


def _json_in(out: str) -> dict:
  """The CLI's JSON object; gloo's own log writes can split a line around it (seen in CI)."""
  return json.JSONDecoder().raw_decode(out, out.index("{\n"))[0]


@pytest.mark.slow
def test_bad_mesh_and_disagreeing_prompts_raise_on_every_process(runs):
  p0, p1, _ = runs[0]
  for p in (p0, p1):
    assert "must span every process's devices" in p["errors"]["mesh (3, 1)"]
    assert "disagree with process 0 (prompt_ids differs on process(es) [1])" in (
        p["errors"]["different prompts"])


@pytest.mark.slow
def test_processes_with_different_device_counts_fail_on_every_process():
  port = free_port()
  results = launch([["devices", port, 2, 0], ["devices", port, 2, 1]], [2, 1], timeout=90)
  for rc, _, err in results:
    assert rc != 0 and "the processes hold different numbers of devices ([2, 1]" in err, err[-3000:]


# -- in this process: argument checks and the digest (no second process needed) -----------------

def test_initialize_rejects_partial_or_malformed_arguments():
  from models.parallel import distributed

  for args, match in [(("localhost:1234", None, 0), "together"),
                      ((None, 2, None), "together"),
                      (("localhost", 2, 0), "HOST:PORT"),
                      (("localhost:1234", 0, 0), "num_processes must be an int >= 1"),
                      (("localhost:1234", 2, 2), r"process_id must lie in \[0, 2\)")]:
    with pytest.raises(ValueError, match=match):
      distributed.initialize(*args)


def test_the_digest_follows_values_not_their_spelling():
  import jax.numpy as jnp
  import numpy as np

  from models.generation.prompt_tree import PromptTree
  from models.parallel import distributed

  same = lambda a, b: np.array_equal(distributed._digest(a), distributed._digest(b))
  prompt = [5, 6, 7]
  assert same(prompt, np.array(prompt)) and same(prompt, jnp.array(prompt))
  assert same(prompt, (np.int64(5), 6, 7))
  assert not same(prompt, [5, 6, 8]) and not same(prompt, [[5, 6, 7]])
  tree = lambda last: PromptTree.from_prompts([prompt * 10 + [1], prompt * 10 + [last]], 2)
  assert same(tree(2), tree(2)) and not same(tree(2), tree(3))
  distributed.check_same(None, prompt_ids=prompt)  # one process: nothing to compare


def test_command_line_mesh_flags():
  import argparse

  from models.parallel import distributed

  p = argparse.ArgumentParser()
  distributed.add_arguments(p)
  assert distributed.from_args(p.parse_args([])) is None
  assert distributed.from_args(p.parse_args(["--mesh", "2x4"])) == (2, 4)
  assert distributed.from_args(p.parse_args(["--mesh", "auto"])) == "auto"
  with pytest.raises(SystemExit, match="--mesh must be"):
    distributed.from_args(p.parse_args(["--mesh", "2,4"]))
  with pytest.raises(SystemExit, match="need --coordinator"):
    distributed.from_args(p.parse_args(["--num-processes", "2"]))
