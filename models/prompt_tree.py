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

:meth:`PromptTree.from_prompts` builds the two-level tree of ``generate``'s
multi-prompt form (common prefix, then one segment per distinct prompt);
automatic detection of deeper trees (a token trie) only has to produce a
``PromptTree`` too.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence, Union

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
    level, node = self.leaves[b]
    out = []
    while level >= 0:
      out.append((level, node))
      node = self.parents[level][node]
      level -= 1
    return out[::-1]

  def context(self, b: int) -> list[int]:
    """Sample b's shared tokens (its prompt without the last token)."""
    return [t for l, n in self.path(b) for t in self.segments[l][n]]

  def prompt(self, b: int) -> list[int]:
    return self.context(b) + [self.last_tokens[b]]

  def node_of_sample(self, level: int) -> np.ndarray:
    """int32 ``[num_samples]``: each sample's node at ``level`` (-1 if none)."""
    out = np.full((self.num_samples,), -1, np.int32)
    for b in range(self.num_samples):
      for l, n in self.path(b):
        if l == level:
          out[b] = n
    return out

  def ancestor(self, level: int, of_level: int) -> np.ndarray:
    """int32 ``[len(segments[of_level])]``: each node's ancestor at ``level`` (< of_level)."""
    nodes = np.arange(len(self.segments[of_level]))
    for l in range(of_level, level, -1):
      nodes = np.asarray(self.parents[l], np.int32)[nodes]
    return nodes.astype(np.int32)

  def lengths(self, level: int) -> np.ndarray:
    return np.asarray([len(s) for s in self.segments[level]], np.int32)

  def context_lengths(self) -> np.ndarray:
    return np.asarray([len(self.context(b)) for b in range(self.num_samples)], np.int32)

  @property
  def shared_tokens(self) -> int:
    """Tokens stored in shared segments (each once)."""
    return sum(len(s) for level in self.segments for s in level)

  def decode_order(self) -> np.ndarray:
    """A permutation of the samples that makes each node's samples contiguous.

    Samples sorted by their path (stable, so ties keep the caller's order):
    the layout ChunkAttention and segment kernels prefer.
    """
    keys = [tuple(n for _, n in self.path(b)) for b in range(self.num_samples)]
    return np.asarray(sorted(range(self.num_samples), key=lambda b: keys[b]), np.int64)

  # -- building -------------------------------------------------------------------------------

  @classmethod
  def from_prompts(cls, prompts: Sequence[Sequence[int]],
                   num_samples: Union[int, Sequence[int]] = 1) -> "PromptTree":
    """The tree of ``generate``'s prompt forms, samples in the caller's order.

    One prompt: one level holding the prompt minus its last token.
    Several prompts: level 0 holds their longest common prefix, level 1 one
    segment per distinct remainder (identical prompts share it); empty
    levels and segments are left out.

    Args:
      prompts: token-id sequences (each non-empty).
      num_samples: samples per prompt: an int for all, or one per prompt.
    """
    prompts = [list(int(t) for t in p) for p in prompts]
    counts = ([int(num_samples)] * len(prompts) if np.ndim(num_samples) == 0
              else [int(n) for n in num_samples])
    if not prompts:
      raise ValueError("PromptTree.from_prompts: prompts must hold at least one prompt")
    if len(counts) != len(prompts):
      raise ValueError(f"PromptTree.from_prompts: num_samples has {len(counts)} entries for "
                       f"{len(prompts)} prompts")
    for i, (p, n) in enumerate(zip(prompts, counts)):
      if not p:
        raise ValueError(f"PromptTree.from_prompts: prompt {i} is empty")
      if n < 1:
        raise ValueError(f"PromptTree.from_prompts: num_samples must be >= 1; got {n} for prompt {i}")
    contexts = [p[:-1] for p in prompts]
    common = os.path.commonprefix(contexts) if len(prompts) > 1 else contexts[0]
    rests = [c[len(common):] for c in contexts]
    levels, parents = [], []
    if common:
      levels.append([tuple(common)])
      parents.append([-1])
    distinct = list(dict.fromkeys(tuple(r) for r in rests if r))
    if distinct:
      levels.append(distinct)
      parents.append([0 if common else -1] * len(distinct))
    top = len(levels) - 1
    leaves, last = [], []
    for p, rest, n in zip(prompts, rests, counts):
      if rest:
        leaf = (top, distinct.index(tuple(rest)))
      else:
        leaf = (0, 0) if common else NO_NODE
      leaves += [leaf] * n
      last += [p[-1]] * n
    return cls(tuple(map(tuple, levels)), tuple(map(tuple, parents)), tuple(leaves), tuple(last))
