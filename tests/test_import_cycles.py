"""No import cycles among the ``models`` modules, counting imports inside functions too."""

import ast
from pathlib import Path

MODELS = Path(__file__).resolve().parent.parent / "models"


def imports_of(path: Path) -> set[str]:
  """The ``models.*`` modules a file imports anywhere (module level or inside functions)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      found.add(node.module)
      # `from models import sharding` imports the module models.sharding
      found.update(f"{node.module}.{a.name}" for a in node.names)
  return {m for m in found if m.startswith("models.") and (MODELS / f"{m[7:]}.py").exists()}


def graph() -> dict[str, set[str]]:
  return {f"models.{p.stem}": imports_of(p) - {f"models.{p.stem}"}
          for p in MODELS.glob("*.py") if p.stem != "__init__"}


def find_cycle(edges: dict[str, set[str]]):
  """One cycle as a list of modules, or None (depth-first search with colours)."""
  state, stack = {}, []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for n in sorted(edges.get(m, ())):
      if state.get(n) == "open":
        return stack[stack.index(n):] + [n]
      if n not in state and (cycle := visit(n)):
        return cycle
    stack.pop()
    state[m] = "done"
    return None

  for m in sorted(edges):
    if m not in state and (cycle := visit(m)):
      return cycle
  return None


def test_the_cycle_finder_finds_a_planted_cycle():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_in_models():
  edges = graph()
  assert "models.sharding" in edges and "models.cache" in edges["models.sharding"]
  assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))
