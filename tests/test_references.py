"""Every file path cited in the docs and in package code names a file that exists, and package
code carries no dated lines (measurement history belongs to the docs and to git)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jax_shared_attn", "pallas_kernels", "models")
TOP = PACKAGES + ("tests", "tools", "docs", "notebooks")
# A path into the repository: a top-level folder, then path characters, ending in a name.
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*[\w/])" % "|".join(TOP))
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
CODE = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def cited_paths(text: str) -> list[str]:
  """Repository paths in ``text`` (globs and placeholders such as ``runs/...`` excluded)."""
  return [m for m in PATH.findall(text) if "*" not in m and "..." not in m]


def test_the_path_finder():
  text = ("see `models/generation/generate.py`, docs/results/x/ and tests/kernels/; "
          "not foo/models/x.py, not `runs/decode`, not models.generation")
  assert cited_paths(text) == ["models/generation/generate.py", "docs/results/x/",
                               "tests/kernels/"]


@pytest.mark.parametrize("path", CODE + DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_paths_exist(path):
  missing = sorted({c for c in cited_paths(path.read_text(encoding="utf-8"))
                    if not (ROOT / c.rstrip("/")).exists()})
  assert not missing, f"{path.relative_to(ROOT)} cites missing paths: {missing}"


def test_no_dated_line_in_package_code():
  dated = [f"{p.relative_to(ROOT)}:{i}" for p in CODE
           for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
           if DATE.search(line)]
  assert not dated, f"dated lines in package code: {dated}"
