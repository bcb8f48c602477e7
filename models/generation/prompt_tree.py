"""Where sharing occurs: a tree of prompt segments and the samples that continue it.

Hydragen needs to be told which tokens are shared by which sequences (paper
Sec. 3.3 and 5). A :class:`PromptTree` says it explicitly: level by level,
token segments, each continuing a parent segment of the level above, and for
every sample the segment its shared context ends at plus its prompt's last
token. For the competitive-programming setting of Sec. 4.4::

    level 0:  [few-shot examples]                       (one segment)
    level 1:  [problem 1 text] [problem 2 text] ...     (parent: segment 0 of level 0)
    samples:  M samples end at each problem's segment

Every segment is prefilled once, and its K/V stored once (:mod:`models.generation.cache`).
The last token of each prompt is not part of the tree: it is the first token
each sample feeds to the decode loop, so that the first new token is sampled
by the same jitted step as all the others.

:meth:`PromptTree.from_prompts` detects the tree of a list of prompts
automatically (a radix tree over the prompts, below): that is
what ``generate`` does with a list of prompts. Build a ``PromptTree`` by hand
to say exactly where sharing occurs.

Automatic sharing detection (:func:`detect_sharing`, also importable from :mod:`models.generation.sharing`):

The Hydragen paper asks the user to say where sharing occurs and leaves
detection to future work (Sec. 5); ChunkAttention finds shared prefixes with a
prefix tree. We do the same on the host, before anything is compiled::

    tree = detect_sharing([shots + p1, shots + p2, shots + p1[:5]], num_samples=[8, 8, 2])
    tokens = models.generate(model, tree, max_new_tokens=64)   # the default for a prompt list

1. **Radix tree** (:class:`RadixTree`). The *context* of a prompt is the prompt
   without its last token (the last token is fed at decode step 0, see
   :mod:`models.generation.prompt_tree`). The contexts go into a compressed token trie:
   every edge holds a run of tokens (a slice of one prompt, never copied), the
   children of a node start with distinct tokens, and a node records the
   prompts whose context ends there. Inserting a context walks its tokens
   once and splits at most one edge, so building costs O(total tokens).
2. **Cut** (:func:`cut`). Each radix node becomes a segment: its level is its
   depth in the (compressed) tree, its parent the segment above it. Identical
   prompts end at the same node and share everything; a prompt whose context
   is a prefix of another's ends at an inner node; a one-token prompt has no
   context (leaf ``(-1, -1)``).
3. **The min_shared_tokens rule.** An inner node whose run is shorter than
   ``min_shared_tokens`` is not worth a segment of its own: its tokens are
   duplicated into each continuation instead (prepended to every child, and a
   leaf segment of just those tokens for the prompts that end there). Runs
   carry down, so ``a`` (5 tokens) then ``b`` (12 tokens) become one
   segment ``a + b`` of 17. Leaves are always segments: the cache has no
   other place for prompt tokens.

Storage invariant (tested): every distinct context prefix is stored in at least
one segment; when it is stored more than once, the segments holding it are
siblings (same parent) and it lies within their first ``min_shared_tokens - 1``
tokens. Equivalently, two sibling segments never share a common prefix of
``min_shared_tokens`` tokens or more, and every segment that has children is at
least ``min_shared_tokens`` long. With ``min_shared_tokens <= 1`` every shared
token is stored exactly once (``tree.shared_tokens`` = the number of distinct
non-empty context prefixes). When no two contexts share ``min_shared_tokens``
leading tokens, the result is one level with one segment per distinct context.

Why a minimum, and why 16 by default: sharing ``r`` tokens among ``k``
continuations saves ``(k - 1) * r`` tokens of K/V, while every segment costs a
fixed amount whatever its length: a part in the attention of every decode step
and layer (a kernel tile, an LSE merge over its samples' rows), a prefill pass
per tree level, and possibly a whole extra level (one more attention call and
merge over the batch per layer and step). For a handful of tokens the fixed
cost wins. 16 tokens is the granularity at which serving systems share K/V:
vLLM's KV blocks (and so its prefix caching) are 16 tokens, ChunkAttention
shares 64-token chunks. Incidental overlaps of a few tokens (a chat template's
``<|im_start|>user``, a common first word) are thereby not turned into levels.

Samples are ordered so that each segment's samples are contiguous by
:meth:`PromptTree.decode_order` (samples sorted by their path; segments are
numbered in depth-first order, so that order is the tree's depth-first order).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import numpy as np

NO_NODE = (-1, -1)


@dataclasses.dataclass(frozen=True)
class PromptTree:
  """A sharing tree over the prompts of a batch of samples.

  Attributes:
    segments: ``segments[l][n]``: token ids of node n at level l (non-empty).
    parents: ``parents[l][n]``: index of node n's parent in level ``l - 1``
      (``-1`` at level 0).
    leaves: ``leaves[b] = (l, n)``: sample b's shared context is the path from
      the root down to node n of level l; ``(-1, -1)``: no shared context.
    last_tokens: ``last_tokens[b]``: sample b's final prompt token.

  Sample b's prompt is ``context(b) + [last_tokens[b]]``. Samples are in the
  caller's order; :meth:`decode_order` groups them by node.
  """

  segments: tuple[tuple[tuple[int, ...], ...], ...]
  parents: tuple[tuple[int, ...], ...]
  leaves: tuple[tuple[int, int], ...]
  last_tokens: tuple[int, ...]

  def __post_init__(self):
    segs = tuple(tuple(tuple(int(t) for t in seg) for seg in level) for level in self.segments)
    parents = tuple(tuple(int(p) for p in level) for level in self.parents)
    leaves = tuple((int(l), int(n)) for l, n in self.leaves)
    last = tuple(int(t) for t in self.last_tokens)
    object.__setattr__(self, "segments", segs)
    object.__setattr__(self, "parents", parents)
    object.__setattr__(self, "leaves", leaves)
    object.__setattr__(self, "last_tokens", last)
    if len(parents) != len(segs):
      raise ValueError(f"PromptTree: parents must have one entry per level ({len(segs)}); got "
                       f"{len(parents)}")
    for l, (level, pars) in enumerate(zip(segs, parents)):
      if not level:
        raise ValueError(f"PromptTree: level {l} has no segment")
      if len(pars) != len(level):
        raise ValueError(f"PromptTree: parents[{l}] must have {len(level)} entries; got {len(pars)}")
      for n, (seg, p) in enumerate(zip(level, pars)):
        if not seg:
          raise ValueError(f"PromptTree: segments[{l}][{n}] is empty")
        ok = p == -1 if l == 0 else 0 <= p < len(segs[l - 1])
        if not ok:
          raise ValueError(f"PromptTree: parents[{l}][{n}] = {p} is not a node of level {l - 1}")
    if not last:
      raise ValueError("PromptTree: there must be at least one sample")
    if len(leaves) != len(last):
      raise ValueError(f"PromptTree: leaves ({len(leaves)}) and last_tokens ({len(last)}) must "
                       "have one entry per sample")
    for b, (l, n) in enumerate(leaves):
      if (l, n) != NO_NODE and not (0 <= l < len(segs) and 0 <= n < len(segs[l])):
        raise ValueError(f"PromptTree: leaves[{b}] = {(l, n)} is not a node")

  # -- reading the tree -----------------------------------------------------------------------

  @property
  def num_samples(self) -> int:
    return len(self.last_tokens)

  @property
  def num_levels(self) -> int:
    return len(self.segments)

  def path(self, b: int) -> list[tuple[int, int]]:
    """``[(0, n0), (1, n1), ...]``: the nodes of sample b's shared context, root first."""
    return self._path_of_leaf(self.leaves[b])

  def _path_of_leaf(self, leaf: tuple[int, int]) -> list[tuple[int, int]]:
    level, node = leaf
    out = []
    while level >= 0:
      out.append((level, node))
      node = self.parents[level][node]
      level -= 1
    return out[::-1]

  def _per_leaf(self, fn) -> list:
    """``[fn(path of sample b) for b]``, computed once per distinct leaf (many samples share one)."""
    memo = {}
    for leaf in self.leaves:
      if leaf not in memo:
        memo[leaf] = fn(self._path_of_leaf(leaf))
    return [memo[leaf] for leaf in self.leaves]

  def context(self, b: int) -> list[int]:
    """Sample b's shared tokens (its prompt without the last token)."""
    return [t for l, n in self.path(b) for t in self.segments[l][n]]

  def prompt(self, b: int) -> list[int]:
    return self.context(b) + [self.last_tokens[b]]

  def node_of_sample(self, level: int) -> np.ndarray:
    """int32 ``[num_samples]``: each sample's node at ``level`` (-1 if none)."""
    nodes = self._per_leaf(lambda path: path[level][1] if level < len(path) else -1)
    return np.asarray(nodes, np.int32)

  def ancestor(self, level: int, of_level: int) -> np.ndarray:
    """int32 ``[len(segments[of_level])]``: each node's ancestor at ``level`` (< of_level)."""
    nodes = np.arange(len(self.segments[of_level]))
    for l in range(of_level, level, -1):
      nodes = np.asarray(self.parents[l], np.int32)[nodes]
    return nodes.astype(np.int32)

  def lengths(self, level: int) -> np.ndarray:
    return np.asarray([len(s) for s in self.segments[level]], np.int32)

  def context_lengths(self) -> np.ndarray:
    return np.asarray(self._per_leaf(lambda path: sum(len(self.segments[l][n]) for l, n in path)),
                      np.int32)

  @property
  def shared_tokens(self) -> int:
    """Tokens stored in shared segments (each once)."""
    return sum(len(s) for level in self.segments for s in level)

  def decode_order(self) -> np.ndarray:
    """A permutation of the samples that makes each node's samples contiguous.

    Samples sorted by their path (stable, so ties keep the caller's order):
    the samples under a node are those whose path starts with the node's own
    path, and a lexicographic sort keeps every common start together. The
    layout ChunkAttention and segment kernels prefer.
    """
    keys = self._per_leaf(lambda path: tuple(n for _, n in path))
    return np.asarray(sorted(range(self.num_samples), key=lambda b: keys[b]), np.int64)

  # -- building -------------------------------------------------------------------------------

  @classmethod
  def from_prompts(cls, prompts: Sequence[Sequence[int]],
                   num_samples: Union[int, Sequence[int]] = 1, *,
                   min_shared_tokens: Optional[int] = None) -> "PromptTree":
    """The sharing tree of a list of prompts, detected automatically; samples in the caller's order.

    A radix tree over the prompts (:func:`detect_sharing`):
    every shared run of at least ``min_shared_tokens`` tokens (default 16)
    becomes one segment, at any depth and fan-out; identical prompts share
    everything; shorter shared runs are duplicated into their continuations.
    One prompt gives one segment (the prompt minus its last token).

    Args:
      prompts: token-id sequences (each non-empty).
      num_samples: samples per prompt: an int for all, or one per prompt.
      min_shared_tokens: see the module docstring (None: the default, 16).
    """
    return detect_sharing(prompts, num_samples, min_shared_tokens=min_shared_tokens)


