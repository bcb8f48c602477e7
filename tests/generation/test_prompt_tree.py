"""PromptTree: reading an explicit sharing tree, validation, from_prompts (detection: test_models_sharing)."""

import numpy as np
import pytest

from models.generation.prompt_tree import NO_NODE, PromptTree

def test_reading_a_hand_built_three_level_tree():
  #   level 0:  A=(1,2,3)            B=(4,)
  #   level 1:  C=(5,) under A       D=(6,7) under A     E=(8,) under B
  #   level 2:  F=(9,) under D
  tree = PromptTree(segments=(((1, 2, 3), (4,)), ((5,), (6, 7), (8,)), ((9,),)),
                    parents=((-1, -1), (0, 0, 1), (1,)),
                    leaves=((2, 0), (0, 1), (1, 0), NO_NODE, (0, 0), (1, 2), (2, 0), (1, 0)),
                    last_tokens=(10, 11, 12, 13, 14, 15, 16, 17))
  assert tree.num_samples == 8 and tree.num_levels == 3 and tree.shared_tokens == 9
  assert tree.path(0) == [(0, 0), (1, 1), (2, 0)] and tree.path(3) == []
  assert tree.prompt(0) == [1, 2, 3, 6, 7, 9, 10] and tree.prompt(3) == [13]
  assert tree.prompt(5) == [4, 8, 15] and tree.prompt(4) == [1, 2, 3, 14]
  np.testing.assert_array_equal(tree.node_of_sample(0), [0, 1, 0, -1, 0, 1, 0, 0])
  np.testing.assert_array_equal(tree.node_of_sample(1), [1, -1, 0, -1, -1, 2, 1, 0])
  np.testing.assert_array_equal(tree.node_of_sample(2), [0, -1, -1, -1, -1, -1, 0, -1])
  np.testing.assert_array_equal(tree.ancestor(0, 2), [0])
  np.testing.assert_array_equal(tree.ancestor(0, 1), [0, 0, 1])
  np.testing.assert_array_equal(tree.lengths(1), [1, 2, 1])
  np.testing.assert_array_equal(tree.context_lengths(), [6, 1, 4, 0, 3, 2, 6, 4])
  # Sorted by path: no context first, then A's samples (A alone, C, D/F), then B's.
  assert tree.decode_order().tolist() == [3, 4, 2, 7, 0, 6, 1, 5]


def test_from_prompts_detects_the_two_level_example():
  few_shot = list(range(20, 40))  # 20 tokens: over the default min_shared_tokens (16)
  prompts = [few_shot + [1, 2, 3], few_shot + [4, 5], few_shot + [1, 2, 3]]
  tree = PromptTree.from_prompts(prompts, [2, 1, 1])
  assert tree.segments == ((tuple(few_shot),), ((1, 2), (4,)))
  assert tree.parents == ((-1,), (0, 0))
  assert tree.leaves == ((1, 0), (1, 0), (1, 1), (1, 0))
  assert tree.last_tokens == (3, 3, 5, 3)
  np.testing.assert_array_equal(tree.node_of_sample(1), [0, 0, 1, 0])
  np.testing.assert_array_equal(tree.ancestor(0, 1), [0, 0])
  assert tree.decode_order().tolist() == [0, 1, 3, 2]
  # A shorter common part is duplicated into one segment per prompt, unless asked otherwise.
  short = [[9, 9, 9, 9, 1, 2, 3], [9, 9, 9, 9, 4, 5]]
  assert PromptTree.from_prompts(short).segments == (((9, 9, 9, 9, 1, 2), (9, 9, 9, 9, 4)),)
  assert PromptTree.from_prompts(short, min_shared_tokens=4).segments == (
      ((9, 9, 9, 9),), ((1, 2), (4,)))


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
