"""Where sharing occurs: a tree of prompt segments and the samples that continue it.

Hydragen needs to be told which tokens are shared by which sequences (paper
Sec. 3.3 and 5). A :class:`PromptTree` says it explicitly: level by level,
token segments, each continuing a parent segment of the level above, and for
every sample the segment its shared context ends at plus its prompt's last
token. For the competitive-programming setting of Sec. 4.4::

    level 0:  [few-shot examples]                       (one segment)
    level 1:  [problem 1 text] [problem 2 text] ...     (parent: segment 0 of level 0)
    samples:  M samples end at each problem's segment

Every segment is prefilled once, and its K/V stored once (:mod:`models.cache`).
The last token of each prompt is not part of the tree: it is the first token
each sample feeds to the decode loop, so that the first new token is sampled
by the same jitted step as all the others.

:meth:`PromptTree.from_prompts` detects the tree of a list of prompts
automatically (a radix tree over the prompts, :mod:`models.sharing`): that is
what ``generate`` does with a list of prompts. Build a ``PromptTree`` by hand
to say exactly where sharing occurs.
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

    A radix tree over the prompts (:func:`models.sharing.detect_sharing`):
    every shared run of at least ``min_shared_tokens`` tokens (default 16)
    becomes one segment, at any depth and fan-out; identical prompts share
    everything; shorter shared runs are duplicated into their continuations.
    One prompt gives one segment (the prompt minus its last token).

    Args:
      prompts: token-id sequences (each non-empty).
      num_samples: samples per prompt: an int for all, or one per prompt.
      min_shared_tokens: see :mod:`models.sharing` (None: the default, 16).
    """
    from models.sharing import detect_sharing  # models.sharing builds PromptTrees: import late
    return detect_sharing(prompts, num_samples, min_shared_tokens=min_shared_tokens)
