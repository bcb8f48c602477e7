"""The persistent compilation cache of a run: XLA's compiled programs and the traced programs of
:mod:`models.generation.programs`, under one folder, with the run's hit counts."""

import os
from typing import Optional


def default_compile_cache() -> str:
  """``$XDG_CACHE_HOME/hydragen/xla`` (``~/.cache/hydragen/xla`` without it)."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "hydragen", "xla")


class CompileCache:
  """The persistent compilation cache of one run, and its hits (JAX's monitoring events).

  ``programs``: the :class:`models.generation.programs.ProgramStore` in ``<path>/programs`` (traced
  programs), or None without a cache.
  """

  def __init__(self, path: Optional[str]):
    import jax

    self.path, self.hits, self.requests, self.programs = None, 0, 0, None
    if path:
      try:
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        # Every program, however fast it compiles: the point is to skip compiling at all.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        self.path = path
      except (OSError, AttributeError):  # read-only home, or an option this jax lacks: compile
        pass
    if self.path:
      from models.generation.programs import store_or_none
      self.programs = store_or_none(os.path.join(self.path, "programs"))

  def __enter__(self):
    import jax
    jax.monitoring.register_event_listener(self._event)
    return self

  def __exit__(self, *exc):
    import jax
    jax.monitoring.unregister_event_listener(self._event)
    if self.programs is not None:  # no read ahead left to wait for at exit
      self.programs.close()

  def _event(self, name: str, **kwargs) -> None:
    if name == "/jax/compilation_cache/cache_hits":
      self.hits += 1
    elif name == "/jax/compilation_cache/compile_requests_use_cache":
      self.requests += 1

  def summary(self) -> str:
    """E.g. ``"traced: 2 programs loaded (1 read ahead), none traced; compiled: cache hit (5 programs)"``."""
    if self.path is None:
      return "no persistent cache"
    if self.requests == 0:
      xla = "nothing compiled"
    elif self.hits == self.requests:
      xla = f"cache hit ({self.hits} programs)"
    else:
      xla = f"{self.hits} of {self.requests} programs from the cache"
    if self.programs is None:
      return xla
    return f"traced: {self.programs.summary()}; compiled: {xla}"
