"""The serving engine: continuous batching over a paged, prefix-cached KV cache.

Host side (pure Python + NumPy): ``pages`` (a page allocator with reference counts),
``radix`` (the prefix cache: a radix tree over token ids whose nodes own whole pages, LRU
eviction of unlocked leaves) and ``cascade`` (each decode step's plan: shared segments by
level, each sequence's own pages, padded to buckets). Device side: ``paged_cache`` (the
per-layer page pools and the attention over them), ``device`` (the prefill and decode
programs, the warm-up's shapes), ``sampling`` (per-row sampling rules as data). ``requests``
(the engine's values) and ``engine`` (the scheduler). See DESIGN.md, "Serving", and
docs/serving.md.
"""

from models.serving.cascade import CascadeConfig, CascadePlan, plan_cascade
from models.serving.engine import Engine
from models.serving.pages import NULL_PAGE, PagePool, PoolStats
from models.serving.paged_cache import PagedKVCache
from models.serving.radix import Match, Node, RadixTree, TreeStats
from models.serving.requests import (EngineConfig, Handle, Request, RequestOutput, SampleOutput,
                                     TokenLogprobs)
from models.serving.sampling import RowRules, sample_rows

__all__ = ["CascadeConfig", "CascadePlan", "plan_cascade", "NULL_PAGE", "PagePool", "PoolStats",
           "Match", "Node", "RadixTree", "TreeStats", "Engine", "EngineConfig", "Handle",
           "Request", "RequestOutput", "SampleOutput", "TokenLogprobs", "PagedKVCache", "RowRules",
           "sample_rows"]
