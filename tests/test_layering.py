"""The packages' import graph: ``models -> jax_shared_attn -> pallas_kernels``, one way.

Every import counts: statements inside functions and ``importlib.import_module("...")`` with a
literal name. The kernels import nothing of jax_shared_attn or models, jax_shared_attn nothing
of models, and no cycle exists; the kernel contract ``pallas_kernels.base`` imports no
implementation."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jax_shared_attn", "pallas_kernels", "models")
LAYERS = ("pallas_kernels", "jax_shared_attn", "models")  # bottom first: each imports only below


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
  base = ROOT.joinpath(*name.split("."))
  return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _edges(tree: ast.AST, name: str, packages=PACKAGES) -> set[str]:
  """The modules of ``packages`` that the parsed module ``name`` imports, anywhere in it."""
  edges = set()
  for node in ast.walk(tree):
    targets = []
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      targets = [f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}")
                 else node.module for a in node.names]
    elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
          and isinstance(node.args[0].value, str)
          and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module",
                                                                             "__import__")):
      targets = [node.args[0].value]
    edges |= {t for t in targets if t.split(".")[0] in packages and t != name}
  return edges


def import_graph(packages=PACKAGES) -> dict[str, set[str]]:
  """Module -> the modules of ``packages`` it imports (``from a import b`` is ``a.b`` where that
  is a module)."""
  graph = {}
  for package in packages:
    for path in sorted((ROOT / package).rglob("*.py")):
      name = _module_name(path)
      graph[name] = _edges(ast.parse(path.read_text(), str(path)), name, packages)
  return graph


def find_cycle(graph: dict[str, set[str]]):
  """A cycle of ``graph`` as a list of modules (first == last), or None."""
  state = {}

  def visit(node, stack):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt, stack)
        if found:
          return found
    stack.pop()
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node, [])
      if found:
        return found
  return None


def test_no_import_cycle():
  cycle = find_cycle(import_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_planted_cycle():
  graph = import_graph()
  graph["pallas_kernels.base"] = graph["pallas_kernels.base"] | {"jax_shared_attn.ops"}
  assert find_cycle(graph) is not None


def test_layers_import_one_way():
  """No module imports a layer above its own (no whitelist)."""
  graph = import_graph()
  for module, edges in graph.items():
    level = LAYERS.index(module.split(".")[0])
    above = {e for e in edges if LAYERS.index(e.split(".")[0]) > level}
    assert not above, (module, sorted(above))


def test_import_graph_sees_function_and_importlib_imports():
  source = ("import importlib\n"
            "def f():\n  from jax_shared_attn import api\n"
            "  return importlib.import_module('models.llama')\n")
  edges = _edges(ast.parse(source), "pallas_kernels.planted")
  assert {"jax_shared_attn.api", "models.llama"} <= edges


def test_kernel_contract_imports_no_implementation():
  assert not {e for e in import_graph()["pallas_kernels.base"]}


def test_importing_the_kernels_loads_nothing_of_the_core():
  code = ("import sys, pallas_kernels, pallas_kernels.gpu, pallas_kernels.tpu, "
          "pallas_kernels.config, pallas_kernels.gpu.dispatch, pallas_kernels.tpu.dispatch, "
          "pallas_kernels.tpu.perf_model; "
          "print(' '.join(m for m in sys.modules if m.startswith(('jax_shared_attn', 'models'))))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       check=True, env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
                                        "PATH": ""}).stdout.split()
  assert out == []


def test_gpu_and_tpu_families_name_their_files_alike():
  """The two kernel families share one file layout, so a reader who knows one finds the other:
  the same name means the same role (kernels per part, the entry points, the dispatch, the
  config, the backward); what only one backend has carries a suffix or its own name."""
  shared_roles = {"__init__", "backward", "common", "config", "dispatch", "prefix", "segment",
                  "shared", "suffix"}
  for family in ("gpu", "tpu"):
    names = {p.stem for p in (ROOT / "pallas_kernels" / family).glob("*.py")}
    assert shared_roles <= names, (family, sorted(shared_roles - names))
    assert not any(n.startswith("_") and n != "__init__" for n in names), (family, sorted(names))
