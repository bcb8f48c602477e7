"""``python -m jax_shared_attn.bench``: runs ``python -m models.bench`` with the same arguments
(moved; this alias goes in the next release)."""

import os
import sys

os.execv(sys.executable, [sys.executable, "-m", "models.bench", *sys.argv[1:]])
