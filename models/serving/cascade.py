"""The cascade plan of one decode step: which cached pages each running sequence reads once per
shared segment, and which it reads alone.

Each running sequence holds a path of radix-tree nodes (whole pages, root excluded) and its
own pages (the prompt tail shorter than a page, then its generated tokens). A chain of nodes
with the same running sequences below it is one *segment*; a segment that >= 2 running
sequences share and that is long enough (``min_shared_tokens``) is read once for all of their
queries at the level of its depth (Hydragen's inter-sequence batching; ChunkAttention's
chunk-first phase); everything else on a sequence's path joins its own page list
(the sequence-first phase). The parts merge by log-sum-exp, so for every sequence::

    context = concat(level 0 segment, level 1 segment, ..., own keys)    (in token order)

Sequences are put in depth-first order of the tree, so each segment's queries are one
contiguous row range ``[seq_start, seq_start + seq_count)``: one matrix product per segment.
All arrays are padded to buckets (:class:`CascadeConfig`), so a device program keyed by
:attr:`CascadePlan.plan_key` compiles once per bucket; padding is length 0 over the null page.
"""

import dataclasses
from typing import Sequence

import numpy as np

from models.serving.pages import NULL_PAGE

_BUCKETED = ("batch", "levels", "segments", "pages", "own_pages")


@dataclasses.dataclass(frozen=True)
class CascadeConfig:
  """How to cut and pad a cascade plan.

  ``min_shared_tokens``: a shared segment shorter than this joins its sequences' own pages
  (unless a shared segment lies below it: the shared parts of a path stay a prefix of it).
  ``batch``, ``levels``, ``segments`` (per level), ``pages`` (per segment), ``own_pages`` (per
  sequence): the padded sizes allowed, ascending; None: powers of two (at least 1).
  """
  min_shared_tokens: int = 1
  batch: tuple[int, ...] | None = None
  levels: tuple[int, ...] | None = None
  segments: tuple[int, ...] | None = None
  pages: tuple[int, ...] | None = None
  own_pages: tuple[int, ...] | None = None

  def __post_init__(self):
    if not isinstance(self.min_shared_tokens, int) or self.min_shared_tokens < 0:
      raise ValueError(f"{self.min_shared_tokens=} must be an int >= 0")
    for name in _BUCKETED:
      sizes = getattr(self, name)
      if sizes is None:
        continue
      if isinstance(sizes, list):  # a list is accepted; stored as a (hashable) tuple
        object.__setattr__(self, name, sizes := tuple(sizes))
      if (not isinstance(sizes, tuple) or not sizes
          or any(not isinstance(s, int) or s < 1 for s in sizes) or list(sizes) != sorted(sizes)):
        raise ValueError(f"{name}={sizes!r} must be None or an ascending tuple of ints >= 1")

  def bucket(self, name: str, n: int) -> int:
    """The padded size of ``name`` for ``n`` entries."""
    sizes = getattr(self, name)
    if sizes is None:
      return 1 << max(n - 1, 0).bit_length()
    for s in sizes:
      if s >= n:
        return s
    raise ValueError(f"{n} {name} exceed the largest bucket {name}={sizes[-1]}")


