"""The hybrid prefix cache on device: MLA latent pages shared read-only + KDA checkpoints.

A hybrid model resumes a prompt at position p only from (a) the MLA latents of every token
before p and (b) every KDA layer's state *at exactly p* — a recurrent state cannot be rebuilt
from an earlier one without re-running the tokens. So an entry is both, at one of the prompt's
checkpoint points (`k3jax.serve.grid`: multiples of the checkpoint interval, and turn
boundaries):

  key      the chained prefix key of tokens[:p] (`grid.prefix_keys`)
  pages    the MLA pages holding positions [0, p) (the last one possibly partly filled): a
           reference each (`PageAllocator`), shared read-only with every request that hits —
           a hit copies a partly filled last page before writing into it (copy-on-write)
  slot     a device checkpoint slot (`DeviceState.store`) holding the KDA caches at p, or
  host     the same arrays offloaded to host memory (optional, `host_bytes`)

Eviction is least-recently-used (a hit or an insert touches an entry): when a checkpoint is
needed and no device slot is free, the LRU entry's checkpoint moves to the host (while the
host budget allows, dropping the host's own LRU entries first) or the entry is dropped; when
pages are needed (`evict_for`), LRU entries are dropped until enough pages are free. Dropping
an entry releases its pages' references; pages a running request also holds stay.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from k3jax.serve.kv import DeviceState
from k3jax.serve.pages import PageAllocator


@dataclasses.dataclass(eq=False)
class Entry:
  key: bytes
  length: int                    # tokens covered: positions [0, length)
  pages: tuple[int, ...]         # ceil(length / page) pages
  slot: int | None = None        # device checkpoint slot
  host: object = None            # offloaded checkpoint (numpy arrays)
  last_used: int = 0


class HybridPrefixCache:
  """Entries keyed by prefix key (module doc). num_slots: device checkpoint slots (those of
  `device.store`); host_bytes: host offload budget (0: no offload)."""

  def __init__(self, device: DeviceState, allocator: PageAllocator, page_size: int,
               num_slots: int, host_bytes: int = 0):
    self.device, self.allocator, self.page_size = device, allocator, page_size
    self.entries: dict[bytes, Entry] = {}
    self._free_slots = list(range(num_slots - 1, -1, -1))
    self.host_bytes = host_bytes
    self._ckpt_bytes = device.checkpoint_bytes
    self._clock = 0
    self.stats = dict(lookups=0, hits=0, inserted=0, dropped=0, offloaded=0, host_restores=0)

  # ------------------------------------------------------------------ queries
  def _touch(self, e: Entry) -> None:
    self._clock += 1
    e.last_used = self._clock

  def lookup(self, keyed: Sequence[tuple[int, bytes]], limit: int) -> Entry | None:
    """The entry of the longest point p < limit among `keyed` [(p, key)] (ascending p)."""
    self.stats["lookups"] += 1
    for p, key in reversed(keyed):
      e = self.entries.get(key)
      if p < limit and e is not None:
        self.stats["hits"] += 1
        self._touch(e)
        return e
    return None

  @property
  def pages_held(self) -> set[int]:
    return {p for e in self.entries.values() for p in e.pages}

  @property
  def host_used(self) -> int:
    return self._ckpt_bytes * sum(e.host is not None for e in self.entries.values())

  # ------------------------------------------------------------------ restore and insert
  def restore(self, e: Entry, tile: int, row: int) -> None:
    """Slot (tile, row)'s KDA caches ← e's checkpoint (device slot, or from the host)."""
    if e.slot is not None:
      self.device.load(e.slot, tile, row)
    else:
      self.device.from_host(e.host, tile, row)
      self.stats["host_restores"] += 1

  def insert(self, key: bytes, length: int, pages: Sequence[int], tile: int, row: int) -> None:
    """An entry for tokens[:length] from slot (tile, row)'s KDA caches (which hold exactly
    `length` tokens) and its first ceil(length / page) pages. Present already: touched."""
    if key in self.entries:
      self._touch(self.entries[key])
      return
    slot = self._take_slot()
    if slot is None:
      return
    n = -(-length // self.page_size)
    e = Entry(key, length, tuple(pages[:n]), slot)
    self.allocator.incref(e.pages)
    self.device.save(tile, row, slot)
    self.entries[key] = e
    self._touch(e)
    self.stats["inserted"] += 1

  def _take_slot(self) -> int | None:
    if self._free_slots:
      return self._free_slots.pop()
    on_device = [e for e in self.entries.values() if e.slot is not None]
    if not on_device:
      return None
    victim = min(on_device, key=lambda e: e.last_used)
    slot = victim.slot
    if self.host_bytes >= self._ckpt_bytes:
      while self.host_used + self._ckpt_bytes > self.host_bytes:
        self._drop(min((e for e in self.entries.values() if e.host is not None),
                       key=lambda e: e.last_used))
      victim.host = self.device.to_host(slot)
      victim.slot = None
      self.stats["offloaded"] += 1
    else:
      self._drop(victim)
      self._free_slots.pop()      # _drop returned the victim's slot
    return slot

  # ------------------------------------------------------------------ eviction
  def _drop(self, e: Entry) -> None:
    del self.entries[e.key]
    self.allocator.decref(e.pages)
    if e.slot is not None:
      self._free_slots.append(e.slot)
    self.stats["dropped"] += 1

  def evict_for(self, need: int, protect: Entry | None = None) -> bool:
    """Drop LRU entries (never `protect`) until `need` pages are free; whether they are."""
    while self.allocator.num_free < need:
      victims = [e for e in self.entries.values() if e is not protect]
      if not victims:
        return False
      self._drop(min(victims, key=lambda e: e.last_used))
    return True

  def clear(self) -> None:
    for e in list(self.entries.values()):
      self._drop(e)


__all__ = ["Entry", "HybridPrefixCache"]
