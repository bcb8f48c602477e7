"""``python -m jax_shared_attn.bench``: moved to ``python -m models.bench`` (next release: gone)."""

import importlib
import sys

sys.exit(importlib.import_module("models.bench.__main__").main())
