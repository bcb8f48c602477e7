"""RadixTree against a brute-force model (a dict: cached page-aligned prefix -> its last page)
under random prompts with shared prefixes, repeats, locks and evictions; LRU order; locked
nodes survive; splits keep ids; page accounting; errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.serving import PagePool, RadixTree


def _cached(tree: RadixTree) -> dict[tuple, int]:
  """The tree's content as the model's dict: every page-aligned prefix -> its last page."""
  ps, out = tree.page_size, {}

  def visit(node, prefix):
    for k in range(node.pages.size):
      out[prefix + tuple(node.tokens[:(k + 1) * ps].tolist())] = int(node.pages[k])
    for child in node.children.values():
      visit(child, prefix + tuple(node.tokens.tolist()))

  visit(tree.root, ())
  return out


def _longest(model: dict, tokens, ps: int) -> int:
  n = len(tokens) // ps * ps
  while n and tuple(tokens[:n]) not in model:
    n -= ps
  return n


def _check_structure(tree: RadixTree):
  ps, seen = tree.page_size, set()
  for node in tree:
    assert node.pages.size >= 1 and node.tokens.size == node.pages.size * ps
    assert node.parent.children[tuple(node.tokens[:ps].tolist())] is node
    assert node.parent is tree.root or node.parent.last_access >= node.last_access
    locks = sum(c.lock_ref for c in node.children.values())
    assert node.lock_ref >= locks  # locks count along the path
    assert node.id not in seen
    seen.add(node.id)
  pages = [int(p) for node in tree for p in node.pages]
  assert len(pages) == len(set(pages))  # each page owned once
  assert all(tree.pool.refcount(p) == 1 for p in pages)  # the tree's one reference
  assert tree.pool.num_used == len(pages)  # nobody else holds pages in these tests


def _prompts(draw, ps):
  """Prompts from a few system prompts and questions over a tiny alphabet (many collisions)."""
  systems = draw(st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=3 * ps),
                          min_size=1, max_size=3))
  questions = st.lists(st.integers(0, 1), max_size=4 * ps)
  prompts = [draw(st.sampled_from(systems)) + draw(questions)
             for _ in range(draw(st.integers(1, 8)))]
  # Truncations of cached prompts: matches that end inside a node (splits).
  return prompts + [p[:draw(st.integers(0, len(p)))] for p in prompts[:3]]


@st.composite
def _scenarios(draw):
  ps = draw(st.sampled_from([1, 2, 3]))
  prompts = _prompts(draw, ps)
  ops = draw(st.lists(st.tuples(st.sampled_from(["insert", "insert", "match", "lock", "lock",
                                                 "unlock", "evict"]),
                                st.integers(0, len(prompts) - 1), st.integers(0, 40)),
                      min_size=4, max_size=25))
  return ps, prompts, ops, draw(st.integers(3, 16))


@settings(max_examples=400)
@given(scenario=_scenarios())
def test_tree_matches_a_brute_force_model(scenario):
  ps, prompts, ops, num_pages = scenario
  pool = PagePool(num_pages, ps)  # small: inserts evict, and evict has work to do
  tree, model, locked = RadixTree(pool), {}, []
  for op, i, k in ops:
    prompt = prompts[i]
    full = len(prompt) // ps * ps
    if op in ("insert", "match", "lock"):
      m = tree.match(prompt)
      assert m.num_tokens == _longest(model, prompt, ps)  # the longest cached prefix
      assert m.pages.tolist() == [model[tuple(prompt[:j])] for j in range(ps, m.num_tokens + 1, ps)]
      assert tree.path(m.node)[-1] is m.node if m.num_tokens else m.node is tree.root
      assert sum(n.num_tokens for n in tree.path(m.node)) == m.num_tokens if m.num_tokens else True
    if op == "insert":
      need = (full - m.num_tokens) // ps
      tree.lock(m.node)  # the match must survive the eviction that makes room for the rest
      tree.evict(need)
      after = _cached(tree)
      assert set(after) <= set(model) and m.num_tokens == _longest(after, prompt, ps)
      model = after
      new = pool.alloc(need)
      tree.unlock(m.node)
      if new is None:  # everything else locked
        continue
      # A copy computed elsewhere for some matched pages: insert releases the duplicates.
      dup = pool.alloc(min(k % 3, m.pages.size)) if pool.num_free >= 2 else np.zeros(0, np.int32)
      given_pages = np.concatenate([dup, m.pages[dup.size:], new]).astype(np.int32)
      before = dict(model)
      r = tree.insert(prompt[:full], given_pages)
      assert r.num_tokens == full
      for j in range(ps, full + 1, ps):
        model.setdefault(tuple(prompt[:j]), int(r.pages[j // ps - 1]))
      assert r.pages.tolist() == [model[tuple(prompt[:j])] for j in range(ps, full + 1, ps)]
      assert all(model[key] == page for key, page in before.items())  # cached pages kept
      assert all(pool.refcount(p) == 0 for p in dup)
      assert (r.node is tree.root) == (full == 0)
    elif op == "lock" and m.num_tokens:
      tree.lock(m.node)
      locked.append(m.node)
    elif op == "unlock" and locked:
      tree.unlock(locked.pop(k % len(locked)))
    elif op == "evict":
      # Every page-aligned prefix of a locked node's tokens must survive.
      held = [tuple(t for n in tree.path(node) for t in n.tokens.tolist()) for node in locked]
      protected = {key for key in model for h in held if h[:len(key)] == key}
      times = {n.id: n.last_access for n in tree}
      freed = tree.evict(k % num_pages)
      after = _cached(tree)
      assert set(after) <= set(model) and protected <= set(after)  # locked paths survive
      assert freed == len(model) - len(after)
      left = [n.last_access for n in tree if not n.children and n.lock_ref == 0]
      assert pool.num_free >= k % num_pages or not left  # stops at the target or when none is left
      removed = [t for i, t in times.items() if i not in {n.id for n in tree}]
      assert not removed or not left or max(removed) <= min(left)  # least recently used first
      model = after
    assert _cached(tree) == model
    _check_structure(tree)
  # With every lock released, clear() frees every page.
  for node in locked:
    tree.unlock(node)
  tree.clear()
  assert pool.num_free == pool.num_pages - 1 and list(tree) == []


def test_match_splits_at_page_boundary_and_keeps_the_locked_id():
  pool = PagePool(16, 2)
  tree = RadixTree(pool)
  r = tree.insert([1, 2, 3, 4, 5, 6], pool.alloc(3))
  tree.lock(r.node)
  m = tree.match([1, 2, 3, 4, 9, 9, 9])  # ends inside the node: split after 2 pages
  assert m.num_tokens == 4 and m.pages.tolist() == r.pages[:2].tolist()
  assert m.node.id != r.node.id and r.node.parent is m.node
  assert r.node.pages.tolist() == r.pages[2:].tolist()  # the locked node keeps its id, lower part
  assert m.node.lock_ref == 1 and tree.version == 2
  assert tree.match([1, 3]).num_tokens == 0 and tree.match([]).num_tokens == 0
  one = tree.match([1, 2, 3])  # partial pages never match; splits m.node after 1 page
  assert one.num_tokens == 2 and one.node.lock_ref == 1 and m.node.parent is one.node
  tree.unlock(r.node)
  assert m.node.lock_ref == one.node.lock_ref == 0
  assert [n.id for n in tree] == [one.node.id, m.node.id, r.node.id]
  assert len({n.id for n in tree} | {tree.root.id}) == 4


def test_insert_releases_duplicate_pages_and_returns_the_cached_ones():
  pool = PagePool(16, 2)
  tree = RadixTree(pool)
  first = tree.insert([1, 2, 3, 4], pool.alloc(2))
  again = pool.alloc(3)
  r = tree.insert([1, 2, 3, 4, 5, 6], again)
  assert r.pages.tolist() == first.pages.tolist() + [again[2]]
  assert [pool.refcount(p) for p in again] == [0, 0, 1]
  assert pool.num_used == 3 and tree.stats().cached_pages == 3


def test_lru_eviction_order_and_locked_nodes_survive():
  pool = PagePool(9, 1)  # 8 usable pages
  tree = RadixTree(pool)
  a = tree.insert([1, 1], pool.alloc(2)).node
  b = tree.insert([2, 2], pool.alloc(2)).node
  c = tree.insert([3, 3], pool.alloc(2)).node
  d = tree.insert([1, 1, 4, 4], np.concatenate([tree.match([1, 1]).pages, pool.alloc(2)])).node
  assert pool.num_free == 0 and d.parent is a
  tree.match([2, 2])  # b is now the most recent; then c, d (and a, its parent)
  tree.lock(c)
  assert tree.evict(0) == 0 and tree.evict(2) == 2  # until 2 are free: the oldest leaf, d
  assert {n.id for n in tree} == {a.id, b.id, c.id}
  assert tree.evict(2) == 0  # 2 are free already
  assert tree.evict(3) == 2  # then a (now a leaf)
  assert {n.id for n in tree} == {b.id, c.id}
  assert tree.evict(8) == 2  # then b; c is locked: 6 free, not 8
  assert [n.id for n in tree] == [c.id] and pool.num_free == 6
  tree.unlock(c)
  tree.clear()
  assert pool.num_free == 8 and tree.stats().nodes == 0


def test_evict_keeps_pages_someone_else_holds():
  pool = PagePool(8, 1)
  tree = RadixTree(pool)
  r = tree.insert([1, 2], pool.alloc(2))
  pool.incref(r.pages[:1])  # say, a copy-on-write reader
  assert tree.evict(7) == 1 and pool.refcount(r.pages[0]) == 1


def test_stats_and_dump():
  pool = PagePool(32, 2)
  tree = RadixTree(pool)
  shared = tree.insert([7, 7, 8, 8], pool.alloc(2))
  x = tree.insert([7, 7, 8, 8, 1, 1], np.concatenate([shared.pages, pool.alloc(1)])).node
  y = tree.insert([7, 7, 8, 8, 2, 2], np.concatenate([shared.pages, pool.alloc(1)])).node
  tree.lock(x)
  tree.lock(y)
  assert tree.match([7, 7, 8, 8, 1, 1, 5]).num_tokens == 6
  assert tree.match([9, 9]).num_tokens == 0
  s = tree.stats()
  assert (s.nodes, s.cached_pages, s.shared_pages, s.locked_pages) == (3, 4, 2, 4)
  assert (s.hit_tokens, s.queried_tokens) == (6, 9) and s.hit_rate == pytest.approx(6 / 9)
  text = tree.dump()
  assert f"#{x.id} tokens=[1, 1]" in text and "lock=2" in text
  tree.unlock(x)
  tree.unlock(y)
  tree.reset()
  s = tree.stats()
  assert (s.nodes, s.queried_tokens, s.hit_rate) == (0, 0, 0.0) and pool.num_used == 0


def test_dump_indents_by_depth():
  pool = PagePool(8, 1)
  tree = RadixTree(pool)
  for i in range(3):
    tree.insert(list(range(i + 1)), np.concatenate([tree.match(list(range(i))).pages,
                                                    pool.alloc(1)]))
  assert tree.dump().splitlines()[1:] == [
      "  #1 tokens=[0] (1) pages=[1] lock=0 t=6", "    #2 tokens=[1] (1) pages=[2] lock=0 t=6",
      "      #3 tokens=[2] (1) pages=[3] lock=0 t=6"]


def test_errors_name_the_argument():
  pool = PagePool(8, 2)
  tree = RadixTree(pool)
  with pytest.raises(ValueError, match="pool must be a PagePool"):
    RadixTree(object())
  with pytest.raises(ValueError, match="tokens must be a 1-D integer array"):
    tree.match([[1, 2]])
  with pytest.raises(ValueError, match="tokens must be a 1-D integer array"):
    tree.match([1.5, 2.0])
  with pytest.raises(ValueError, match=r"pages \(shape \(1,\)\) must be int\[len\(tokens\)"):
    tree.insert([1, 2, 3], pool.alloc(1))
  with pytest.raises(ValueError, match="num_pages=-1 "):
    tree.evict(-1)
  with pytest.raises(ValueError, match=r"pages \[3\] must all be allocated"):
    tree.insert([1, 2], [3])
  with pytest.raises(ValueError, match="page "):
    tree.insert([1, 2], [0])
  node = tree.insert([1, 2], pool.alloc(1)).node
  with pytest.raises(ValueError, match=f"node {node.id} is not locked"):
    tree.unlock(node)
  other = RadixTree(PagePool(8, 2))
  with pytest.raises(ValueError, match="node must be a node of this tree"):
    other.lock(node)
  with pytest.raises(ValueError, match="node must be a node of this tree"):
    tree.path("node")
  tree.clear()
  with pytest.raises(ValueError, match="node must be a node of this tree"):
    tree.lock(node)  # removed
  tree.lock(tree.root)  # an empty match: holds nothing
  tree.unlock(tree.root)
  assert tree.path(tree.root) == () and tree.root.lock_ref == 0


@settings(max_examples=150)
@given(ps=st.sampled_from([1, 2, 4]), num_pages=st.integers(4, 24), data=st.data())
def test_engine_like_page_accounting(ps, num_pages, data):
  """Requests arrive (match, lock, prefill the rest, insert, own tail) and finish (unlock,
  release own pages) under a small pool; evict when alloc fails. No page is both free and
  owned; the tree and the running sequences own every used page; in the end all are free."""
  pool = PagePool(num_pages, ps)
  tree, running = RadixTree(pool), []
  systems = [[7] * ps * 2, [8, 9] * ps, []]
  for _ in range(data.draw(st.integers(1, 30))):
    if running and data.draw(st.booleans()):  # a request finishes
      node, own = running.pop(data.draw(st.integers(0, len(running) - 1)))
      tree.unlock(node)
      pool.decref(own)
    else:  # a request arrives
      prompt = data.draw(st.sampled_from(systems)) + data.draw(
          st.lists(st.integers(0, 2), max_size=3 * ps))
      full = len(prompt) // ps * ps
      m = tree.match(prompt)
      tree.lock(m.node)  # hold the match while allocating, as an engine must
      need = (full - m.num_tokens) // ps + 1  # the new full pages and one own page
      if pool.num_free < need:
        tree.evict(need)
      pages = pool.alloc(need)
      tree.unlock(m.node)
      if pages is None:  # preempted: nothing taken
        continue
      node = tree.insert(prompt[:full], np.concatenate([m.pages, pages[:-1]])).node
      tree.lock(node)
      running.append((node, pages[-1:]))
    owned = [int(p) for n in tree for p in n.pages] + [int(o[0]) for _, o in running]
    assert len(owned) == len(set(owned))
    assert not set(owned) & set(pool._free)
    assert set(owned) | set(pool._free) == set(range(1, num_pages))
  for node, own in running:
    tree.unlock(node)
    pool.decref(own)
  tree.clear()
  assert pool.num_free == num_pages - 1 and tree.stats().nodes == 0
