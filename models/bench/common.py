"""What every benchmark shares: the out-of-memory test, the device and date stamp of a report,
its JSON/Markdown/PNG files, comma-separated integer flags, counting compiles. Timing is
:mod:`models.bench.timing`."""

from __future__ import annotations

import argparse
import contextlib
import json
import time


def is_oom(e: BaseException) -> bool:
  """Whether ``e`` is the device running out of memory (XLA's RESOURCE_EXHAUSTED and its kin)."""
  text = str(e)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "OOM" in text


def stamp(**extra) -> dict:
  """The ``info`` of a report: device kind, backend, device count, jax version, UTC date;
  then ``extra``."""
  import jax

  return dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(),
              count=jax.device_count(), jax=jax.__version__,
              date=time.strftime("%Y-%m-%d", time.gmtime()), **extra)


def write_json(path: str, info: dict, rows: list, **more) -> None:
  """``{"info": info, "rows": rows, **more}`` to ``path`` (rewritten after every row)."""
  with open(path, "w") as f:
    json.dump(dict(info=info, rows=rows, **more), f, indent=1)


def write_text(path: str, text: str) -> None:
  """A Markdown table (or any text) to ``path``."""
  with open(path, "w") as f:
    f.write(text)


def save_png(fig, path: str) -> None:
  """A matplotlib figure to ``path`` (120 dpi), then closed."""
  import matplotlib.pyplot as plt

  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def ints(text: str) -> list[int]:
  """An argparse type: ``"8,64"`` -> ``[8, 64]``."""
  try:
    return [int(x) for x in text.split(",") if x]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated ints; got {text!r}") from None


COMPILE = "/jax/core/compile/backend_compile_duration"  # one XLA compile
TRACE = "/jax/core/compile/jaxpr_trace_duration"  # one trace to a jaxpr


@contextlib.contextmanager
def counting_compiles(kinds=(COMPILE,)):
  """A list of the JAX events of ``kinds`` (:data:`COMPILE`, :data:`TRACE`) inside it."""
  import jax

  events = []
  listener = lambda event, duration, **kw: events.append(event) if event in kinds else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
