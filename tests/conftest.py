"""Shared test settings: hypothesis profiles and a count of generated cases."""

import os

from hypothesis import HealthCheck, settings

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