# -- automatic detection: a radix tree over the prompts ---------------------------------------

DEFAULT_MIN_SHARED_TOKENS = 16


class RadixNode:
  """A node of the radix tree: the edge into it and what hangs below.

  Attributes:
    source, start, end: the edge's tokens are ``source[start:end]`` (a slice of
      the prompt that created it; empty for the root).
    children: first token of the child's edge -> child.
    prompts: indices of the prompts whose context ends exactly here.
  """

  __slots__ = ("source", "start", "end", "children", "prompts")

  def __init__(self, source: Sequence[int], start: int, end: int):
    self.source, self.start, self.end = source, start, end
    self.children: dict[int, RadixNode] = {}
    self.prompts: list[int] = []

  def __len__(self) -> int:
    return self.end - self.start

  @property
  def tokens(self) -> list[int]:
    return list(self.source[self.start:self.end])


class RadixTree:
  """A compressed token trie of prompt contexts (O(total tokens) to build)."""

  def __init__(self):
    self.root = RadixNode((), 0, 0)

  @classmethod
  def build(cls, contexts: Sequence[Sequence[int]]) -> "RadixTree":
    tree = cls()
    for i, context in enumerate(contexts):
      tree.insert(context, i)
    return tree

  def insert(self, context: Sequence[int], prompt: int) -> RadixNode:
    """Adds ``context`` (records ``prompt`` at the node where it ends); returns that node."""
    node, pos = self.root, 0
    while pos < len(context):
      child = node.children.get(context[pos])
      if child is None:  # nothing shares this continuation: one new leaf holds the rest
        child = node.children[context[pos]] = RadixNode(context, pos, len(context))
        node, pos = child, len(context)
        break
      # Walk the edge while it agrees with the context (its first token does, by the key).
      src, start, n = child.source, child.start, len(child)
      k = 1
      while k < n and pos + k < len(context) and src[start + k] == context[pos + k]:
        k += 1
      if k < n:  # the context leaves (or ends inside) the edge: split it at k
        middle = RadixNode(src, start, start + k)
        child.start = start + k
        middle.children[src[start + k]] = child
        node.children[context[pos]] = middle
        child = middle
      node, pos = child, pos + k
    node.prompts.append(prompt)
    return node

  def nodes(self) -> int:
    """Number of nodes, the root included."""
    count, stack = 0, [self.root]
    while stack:
      node = stack.pop()
      count += 1
      stack.extend(node.children.values())
    return count


