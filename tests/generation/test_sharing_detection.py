"""Automatic sharing detection (models.generation.sharing): exact prompts, each shared run stored once, order.

The storage invariant tested on every generated case (``m = max(min_shared_tokens, 1)``):

* every distinct non-empty prefix of a context (context = prompt minus its last token) is
  stored in at least one segment; if in more than one, the segments holding it are siblings
  (same parent) and it lies within their first ``m - 1`` tokens (only runs shorter than
  ``min_shared_tokens`` are ever duplicated);
* sibling segments are distinct and share fewer than ``m`` leading tokens; a segment with
  children has at least ``m`` tokens; every segment is on some sample's path;
* with ``min_shared_tokens <= 1`` every prefix is stored exactly once, and when no two
  contexts share ``m`` leading tokens the tree is one level of one segment per context.
"""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, strategies as st

from models.generation.loop import prefill, generate
from models.generation.prompt_tree import NO_NODE, PromptTree
from models.generation.sharing import DEFAULT_MIN_SHARED_TOKENS, RadixTree, detect_sharing
from strategies import count_case

SMALL = st.integers(0, 3)  # a tiny alphabet: accidental overlaps of every length happen


@st.composite
def prompt_sets(draw):
  """Prompts built from shared pieces of random lengths (0..40 tokens, around every threshold),
  plus prefixes of earlier prompts, exact repeats and unrelated prompts."""
  pieces = draw(st.lists(st.lists(SMALL, max_size=40), min_size=1, max_size=4))
  prompts = []
  for _ in range(draw(st.integers(1, 8))):
    kind = draw(st.sampled_from(["compose", "compose", "prefix", "repeat", "fresh"]))
    if kind in ("prefix", "repeat") and prompts:
      earlier = draw(st.sampled_from(prompts))
      cut = len(earlier) if kind == "repeat" else draw(st.integers(1, len(earlier)))
      prompts.append(earlier[:cut])
    elif kind == "fresh":  # a large alphabet: (almost surely) nothing shared
      prompts.append(draw(st.lists(st.integers(100, 10**6), min_size=1, max_size=30)))
    else:
      parts = draw(st.lists(st.sampled_from(range(len(pieces))), min_size=1, max_size=3))
      tail = draw(st.lists(SMALL, min_size=1, max_size=6))
      prompts.append([t for i in parts for t in pieces[i]] + tail)
  counts = draw(st.one_of(st.integers(1, 3),
                          st.lists(st.integers(1, 3), min_size=len(prompts), max_size=len(prompts))))
  min_shared = draw(st.sampled_from([0, 1, 2, 3, 5, DEFAULT_MIN_SHARED_TOKENS]))
  return prompts, counts, min_shared


def common_prefix(a, b) -> int:
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


