"""The README and the result notes link to files that exist (a results table without its data is
a claim nobody can check)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
  """Targets of Markdown links that point into the repository (no scheme, no pure anchor)."""
  targets = []
  for target in LINK.findall(text):
    if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
      continue
    targets.append(target.split("#", 1)[0])
  return targets


def test_link_parser():
  text = ("[a](docs/x.md) [b](https://e.org/y) [c](#top) [d](../z.json#L3) "
          "[e](mailto:me@example.org)")
  assert relative_links(text) == ["docs/x.md", "../z.json"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
  missing = [t for t in relative_links(doc.read_text(encoding="utf-8"))
             if not (doc.parent / t).exists()]
  assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"
