"""Host-side structures of the serving engine (pure Python + NumPy, no JAX).

``pages`` (a page allocator with reference counts), ``radix`` (the prefix cache: a radix tree
over token ids whose nodes own whole pages, LRU eviction of unlocked leaves) and ``cascade``
(each decode step's plan: shared segments by level, each sequence's own pages, padded to
buckets). See DESIGN.md, "Serving".
"""

from models.serving.cascade import CascadeConfig, CascadePlan, plan_cascade
from models.serving.pages import NULL_PAGE, PagePool, PoolStats
from models.serving.radix import Match, Node, RadixTree, TreeStats

__all__ = ["CascadeConfig", "CascadePlan", "plan_cascade", "NULL_PAGE", "PagePool", "PoolStats",
           "Match", "Node", "RadixTree", "TreeStats"]
