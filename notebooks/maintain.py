"""Upkeep of the notebooks: running them with their outputs stored, the repository they name.

    python notebooks/maintain.py execute NAME [--set K=V ...] [--out DIR]   # run, store outputs
    python notebooks/maintain.py strip                   # drop outputs and execution counts
    python notebooks/maintain.py set-repo OWNER/NAME     # point install cells and badges elsewhere

``execute`` runs a notebook in a fresh kernel of this interpreter (the repository root on the
path) and writes it back with its outputs (or to ``DIR``). ``--set`` values are injected after
the ``parameters`` cell for the run; the stored notebook keeps the defaults and says, in a note
where the injected cell was, which values made its outputs.

``REPO`` below is the one place that names the GitHub repository. The notebooks' install cells
(``REPO = "..."``, used in ``pip install git+https://github.com/{REPO}.git``), their "Open in
Colab" badges and docs/notebooks.md hold copies of it; ``set-repo`` rewrites them all, and
tests/test_notebooks.py fails when any of them disagrees with ``REPO``.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = "hydragen-jax/hydragen-jax"  # placeholder owner until the project has its GitHub home
# The install cells refuse to pip-install from this value with a one-line message.
PLACEHOLDER = "hydragen-jax/hydragen-jax"

NOTE_ID = "stored-outputs-note"  # the markdown cell naming the values of the stored run
HERE = Path(__file__).resolve().parent
DOCS = HERE.parent / "docs" / "notebooks.md"


def notebooks() -> list[Path]:
  return sorted(HERE.glob("*.ipynb"))


def _write(path: Path, nb: dict) -> None:
  # nbformat's own layout (indent 1, sorted keys), so that diffs stay small.
  path.write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n")


def strip(path: Path) -> None:
  nb = json.loads(path.read_text())
  for cell in nb["cells"]:
    if cell["cell_type"] == "code":
      cell["outputs"], cell["execution_count"] = [], None
    cell.get("metadata", {}).pop("execution", None)
  nb.get("metadata", {}).pop("widgets", None)
  _write(path, nb)


def inject_parameters(nb, values: dict):
  """``nb`` (an nbformat notebook) with a cell tagged ``injected-parameters`` assigning
  ``values`` right after the ``parameters`` cell (papermill's convention)."""
  import nbformat

  tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
  assert len(tagged) == 1, f"expected one cell tagged 'parameters'; found {len(tagged)}"
  source = "# Parameters injected by notebooks/maintain.py\n" + "".join(
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


def execute(path: Path, values: dict, workdir: Path, timeout: int = 1800):
  """Runs the notebook at ``path`` with ``values`` injected in a fresh kernel of this
  interpreter (its own kernel spec), the repository root on ``PYTHONPATH``; any cell error
  raises. Returns the executed nbformat notebook and the seconds it took."""
  import nbclient
  import nbformat

  kernel = "hydragen-notebook"
  spec_dir = workdir / "jupyter" / "kernels" / kernel
  spec_dir.mkdir(parents=True, exist_ok=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": kernel, "language": "python"}))
  nb = inject_parameters(nbformat.read(path, as_version=4), values)
  env = dict(os.environ)
  env["JUPYTER_PATH"] = str(workdir / "jupyter")
  env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), *filter(None, [env.get("PYTHONPATH")])])
  saved = os.environ.get("JUPYTER_PATH")
  os.environ["JUPYTER_PATH"] = env["JUPYTER_PATH"]  # where nbclient looks up the kernel spec
  try:
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name=kernel,
                                     resources={"metadata": {"path": str(workdir)}})
    start = time.perf_counter()
    client.execute(env=env)
  finally:
    if saved is None:
      os.environ.pop("JUPYTER_PATH", None)
    else:
      os.environ["JUPYTER_PATH"] = saved
  return nb, time.perf_counter() - start


def store_executed(nb, values: dict, dest: Path) -> None:
  """Writes an executed notebook, its injected cell replaced by a note naming the values."""
  import nbformat

  # The note of an earlier run names that run's values: it goes (a run of the defaults has none).
  nb.cells = [c for c in nb.cells if c.get("id") != NOTE_ID]
  (i,) = [i for i, c in enumerate(nb.cells) if "injected-parameters" in c.metadata.get("tags", [])]
  if values:
    shown = ", ".join(f"`{k} = {v!r}`" for k, v in values.items())
    nb.cells[i] = nbformat.v4.new_markdown_cell(
        f"*The stored outputs below come from a run with {shown} in place of the defaults above "
        "(`notebooks/maintain.py execute`); run all cells for your own.*")
    nb.cells[i].id = NOTE_ID  # a fixed id: small diffs between runs
  else:
    del nb.cells[i]
  for cell in nb.cells:
    cell.get("metadata", {}).pop("execution", None)
  nb.get("metadata", {}).pop("widgets", None)
  _write(dest, json.loads(nbformat.writes(nb)))


def _value(text: str):
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def set_repo(new: str) -> None:
  if not re.fullmatch(r"[\w.-]+/[\w.-]+", new):
    raise SystemExit(f"set-repo: expected OWNER/NAME; got {new!r}")
  old = re.escape(REPO)
  for path in [*notebooks(), DOCS]:
    if path.exists():
      text = path.read_text()
      text = re.sub(rf'REPO = \\?"{old}\\?"', lambda m: m.group(0).replace(REPO, new), text)
      text = re.sub(rf"(github\.com/|github/){old}/", rf"\g<1>{new}/", text)
      text = re.sub(rf"(github\.com/|github/){old}(\.git|\))", rf"\g<1>{new}\g<2>", text)
      path.write_text(text)
  me = Path(__file__)
  me.write_text(me.read_text().replace(f'REPO = "{REPO}"', f'REPO = "{new}"', 1))


def main(argv: list[str]) -> int:
  if argv[:1] == ["execute"] and len(argv) >= 2:
    names, values, out = [], {}, None
    rest = iter(argv[1:])
    for arg in rest:
      if arg == "--set":
        key, _, text = next(rest).partition("=")
        values[key] = _value(text)
      elif arg == "--out":
        out = Path(next(rest))
      elif arg.startswith("-"):
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
      else:
        names.append(arg)
    for name in names:
      path = HERE / (name if name.endswith(".ipynb") else f"{name}.ipynb")
      with tempfile.TemporaryDirectory() as tmp:
        nb, seconds = execute(path, values, Path(tmp))
      dest = path if out is None else out / path.name
      dest.parent.mkdir(parents=True, exist_ok=True)
      store_executed(nb, values, dest)
      print(f"{path.name}: {seconds:.1f} s -> {dest}")
    return 0
  if argv[:1] == ["strip"] and len(argv) == 1:
    for path in notebooks():
      strip(path)
    return 0
  if argv[:1] == ["set-repo"] and len(argv) == 2:
    set_repo(argv[1])
    return 0
  print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
