"""No import cycle among the modules of ``models``, ``jax_shared_attn`` and ``pallas_kernels``
(every subpackage, recursively), counting imports inside functions and string imports
(``importlib.import_module("...")``); and the library never imports the benchmarks or the CLI."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("models", "jax_shared_attn", "pallas_kernels")


def module_name(path: Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
  base = ROOT.joinpath(*name.split("."))
  return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def imports_of(path: Path, name: str = "") -> set[str]:
  """The modules of :data:`PACKAGES` a file imports anywhere: ``import a.b``, ``from a import b``
  (the module ``a.b`` where that is one, else ``a``), ``from . import b`` and
  ``importlib.import_module("a.b")`` with a literal name. ``name``: the module's (default: from
  its path)."""
  name = name or module_name(path)
  package = name if path.stem == "__init__" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
      found.update(f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base
                   for a in node.names)
    elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
          and isinstance(node.args[0].value, str)
          and ast.unparse(node.func) in ("importlib.import_module", "import_module")):
      found.add(node.args[0].value)
  return {m for m in found if m.split(".")[0] in PACKAGES and is_module(m)}


def graph() -> dict[str, set[str]]:
  edges = {}
  for package in PACKAGES:
    for path in sorted((ROOT / package).rglob("*.py")):
      name = module_name(path)
      edges[name] = imports_of(path) - {name}
  return edges


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
  edges = graph()
  edges["models.model.config"] = edges["models.model.config"] | {"models.generation.loop"}
  assert find_cycle(edges) is not None


def test_imports_inside_functions_and_string_imports_count(tmp_path):
  edges = graph()
  # inside a function: the decoder places its cache writes through the parallel package
  assert any(e.startswith("models.parallel") for e in edges["models.model.llama"])
  assert "models.bench.attention" in edges["models.bench.__main__"]
  src = tmp_path / "m.py"
  src.write_text("def f():\n  import importlib\n  importlib.import_module('models.cli')\n")
  assert imports_of(src, "models.m") == {"models.cli"}


def test_every_subpackage_is_covered():
  edges = graph()
  for sub in ("model", "checkpoints", "generation", "parallel", "training", "cli", "bench"):
    assert f"models.{sub}" in edges and any(m.startswith(f"models.{sub}.") for m in edges), sub


def test_no_import_cycle():
  edges = graph()
  assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


def test_the_library_imports_neither_benchmarks_nor_cli():
  """Only the CLI's command table imports ``models.bench``; the benchmarks never import the
  CLI; the kernels and the attention API never import ``models``."""
  for module, targets in graph().items():
    if module.startswith("models.bench"):
      assert not any(t.startswith("models.cli") for t in targets), module
    elif not module.startswith("models.cli"):
      assert not any(t.startswith(("models.bench", "models.cli")) for t in targets), module
    if module.startswith(("jax_shared_attn", "pallas_kernels")):
      assert not any(t.split(".")[0] == "models" for t in targets), module
