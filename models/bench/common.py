"""What every benchmark shares: the out-of-memory test, the device and date stamp of a report,
its JSON/Markdown/PNG files, comma-separated integer flags. Timing is :mod:`models.bench.timing`."""

from __future__ import annotations

import argparse
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
