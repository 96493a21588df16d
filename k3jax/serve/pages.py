"""Host bookkeeping of the MLA latent pages: a free list and a reference count per page.

The pages themselves are device arrays (`k3jax.cache.MLAPages`, one pool per MLA layer, the
same page id in every layer). Page 0 is the zero page: never handed out, it fills the unused
entries of a block table. A page is referenced by the requests whose block tables hold it and
by the prefix-cache entries that cover it; it returns to the free list when the last
reference goes.
"""

from __future__ import annotations

from typing import Iterable

NULL_PAGE = 0


class OutOfPages(RuntimeError):
  """Not enough free pages (the caller evicts cache entries or waits)."""


class PageAllocator:
  """Pages 1 … num_pages−1 with reference counts."""

  def __init__(self, num_pages: int):
    if num_pages < 2:
      raise ValueError(f"num_pages: expected >= 2 (page 0 is the zero page), found {num_pages}")
    self.num_pages = num_pages
    self._free = list(range(num_pages - 1, 0, -1))   # pop() hands out low ids first
    self._refs = [0] * num_pages

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def num_used(self) -> int:
    return self.num_pages - 1 - len(self._free)

  def refcount(self, page: int) -> int:
    return self._refs[page]

  def alloc(self, n: int) -> list[int]:
    """n fresh pages, each with one reference; OutOfPages when fewer are free."""
    if n > len(self._free):
      raise OutOfPages(f"need {n} pages, {len(self._free)} free")
    pages = [self._free.pop() for _ in range(n)]
    for p in pages:
      self._refs[p] = 1
    return pages

  def incref(self, pages: Iterable[int]) -> None:
    for p in pages:
      if p == NULL_PAGE or self._refs[p] < 1:
        raise ValueError(f"page {p}: incref of a page that is not allocated")
      self._refs[p] += 1

  def decref(self, pages: Iterable[int]) -> None:
    for p in pages:
      if p == NULL_PAGE or self._refs[p] < 1:
        raise ValueError(f"page {p}: decref of a page that is not allocated")
      self._refs[p] -= 1
      if self._refs[p] == 0:
        self._free.append(p)


__all__ = ["NULL_PAGE", "OutOfPages", "PageAllocator"]