def cut(radix: RadixTree, min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS):
  """Cuts a radix tree into tree levels (see the module docstring for the rule).

  Returns:
    ``(segments, parents, leaf_of_prompt)``: ``segments[l]`` lists the token
    tuples of level l in depth-first order, ``parents[l]`` each one's parent
    index in level ``l - 1`` (-1 at level 0), and ``leaf_of_prompt[i]`` the
    ``(level, node)`` prompt i's context ends at (``NO_NODE`` if empty).
  """
  segments: list[list[tuple[int, ...]]] = []
  parents: list[list[int]] = []
  leaf_of_prompt: dict[int, tuple[int, int]] = {}

  def add_segment(parent: tuple[int, int], tokens: list[int]) -> tuple[int, int]:
    level = parent[0] + 1  # NO_NODE's level is -1: a root segment is at level 0
    if level == len(segments):
      segments.append([])
      parents.append([])
    segments[level].append(tuple(tokens))
    parents[level].append(parent[1])
    return level, len(segments[level]) - 1

  # Depth-first, children in insertion order (an explicit stack: trees can be deep).
  # Entry: (radix node, the segment it hangs below, tokens carried down from short runs).
  stack = [(child, NO_NODE, []) for child in reversed(list(radix.root.children.values()))]
  for i in radix.root.prompts:
    leaf_of_prompt[i] = NO_NODE  # a one-token prompt: no context at all
  while stack:
    node, parent, carried = stack.pop()
    run = carried + node.tokens
    if not node.children or len(run) >= max(1, min_shared_tokens):  # a segment of its own
      here = add_segment(parent, run)
      for i in node.prompts:
        leaf_of_prompt[i] = here
      below, carry = here, []
    else:  # a short shared run: duplicate it into every continuation
      if node.prompts:  # the prompts ending here get a leaf holding just the run
        here = add_segment(parent, run)
        for i in node.prompts:
          leaf_of_prompt[i] = here
      below, carry = parent, run
    for child in reversed(list(node.children.values())):
      stack.append((child, below, carry))
  return segments, parents, leaf_of_prompt


