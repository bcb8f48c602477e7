"""plan_cascade against a brute-force grouping on random prefix trees: every page on the paths
grouped by the set of running sequences that hold it (equal sets: one segment), shared when
>= 2 hold it and it is long enough or above a shared group; each sequence's levels + own keys
concatenate to exactly its context; rows depth-first; padding inert; errors named."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.serving import NULL_PAGE, CascadeConfig, CascadePlan, PagePool, RadixTree, plan_cascade


@dataclasses.dataclass
class Seq:
  path: tuple  # radix nodes, root excluded
  own_pages: np.ndarray
  own_length: int


@st.composite
def _running(draw):
  """A radix tree of random prompts (system prompts + questions) and the sequences decoding
  from them: several samples per prompt, prompts that are prefixes of others, own tails."""
  ps = draw(st.sampled_from([1, 2, 4]))
  systems = draw(st.lists(st.lists(st.integers(0, 2), max_size=4 * ps), min_size=1, max_size=3))
  prompts = [draw(st.sampled_from(systems)) + draw(st.lists(st.integers(0, 2), max_size=3 * ps))
             for _ in range(draw(st.integers(1, 6)))]
  pool = PagePool(512, ps)
  tree = RadixTree(pool)
  seqs = []
  for prompt in prompts:
    m = tree.match(prompt)
    full = len(prompt) // ps * ps
    pages = np.concatenate([m.pages, pool.alloc((full - m.num_tokens) // ps)])
    node = tree.insert(prompt[:full], pages).node
    for _ in range(draw(st.integers(0, 3))):  # samples of this prompt
      own_length = len(prompt) - full + draw(st.integers(0, 3 * ps))
      own = pool.alloc(-(-own_length // ps) + draw(st.integers(0, 1)))  # maybe one page ahead
      seqs.append(Seq(node, own, own_length))
  # Paths are read once the tree stopped changing: a later insert or match may split nodes.
  for s in seqs:
    s.path = () if s.path is tree.root else tree.path(s.path)
  min_shared = draw(st.sampled_from([0, 1, ps, 2 * ps, 3 * ps, 100]))
  perm = draw(st.permutations(range(len(seqs))))
  return ps, [seqs[i] for i in perm], min_shared


def _plan(ps, seqs, config):
  return plan_cascade([s.path for s in seqs], [s.own_pages for s in seqs],
                      [s.own_length for s in seqs], ps, config)


def _context(seq: Seq, ps: int) -> list[int]:
  """The pages of a sequence's context in token order (the own tail's used pages)."""
  return ([int(p) for n in seq.path for p in n.pages]
          + seq.own_pages[:-(-seq.own_length // ps)].tolist())


def _brute_force(seqs, ps, min_shared):
  """Shared groups: frozenset of sequences -> its pages in order (the model of segments)."""
  holders = {}
  for i, s in enumerate(seqs):
    for n in s.path:
      for p in n.pages:
        holders.setdefault(int(p), set()).add(i)
  groups = {}
  for p, who in holders.items():  # dict order is each path's order: pages stay in token order
    groups.setdefault(frozenset(who), []).append(p)
  shared = {}
  for who in sorted(groups, key=len):  # a group's subgroups first (fewer holders)
    below = any(shared[w] for w in shared if w < who)
    shared[who] = len(who) >= 2 and (len(groups[who]) * ps >= min_shared or below)
  return {who: pages for who, pages in groups.items() if shared[who]}


@settings(max_examples=250)
@given(case=_running())
def test_plan_matches_brute_force_grouping(case):
  ps, seqs, min_shared = case
  plan = _plan(ps, seqs, CascadeConfig(min_shared_tokens=min_shared))
  n, (B, L, S, P, O) = len(seqs), plan.plan_key
  order = plan.order[:n].tolist()
  assert sorted(order) == list(range(n)) and (plan.order[n:] == -1).all()
  row_of = {i: r for r, i in enumerate(order)}

  # The concatenation invariant: levels in order, then own keys = the context, every page once.
  for i, s in enumerate(seqs):
    r, got, tokens = row_of[i], [], 0
    for lv in range(L):
      j = plan.segment_of_seq[lv, r]
      if j >= 0:
        assert plan.lengths[lv, j] > 0 and plan.lengths[lv, j] % ps == 0
        got += plan.page_table[lv, j, :plan.lengths[lv, j] // ps].tolist()
        tokens += int(plan.lengths[lv, j])
      else:  # a sequence's shared segments are the first levels, without gaps
        assert (plan.segment_of_seq[lv:, r] == -1).all()
        break
    own_len = int(plan.own_lengths[r])
    got += plan.own_page_table[r, :-(-own_len // ps)].tolist()
    assert got == _context(s, ps)
    assert tokens + own_len == sum(n.num_tokens for n in s.path) + s.own_length

  # Segments = the brute-force shared groups, at the level of the shared groups above them.
  expected = _brute_force(seqs, ps, min_shared)
  found = {}
  for lv in range(L):
    for j in range(S):
      length = int(plan.lengths[lv, j])
      if not length:
        continue
      start, count = int(plan.seq_start[lv, j]), int(plan.seq_count[lv, j])
      rows = np.flatnonzero(plan.segment_of_seq[lv] == j)
      assert rows.tolist() == list(range(start, start + count))  # one contiguous row range
      who = frozenset(order[r] for r in rows)
      assert who not in found
      found[who] = plan.page_table[lv, j, :length // ps].tolist()
      assert lv == sum(1 for w in expected if w > who)  # its depth among shared groups
  assert found == expected
  assert plan.num_levels == max((sum(1 for w in expected if w >= v) for v in expected), default=0)
  all_pages = [p for pages in found.values() for p in pages]
  assert len(all_pages) == len(set(all_pages))  # a shared page in exactly one segment

  # Padding is inert: length 0, null pages, no rows.
  used = plan.lengths > 0
  assert (plan.seq_count[~used] == 0).all() and (plan.page_table[~used] == NULL_PAGE).all()
  for lv in range(L):
    for j in range(S):
      assert (plan.page_table[lv, j, plan.lengths[lv, j] // ps:] == NULL_PAGE).all()
  assert (plan.segment_of_seq[:, n:] == -1).all() and (plan.own_lengths[n:] == 0).all()
  assert (plan.own_page_table[n:] == NULL_PAGE).all()
  for r, i in enumerate(order):
    own_total = len(_context(seqs[i], ps)) - sum(len(found[w]) for w in found if i in w)
    extra = seqs[i].own_pages.size - -(-seqs[i].own_length // ps)  # pages allocated ahead
    assert (plan.own_page_table[r, own_total + extra:] == NULL_PAGE).all()

  # Buckets: powers of two, at least 1; the plan is a value.
  for size in plan.plan_key:
    assert size >= 1 and size & (size - 1) == 0
  assert B >= n and L >= plan.num_levels
  again = _plan(ps, seqs, CascadeConfig(min_shared_tokens=min_shared))
  assert again == plan and hash(again) == hash(plan) and again.plan_key == plan.plan_key
  with pytest.raises(ValueError, match="read-only"):
    plan.own_lengths[0] = 1


def _chain_tree():
  """Prompts a+b+c (2 samples), a+b (1 sample), a+d (1 sample), page_size 2."""
  pool = PagePool(64, 2)
  tree = RadixTree(pool)
  a, b, c, d = [1, 1, 2, 2], [3, 3], [4, 4, 5, 5], [6, 6]
  abc = tree.insert(a + b + c, pool.alloc(5)).node
  ab = tree.match(a + b).node  # splits: a+b | c
  ad = tree.insert(a + d, np.concatenate([tree.match(a).pages, pool.alloc(1)])).node
  paths = [tree.path(abc), tree.path(ad), tree.path(abc), tree.path(ab)]
  own = [pool.alloc(1) for _ in paths]
  return tree, paths, own, [1, 2, 0, 2]


def test_chain_levels_and_order_by_hand():
  tree, paths, own, own_lengths = _chain_tree()
  a, b, c = paths[0]
  d = paths[1][1]
  assert paths[1][0] is a and paths[3] == (a, b) and b.id < d.id
  plan = plan_cascade(paths, own, own_lengths, 2)
  # a: 4 sequences, b: 3 (0, 2, 3), c: 2 (0, 2), d: 1 (own).
  assert plan.segment_nodes == (((a.id,),), ((b.id,),), ((c.id,),))
  # Depth first, children by id: under b, sequence 3 ends there, then c's 0 and 2; then d's 1.
  assert plan.order.tolist() == [3, 0, 2, 1]
  assert plan.seq_start[:3, 0].tolist() == [0, 0, 1] and plan.seq_count[:3, 0].tolist() == [4, 3, 2]
  assert plan.segment_of_seq.tolist() == [[0, 0, 0, 0], [0, 0, 0, -1], [-1, 0, 0, -1],
                                          [-1, -1, -1, -1]]
  assert plan.plan_key == (4, 4, 1, 2, 2)
  assert plan.own_lengths.tolist() == [2, 1, 0, 2 + 2]
  assert plan.own_page_table[3].tolist() == d.pages.tolist() + own[1].tolist()


def test_min_shared_tokens_keeps_short_segments_above_shared_ones():
  tree, paths, own, own_lengths = _chain_tree()
  a, b, c = paths[0]
  # b (2 tokens) is short, but c (4 tokens, 2 sequences) below it is shared: b stays shared,
  # so that each sequence's shared parts are a prefix of its context.
  plan = plan_cascade(paths, own, own_lengths, 2, CascadeConfig(min_shared_tokens=3))
  assert plan.segment_nodes == (((a.id,),), ((b.id,),), ((c.id,),))
  # Without sequence 2, c is held by one sequence: b is short and joins the own pages.
  keep = [0, 1, 3]
  plan = plan_cascade([paths[i] for i in keep], [own[i] for i in keep],
                      [own_lengths[i] for i in keep], 2, CascadeConfig(min_shared_tokens=3))
  assert plan.segment_nodes == (((a.id,),),)
  assert plan.order.tolist() == [2, 0, 1, -1]
  assert (plan.own_page_table[1, :4].tolist()
          == b.pages.tolist() + c.pages.tolist() + own[0].tolist())
  assert plan.own_lengths[:3].tolist() == [2 + 2, 2 + 4 + 1, 2 + 2]
  # Nothing long enough: no level; padding only.
  plan = plan_cascade(paths, own, own_lengths, 2, CascadeConfig(min_shared_tokens=5))
  assert plan.num_levels == 0 and plan.plan_key[1:4] == (1, 1, 1)
  assert (plan.segment_of_seq == -1).all() and (plan.lengths == 0).all()


def test_given_buckets_and_equality():
  tree, paths, own, own_lengths = _chain_tree()
  config = CascadeConfig(batch=(8, 64), levels=(4,), segments=[2, 16], pages=(3, 8),
                         own_pages=(16,))
  assert config.segments == (2, 16)
  plan = plan_cascade(paths, own, own_lengths, 2, config)
  assert plan.plan_key == (8, 4, 2, 3, 16)
  assert plan == plan_cascade(paths, own, own_lengths, 2, config)
  assert plan != plan_cascade(paths, own, [1, 2, 0, 1], 2, config)  # one length changed
  assert plan != plan_cascade(paths[:3], own[:3], own_lengths[:3], 2, config)
  assert {plan: 1}[plan_cascade(paths, own, own_lengths, 2, config)] == 1
  assert isinstance(plan, CascadePlan) and plan != "plan"
  with pytest.raises(ValueError, match="4 batch exceed the largest bucket batch=2"):
    plan_cascade(paths, own, own_lengths, 2, CascadeConfig(batch=(1, 2)))
  empty = plan_cascade([], [], [], 2)
  assert empty.plan_key == (1, 1, 1, 1, 1) and empty.num_seqs == 0 and empty.order[0] == -1


def test_errors_name_the_argument():
  tree, paths, own, own_lengths = _chain_tree()
  with pytest.raises(ValueError, match="paths, own_pages, own_lengths must have one entry"):
    plan_cascade(paths, own[:2], own_lengths, 2)
  with pytest.raises(ValueError, match=r"own_lengths\[1\]=3 must be in \[0, 1 own pages"):
    plan_cascade(paths, own, [1, 3, 0, 2], 2)
  with pytest.raises(ValueError, match="page_size=0 "):
    plan_cascade(paths, own, own_lengths, 0)
  a, b, c = paths[0]
  with pytest.raises(ValueError, match=rf"paths\[1\]: node {c.id} appears under parents"):
    plan_cascade([paths[0], (a, c)], own[:2], own_lengths[:2], 2)
  with pytest.raises(ValueError, match="min_shared_tokens=-1 "):
    CascadeConfig(min_shared_tokens=-1)
  with pytest.raises(ValueError, match=r"pages=\(4, 2\) must be None or an ascending tuple"):
    CascadeConfig(pages=(4, 2))
  with pytest.raises(ValueError, match=r"batch=\(0,\) must be None"):
    CascadeConfig(batch=(0,))


def test_deep_paths_and_any_node_type():
  """Nodes need only ``id`` and ``pages``; a path thousands of nodes deep plans fine."""
  import types
  nodes = [types.SimpleNamespace(id=i, pages=np.array([i + 1])) for i in range(3000)]
  plan = plan_cascade([nodes, nodes[:2000]], [[9000], [9001]], [1, 1], 1)
  assert plan.segment_nodes == ((tuple(range(2000)),),)  # one chain: one segment
  assert plan.order.tolist() == [1, 0] and plan.lengths[0, 0] == 2000
  assert plan.own_lengths.tolist() == [1, 1001]
  assert plan.own_page_table[1, :1001].tolist() == list(range(2001, 3001)) + [9000]
