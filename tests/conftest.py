"""Shared test settings: hypothesis profiles, the attention path the oracle tests run
(``--impl``), and a count of generated cases."""

import importlib.util
import os
import shutil
import tempfile

# CPU-only runs (CI): LLVM -O1 and no expensive LLVM passes. The programs the tests compile are
# tiny (interpreted Pallas kernels, tiny models) and compiling dominates: ~30% less time for
# compile-bound tests. -O0 saved as much there but made the SmolLM2 tests (runtime-bound) 2-3x
# slower; -O1 keeps their time. XLA's HLO passes and float semantics (no fast math) are the
# same; only the machine code is less optimized. XLA reads the flags once, when the backend starts, so they are
# set here, before anything imports JAX; subprocesses (CLI, notebooks, the 8-device suites)
# inherit them. A process that may see a GPU or TPU keeps XLA's defaults;
# HYDRAGEN_TEST_FAST_COMPILE=0 keeps them on a CPU too.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=1",
                      "--xla_llvm_disable_expensive_passes=true")
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                        "jax_rocm7_plugin", "libtpu")


def _cpu_only() -> bool:
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms.split(",") == ["cpu"]
  return not any(importlib.util.find_spec(m) for m in _ACCELERATOR_PLUGINS)


if os.environ.get("HYDRAGEN_TEST_FAST_COMPILE", "1") != "0" and _cpu_only():
  _flags = os.environ.get("XLA_FLAGS", "").split()
  _names = {f.split("=")[0] for f in _flags}
  os.environ["XLA_FLAGS"] = " ".join(
      _flags + [f for f in FAST_COMPILE_FLAGS if f.split("=")[0] not in _names])

# One persistent compilation cache for the whole run (opt-in: HYDRAGEN_TEST_COMPILE_CACHE=1),
# shared by its processes: the pytest-xdist workers (started after this module ran in the
# controller, they inherit the variable) and the tests' subprocesses (the CLI, notebooks, the
# 8-device suites), which compile many of the same programs. Programs that compile in under
# 0.3 s are not stored. Off by default: in two full runs with it, jax 0.10.2's cache write
# (`compilation_cache.put_executable_and_time`) crashed an xdist worker with a segmentation
# fault while storing the GRPO training step (not reproduced with the training tests alone;
# docs/testing.md). A cache the caller set (JAX_COMPILATION_CACHE_DIR) is used as it is.
_RUN_CACHE = None
if (os.environ.get("HYDRAGEN_TEST_COMPILE_CACHE", "0") == "1" and _cpu_only()
    and "JAX_COMPILATION_CACHE_DIR" not in os.environ):
  _RUN_CACHE = tempfile.mkdtemp(prefix="hydragen-test-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _RUN_CACHE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")

# Where each pytest-xdist worker writes its fatal-error dump (a segfault's Python stacks): the
# controller makes the folder before it starts the workers (they inherit the variable) and
# prints the crashed thread's stack in its summary, at the end of the output, where a CI log's
# tail shows it.
_MADE_CRASH_DIR = ("PYTEST_XDIST_WORKER" not in os.environ
                   and "HYDRAGEN_TEST_CRASH_DIR" not in os.environ)
if _MADE_CRASH_DIR:
  os.environ["HYDRAGEN_TEST_CRASH_DIR"] = tempfile.mkdtemp(prefix="hydragen-test-crash-")
_CRASH_DIR = os.environ["HYDRAGEN_TEST_CRASH_DIR"]
_crash_file = None

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from jax_shared_attn.ops import IMPLS  # noqa: E402
from strategies import CASES  # noqa: E402

