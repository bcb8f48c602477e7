"""Moved to :mod:`models.bench` (``python -m models.bench``); this alias goes in the next release.

The attention API never imports the model package, so this alias does not either: once
``models`` is imported, ``jax_shared_attn.bench.attention`` and its siblings are the modules of
:mod:`models.bench` (``models/_deprecated.py``), and ``python -m jax_shared_attn.bench`` runs
``python -m models.bench`` in its place.
"""

import warnings

warnings.warn("jax_shared_attn.bench moved to models.bench; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)
