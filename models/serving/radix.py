"""A radix tree over token ids whose nodes own whole KV-cache pages (the prefix cache).

Every edge is a run of whole pages: a node holds ``tokens`` (int32[k * page_size]) and the
``pages`` (int32[k]) their keys and values live in, so a cached prefix is always page-aligned
(vLLM and SGLang cache full blocks only; ChunkAttention's chunks). A prompt tail shorter than a
page is never cached: it lives in the sequence's own first page.

Ownership: the tree holds one :class:`~models.serving.pages.PagePool` reference per page it
owns. :meth:`RadixTree.insert` takes over the caller's reference of each page it is given.
A running sequence holds no references on cached pages: it locks its node
(:meth:`RadixTree.lock` counts along the path to the root), and locked nodes are never evicted.

A request's flow (page_size 16)::

    m = tree.match(prompt)                  # the cached prefix: m.pages, m.num_tokens
    tree.lock(m.node)                       # not evicted while we allocate
    new = pool.alloc(len(prompt) // 16 - m.pages.size)   # None: tree.evict(...), or wait
    ...prefill prompt[m.num_tokens:] into new and the tail into an own page...
    r = tree.insert(prompt[:len(prompt) // 16 * 16], np.concatenate([m.pages, new]))
    tree.lock(r.node); tree.unlock(m.node)  # decode reads r.pages; unlock r.node when done
"""

import dataclasses
import heapq
import itertools
from typing import Iterator

import numpy as np

from models.serving.pages import PagePool


class Node:
  """A run of whole pages: ``tokens`` int32[len(pages) * page_size], ``pages`` int32[k].

  ``id`` is unique within its tree and never reused; it stays with the node's deeper part
  when the node is split, so a node a sequence locked keeps its id.
  """

  __slots__ = ("id", "tokens", "pages", "parent", "children", "lock_ref", "last_access")

  def __init__(self, node_id: int, tokens: np.ndarray, pages: np.ndarray, parent: "Node | None"):
    self.id, self.tokens, self.pages, self.parent = node_id, tokens, pages, parent
    self.children: dict[tuple, Node] = {}  # keyed by the child's first page of tokens
    self.lock_ref = 0  # running sequences whose locked node is this one or below it
    self.last_access = 0

  @property
  def num_tokens(self) -> int:
    return int(self.tokens.size)

  def __repr__(self) -> str:
    return (f"Node(id={self.id}, tokens={self.num_tokens}, pages={self.pages.tolist()}, "
            f"lock_ref={self.lock_ref}, children={len(self.children)})")


@dataclasses.dataclass(frozen=True)
class Match:
  """A cached prefix: its last ``node``, its ``pages`` int32[num_tokens // page_size]."""
  node: Node
  pages: np.ndarray
  num_tokens: int


