"""Upkeep of the notebooks: the GitHub repository they name, and stripping outputs.

    python notebooks/maintain.py strip                   # drop outputs and execution counts
    python notebooks/maintain.py set-repo OWNER/NAME     # point install cells and badges elsewhere

``REPO`` below is the one place that names the GitHub repository. The notebooks' install cells
(``REPO = "..."``, used in ``pip install git+https://github.com/{REPO}.git``), their "Open in
Colab" badges and docs/notebooks.md hold copies of it; ``set-repo`` rewrites them all, and
tests/test_notebooks.py fails when any of them disagrees with ``REPO``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = "hydragen-jax/hydragen-jax"  # placeholder owner until the project has its GitHub home

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
