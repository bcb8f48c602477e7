"""The scheduler's per-request state (host side): a request, its samples, its prompt's pages.

A request moves waiting -> prefill (its prompt pages allocated, the cached ones locked) ->
running (one :class:`Seq` per sample, each holding the prompt through its tree node and its
own pages) -> done. Preemption resets it to waiting.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from models.serving.requests import Handle, SampleOutput


class PromptPages:
  """A request's prompt pages outside the tree (``prefix_caching=False``): a path node."""

  def __init__(self, node_id: int, pages: np.ndarray):
    self.id, self.pages = node_id, pages


class Seq:
  """One sample of a running request."""

  def __init__(self, req: "Req", index: int, own_pages: list[int], own_len: int):
    self.req, self.index = req, index
    self.own_pages, self.own_len = own_pages, own_len
    self.generated: list[int] = []
    self.next_token = int(req.prompt[-1])
    self.finish_reason: Optional[str] = None
    self.text: Optional[str] = None


class Req:
  """A request's scheduling state: waiting -> prefill -> running -> done."""

  def __init__(self, handle: Handle, prompt: np.ndarray):
    self.handle, self.request, self.prompt = handle, handle.request, prompt
    self.context = prompt[:-1]  # prefilled; the last token is fed by the first decode step
    self._page_keys: tuple[int, list[int]] | None = None  # (page size, keys)
    self.reset()

  def page_keys(self, page_size: int) -> list[int]:
    """``keys[k]`` stands for the context's first ``k + 1`` whole pages (equal keys: equal
    pages, up to a hash collision), computed once per page size: a chain of hashes, page by
    page."""
    if self._page_keys is None or self._page_keys[0] != page_size:
      keys, key = [], 0
      for k in range(self.context.size // page_size):
        key = hash((key, self.context[k * page_size:(k + 1) * page_size].tobytes()))
        keys.append(key)
      self._page_keys = page_size, keys
    return self._page_keys[1]

  def reset(self) -> None:
    self.state = "waiting"
    self.admitted = -1
    self.match_node = None  # the tree node locked while prefilling
    self.node = None  # the tree node (or PromptPages) every sample's path ends at
    self.pages = np.zeros(0, np.int32)  # prompt pages: cached, then new (tail page last)
    self.copies = np.zeros(0, np.int32)  # the tail page's copies for samples 1..n-1
    self.prefilled = 0
    self.cached_tokens = 0
    self.seqs: list[Seq] = []
    self.finished: dict[int, SampleOutput] = {}


class PrefillIndex:
  """Requests being prefilled, found by the key of their first ``m + 1`` whole pages
  (:meth:`Req.page_keys`): one dict per page count ``m`` asked for, built on first use and kept
  up to date as requests join, so each lookup is a dict lookup, not a scan of every request."""

  def __init__(self, reqs, page_size: int):
    self.page_size = page_size
    self._reqs: list[Req] = list(reqs)
    self._by_key: dict[int, dict[int, list[Req]]] = {}  # m -> key of pages 0..m -> requests

  def add(self, req: Req) -> None:
    self._reqs.append(req)
    for m, table in self._by_key.items():
      self._put(table, req, m)

  def sharing(self, m: int, key: int) -> list[Req]:
    """The requests whose first ``m + 1`` whole pages have key ``key``."""
    table = self._by_key.get(m)
    if table is None:
      table = self._by_key[m] = {}
      for req in self._reqs:
        self._put(table, req, m)
    return table.get(key, [])

  def _put(self, table: dict[int, list[Req]], req: Req, m: int) -> None:
    keys = req.page_keys(self.page_size)
    if len(keys) > m:
      table.setdefault(keys[m], []).append(req)
