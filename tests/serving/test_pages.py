"""PagePool: the null page, alloc/incref/decref accounting against a model of reference counts
under random operation sequences, counters, and errors that name the argument."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.serving import NULL_PAGE, PagePool


def _check_invariants(pool: PagePool, refs: dict[int, int]):
  """Every usable page is either free or held (never both); counts equal the model's."""
  free = set(pool._free)
  held = {p for p, r in refs.items() if r > 0}
  assert len(free) == len(pool._free)  # no page twice on the free list
  assert not free & held
  assert free | held == set(range(1, pool.num_pages))
  assert NULL_PAGE not in free and pool.refcount(1) >= 0
  for p in range(1, pool.num_pages):
    assert pool.refcount(p) == refs.get(p, 0)
  every = np.arange(1, pool.num_pages)
  assert pool.refcounts(every).tolist() == [refs.get(p, 0) for p in every]
  assert pool.num_free + pool.num_used == pool.num_pages - 1


def test_alloc_hands_out_pages_and_never_the_null_page():
  pool = PagePool(num_pages=5, page_size=16)
  assert (pool.num_free, pool.num_used) == (4, 0)
  pages = pool.alloc(3)
  assert pages.dtype == np.int32 and pages.tolist() == [1, 2, 3]
  assert pool.alloc(0).shape == (0,)
  assert pool.alloc(2) is None  # one free: nothing taken
  assert pool.num_free == 1
  assert pool.alloc(1).tolist() == [4]
  assert pool.alloc(1) is None
  pool.decref(pages)
  assert pool.num_free == 3
  again = pool.alloc(3)
  assert sorted(again.tolist()) == [1, 2, 3]
  stats = pool.stats()
  assert (stats.allocated, stats.freed, stats.failed_allocs, stats.peak_used) == (7, 3, 2, 4)


def test_refcounts_free_at_zero():
  pool = PagePool(4, 2)
  pages = pool.alloc(2)
  pool.incref(pages[:1])
  pool.incref([pages[0], pages[0]])  # repeats count
  assert pool.refcount(pages[0]) == 4
  pool.decref(pages)
  assert pool.num_used == 1 and pool.refcount(pages[1]) == 0
  pool.decref([pages[0]] * 3)
  assert pool.num_used == 0 and pool.num_free == 3


@settings(max_examples=150)
@given(num_pages=st.integers(2, 12), ops=st.lists(
    st.tuples(st.sampled_from(["alloc", "incref", "decref"]), st.integers(0, 6),
              st.integers(0, 2**16)), max_size=40))
def test_random_operations_match_a_model(num_pages, ops):
  pool, refs = PagePool(num_pages, 4), {}
  for op, k, seed in ops:
    rng = np.random.default_rng(seed)
    held = [p for p, r in refs.items() if r > 0]
    if op == "alloc":
      pages = pool.alloc(k)
      if k > num_pages - 1 - len(held):
        assert pages is None
      else:
        assert pages.size == k and not set(pages.tolist()) & set(held)
        refs.update({int(p): 1 for p in pages})
    elif held:
      pages = rng.choice(held, size=min(k, 2 * len(held)))
      if op == "incref":
        pool.incref(pages)
        for p in pages:
          refs[int(p)] += 1
      elif all(refs[int(p)] >= np.sum(pages == p) for p in pages):
        pool.decref(pages)
        for p in pages:
          refs[int(p)] -= 1
      else:  # more drops than references: refused, nothing changes
        with pytest.raises(ValueError, match="double free"):
          pool.decref(pages)
    _check_invariants(pool, refs)
  # Releasing everything frees every page.
  for p, r in refs.items():
    if r:
      pool.decref([p] * r)
  assert pool.num_free == num_pages - 1 and pool.num_used == 0


def test_errors_name_the_argument():
  with pytest.raises(ValueError, match="num_pages=1 "):
    PagePool(1, 4)
  with pytest.raises(ValueError, match="page_size=0 "):
    PagePool(4, 0)
  pool = PagePool(4, 2)
  with pytest.raises(ValueError, match="n=-1 "):
    pool.alloc(-1)
  with pytest.raises(ValueError, match="n=1.5 "):
    pool.alloc(1.5)
  pages = pool.alloc(1)
  pool.decref(pages)
  with pytest.raises(ValueError, match=r"pages \[1\] .*double free"):
    pool.decref(pages)
  with pytest.raises(ValueError, match=r"pages \[1\] are free"):
    pool.incref(pages)
  for bad in ([0], [4], [-1]):
    with pytest.raises(ValueError, match=r"pages \[-?\d\] are not page ids 1..3"):
      pool.decref(bad)
  with pytest.raises(ValueError, match="pages must be a 1-D integer array"):
    pool.incref([[1]])
  with pytest.raises(ValueError, match="pages must be a 1-D integer array"):
    pool.decref([1.0])
  with pytest.raises(ValueError, match="page "):
    pool.refcount(9)
  assert pool.num_free == 3  # failed calls changed nothing


def _req(tokens: list[int]):
  """A request's scheduler state for ``tokens`` (its context: all but one more last token)."""
  import types

  from models.serving.state import Req
  return Req(types.SimpleNamespace(request=None), np.asarray(tokens + [0], np.int32))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40),
       st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 6))
def test_page_keys_are_equal_exactly_for_equal_whole_pages(a, b, page_size):
  # Admission compares prompts by these keys: key k stands for the first k + 1 whole pages of
  # the context (the prompt without its last token), for the page size asked.
  ra, rb = _req(a), _req(b)
  for ps in (page_size, page_size + 1):  # a second page size: keys of its own pages
    ka, kb = ra.page_keys(ps), rb.page_keys(ps)
    assert len(ka) == len(a) // ps and len(kb) == len(b) // ps
    for k in range(min(len(ka), len(kb))):
      assert (ka[k] == kb[k]) == (a[:(k + 1) * ps] == b[:(k + 1) * ps])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=14), min_size=1, max_size=8),
       st.integers(0, 3), st.integers(1, 3))
def test_prefill_index_finds_exactly_the_requests_with_a_key(prompts, split, page_size):
  # The admission's index of prefilling requests against a scan of them all, with requests
  # joining after some lookups were made (the index keeps its built tables up to date).
  from models.serving.state import PrefillIndex

  reqs = [_req(p) for p in prompts]
  index = PrefillIndex(reqs[:split], page_size)
  members = list(reqs[:split])

  def check():
    for m in range(4):
      for probe in reqs:
        keys = probe.page_keys(page_size)
        if len(keys) > m:
          want = [r for r in members if len(r.page_keys(page_size)) > m
                  and r.page_keys(page_size)[m] == keys[m]]
          assert index.sharing(m, keys[m]) == want

  check()
  for r in reqs[split:]:
    index.add(r)
    members.append(r)
    check()
