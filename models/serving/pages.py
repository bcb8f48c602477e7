"""A host allocator of KV-cache pages: a free list and a reference count per page.

Pages are ids ``0 .. num_pages-1`` into a per-layer device pool ``[num_pages, page_size, ...]``.
Page :data:`NULL_PAGE` (0) is reserved: it is never handed out, so page tables are padded
with it and a padded gather reads a real (ignored) page instead of going out of bounds.
Usable capacity is therefore ``num_pages - 1``.

Ownership is by reference: :meth:`PagePool.alloc` returns pages holding one reference each;
every holder (a running sequence, the radix tree) owns one reference per page it keeps, and
the page returns to the free list when the last one is dropped by :meth:`PagePool.decref`.
"""

import dataclasses

import numpy as np

NULL_PAGE = 0


@dataclasses.dataclass(frozen=True)
class PoolStats:
  """Counters of a :class:`PagePool` since it was made (pages, not calls)."""
  num_pages: int
  num_free: int
  num_used: int
  allocated: int  # pages handed out by alloc
  freed: int  # pages returned to the free list
  failed_allocs: int  # alloc calls answered None
  peak_used: int


class PagePool:
  """Page ids ``1 .. num_pages-1`` with reference counts; page 0 is the null page.

  >>> pool = PagePool(num_pages=8, page_size=16)
  >>> pages = pool.alloc(3)        # int32[3], one reference each
  >>> pool.incref(pages[:1]); pool.decref(pages); pool.num_used
  1
  """

  def __init__(self, num_pages: int, page_size: int):
    if not isinstance(num_pages, (int, np.integer)) or num_pages < 2:
      raise ValueError(f"num_pages={num_pages!r} must be an int >= 2 (page 0 is the null page)")
    if not isinstance(page_size, (int, np.integer)) or page_size < 1:
      raise ValueError(f"page_size={page_size!r} must be a positive int")
    self.num_pages, self.page_size = int(num_pages), int(page_size)
    self._refs = np.zeros(self.num_pages, np.int32)
    # A stack popped from the end: the lowest ids go out first, freed pages are reused first
    # (their device memory is the most likely to still be in cache).
    self._free = list(range(self.num_pages - 1, NULL_PAGE, -1))
    self._allocated = self._freed = self._failed = self._peak = 0

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def num_used(self) -> int:
    return self.num_pages - 1 - len(self._free)

  def refcount(self, page: int) -> int:
    """References held on ``page`` (0: free)."""
    return int(self.refcounts(np.asarray([page]))[0])

  def refcounts(self, pages) -> np.ndarray:
    """References held on each of ``pages`` (int[n]; 0: free)."""
    return self._refs[self._check(pages, "pages")]

  def alloc(self, n: int) -> np.ndarray | None:
    """``n`` free pages, int32[n], one reference each; None (nothing taken) if fewer are free."""
    if not isinstance(n, (int, np.integer)) or n < 0:
      raise ValueError(f"n={n!r} must be an int >= 0")
    if n > len(self._free):
      self._failed += 1
      return None  # the caller evicts or preempts, then asks again
    pages = np.asarray(self._free[len(self._free) - n:][::-1], np.int32)
    del self._free[len(self._free) - n:]
    self._refs[pages] = 1
    self._allocated += n
    self._peak = max(self._peak, self.num_used)
    return pages

  def incref(self, pages) -> None:
    """One more reference on each of ``pages`` (int[n]; repeats count), all in use."""
    pages = self._check(pages, "pages")
    if np.any(self._refs[pages] == 0):
      raise ValueError(f"pages {sorted(set(pages[self._refs[pages] == 0].tolist()))} are free: "
                       "incref needs pages in use (alloc them)")
    np.add.at(self._refs, pages, 1)

  def decref(self, pages) -> None:
    """Drops one reference from each of ``pages`` (repeats count); a page at 0 is freed."""
    pages = self._check(pages, "pages")
    ids, counts = np.unique(pages, return_counts=True)
    # Checked before anything changes, so a bad call leaves the pool as it was.
    over = ids[self._refs[ids] < counts]
    if over.size:
      raise ValueError(f"pages {over.tolist()} have fewer references than decref drops "
                       "(double free)")
    self._refs[ids] -= counts.astype(np.int32)
    freed = ids[self._refs[ids] == 0]
    self._free.extend(freed[::-1].tolist())
    self._freed += int(freed.size)

  def stats(self) -> PoolStats:
    return PoolStats(self.num_pages, self.num_free, self.num_used, self._allocated, self._freed,
                     self._failed, self._peak)

  def _check(self, pages, name: str) -> np.ndarray:
    pages = np.asarray(pages)
    if pages.ndim != 1 or (pages.size and not np.issubdtype(pages.dtype, np.integer)):
      raise ValueError(f"{name} must be a 1-D integer array, got shape {pages.shape} "
                       f"dtype {pages.dtype}")
    pages = pages.astype(np.int64)
    bad = pages[(pages <= NULL_PAGE) | (pages >= self.num_pages)]
    if bad.size:
      raise ValueError(f"{name} {bad.tolist()} are not page ids 1..{self.num_pages - 1} "
                       f"(page {NULL_PAGE} is the null page)")
    return pages

  def __repr__(self) -> str:
    return (f"PagePool(num_pages={self.num_pages}, page_size={self.page_size}, "
            f"used={self.num_used}, free={self.num_free})")
