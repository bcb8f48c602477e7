"""Shared test settings: hypothesis profiles, the attention path the oracle tests run
(``--impl``), and a count of generated cases."""

import os

import pytest
from hypothesis import HealthCheck, settings

from jax_shared_attn.ops import IMPLS
from strategies import CASES

# Interpret-mode kernels and CPU compiles are slow per example; no deadline.
settings.register_profile(
    "ci", deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", parent=settings.get_profile("ci"), max_examples=10)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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


def pytest_addoption(parser):
  parser.addoption(
      "--impl", default=os.environ.get("HYDRAGEN_TEST_IMPL", "xla"), choices=IMPLS,
      help="attention implementation the oracle tests (marker 'device') run: xla (default), or "
      "auto on a GPU or TPU for its kernels natively (docs/gpu-tests.md); env HYDRAGEN_TEST_IMPL")


@pytest.fixture(scope="session")
def impl(request):
  """The ``--impl`` the oracle tests pass to the attention API."""
  return request.config.getoption("--impl")


def pytest_collection_modifyitems(config, items):
  """Marks 'device' the tests that run the configured attention path: those taking the ``impl``
  fixture, and the model tests (they use impl="auto", the kernels on a GPU or TPU)."""
  for item in items:
    if "impl" in getattr(item, "fixturenames", ()) or item.path.name.startswith("test_models_"):
      item.add_marker(pytest.mark.device)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  """A saved tiny model (context 1024) with a byte-level tokenizer (one token per byte), for the
  command-line tests."""
  from models.config import preset
  from models.llama import random_init
  from models.loading import save_pretrained
  from models.tokenizer import Tokenizer, _bytes_to_unicode

  path = str(tmp_path_factory.mktemp("tiny"))
  spelling = _bytes_to_unicode()
  tokenizer = Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "gpt2",
                                          "tokenizer.ggml.tokens": [spelling[b] for b in range(256)]})
  save_pretrained(path, random_init(preset("tiny"), seed=7, std=0.1), tokenizer)
  return path