@dataclasses.dataclass(frozen=True)
class TreeStats:
  """A snapshot of a :class:`RadixTree` (root excluded)."""
  nodes: int
  cached_pages: int
  shared_pages: int  # pages of nodes locked by >= 2 running sequences
  locked_pages: int
  hit_tokens: int  # tokens match() found cached
  queried_tokens: int  # tokens match() was asked for

  @property
  def hit_rate(self) -> float:
    return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class RadixTree:
  """The prefix cache over one :class:`PagePool`; see the module docstring."""

  def __init__(self, pool: PagePool):
    if not isinstance(pool, PagePool):
      raise ValueError(f"pool must be a PagePool, got {type(pool).__name__}")
    self.pool, self.page_size = pool, pool.page_size
    self._ids = itertools.count()
    self._clock = itertools.count(1)  # logical time: deterministic LRU order
    self.root = Node(next(self._ids), np.zeros(0, np.int32), np.zeros(0, np.int32), None)
    self.version = 0  # bumped whenever nodes are added, split or removed (re-plan the cascade)
    self._hit = self._queried = 0

  # -- lookup and insertion --------------------------------------------------------------------

  def match(self, tokens) -> Match:
    """The longest cached page-aligned prefix of ``tokens`` (int[n]).

    A match ending inside a node splits it at that page boundary, so ``node`` ends exactly at
    the prefix (lockable). Refreshes the LRU time of the path; takes no page reference.
    """
    tokens = self._tokens(tokens, "tokens")
    node, pos, pages, _ = self._walk(tokens, None)
    self._hit += pos
    self._queried += int(tokens.size)
    return Match(node, _concat(pages), pos)

  def insert(self, tokens, pages) -> Match:
    """Caches ``pages`` (int[k], K/V of ``tokens`` int[k * page_size]); returns the cached path.

    Takes over the caller's reference of each page in ``pages``: where a page of the same
    tokens is already cached under another id, the given page is released (decref) and the
    returned ``Match.pages`` holds the cached one, which the caller must use instead. A given
    page equal to the cached one (it came from :meth:`match`) is left alone.
    """
    tokens = self._tokens(tokens, "tokens")
    pages = np.asarray(pages)
    if pages.ndim != 1 or tokens.size != pages.size * self.page_size:
      raise ValueError(f"pages (shape {pages.shape}) must be int[len(tokens) // page_size] = "
                       f"int[{tokens.size / self.page_size:g}] (page_size {self.page_size})")
    pages = pages.astype(np.int32)
    if np.any(self.pool.refcounts(pages) == 0):  # checked before anything changes
      raise ValueError(f"pages {pages.tolist()} must all be allocated (the caller's references)")
    node, pos, path_pages, now = self._walk(tokens, pages)
    if pos < tokens.size:  # the rest is new: one node owns it
      child = Node(next(self._ids), tokens[pos:].copy(), pages[pos // self.page_size:].copy(),
                   node)
      child.last_access = now  # a path's times never grow downward: leaves go first
      node.children[self._key(child.tokens)] = child
      path_pages.append(child.pages)
      node, self.version = child, self.version + 1
    return Match(node, _concat(path_pages), int(tokens.size))

  def _walk(self, tokens: np.ndarray, given: np.ndarray | None):
    """Follows cached whole pages of ``tokens``; splits where the match ends inside a node.

    With ``given`` (insert), releases each given page that duplicates a cached one.
    Returns (last node, matched tokens, [pages per node on the path], the walk's time).
    """
    ps, node, pos, path_pages = self.page_size, self.root, 0, []
    now = next(self._clock)
    while tokens.size - pos >= ps:
      child = node.children.get(self._key(tokens[pos:pos + ps]))
      if child is None:
        break
      # Whole pages of the child that match, comparing page rows of tokens.
      n = min(child.pages.size, (tokens.size - pos) // ps)
      same = np.all(child.tokens[:n * ps].reshape(n, ps) == tokens[pos:pos + n * ps].reshape(n, ps),
                    axis=1)
      k = n if same.all() else int(np.argmin(same))  # >= 1: the first page is the key
      if k < child.pages.size:
        child = self._split(child, k)
      child.last_access = now
      if given is not None:
        mine = given[pos // ps:pos // ps + k]
        dup = mine[mine != child.pages]
        if dup.size:
          self.pool.decref(dup)
      path_pages.append(child.pages)
      node, pos = child, pos + k * ps
      if k < n:  # the tokens leave the tree inside this node
        break
    return node, pos, path_pages, now

  def _split(self, node: Node, k: int) -> Node:
    """Cuts ``node`` after its first ``k`` pages; returns the new upper node.

    The lower part keeps the id (a sequence that locked it keeps its handle); the upper part
    inherits its lock count, since every lock through the lower part passes the upper one.
    """
    ps, parent = self.page_size, node.parent
    upper = Node(next(self._ids), node.tokens[:k * ps], node.pages[:k], parent)
    upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
    parent.children[self._key(upper.tokens)] = upper
    node.tokens, node.pages, node.parent = node.tokens[k * ps:], node.pages[k:], upper
    upper.children[self._key(node.tokens)] = node
    self.version += 1
    return upper

  # -- running sequences -----------------------------------------------------------------------

  def lock(self, node: Node) -> None:
    """A running sequence holds the path root..``node``: none of it can be evicted.

    Locking the root (an empty match) holds nothing, so a sequence can always lock its node.
    """
    for n in self._path_up(node, "node"):
      n.lock_ref += 1

  def unlock(self, node: Node) -> None:
    """Releases a :meth:`lock` of ``node``."""
    path = self._path_up(node, "node")
    if any(n.lock_ref <= 0 for n in path):
      raise ValueError(f"node {node.id} is not locked (unlock without lock)")
    for n in path:
      n.lock_ref -= 1

  def path(self, node: Node) -> tuple[Node, ...]:
    """The nodes from below the root down to ``node`` (the cascade planner's input; () for
    the root)."""
    return tuple(reversed(self._path_up(node, "node")))

  # -- eviction --------------------------------------------------------------------------------

  def evict(self, num_pages: int) -> int:
    """Removes unlocked leaves, least recently used first, until the pool has ``num_pages``
    free pages or nothing is evictable; returns the pages this freed.

    A removed node drops the tree's reference on its pages; a page someone else still holds
    stays allocated (and is not counted as freed).
    """
    if not isinstance(num_pages, (int, np.integer)) or num_pages < 0:
      raise ValueError(f"num_pages={num_pages!r} must be an int >= 0")
    start = self.pool.num_free
    heap = [(n.last_access, n.id, n) for n in self if not n.children and n.lock_ref == 0]
    heapq.heapify(heap)
    while heap and self.pool.num_free < num_pages:
      _, _, leaf = heapq.heappop(heap)
      parent = leaf.parent
      self._remove(leaf)
      # The parent may have become an evictable leaf; its own time orders it.
      if parent is not self.root and not parent.children and parent.lock_ref == 0:
        heapq.heappush(heap, (parent.last_access, parent.id, parent))
    return self.pool.num_free - start

  def clear(self) -> None:
    """Drops every unlocked node; with nothing locked the tree is empty and its pages free."""
    self.evict(self.pool.num_pages)  # more than can ever be free: evicts all it can

  def reset(self) -> None:
    """:meth:`clear`, and zeroes the hit counters."""
    self.clear()
    self._hit = self._queried = 0

  def _remove(self, leaf: Node) -> None:
    del leaf.parent.children[self._key(leaf.tokens)]
    leaf.parent = None
    self.pool.decref(leaf.pages)
    self.version += 1

  # -- inspection ------------------------------------------------------------------------------

  def __iter__(self) -> Iterator[Node]:
    """The nodes below the root, depth first (children in insertion order)."""
    return (node for node, _ in self._preorder())

  def _preorder(self) -> Iterator[tuple[Node, int]]:
    stack = [(child, 1) for child in reversed(self.root.children.values())]
    while stack:  # no recursion: a long conversation makes a deep tree
      node, depth = stack.pop()
      yield node, depth
      stack.extend((child, depth + 1) for child in reversed(node.children.values()))

  def stats(self) -> TreeStats:
    nodes = list(self)
    return TreeStats(
        nodes=len(nodes), cached_pages=sum(n.pages.size for n in nodes),
        shared_pages=sum(n.pages.size for n in nodes if n.lock_ref >= 2),
        locked_pages=sum(n.pages.size for n in nodes if n.lock_ref >= 1),
        hit_tokens=self._hit, queried_tokens=self._queried)

  def dump(self, max_tokens: int = 8) -> str:
    """One line per node, indented by depth: id, tokens (first ``max_tokens``), pages, locks."""
    lines = [f"root (page_size {self.page_size}, version {self.version})"]
    for node, depth in self._preorder():
      more = "..." if node.num_tokens > max_tokens else ""
      lines.append(f"{'  ' * depth}#{node.id} tokens={node.tokens[:max_tokens].tolist()}{more} "
                   f"({node.num_tokens}) pages={node.pages.tolist()} lock={node.lock_ref} "
                   f"t={node.last_access}")
    return "\n".join(lines)

  def _path_up(self, node: Node, name: str) -> list[Node]:
    path, n = [], node
    while isinstance(n, Node) and n.parent is not None:
      path.append(n)
      n = n.parent
    if n is not self.root:  # a removed node, another tree's node, not a node
      raise ValueError(f"{name} must be a node of this tree, got {node!r}")
    return path

  def _key(self, tokens: np.ndarray) -> tuple:
    return tuple(tokens[:self.page_size].tolist())

  @staticmethod
  def _tokens(tokens, name: str) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
      raise ValueError(f"{name} must be a 1-D integer array, got shape {tokens.shape} "
                       f"dtype {tokens.dtype}")
    return tokens.astype(np.int32)


def _concat(pages: list[np.ndarray]) -> np.ndarray:
  return np.concatenate(pages) if pages else np.zeros(0, np.int32)
