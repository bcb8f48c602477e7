"""The sharing tree: every sample's prompt is reconstructed exactly, each segment stored once."""

import os

import numpy as np
import pytest
from hypothesis import given, strategies as st

from models.prompt_tree import NO_NODE, PromptTree
from strategies import count_case

TOKENS = st.integers(0, 5)  # a small alphabet: shared prefixes, repeats and prefixes happen often


@st.composite
def prompt_sets(draw):
  common = draw(st.lists(TOKENS, max_size=6))
  n = draw(st.integers(1, 5))
  prompts = []
  for _ in range(n):
    if prompts and draw(st.booleans()):  # a repeat or a prefix of an earlier prompt
      earlier = draw(st.sampled_from(prompts))
      prompts.append(earlier[:draw(st.integers(1, len(earlier)))])
    else:
      prompts.append(common + draw(st.lists(TOKENS, min_size=0 if common else 1, max_size=5)))
  counts = draw(st.one_of(st.integers(1, 3), st.lists(st.integers(1, 3), min_size=n, max_size=n)))
  return prompts, counts


@given(prompt_sets())
def test_from_prompts_reconstructs_every_prompt_and_stores_segments_once(case):
  count_case("prompt_tree")
  prompts, counts = case
  tree = PromptTree.from_prompts(prompts, counts)
  per_prompt = [counts] * len(prompts) if isinstance(counts, int) else counts
  expected = [p for p, n in zip(prompts, per_prompt) for _ in range(n)]
  assert tree.num_samples == len(expected)
  assert [tree.prompt(b) for b in range(tree.num_samples)] == expected
  # No segment is stored twice (siblings differ), at most two levels (common part, remainders),
  # and the shared tokens are the common part plus each distinct remainder, once.
  assert tree.num_levels <= 2
  for level, parents in zip(tree.segments, tree.parents):
    assert len(set(zip(level, parents))) == len(level)
  contexts = {tuple(p[:-1]) for p in prompts}
  common = len(os.path.commonprefix([list(c) for c in contexts]))
  assert tree.shared_tokens == common + sum(len(c) - common for c in contexts)
  # The decode order makes every node's samples contiguous.
  order = tree.decode_order()
  assert sorted(order.tolist()) == list(range(tree.num_samples))
  for level in range(tree.num_levels):
    nodes = tree.node_of_sample(level)[order]
    seen = [n for i, n in enumerate(nodes) if i == 0 or n != nodes[i - 1]]
    assert len(seen) == len(set(seen))


def test_two_level_example():
  few_shot = [9, 9, 9, 9]
  tree = PromptTree.from_prompts([few_shot + [1, 2, 3], few_shot + [4, 5], few_shot + [1, 2, 3]],
                                 [2, 1, 1])
  assert tree.segments == (((9, 9, 9, 9),), ((1, 2), (4,)))
  assert tree.parents == ((-1,), (0, 0))
  assert tree.leaves == ((1, 0), (1, 0), (1, 1), (1, 0))
  assert tree.last_tokens == (3, 3, 5, 3)
  np.testing.assert_array_equal(tree.node_of_sample(1), [0, 0, 1, 0])
  np.testing.assert_array_equal(tree.ancestor(0, 1), [0, 0])
  assert tree.decode_order().tolist() == [0, 1, 3, 2]


def test_single_token_prompt_has_no_shared_context():
  tree = PromptTree.from_prompts([[7]], 3)
  assert tree.num_levels == 0 and tree.leaves == (NO_NODE,) * 3 and tree.last_tokens == (7,) * 3


@pytest.mark.parametrize("args, message", [
    (([],), "at least one prompt"), (([[1], []],), "prompt 1 is empty"),
    (([[1, 2]], 0), "num_samples"), (([[1, 2], [3]], [1]), "num_samples")])
def test_from_prompts_errors(args, message):
  with pytest.raises(ValueError, match=message):
    PromptTree.from_prompts(*args)


@pytest.mark.parametrize("fields, message", [
    (dict(segments=(((1,),),), parents=((0,),)), "parents\\[0\\]\\[0\\]"),
    (dict(segments=(((),),), parents=((-1,),)), "empty"),
    (dict(segments=(((1,),), ((2,),)), parents=((-1,), (3,))), "not a node of level 0"),
    (dict(leaves=((2, 0),)), "leaves\\[0\\]"),
])
def test_invalid_trees_are_rejected(fields, message):
  base = dict(segments=(((1, 2),),), parents=((-1,),), leaves=((0, 0),), last_tokens=(3,))
  base.update(fields)
  with pytest.raises(ValueError, match=message):
    PromptTree(**base)
