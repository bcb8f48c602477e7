"""The packages' import graph: no cycle among jax_shared_attn and pallas_kernels (every import
statement counts, including those inside functions), and the kernels never import the core's
API or dispatch (they implement the leaf interface ``pallas_kernels.interface``)."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jax_shared_attn", "pallas_kernels")
# The core's modules the kernels may use: the contract (reference, merge) and plain data.
KERNEL_MAY_IMPORT = {"jax_shared_attn.reference", "jax_shared_attn.merge", "jax_shared_attn._checks",
                     "jax_shared_attn.iomodel"}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
  base = ROOT.joinpath(*name.split("."))
  return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def import_graph(packages=PACKAGES) -> dict[str, set[str]]:
  """Module -> the modules of ``packages`` it imports (``from a import b`` is ``a.b`` where that
  is a module)."""
  graph = {}
  for package in packages:
    for path in sorted((ROOT / package).rglob("*.py")):
      name, edges = _module_name(path), set()
      for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
          targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
          targets = [f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}")
                     else node.module for a in node.names]
        edges |= {t for t in targets if t.split(".")[0] in packages and t != name}
      graph[name] = edges
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
  graph["pallas_kernels.interface"] = graph["pallas_kernels.interface"] | {"jax_shared_attn.ops"}
  assert find_cycle(graph) is not None


def test_kernels_import_only_the_core_contract():
  graph = import_graph()
  for module, edges in graph.items():
    if module.startswith("pallas_kernels"):
      core = {e for e in edges if e.startswith("jax_shared_attn")}
      assert core <= KERNEL_MAY_IMPORT, (module, core - KERNEL_MAY_IMPORT)
      assert not any(e.startswith("models") for e in edges), module


def test_importing_the_kernels_loads_no_core_dispatch():
  code = ("import sys, pallas_kernels.gpu, pallas_kernels.tpu, pallas_kernels.config; "
          "print(' '.join(m for m in sys.modules if m.startswith('jax_shared_attn')))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       check=True, env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
                                        "PATH": ""}).stdout.split()
  assert not {"jax_shared_attn.api", "jax_shared_attn.ops", "jax_shared_attn.dispatch"} & set(out)


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