@dataclasses.dataclass(frozen=True, eq=False)
class CascadePlan:
  """One decode step's cascade, padded. B, L, S, P, O: the buckets of ``plan_key``.

  Rows are sequences in depth-first order: ``order[r]`` is the input index of row r (-1:
  padding). Level arrays are stacked over levels (padding levels are all empty):

  - ``page_table`` int32[L, S, P]: each segment's pages (null page after its end);
  - ``lengths`` int32[L, S]: its tokens (0: padding);
  - ``seq_start``, ``seq_count`` int32[L, S]: the rows that read it;
  - ``segment_of_seq`` int32[L, B]: the segment row r reads at each level, -1 for none;
  - ``own_page_table`` int32[B, O], ``own_lengths`` int32[B]: each row's own keys in token
    order (path pages in no shared segment, then its own pages).
  """
  page_size: int
  num_seqs: int
  order: np.ndarray
  page_table: np.ndarray
  lengths: np.ndarray
  seq_start: np.ndarray
  seq_count: np.ndarray
  segment_of_seq: np.ndarray
  own_page_table: np.ndarray
  own_lengths: np.ndarray
  segment_nodes: tuple  # per level, per segment: the tree node ids it merges (for debugging)

  def __post_init__(self):
    for value in self._fields():  # a value: its arrays cannot change under its hash
      if isinstance(value, np.ndarray):
        value.flags.writeable = False

  @property
  def plan_key(self) -> tuple[int, int, int, int, int]:
    """(batch, levels, segments, pages, own_pages): the padded sizes a device program needs."""
    num_levels, segments, pages = self.page_table.shape
    return (self.order.size, num_levels, segments, pages, self.own_page_table.shape[1])

  @property
  def num_levels(self) -> int:
    """Levels that hold a shared segment (before padding)."""
    return len(self.segment_nodes)

  def _fields(self):
    return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

  def __eq__(self, other) -> bool:
    if not isinstance(other, CascadePlan):
      return NotImplemented
    return all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
               for a, b in zip(self._fields(), other._fields()))

  def __hash__(self) -> int:
    return hash(tuple(a.tobytes() if isinstance(a, np.ndarray) else a for a in self._fields()))