def detect_sharing(prompts: Sequence[Sequence[int]],
                   num_samples: Union[int, Sequence[int]] = 1, *,
                   min_shared_tokens: Optional[int] = DEFAULT_MIN_SHARED_TOKENS) -> PromptTree:
  """The sharing tree of a list of prompts, detected with a radix tree.

  Args:
    prompts: token-id sequences (each non-empty), in the caller's order.
    num_samples: samples per prompt: an int for all, or one int (>= 1) per prompt.
    min_shared_tokens: a shared run shorter than this is duplicated into its
      continuations instead of becoming a segment (default 16; 0 or 1: share
      every common token). ``None`` means the default.

  Returns:
    A :class:`PromptTree` whose samples are in the caller's order (prompt 0's
    samples first); sample b's prompt is ``tree.prompt(b)``.
  """
  prompts = [[int(t) for t in p] for p in prompts]
  if not prompts:
    raise ValueError("detect_sharing: prompts must hold at least one prompt")
  counts = ([num_samples] * len(prompts) if np.ndim(num_samples) == 0 else list(num_samples))
  if len(counts) != len(prompts):
    raise ValueError(f"detect_sharing: num_samples has {len(counts)} entries for "
                     f"{len(prompts)} prompts")
  for i, (p, n) in enumerate(zip(prompts, counts)):
    if not p:
      raise ValueError(f"detect_sharing: prompt {i} is empty")
    if int(n) != n or n < 1:
      raise ValueError(f"detect_sharing: num_samples must be ints >= 1; got {n!r} for prompt {i}")
  if min_shared_tokens is None:
    min_shared_tokens = DEFAULT_MIN_SHARED_TOKENS
  if int(min_shared_tokens) != min_shared_tokens or min_shared_tokens < 0:
    raise ValueError(f"detect_sharing: min_shared_tokens must be an int >= 0; got "
                     f"{min_shared_tokens!r}")
  radix = RadixTree.build([p[:-1] for p in prompts])
  segments, parents, leaf_of_prompt = cut(radix, int(min_shared_tokens))
  leaves, last = [], []
  for i, (p, n) in enumerate(zip(prompts, counts)):
    leaves += [leaf_of_prompt[i]] * int(n)
    last += [p[-1]] * int(n)
  return PromptTree(tuple(map(tuple, segments)), tuple(map(tuple, parents)), tuple(leaves),
                    tuple(last))