def check_tree(prompts, counts, min_shared, tree: PromptTree) -> None:
  """Every property in the module docstring, checked against brute force."""
  m = max(min_shared, 1)
  per_prompt = [counts] * len(prompts) if isinstance(counts, int) else counts
  expected = [p for p, n in zip(prompts, per_prompt) for _ in range(n)]
  # Exact prompts, in the caller's order.
  assert tree.num_samples == len(expected)
  assert [tree.prompt(b) for b in range(tree.num_samples)] == expected
  # A context determines its leaf and distinct contexts get distinct leaves: identical prompts
  # share everything, and every other sample is told apart.
  leaf_of = {}
  for b, p in enumerate(expected):
    assert leaf_of.setdefault(tuple(p[:-1]), tree.leaves[b]) == tree.leaves[b]
  assert len(set(leaf_of.values())) == len(leaf_of)
  assert leaf_of.get((), NO_NODE) == NO_NODE
  # Full context of every node, and who holds each context prefix at which offset.
  full = {}
  for l, level in enumerate(tree.segments):
    for n, seg in enumerate(level):
      above = () if l == 0 else full[(l - 1, tree.parents[l][n])]
      full[(l, n)] = above + seg
  holders = {}
  for (l, n), ctx in full.items():
    seg_len = len(tree.segments[l][n])
    for j in range(seg_len):
      holders.setdefault(ctx[:len(ctx) - seg_len + j + 1], []).append((l, n, j))
  prefixes = {c[:i] for c in leaf_of for i in range(1, len(c) + 1)}
  assert set(holders) == prefixes  # everything stored is a real prefix; every prefix is stored
  parent_of = lambda l, n: (l - 1, tree.parents[l][n]) if l > 0 else NO_NODE
  for prefix, where in holders.items():
    if len(where) > 1:  # duplicated: only a short run, into siblings
      assert len({parent_of(l, n) for l, n, _ in where}) == 1, (prefix, where)
      assert all(j < m - 1 for _, _, j in where), (prefix, where)
  assert sum(len(w) for w in holders.values()) == tree.shared_tokens
  if min_shared <= 1:
    assert tree.shared_tokens == len(prefixes)  # every shared token exactly once
  # Siblings: distinct, fewer than m common leading tokens; inner segments are >= m long.
  children = {}
  for l, level in enumerate(tree.segments):
    for n in range(len(level)):
      children.setdefault(parent_of(l, n), []).append((l, n))
  for parent, kids in children.items():
    segs = [tree.segments[l][n] for l, n in kids]
    assert len(set(segs)) == len(segs)
    for a, b in itertools.combinations(segs, 2):
      assert common_prefix(a, b) < m, (a, b)
    if parent != NO_NODE:
      assert len(tree.segments[parent[0]][parent[1]]) >= m
  # Every segment is on some sample's path (no orphan prefill work).
  on_paths = {node for b in range(tree.num_samples) for node in tree.path(b)}
  assert on_paths == set(full)
  # No sharing worth a segment: one level, one segment per distinct non-empty context.
  contexts = [c for c in leaf_of if c]
  if all(common_prefix(a, b) < m for a, b in itertools.combinations(contexts, 2)):
    assert tree.num_levels <= 1 and sorted(full.values()) == sorted(contexts)
  # Decode order: a permutation in which every node's samples are contiguous.
  order = tree.decode_order()
  assert sorted(order.tolist()) == list(range(tree.num_samples))
  paths = [set(tree.path(b)) for b in order]
  for node in full:
    rows = [i for i, p in enumerate(paths) if node in p]
    assert rows == list(range(rows[0], rows[-1] + 1)), (node, rows)


@given(prompt_sets())
def test_detected_tree_is_exact_and_stores_shared_runs_once(case):
  count_case("sharing")
  prompts, counts, min_shared = case
  tree = detect_sharing(prompts, counts, min_shared_tokens=min_shared)
  check_tree(prompts, counts, min_shared, tree)
  assert PromptTree.from_prompts(prompts, counts, min_shared_tokens=min_shared) == tree


@given(st.lists(st.lists(SMALL, min_size=1, max_size=30), min_size=1, max_size=10))
def test_radix_tree_is_compressed_and_holds_each_prefix_once(contexts):
  count_case("radix_tree")
  radix = RadixTree.build(contexts)
  prefixes = {tuple(c[:i]) for c in contexts for i in range(1, len(c) + 1)}
  edge_tokens, stack, ended = 0, [(radix.root, ())], {}
  while stack:
    node, above = stack.pop()
    here = above + tuple(node.tokens)
    edge_tokens += len(node)
    for i in node.prompts:
      ended[i] = here
    if node is not radix.root:
      assert len(node) > 0 and (node.prompts or len(node.children) >= 2)  # compressed
    for first, child in node.children.items():
      assert child.tokens[0] == first
      stack.append((child, here))
  assert edge_tokens == len(prefixes)  # a trie's nodes, each token once
  assert ended == {i: tuple(c) for i, c in enumerate(contexts)}
  assert radix.nodes() <= 2 * len({tuple(c) for c in contexts}) + 1