def plan_cascade(paths: Sequence[Sequence], own_pages: Sequence, own_lengths: Sequence[int],
                 page_size: int, config: CascadeConfig = CascadeConfig()) -> CascadePlan:
  """The cascade of the running sequences ``i = 0..n-1``.

  ``paths[i]``: the tree nodes sequence i holds, root excluded, top down (anything with
  ``id`` and ``pages`` int[k]: :meth:`RadixTree.path` of its locked node, read after the
  tree's last change, since a split changes paths); nodes are the same ids wherever they
  appear. ``own_pages[i]`` int[m] and ``own_lengths[i] <= m * page_size``:
  its own keys after the path.

  >>> from models.serving import PagePool, RadixTree
  >>> pool = PagePool(16, page_size=2); tree = RadixTree(pool)
  >>> node = tree.insert([5, 5, 6, 6], pool.alloc(2)).node      # a shared prompt, 2 pages
  >>> plan = plan_cascade([tree.path(node)] * 2, [pool.alloc(1), pool.alloc(1)], [1, 1], 2)
  >>> plan.page_table[0, 0].tolist(), plan.lengths[0].tolist(), plan.own_page_table.tolist()
  ([1, 2], [4], [[3], [4]])
  """
  n = len(paths)
  if len(own_pages) != n or len(own_lengths) != n:
    raise ValueError(f"paths, own_pages, own_lengths must have one entry per sequence, got "
                     f"{n}, {len(own_pages)}, {len(own_lengths)}")
  if not isinstance(page_size, (int, np.integer)) or page_size < 1:
    raise ValueError(f"page_size={page_size!r} must be a positive int")
  page_size = int(page_size)
  own = [np.asarray(p, np.int32).reshape(-1) for p in own_pages]
  for i, (p, length) in enumerate(zip(own, own_lengths)):
    if not 0 <= length <= p.size * page_size:
      raise ValueError(f"own_lengths[{i}]={length} must be in [0, {p.size} own pages * "
                       f"{page_size}]")

  # The union of the paths as a trie of node ids: parent, children, sequences ending there,
  # and how many sequences pass through each node.
  pages, parent, children, ending, count = {}, {}, {None: []}, {None: []}, {}
  for i, path in enumerate(paths):
    up = None
    for node in path:
      nid = node.id
      if nid not in parent:
        node_pages = np.asarray(node.pages, np.int32).reshape(-1)
        if node_pages.size == 0:
          raise ValueError(f"paths[{i}]: node {nid} has no pages")
        pages[nid], parent[nid], children[nid], ending[nid], count[nid] = (
            node_pages, up, [], [], 0)
        children[up].append(nid)
      elif parent[nid] != up:
        raise ValueError(f"paths[{i}]: node {nid} appears under parents {parent[nid]} and {up}")
      count[nid] += 1
      up = nid
    ending[up].append(i)

  # Segments: maximal chains whose nodes have the same sequences below (equal counts, since
  # the sets are nested), keyed by their head node. One pre-order walk (children by id, without
  # recursion: trees can be deep) gives the rows, depth first, and each segment's first row.
  seg_of, seg_nodes, seg_kids, seg_rows, seg_depth, order = {}, {}, {}, {}, {}, []
  stack = [(None, None, 0)]  # (node, the segment above it, that segment's depth + 1)
  while stack:
    nid, seg, depth = stack.pop()
    if nid is not None:
      if seg is not None and count[nid] == count[seg_nodes[seg][-1]]:
        seg_nodes[seg].append(nid)  # continues the chain above
      else:
        seg_nodes[nid], seg_kids[nid], seg_rows[nid], seg_depth[nid] = [nid], [], len(order), depth
        if seg is not None:
          seg_kids[seg].append(nid)
        seg, depth = nid, depth + 1
      seg_of[nid] = seg
    order.extend(ending[nid])
    stack.extend((kid, seg, depth) for kid in sorted(children[nid], reverse=True))

  # Shared: >= 2 sequences, and long enough or above another shared segment. Segments were
  # made parents first, so the reverse decides every segment's children before it.
  shared = {}
  for seg in reversed(seg_nodes):
    tokens = page_size * sum(pages[nid].size for nid in seg_nodes[seg])
    shared[seg] = count[seg] >= 2 and (tokens >= config.min_shared_tokens
                                       or any(shared[k] for k in seg_kids[seg]))

  levels = [[] for _ in range(1 + max((seg_depth[s] for s in shared if shared[s]), default=-1))]
  for seg in sorted((s for s in shared if shared[s]), key=lambda s: seg_rows[s]):
    levels[seg_depth[seg]].append(seg)
  seg_pages = {s: np.concatenate([pages[nid] for nid in seg_nodes[s]]) for s in seg_nodes}

  num_levels = len(levels)
  B = config.bucket("batch", n)
  L = config.bucket("levels", num_levels)
  S = config.bucket("segments", max((len(lv) for lv in levels), default=0))
  P = config.bucket("pages", max((seg_pages[s].size for lv in levels for s in lv), default=0))
  page_table = np.full((L, S, P), NULL_PAGE, np.int32)
  lengths, seq_start, seq_count = (np.zeros((L, S), np.int32) for _ in range(3))
  segment_of_seq = np.full((L, B), -1, np.int32)
  for lv, segs in enumerate(levels):
    for j, seg in enumerate(segs):
      page_table[lv, j, :seg_pages[seg].size] = seg_pages[seg]
      lengths[lv, j] = seg_pages[seg].size * page_size
      seq_start[lv, j], seq_count[lv, j] = seg_rows[seg], count[seg]
      segment_of_seq[lv, seg_rows[seg]:seg_rows[seg] + count[seg]] = j

  # Own keys per row: the path's nodes in no shared segment (a suffix of the path), then its
  # own pages; path pages are whole, so token t of the row is in page t // page_size.
  own_rows = []
  for i in order:
    rest = [pages[node.id] for node in paths[i] if not shared[seg_of[node.id]]]
    own_rows.append(np.concatenate(rest + [own[i]]) if rest else own[i])
  O = config.bucket("own_pages", max((r.size for r in own_rows), default=0))
  own_page_table = np.full((B, O), NULL_PAGE, np.int32)
  own_len = np.zeros(B, np.int32)
  for r, (i, row) in enumerate(zip(order, own_rows)):
    own_page_table[r, :row.size] = row
    own_len[r] = (row.size - own[i].size) * page_size + own_lengths[i]
  return CascadePlan(
      page_size=page_size, num_seqs=n,
      order=np.asarray(order + [-1] * (B - n), np.int32),
      page_table=page_table, lengths=lengths, seq_start=seq_start, seq_count=seq_count,
      segment_of_seq=segment_of_seq, own_page_table=own_page_table, own_lengths=own_len,
      segment_nodes=tuple(tuple(tuple(seg_nodes[s]) for s in segs) for segs in levels))