# Interpret-mode kernels and CPU compiles are slow per example; no deadline.
settings.register_profile(
    "ci", deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", parent=settings.get_profile("ci"), max_examples=10)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.hookimpl(trylast=True)  # after pytest's faulthandler plugin pointed it at stderr
def pytest_configure(config):
  global _crash_file
  worker = os.environ.get("PYTEST_XDIST_WORKER")
  if worker and os.path.isdir(_CRASH_DIR):
    import faulthandler
    _crash_file = open(os.path.join(_CRASH_DIR, f"{worker}-{os.getpid()}.txt"), "w")
    faulthandler.enable(file=_crash_file, all_threads=True)


def _crash_reports() -> list[tuple[str, list[str]]]:
  """(file name, the crashed thread's lines) of every worker that wrote a fatal-error dump."""
  out = []
  for name in sorted(os.listdir(_CRASH_DIR)) if os.path.isdir(_CRASH_DIR) else ():
    with open(os.path.join(_CRASH_DIR, name), errors="replace") as f:
      lines = f.read().splitlines()
    if not lines:
      continue
    start = next((i for i, l in enumerate(lines) if l.startswith("Current thread")), 0)
    end = next((i for i in range(start + 1, len(lines))
                if not lines[i].startswith("  ")), len(lines))
    frames = [l for l in lines[start + 1:end]  # the test's frames, not pytest's machinery
              if not any(f"/{m}/" in l for m in ("_pytest", "pluggy", "xdist", "execnet"))]
    out.append((name, lines[:1] + frames[:20]))
  return out


def pytest_unconfigure(config):
  if _crash_file is not None:  # a worker's dump: the session is over, nothing more to catch
    import faulthandler
    faulthandler.disable()
    _crash_file.close()
  if _MADE_CRASH_DIR:
    shutil.rmtree(_CRASH_DIR, ignore_errors=True)
  if _RUN_CACHE is not None:  # the process that made it (the controller, or a run without -n)
    shutil.rmtree(_RUN_CACHE, ignore_errors=True)


def pytest_sessionfinish(session):
  workeroutput = getattr(session.config, "workeroutput", None)
  if workeroutput is not None:  # a pytest-xdist worker: hand the counts to the controller
    workeroutput["property_cases"] = dict(CASES)


def pytest_testnodedown(node, error):
  for name, n in getattr(node, "workeroutput", {}).get("property_cases", {}).items():
    CASES[name] += n


def pytest_terminal_summary(terminalreporter):
  if CASES:
    total = sum(CASES.values())
    terminalreporter.write_sep("-", f"property-test cases generated: {total}")
    for name, n in sorted(CASES.items()):
      terminalreporter.write_line(f"  {name}: {n}")
  for name, lines in _crash_reports():  # last: a CI log's tail shows it
    terminalreporter.write_sep("!", f"fatal error in worker {name[:-4]}: the crashed thread "
                               "(most recent call first)")
    for line in lines:
      terminalreporter.write_line(line)


def pytest_addoption(parser):
  parser.addoption(
      "--impl", default=os.environ.get("HYDRAGEN_TEST_IMPL", "xla"), choices=IMPLS,
      help="attention implementation the oracle tests (marker 'device') run: xla (default), or "
      "auto on a GPU or TPU for its kernels natively (docs/gpu-tests.md); env HYDRAGEN_TEST_IMPL")


@pytest.fixture(scope="session")
def impl(request):
  """The ``--impl`` the oracle tests pass to the attention API."""
  return request.config.getoption("--impl")


_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                  "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture(autouse=True)
def _run_compile_cache_options():
  """Gives every test the run's persistent-cache settings: a test that opens a
  :class:`models.generation.compile_cache.CompileCache` in this process (the CLI, the start-up
  benchmark) points the cache at its own, soon deleted, folder and stores every program (no
  minimum compile time), which later tests in the worker must not inherit."""
  import jax
  saved = {k: jax.config.values[k] for k in _CACHE_OPTIONS}
  yield
  if any(jax.config.values[k] != v for k, v in saved.items()):
    from jax._src import compilation_cache
    for k, v in saved.items():
      jax.config.update(k, v)
    compilation_cache.reset_cache()


# The folders of the model-side tests (tests/<subpackage of models>/).
MODEL_TEST_DIRS = ("model", "checkpoints", "generation", "training")


def pytest_collection_modifyitems(config, items):
  """Marks 'device' the tests that run the configured attention path: those taking the ``impl``
  fixture, and the model tests (they use impl="auto", the kernels on a GPU or TPU). Runs the
  tests marked 'slow' (minutes each: subprocesses, notebooks) first, in their order, so that
  pytest-xdist's workers do not end on one of them while the other worker idles."""
  for item in items:
    if "impl" in getattr(item, "fixturenames", ()) or item.path.parent.name in MODEL_TEST_DIRS:
      item.add_marker(pytest.mark.device)
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  """A saved tiny model (context 1024) with a byte-level tokenizer (one token per byte), for the
  command-line tests."""
  from models.checkpoints.loading import save_pretrained
  from models.checkpoints.tokenizer import Tokenizer, _bytes_to_unicode
  from models.model.config import preset
  from models.model.llama import random_init

  path = str(tmp_path_factory.mktemp("tiny"))
  spelling = _bytes_to_unicode()
  tokenizer = Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "gpt2",
                                          "tokenizer.ggml.tokens": [spelling[b] for b in range(256)]})
  save_pretrained(path, random_init(preset("tiny"), seed=7, std=0.1), tokenizer)
  return path



def _memory_maps() -> tuple[int, int]:
  """(memory maps of this process, the kernel's limit ``vm.max_map_count``); (0, 0) where
  /proc does not tell."""
  try:
    with open("/proc/self/maps", "rb") as f:
      used = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
      return used, int(f.read())
  except (OSError, ValueError):
    return 0, 0


@pytest.fixture(autouse=True, scope="module")
def _release_programs_near_the_map_limit():
  """Every compiled CPU program holds ~6 memory maps; a worker that keeps all the programs of
  the run reaches the kernel's limit (vm.max_map_count, 65,530 by default), and then XLA's
  compiler segfaults where it maps new code. After a module, past half the limit, the
  compiled programs are released (later modules compile what they need again)."""
  yield
  used, limit = _memory_maps()
  if limit and used > limit // 2:
    import gc

    import jax
    jax.clear_caches()
    gc.collect()
