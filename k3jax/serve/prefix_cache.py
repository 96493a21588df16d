"""KDA-aware prefix cache: MLA latent pages and KDA state checkpoints in one page pool (docs/k3.md §10).

A hybrid model can only resume a prompt from position b when it has, for that prefix,
  * the MLA latent cache of every token before b (every MLA layer), and
  * the KDA recurrent state *at exactly b* (every KDA layer: state + last conv inputs),
because a KDA state cannot be rebuilt from earlier states without re-running the tokens.
So a request reuses the longest hash boundary where both exist ("a 2800-token match reuses 2560").

Structure (all host-side, pure Python + numpy payloads; a real server keeps the payload on
device and copies asynchronously — the `landed` flags model that copy):
  * `PagePool`: `num_pages` pages of `page_bytes`; every object (an MLA block or a KDA checkpoint)
    owns whole pages; free pages come first, then least-recently-used unpinned objects are evicted.
  * MLA physical blocks of `block_tokens` (6144) tokens of latents for all MLA layers. Prefixes are
    hashed every `hash_tokens` (512) tokens with a chained hash; the index maps each chained hash
    to (block, offset). A request's new tokens go into fresh blocks starting at its reuse point
    (always a hash boundary), so shared blocks are never written again.
  * KDA checkpoints only at boundaries that are multiples of `kda_checkpoint_every` (a sparse
    subset of the hash boundaries). A checkpoint holds every KDA layer's state; it becomes
    matchable only when *all* layers have landed, and it is invalidated (index entry and pages of
    every layer) in one step — never one layer alone.
  * Reference counts: `match` pins what it returns before the caller allocates anything
    (pin-before-allocate: the allocation's evictions can then never take the pages being
    reused); `store` pins the new objects; `release` unpins a request's whole lease.
  * Entries whose copy has not landed are never matched and never evicted.

Typical request:
    lease = cache.match(tokens)                  # pins the reusable prefix
    latents = cache.read_mla(lease); states = cache.read_kda(lease)
    ... prefill tokens[lease.reused:] from those ...
    cache.store(lease, tokens, new_latents, checkpoints)   # allocates, copies (pending)
    cache.land(lease)                            # copies completed: now matchable by others
    cache.release(lease)                         # request finished
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class PrefixCacheConfig:
  """Sizes of the cache. Byte sizes are per token (MLA, all MLA layers) and per layer (KDA)."""
  num_pages: int
  page_bytes: int
  mla_bytes_per_token: int
  kda_layer_bytes: int
  num_kda_layers: int
  hash_tokens: int = 512
  block_tokens: int = 6144
  kda_checkpoint_every: int = 512

  def __post_init__(self):
    for f in ("num_pages", "page_bytes", "mla_bytes_per_token", "hash_tokens", "block_tokens",
              "kda_checkpoint_every"):
      v = getattr(self, f)
      if not isinstance(v, int) or v <= 0:
        raise ValueError(f"PrefixCacheConfig.{f}: expected a positive int, found {v!r}")
    if self.num_kda_layers < 0 or self.kda_layer_bytes < 0:
      raise ValueError("PrefixCacheConfig.num_kda_layers/kda_layer_bytes: expected >= 0")
    if self.block_tokens % self.hash_tokens:
      raise ValueError(f"PrefixCacheConfig.block_tokens: expected a multiple of hash_tokens="
                       f"{self.hash_tokens}, found {self.block_tokens}")
    if self.kda_checkpoint_every % self.hash_tokens:
      raise ValueError(f"PrefixCacheConfig.kda_checkpoint_every: expected a multiple of "
                       f"hash_tokens={self.hash_tokens}, found {self.kda_checkpoint_every}")

  @property
  def pages_per_block(self) -> int:
    return math.ceil(self.block_tokens * self.mla_bytes_per_token / self.page_bytes)

  @property
  def pages_per_kda_layer(self) -> int:
    return math.ceil(self.kda_layer_bytes / self.page_bytes) if self.kda_layer_bytes else 0


class PoolExhausted(RuntimeError):
  """Not enough free or evictable pages (everything else is pinned or still being copied)."""


@dataclasses.dataclass(eq=False)
class _Object:
  """Something that owns pages: an MLA block or a KDA checkpoint."""
  kind: str                       # "mla" | "kda"
  pages: list[int]
  refcount: int = 0
  last_used: int = 0
  # MLA: the hashes this block indexes; KDA: its one boundary hash.
  hashes: list[bytes] = dataclasses.field(default_factory=list)
  landed: bool = False            # MLA: the whole block's copy; KDA: see layer_landed
  layer_landed: list[bool] = dataclasses.field(default_factory=list)
  payload: object = None          # MLA: [L_mla, block_tokens, width]; KDA: per-layer list

  @property
  def ready(self) -> bool:
    return self.landed and all(self.layer_landed)


class PagePool:
  """Fixed pool of pages shared by all objects; owners are tracked per page."""

  def __init__(self, num_pages: int):
    self.num_pages = num_pages
    self._free = list(range(num_pages - 1, -1, -1))
    self.owner: dict[int, _Object] = {}

  @property
  def num_free(self) -> int:
    return len(self._free)

  def take(self, n: int, obj: _Object) -> list[int]:
    if n > len(self._free):
      raise PoolExhausted(f"need {n} pages, {len(self._free)} free")
    pages = [self._free.pop() for _ in range(n)]
    for p in pages:
      self.owner[p] = obj
    return pages

  def give_back(self, pages: Sequence[int]) -> None:
    for p in pages:
      del self.owner[p]
      self._free.append(p)


@dataclasses.dataclass(eq=False)
class Lease:
  """One request's view: what it reuses (pinned) and what it stored (pinned until release)."""
  tokens: tuple[int, ...]
  mla_hit: int                               # tokens with MLA latents available
  reused: int                                # resume point: MLA hit AND a KDA checkpoint
  _slots: list[tuple[_Object, int]]           # (block, token offset) per reused hash block
  _checkpoint: _Object | None
  _pinned: list[_Object] = dataclasses.field(default_factory=list)
  released: bool = False