def test_no_sharing_identical_prompts_and_prefixes():
  # No common first token: one segment per prompt, one level.
  tree = detect_sharing([[1, 2, 3], [4, 5], [6]], [1, 2, 1])
  assert tree.segments == (((1, 2), (4,)),) and tree.leaves == ((0, 0), (0, 1), (0, 1), NO_NODE)
  # Identical prompts share everything: one segment, every sample on it.
  p = list(range(50))
  tree = detect_sharing([p, p, p], [2, 1, 3])
  assert tree.segments == ((tuple(p[:-1]),),) and set(tree.leaves) == {(0, 0)}
  # A prompt that is a prefix of another ends at an inner node (its last token is not stored).
  q = list(range(100, 140))
  tree = detect_sharing([q, q[:20], q[:21]], 1, min_shared_tokens=1)
  assert tree.segments == ((tuple(q[:19]),), ((q[19],),), (tuple(q[20:39]),))
  assert tree.leaves == ((2, 0), (0, 0), (1, 0))
  assert [tree.prompt(b) for b in range(3)] == [q, q[:20], q[:21]]
  # By default the one-token run q[19] is no segment: it is duplicated into both continuations.
  tree = detect_sharing([q, q[:20], q[:21]], 1)
  assert tree.segments == ((tuple(q[:19]),), ((q[19],), tuple(q[19:39])))
  assert tree.leaves == ((1, 1), (0, 0), (1, 0))


def test_short_runs_are_carried_down_and_joined():
  a, b = list(range(200, 205)), list(range(300, 312))  # 5 + 12 tokens: 17 together
  x, y, z = [1, 2, 3], [4, 5], [6, 7, 8, 9]
  prompts = [a + b + x, a + b + y, a + z]
  tree = detect_sharing(prompts, 1)  # a alone (5 < 16): duplicated; a + b (17): one segment
  assert tree.segments == ((tuple(a + b), tuple(a + z[:-1])), ((1, 2), (4,)))
  assert tree.parents == ((-1, -1), (0, 0))
  assert tree.leaves == ((1, 0), (1, 1), (0, 1))
  assert detect_sharing(prompts, 1, min_shared_tokens=5).segments == (
      (tuple(a),), (tuple(b), tuple(z[:-1])), ((1, 2), (4,)))
  assert detect_sharing(prompts, 1, min_shared_tokens=18).segments == (
      (tuple(a + b + x[:-1]), tuple(a + b + y[:-1]), tuple(a + z[:-1])),)
  # A prompt ending inside a short run gets a leaf of just that run (the run is duplicated).
  tree = detect_sharing([a + b + x, a + [7]], 1)  # contexts a+b+x[:-1] and a: 5 shared < 16
  assert tree.segments == ((tuple(a), tuple(a + b + x[:-1])),)  # depth-first: the run's leaf first


def test_the_paper_setting_is_two_levels():
  rng = np.random.default_rng(0)
  shots = rng.integers(3, 32000, 2400).tolist()
  problems = [rng.integers(3, 32000, n).tolist() for n in rng.integers(300, 701, 120)]
  tree = detect_sharing([shots + p for p in problems], 128)
  assert tree.segments[0] == (tuple(shots),)
  assert tree.segments[1] == tuple(tuple(p[:-1]) for p in problems)
  assert tree.num_samples == 120 * 128 and tree.num_levels == 2
  order = tree.decode_order()
  assert (tree.node_of_sample(1)[order] == np.repeat(np.arange(120), 128)).all()


def test_deep_chains_need_no_recursion():
  base = list(range(1000, 1700))
  prompts = [base[:n] for n in range(2, 700, 1)]  # every prompt a prefix of the next
  tree = detect_sharing(prompts, 1, min_shared_tokens=1)
  assert tree.num_levels == len(prompts) and tree.shared_tokens == 698
  assert tree.prompt(len(prompts) - 1) == prompts[-1]


@pytest.mark.parametrize("args, kwargs, message", [
    (([],), {}, "at least one prompt"), (([[1], []],), {}, "prompt 1 is empty"),
    (([[1, 2]], 0), {}, "num_samples"), (([[1, 2], [3]], [1]), {}, "num_samples"),
    (([[1, 2]], 1.5), {}, "num_samples"), (([[1, 2]],), dict(min_shared_tokens=-1), "min_shared"),
])
def test_errors_name_the_argument(args, kwargs, message):
  with pytest.raises(ValueError, match=message):
    detect_sharing(*args, **kwargs)


# -- generation over detected trees ---------------------------------------------------------------

NEW = 8


@pytest.fixture(scope="module")
def tiny():
  from models.model.config import preset
  from models.model.llama import random_init
  config = preset("tiny").replace(num_heads=6, num_kv_heads=2, head_dim=16)
  return random_init(config, seed=3, std=0.12)


