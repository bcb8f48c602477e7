"""Moved to :mod:`models.bench` (``python -m models.bench``); this alias goes in the next release.

Importing ``models`` installs the aliases of the old submodules (``jax_shared_attn.bench.timing``
is :mod:`models.bench.timing`); nothing else in ``jax_shared_attn`` imports ``models``.
"""

import importlib
import warnings

warnings.warn("jax_shared_attn.bench moved to models.bench; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)
importlib.import_module("models")


def __getattr__(name):
  if name in ("attention", "backward", "profile", "timing"):
    return importlib.import_module(f"jax_shared_attn.bench.{name}")
  raise AttributeError(f"module 'jax_shared_attn.bench' has no attribute {name!r}")
