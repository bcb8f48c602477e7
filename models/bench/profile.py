"""Device time from the profiler: what the GPU did, not what the host waited for.

A wall clock around a jitted program measures the host as well as the
device: when the kernels are short, the GPU waits between them for the host
to launch the next one, and a microbenchmark of a few-microsecond op reads
tens of microseconds. Inside a model's decode step those launches overlap
the long matrix products, so the device's own time is the figure that
carries over. :func:`device_events` runs a function under
:func:`jax.profiler.trace` and returns the kernels (and copies) the GPU ran,
from the trace's device plane; :func:`busy_ns` is the time the device was
busy (the union of their intervals, so concurrent streams are not counted
twice).

Returns ``None`` where the trace has no device plane (a CPU backend): callers
fall back to the wall clock there.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import tempfile
from typing import Callable, Iterable

import jax

# Lines of a GPU plane that hold the device's activity ("Stream #13(...)"); the plane's other
# lines ("XLA Modules", "XLA Ops", "Launch Stats", ...) annotate the same time again.
_STREAM_LINE = re.compile(r"^Stream #\d+")
_DEVICE_PLANE = re.compile(r"^/device:(GPU|TPU):\d+")


@dataclasses.dataclass(frozen=True)
class Event:
  name: str
  start_ns: float
  duration_ns: float
  stream: str = ""  # the profiler's line, e.g. "Stream #14(Compute)"

  @property
  def end_ns(self) -> float:
    return self.start_ns + self.duration_ns


def events_from_xspace(planes) -> list[Event] | None:
  """Device activity of a ``jax.profiler.ProfileData``'s planes (None: no device plane)."""
  found = False
  events = []
  for plane in planes:
    if not _DEVICE_PLANE.match(plane.name):
      continue
    found = True
    stream_lines = [line for line in plane.lines if _STREAM_LINE.match(line.name)]
    for line in stream_lines:
      for ev in line.events:
        events.append(Event(ev.name, float(ev.start_ns), float(ev.duration_ns), line.name))
  return sorted(events, key=lambda e: e.start_ns) if found else None


def device_events(fn: Callable[[], object]) -> list[Event] | None:
  """Runs ``fn()`` (which should block until its result is ready) under the profiler."""
  from jax.profiler import ProfileData

  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      fn()
    paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not paths:
      return None
    return events_from_xspace(ProfileData.from_file(paths[0]).planes)


def busy_ns(events: Iterable[Event]) -> float:
  """Time covered by at least one event (the union of the intervals)."""
  total, end = 0.0, float("-inf")
  for ev in sorted(events, key=lambda e: e.start_ns):
    start = max(ev.start_ns, end)
    if ev.end_ns > start:
      total += ev.end_ns - start
    end = max(end, ev.end_ns)
  return total


def span_ns(events: list[Event]) -> float:
  """First start to last end (busy time plus the gaps between kernels)."""
  return max(e.end_ns for e in events) - min(e.start_ns for e in events) if events else 0.0


CATEGORIES = (
    # Our kernels (Pallas names them after the kernel function / the name= we give).
    ("attention", re.compile(r"hydragen|attention|mosaic|flash|fmha|sdpa|cudnn", re.I)),
    ("matmul", re.compile(r"gemm|cublas|nvjet|cutlass|xmma|gemv|dot|matmul", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


def category(name: str) -> str:
  for label, pattern in CATEGORIES:
    if pattern.search(name):
      return label
  return "other"


def breakdown(events: list[Event], per: float = 1.0, top: int = 12) -> dict:
  """Device time by category and the ``top`` kernels, in microseconds divided by ``per``."""
  by_cat = collections.defaultdict(float)
  by_name = collections.defaultdict(lambda: [0.0, 0])
  for ev in events:
    by_cat[category(ev.name)] += ev.duration_ns
    entry = by_name[ev.name]
    entry[0] += ev.duration_ns
    entry[1] += 1
  kernels = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
  return {
      "busy_us": busy_ns(events) / 1e3 / per,
      "span_us": span_ns(events) / 1e3 / per,
      "by_category_us": {k: v / 1e3 / per for k, v in sorted(by_cat.items())},
      "kernels": [{"name": n[:120], "us": t / 1e3 / per, "count": c / per}
                  for n, (t, c) in kernels],
  }
