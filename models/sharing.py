"""Automatic sharing detection: a radix tree over the prompts, cut into a :class:`PromptTree`.

The Hydragen paper asks the user to say where sharing occurs and leaves
detection to future work (Sec. 5); ChunkAttention finds shared prefixes with a
prefix tree. We do the same on the host, before anything is compiled::

    tree = detect_sharing([shots + p1, shots + p2, shots + p1[:5]], num_samples=[8, 8, 2])
    tokens = models.generate(model, tree, max_new_tokens=64)   # the default for a prompt list

1. **Radix tree** (:class:`RadixTree`). The *context* of a prompt is the prompt
   without its last token (the last token is fed at decode step 0, see
   :mod:`models.prompt_tree`). The contexts go into a compressed token trie:
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

from typing import Optional, Sequence, Union

import numpy as np

from models.prompt_tree import NO_NODE, PromptTree

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