class PrefixCache:
  """The KDA-aware prefix cache (see module docstring)."""

  def __init__(self, config: PrefixCacheConfig):
    self.config = config
    self.pool = PagePool(config.num_pages)
    self._mla_index: dict[bytes, tuple[_Object, int]] = {}
    self._kda_index: dict[bytes, _Object] = {}
    self._objects: set[_Object] = set()
    self._clock = 0

  # ---------------------------------------------------------------- hashing
  def chain_hashes(self, tokens: Sequence[int]) -> list[bytes]:
    """Chained hash of every full `hash_tokens` block: h_i covers tokens[: (i+1)·hash_tokens]."""
    n = self.config.hash_tokens
    out, h = [], b""
    for i in range(len(tokens) // n):
      block = np.asarray(tokens[i * n:(i + 1) * n], np.int64).tobytes()
      h = hashlib.sha256(h + block).digest()
      out.append(h)
    return out

  def _tick(self, obj: _Object) -> None:
    self._clock += 1
    obj.last_used = self._clock

  # ---------------------------------------------------------------- lookup
  def match(self, tokens: Sequence[int]) -> Lease:
    """Find and pin the longest reusable prefix of `tokens`.

    The resume point is the largest boundary b < len(tokens) (at least one token is left to
    compute the next-token logits) with landed MLA latents for all of tokens[:b] and a landed
    KDA checkpoint at b. Pins (refcount += 1) exactly the objects needed to resume there.
    """
    if len(tokens) == 0:
      raise ValueError("tokens: expected a non-empty prompt, found length 0")
    cfg = self.config
    hashes = self.chain_hashes(tokens)
    slots: list[tuple[_Object, int]] = []
    for h in hashes:
      hit = self._mla_index.get(h)
      if hit is None or not hit[0].ready:
        break
      slots.append(hit)
    mla_hit = len(slots) * cfg.hash_tokens
    reused, checkpoint = 0, None
    for i in range(len(slots), 0, -1):
      b = i * cfg.hash_tokens
      if b >= len(tokens) or b % cfg.kda_checkpoint_every:
        continue
      if cfg.num_kda_layers == 0:           # no KDA layer: any MLA boundary works
        reused = b
        break
      ck = self._kda_index.get(hashes[i - 1])
      if ck is not None and ck.ready:
        reused, checkpoint = b, ck
        break
    slots = slots[:reused // cfg.hash_tokens]
    lease = Lease(tuple(int(t) for t in tokens), mla_hit, reused, slots, checkpoint)
    for obj in {id(o): o for o, _ in slots}.values():
      self._pin(lease, obj)
    if checkpoint is not None:
      self._pin(lease, checkpoint)
    return lease

  def _pin(self, lease: Lease, obj: _Object) -> None:
    obj.refcount += 1
    self._tick(obj)
    lease._pinned.append(obj)

  def read_mla(self, lease: Lease) -> np.ndarray | None:
    """Latents of the reused prefix: [L_mla, lease.reused, width] (None when nothing is reused)."""
    if not lease._slots:
      return None
    n = self.config.hash_tokens
    return np.concatenate([blk.payload[:, off:off + n] for blk, off in lease._slots], axis=1)

  def read_kda(self, lease: Lease) -> list | None:
    """Per-KDA-layer checkpoint payloads at `lease.reused` (None when there is none)."""
    return None if lease._checkpoint is None else list(lease._checkpoint.payload)

  # ---------------------------------------------------------------- allocation / storing
  def _allocate(self, kind: str, num_pages: int) -> _Object:
    obj = _Object(kind, [])
    while self.pool.num_free < num_pages:
      victims = [o for o in self._objects if o.refcount == 0 and o.ready]
      if not victims:
        raise PoolExhausted(
            f"page pool: need {num_pages} pages, {self.pool.num_free} free and every other page "
            "is pinned or still being copied")
      self._evict(min(victims, key=lambda o: o.last_used))
    obj.pages = self.pool.take(num_pages, obj)
    self._objects.add(obj)
    self._tick(obj)
    return obj

  def _evict(self, obj: _Object) -> None:
    """Drop an object and all its index entries; a KDA checkpoint goes for every layer at once."""
    if obj.kind == "mla":
      for h in obj.hashes:
        if self._mla_index.get(h, (None,))[0] is obj:
          del self._mla_index[h]
    else:
      for h in obj.hashes:
        if self._kda_index.get(h) is obj:
          del self._kda_index[h]
    self.pool.give_back(obj.pages)
    obj.pages = []
    self._objects.discard(obj)

  def store(self, lease: Lease, latents: np.ndarray, checkpoints: dict[int, list]) -> None:
    """Write a request's new latents and KDA checkpoints (copies pending until `land`).

    latents: [L_mla, len(tokens) - lease.reused, width], the MLA latents of the tokens after the
      reuse point. checkpoints: {boundary: [payload per KDA layer]} for boundaries after the
      reuse point; only boundaries that are multiples of `kda_checkpoint_every` are kept (others
      are ignored: checkpoints are sparse on purpose). Call after `match` (the reused prefix is
      pinned first, so the evictions this allocation may trigger cannot touch it).
    """
    cfg = self.config
    if lease.released:
      raise ValueError("lease: already released")
    start, total = lease.reused, len(lease.tokens)
    if latents.shape[1] != total - start:
      raise ValueError(f"latents: expected {total - start} new tokens on axis 1, found "
                       f"{latents.shape[1]}")
    hashes = self.chain_hashes(lease.tokens)
    pinned_before = len(lease._pinned)
    try:
      self._store(lease, latents, checkpoints, hashes, start, total)
    except PoolExhausted:
      # All or nothing: drop what this call allocated so a failed request leaks no pages.
      for obj in lease._pinned[pinned_before:]:
        obj.refcount -= 1
        self._evict(obj)
      del lease._pinned[pinned_before:]
      raise

  def _store(self, lease, latents, checkpoints, hashes, start, total):
    cfg = self.config
    for pos in range(start, total, cfg.block_tokens):
      blk = self._allocate("mla", cfg.pages_per_block)
      self._pin(lease, blk)
      payload = np.zeros((latents.shape[0], cfg.block_tokens, latents.shape[2]), latents.dtype)
      chunk = latents[:, pos - start:pos - start + cfg.block_tokens]
      payload[:, :chunk.shape[1]] = chunk
      blk.payload = payload
      # Index every full hash block that lives in this physical block (not yet landed).
      for i in range(pos // cfg.hash_tokens, min(len(hashes), (pos + cfg.block_tokens) //
                                                  cfg.hash_tokens)):
        if hashes[i] not in self._mla_index:
          self._mla_index[hashes[i]] = (blk, i * cfg.hash_tokens - pos)
          blk.hashes.append(hashes[i])
    for b, layers in sorted(checkpoints.items()):
      if b <= start or b > total or b % cfg.kda_checkpoint_every or b % cfg.hash_tokens:
        continue
      if len(layers) != cfg.num_kda_layers:
        raise ValueError(f"checkpoints[{b}]: expected {cfg.num_kda_layers} KDA layers, found "
                         f"{len(layers)}")
      h = hashes[b // cfg.hash_tokens - 1]
      if h in self._kda_index:
        continue
      ck = self._allocate("kda", cfg.pages_per_kda_layer * cfg.num_kda_layers)
      self._pin(lease, ck)
      ck.landed = True
      ck.layer_landed = [False] * cfg.num_kda_layers
      ck.payload = [None] * cfg.num_kda_layers
      ck.hashes = [h]
      ck.pending = list(layers)
      self._kda_index[h] = ck

  def land(self, lease: Lease, kda_layers: Sequence[int] | None = None) -> None:
    """Mark the lease's pending copies as complete (optionally only some KDA layers).

    An MLA block becomes matchable when it lands; a KDA checkpoint only once every KDA layer has
    landed (a partially copied checkpoint is never used).
    """
    for obj in lease._pinned:
      if obj.kind == "mla":
        obj.landed = True
      elif hasattr(obj, "pending"):
        for l in (range(len(obj.layer_landed)) if kda_layers is None else kda_layers):
          obj.payload[l] = obj.pending[l]
          obj.layer_landed[l] = True
        if all(obj.layer_landed):
          del obj.pending

  def release(self, lease: Lease) -> None:
    """Unpin everything the lease holds (idempotent)."""
    if lease.released:
      return
    for obj in lease._pinned:
      obj.refcount -= 1
    lease.released = True

  # ---------------------------------------------------------------- invalidation / inspection
  def invalidate_checkpoint(self, tokens: Sequence[int], boundary: int) -> bool:
    """Atomically drop the KDA checkpoint of tokens[:boundary] (all KDA layers). Returns found.

    Raises if the checkpoint is pinned by a live request.
    """
    if boundary <= 0 or boundary % self.config.hash_tokens:
      raise ValueError(f"boundary: expected a positive multiple of "
                       f"{self.config.hash_tokens}, found {boundary}")
    h = self.chain_hashes(tokens[:boundary])[-1]
    ck = self._kda_index.get(h)
    if ck is None:
      return False
    if ck.refcount:
      raise ValueError(f"boundary {boundary}: checkpoint is pinned by {ck.refcount} request(s)")
    self._evict(ck)
    return True

  def kda_layer_hits(self, tokens: Sequence[int], boundary: int) -> list[bool]:
    """For each KDA layer, whether a usable checkpoint exists at `boundary` (all or none)."""
    h = self.chain_hashes(tokens[:boundary])[-1]
    ck = self._kda_index.get(h)
    ok = ck is not None and ck.ready
    return [ok] * self.config.num_kda_layers

  def refcounts(self, lease: Lease) -> list[int]:
    """Refcounts of the objects a lease holds (for tests and debugging)."""
    return [o.refcount for o in lease._pinned]

  def stats(self) -> dict:
    return dict(free_pages=self.pool.num_free, objects=len(self._objects),
                mla_entries=len(self._mla_index), kda_checkpoints=len(self._kda_index))


__all__ = ["PrefixCacheConfig", "PrefixCache", "PagePool", "Lease", "PoolExhausted"]