@nnx.jit
def _last_logits(model, ids, length):
  return model(ids)[0, length - 1]  # causal: position length - 1 never sees the right padding


def greedy_alone(model, prompt, n, width=64):
  """Greedy decoding of ONE prompt by re-running the plain full forward (no cache, no tree)
  for every token; the fixed width keeps one compiled program per model."""
  seq = np.zeros((1, width), np.int32)
  seq[0, :len(prompt)] = prompt
  for i in range(len(prompt), len(prompt) + n):
    seq[0, i] = int(jnp.argmax(_last_logits(model, jnp.asarray(seq), jnp.int32(i))))
  return seq[0, len(prompt):len(prompt) + n]


def tree_prompts():
  rng = np.random.default_rng(7)
  draw = lambda n: rng.integers(0, 256, n).tolist()
  shots, a, b = draw(20), draw(18), draw(3)
  p0 = shots + a + draw(4)
  return [p0,
          shots + a + draw(6),   # shares shots + a with p0
          shots + b + draw(5),   # shots, then a 3-token run (< 16: duplicated by default)
          shots + b + draw(2),
          shots + a,             # its context is a prefix of p0's (ends at an inner node)
          draw(9),               # unrelated
          [17],                  # one token: no context at all
          p0]                    # a repeat


def test_generation_over_detected_trees_equals_each_prompt_alone(tiny):
  prompts, counts = tree_prompts(), [2, 1, 1, 2, 1, 1, 2, 1]
  starts = np.cumsum([0] + counts)
  alone = [greedy_alone(tiny, p, NEW) for p in prompts]
  outs = {}
  # Default: [shots, unrelated] / [a, b + own (x2)] / [a's continuations (x2)]; with 2 the
  # 3-token run b is a segment too: [shots, unrelated] / [a, b] / [a's (x2), b's (x2)].
  for min_shared, sizes in ((DEFAULT_MIN_SHARED_TOKENS, [2, 3, 2]), (2, [2, 2, 4])):
    tree = PromptTree.from_prompts(prompts, counts, min_shared_tokens=min_shared)
    assert [len(level) for level in tree.segments] == sizes
    state = prefill(tiny, tree, max_new_tokens=NEW)
    # Every tree node prefilled once: the cache's levels are exactly the tree's.
    assert len(state.cache.levels) == len(sizes)
    for l, level in enumerate(state.cache.levels):
      assert level.k[0].shape[:2] == (len(tree.segments[l]), tree.lengths(l).max())
    out = outs[min_shared] = np.asarray(generate(tiny, tree, max_new_tokens=NEW))
    for i, n in enumerate(counts):
      np.testing.assert_array_equal(out[starts[i]:starts[i + 1]],
                                    np.broadcast_to(alone[i], (n, NEW)), err_msg=f"prompt {i}")
  # The list form uses the detected tree (default minimum).
  listed = generate(tiny, prompts, num_samples=counts, max_new_tokens=NEW)
  np.testing.assert_array_equal(np.asarray(listed), outs[DEFAULT_MIN_SHARED_TOKENS])


def test_smollm2_greedy_over_a_detected_tree():
  from models.checkpoints.loading import from_pretrained
  from model_checks import smollm2_gguf

  model, tokenizer, _ = from_pretrained(smollm2_gguf())  # float32
  questions = ["Which fruit is yellow?", "Which fruit is purple?", "What is 2+2?"]
  prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
             for q in questions]
  tree = detect_sharing(prompts, [2, 1, 1])
  # The chat template's start (system message, user turn: >= 16 tokens) once, then each
  # question ("Which fruit is" is shorter than 16 tokens: duplicated).
  assert [len(level) for level in tree.segments] == [1, 3] and len(tree.segments[0][0]) >= 16
  new = 5
  out = np.asarray(generate(model, prompts, num_samples=[2, 1, 1], max_new_tokens=new))
  for i, row in enumerate((0, 2, 3)):
    np.testing.assert_array_equal(out[row], greedy_alone(model, prompts[i], new))
  np.testing.assert_array_equal(out[0], out[1])
