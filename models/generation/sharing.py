"""Automatic sharing detection: ``detect_sharing`` and its radix tree.

They live in :mod:`models.generation.prompt_tree` (the tree and its builder in one module, so that neither
imports the other; the module docstring there describes the algorithm); this module keeps their
import path.
"""

from models.generation.prompt_tree import (DEFAULT_MIN_SHARED_TOKENS, RadixNode, RadixTree, cut,  # noqa: F401
                                detect_sharing)
