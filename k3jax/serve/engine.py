"""The serving engine: continuous batching over a fixed set of slots — the one place requests
are scheduled.

    engine = Engine(config, variables, EngineConfig(num_slots=8, max_len=2048))
    rid = engine.submit(prompt_ids, RequestParams(max_tokens=64), on_update=callback)
    while engine.step(): ...              # or engine.generate([...]) / an EngineLoop thread

Slots and tiles. `num_slots` slots, grouped in decode tiles of `tile_rows` (slot i is row
i % rows of tile i // rows). A slot holds one request: its KDA caches are its row of the tile
(`DeviceState.kda`), its MLA latents live in pages listed by its block-table row.

A step (`step`):
  1. requests submitted or cancelled since the last step are taken in (any thread may call
     `submit` / `cancel`; the engine thread runs `step`);
  2. admission: waiting requests, first come first served, take free slots. Each looks up the
     hybrid prefix cache (`HybridPrefixCache`) for its longest cached checkpoint point p; a hit
     restores the KDA checkpoint into the slot's row and shares the pages of [0, p) (copying a
     partly filled last page); the request's remaining pages — for its whole prompt and
     `max_tokens` — are reserved now (evicting LRU cache entries if needed), so a running
     request never runs out; a request that cannot get them waits at the head of the queue;
  3. decode: every tile with a decoding slot runs the decode program once (one token per row);
  4. prefill: the prefilling slots, in admission order, run their next pieces (`grid.pieces`:
     split at the grid, at turn boundaries and at the prompt's end, from p) while the step's
     token budget (`step_tokens`, less the decode rows) lasts — at least one piece per step;
     the oldest slot's next piece shares its program with up to `prefill_rows` − 1 other
     slots' next pieces of the same bucket.
     After a piece ending at a checkpoint point the slot's caches become a cache entry; the
     prompt's last piece samples the first token.
Sampled tokens pass the request's stop rules (stop tokens, stop strings, `max_tokens`); a
finished or cancelled request frees its slot and its pages' references at once.

Pause and resume (partial rollouts that keep their caches, k3jax/posttrain/rl/partial.py).
`pause(id)` takes a running request out of its slot between steps: the slot is freed, the
request's MLA pages stay allocated and referenced by it (the paused record), and its slot's KDA
caches (recurrent states and conv tails: fixed size) — with speculative decoding also its
pending draft pairs (the MTP layer's next inputs; its MLA latents are in the pages) — are
copied out to device arrays of one row. `resume(id)` queues it; at the next admission it
takes any free slot before the waiting requests, its row is copied back and its pages
re-attached to that slot's block-table row, and it continues the same token list (decode, or
the rest of its prompt's pieces if it was paused mid-prefill) with no prefill of what it
already holds. A request paused before it was
admitted holds nothing and resumes at the head of the queue. Paused requests survive
`set_variables` (their caches, computed by the old weights, stay: a stale cache, as K3's
partial rollouts keep); `cancel` of a paused request releases its pages.

Compiled shapes are fixed: decode compiles once ([tile_rows, 1]), prefill once per bucket
([prefill_rows, b] for b in `prefill_buckets`), whatever the traffic. With that, and
row-independent programs (k3jax/serve/kv.py), a request's tokens and log-probs do not depend on
what else runs, in which slot, with which budget, or on a prefix-cache hit (the grid makes a
hit compute what a miss does; docs/notes/serve.md).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Callable, Sequence

import numpy as np

from k3jax.config import ModelConfig
from k3jax.serve import grid
from k3jax.serve.hybrid_cache import HybridPrefixCache
from k3jax.serve.kv import DeviceState, Piece, Sampled
from k3jax.serve.pages import NULL_PAGE, PageAllocator
from k3jax.serve.sampling import LOGPROBS, SamplingParams, StopChecker


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Sizes and policies of an engine.

  num_slots: concurrent requests (a multiple of tile_rows); tile_rows: rows of the decode
    program. max_len: tokens per request (prompt + generated). page_size: tokens per MLA page;
    num_pages: the page pool (default: every slot's max_len, plus as many again for the
    prefix cache). prefill_chunk: the grid (longest piece); prefill_buckets: the compiled
    piece lengths (default: powers of two from 16 up to prefill_chunk); prefill_rows: pieces
    (of one bucket, from different slots) per prefill program. step_tokens: a step's
    token budget (decode rows + prefill pieces). checkpoint_interval: grid points kept as
    cache entries (a multiple of prefill_chunk). boundary_token: the id after which a turn
    boundary lies (a chat's `[end_of_msg]`; None: none). prefix_cache: keep and use entries;
    num_checkpoints: device checkpoint slots; host_checkpoint_bytes: host offload budget.
    num_top_logprobs: top log-probs reported per token. logprobs: whose log-probs a token
    reports: "model" (the model's own distribution, the default) or "sampling" (the
    distribution the request samples from — its temperature, top-k and top-p — the behaviour
    policy an RL update weighs against). draft_len: speculative decoding with the model's
    MTP / EAGLE-3 draft, this many drafted tokens per round (0: off; k3jax/serve/kv_spec.py).
  """
  num_slots: int = 8
  tile_rows: int = 4
  max_len: int = 1024
  page_size: int = 16
  num_pages: int | None = None
  prefill_chunk: int = 128
  prefill_buckets: tuple[int, ...] | None = None
  step_tokens: int = 256
  checkpoint_interval: int = 512
  boundary_token: int | None = None
  prefix_cache: bool = True
  num_checkpoints: int = 32
  host_checkpoint_bytes: int = 0
  num_top_logprobs: int = 5
  draft_len: int = 0
  prefill_rows: int = 1
  logprobs: str = "model"

  def __post_init__(self):
    def bad(field, msg):
      raise ValueError(f"EngineConfig.{field}: {msg}")
    for f in ("num_slots", "tile_rows", "max_len", "page_size", "prefill_chunk", "step_tokens",
              "checkpoint_interval", "prefill_rows"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        bad(f, f"expected a positive int, found {v!r}")
    if self.num_slots % self.tile_rows:
      bad("num_slots", f"expected a multiple of tile_rows={self.tile_rows}, found "
          f"{self.num_slots}")
    if self.prefill_chunk % self.page_size:
      bad("prefill_chunk", f"expected a multiple of page_size={self.page_size}, found "
          f"{self.prefill_chunk}")
    if self.checkpoint_interval % self.prefill_chunk:
      bad("checkpoint_interval", f"expected a multiple of prefill_chunk="
          f"{self.prefill_chunk}, found {self.checkpoint_interval}")
    b = self.buckets
    if list(b) != sorted(set(b)) or b[-1] != self.prefill_chunk or b[0] < 1:
      bad("prefill_buckets", f"expected ascending lengths ending at prefill_chunk="
          f"{self.prefill_chunk}, found {b}")
    if self.num_pages is not None and self.num_pages < 2:
      bad("num_pages", f"expected >= 2 (page 0 is the zero page), found {self.num_pages}")
    for f in ("num_checkpoints", "host_checkpoint_bytes", "num_top_logprobs", "draft_len"):
      if getattr(self, f) < 0:
        bad(f, f"expected >= 0, found {getattr(self, f)}")
    if self.logprobs not in LOGPROBS:
      bad("logprobs", f"expected one of {LOGPROBS}, found {self.logprobs!r}")

  @property
  def buckets(self) -> tuple[int, ...]:
    if self.prefill_buckets is not None:
      return tuple(self.prefill_buckets)
    out, b = [], 16
    while b < self.prefill_chunk:
      out.append(b)
      b *= 2
    return tuple(out) + (self.prefill_chunk,)

  @property
  def pages_per_seq(self) -> int:
    return -(-self.max_len // self.page_size)

  @property
  def pool_pages(self) -> int:
    return self.num_pages or 1 + 2 * self.num_slots * self.pages_per_seq


@dataclasses.dataclass(frozen=True)
class RequestParams:
  """A request's generation settings. temperature 0 is greedy; top_k 0 and top_p 1 are off;
  seed fixes its draws (token n uses fold_in(PRNGKey(seed), n)); stop_tokens end it without
  being emitted (with include_stop: emitted, with its log-prob, as the last token — an RL
  policy's action); stop_strings end it once the decoded text holds one (needs the engine's
  `decode`); max_tokens caps the generated tokens."""
  max_tokens: int = 16
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop_tokens: tuple[int, ...] = ()
  stop_strings: tuple[str, ...] = ()
  include_stop: bool = False

  def __post_init__(self):
    if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or (
        self.max_tokens < 1):
      raise ValueError(f"max_tokens: expected an int >= 1, found {self.max_tokens!r}")
    if not 0 <= self.seed < 2 ** 32:
      raise ValueError(f"seed: expected an int in [0, 2**32), found {self.seed!r}")
    SamplingParams(self.temperature, self.top_k, self.top_p)   # same checks, same messages

  @property
  def sampling(self) -> SamplingParams:
    return SamplingParams(self.temperature, self.top_k, self.top_p, tuple(self.stop_tokens),
                          tuple(self.stop_strings))


@dataclasses.dataclass
class Update:
  """What a request produced in one step (passed to its `on_update`).

  tokens / logprobs: the tokens emitted this step and their log-probs; top: per token, the
  top (id, logprob) pairs; finished with finish_reason "stop" | "length" | "cancelled" |
  "error" (error: the message)."""
  request_id: str
  tokens: list[int]
  logprobs: list[float]
  top: list[list[tuple[int, float]]]
  finished: bool = False
  finish_reason: str | None = None
  error: str | None = None
  record: "Request | None" = None          # the finished request (timings, cached tokens)


@dataclasses.dataclass(eq=False)
class Request:
  """A request's state inside the engine (module doc); `result` fields filled as it runs."""
  id: str
  prompt: np.ndarray
  params: RequestParams
  on_update: Callable[[Update], None] | None
  keyed: list[tuple[int, bytes]]          # (checkpoint point, prefix key), ascending
  checker: StopChecker
  media: object = None                    # a `Media` (its images), encoded at admission
  features: object = None                 # its placeholders' features [n, d] (device)
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  top: list = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  error: str | None = None
  cached_tokens: int = 0
  keep: bool = True                       # stays in `Engine.requests` once finished
  arrived: float = 0.0
  first_token_at: float | None = None
  finished_at: float | None = None

  @property
  def done(self) -> bool:
    return self.finish_reason is not None


@dataclasses.dataclass(eq=False)
class _Slot:
  index: int
  tile: int
  row: int
  req: Request | None = None
  length: int = 0                          # tokens in the slot's caches
  pages: list[int] = dataclasses.field(default_factory=list)
  pieces: list[tuple[int, int]] = dataclasses.field(default_factory=list)
  next_token: int = 0                      # the token the next decode feeds


@dataclasses.dataclass(eq=False)
class _Paused:
  """A paused request (module doc): its slot's state kept outside the decode batch. kda None:
  paused before admission (nothing held)."""
  req: Request
  length: int = 0
  pages: list[int] = dataclasses.field(default_factory=list)
  pieces: list[tuple[int, int]] = dataclasses.field(default_factory=list)
  next_token: int = 0
  kda: object = None                       # the slot's row (`DeviceState.take_row`): KDA
                                           # caches and pending draft pairs (device arrays)


class Engine:
  """The continuous-batching engine (module doc).

  config / variables: the model (`K3Model` config and variables; run with
  `config.for_inference()`). decode: ids → text, for stop strings.
  """

  def __init__(self, config: ModelConfig, variables, engine_config: EngineConfig = EngineConfig(),
               decode: Callable[[Sequence[int]], str] | None = None):
    ec = engine_config
    self.config, self.ec, self.decode_text = config, ec, decode
    self.device = DeviceState(config, variables, num_tiles=ec.num_slots // ec.tile_rows,
                              rows=ec.tile_rows, num_pages=ec.pool_pages,
                              page_size=ec.page_size,
                              num_checkpoints=ec.num_checkpoints if ec.prefix_cache else 0,
                              num_top=ec.num_top_logprobs, draft_len=ec.draft_len,
                              prefill_rows=ec.prefill_rows, logprobs=ec.logprobs)
    self.allocator = PageAllocator(ec.pool_pages)
    self.cache = HybridPrefixCache(self.device, self.allocator, ec.page_size,
                                   ec.num_checkpoints if ec.prefix_cache else 0,
                                   ec.host_checkpoint_bytes)
    self.slots = [_Slot(i, i // ec.tile_rows, i % ec.tile_rows) for i in range(ec.num_slots)]
    self.tables = [np.zeros((ec.tile_rows, ec.pages_per_seq), np.int32)
                   for _ in range(ec.num_slots // ec.tile_rows)]
    self.waiting: list[Request] = []
    self.requests: dict[str, Request] = {}
    self._prefilling: list[_Slot] = []
    self.paused: dict[str, _Paused] = {}    # paused requests (module doc), by id
    self._resuming: list[_Paused] = []      # resumed, waiting for a free slot
    self._inbox: list[tuple[str, object]] = []
    self._lock = threading.Lock()           # the inbox and the request table
    self._step_lock = threading.Lock()      # a step vs. `stats` from another thread
    self.wake = threading.Event()          # set by submit / cancel (an idle loop waits on it)
    self._ids = itertools.count()
    self._salt = repr(("k3jax-grid", ec.prefill_chunk, self.ec.buckets,
                       ec.boundary_token)).encode()
    self.counters = dict(submitted=0, finished=0, prompt_tokens=0, cached_tokens=0,
                         generated_tokens=0, steps=0, decode_calls=0, prefill_calls=0,
                         drafted=0, accepted=0, prefill_tokens=0, pauses=0, resumes=0)
    self.finish_counts: dict[str, int] = {}

  # ------------------------------------------------------------------ the public interface
  def submit(self, prompt: Sequence[int], params: RequestParams = RequestParams(), *,
             on_update: Callable[[Update], None] | None = None, request_id: str | None = None,
             cache_prefix: bool = True, media=None, media_keys: Sequence[int] | None = None,
             keep: bool = True) -> str:
    """Queue a request (any thread); ValueError naming the problem for a request that can
    never run. Returns its id. `cache_prefix=False`: neither look up nor store cache entries.

    media: a `k3jax.vision.media.Media` for the prompt's placeholders (a multimodal model),
    encoded once at admission; media_keys: one int64 per placeholder naming its image (a
    digest) — the prefix keys then cover the images, else a media request is not cached.
    keep=False: the record is dropped when it finishes (its final `Update.record` has it)."""
    ids = np.asarray(prompt)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"prompt: expected a non-empty list of token ids, found shape "
                       f"{ids.shape} {ids.dtype}")
    if ids.min() < 0 or ids.max() >= self.config.text.vocab_size:
      raise ValueError(f"prompt: token ids must be in [0, vocab_size={self.config.text.vocab_size}),"
                       f" found [{ids.min()}, {ids.max()}]")
    if len(ids) + params.max_tokens + self.ec.draft_len > self.ec.max_len:
      more = f" + draft_len {self.ec.draft_len}" if self.ec.draft_len else ""
      raise ValueError(f"prompt: {len(ids)} tokens + max_tokens {params.max_tokens}{more} "
                       f"exceed the context of {self.ec.max_len} tokens")
    pages = -(-(len(ids) + params.max_tokens + self.ec.draft_len) // self.ec.page_size)
    if pages > self.allocator.num_pages - 1:
      raise ValueError(f"prompt: needs {pages} pages of {self.ec.page_size} tokens, the pool "
                       f"has {self.allocator.num_pages - 1}")
    checker = StopChecker(params.sampling, self.decode_text if params.stop_strings else None)
    ids = ids.astype(np.int32)
    extra = self._check_media(ids, media, media_keys)
    keyed = []
    if cache_prefix and self.ec.prefix_cache and (media is None or extra is not None):
      points = [p for p in grid.split_points(ids, self.ec.prefill_chunk, self.ec.boundary_token)
                if grid.is_checkpoint(ids, p, self.ec.checkpoint_interval,
                                      self.ec.boundary_token)]
      keyed = list(zip(points, grid.prefix_keys(ids, points, self._salt, extra)))
    rid = request_id or f"req-{next(self._ids)}"
    req = Request(rid, ids, params, on_update, keyed, checker, media=media, keep=keep,
                  arrived=time.perf_counter())
    with self._lock:
      if rid in self.requests:
        raise ValueError(f"request_id: {rid!r} is already in use")
      self.requests[rid] = req
      self._inbox.append(("submit", req))
      self.counters["submitted"] += 1
    self.wake.set()
    return rid

  def _check_media(self, ids, media, media_keys):
    """Placeholders vs media (ValueError naming the mismatch); the per-position extra key."""
    pid = self.config.media_placeholder_token_id
    n = 0 if pid is None else int((ids == pid).sum())
    if media is None:
      if n and self.config.vision is not None:
        raise ValueError(f"prompt: {n} media placeholders (id {pid}) but no media")
      return None
    if self.config.vision is None:
      raise ValueError("media: the model has no vision tower (config.vision is None: a "
                       "text-only model)")
    m = int(np.asarray(media.num_merged).sum())
    if n != m:
      raise ValueError(f"prompt: {n} media placeholders (id {pid}) but the media give {m} "
                       f"merged vision tokens")
    if media_keys is None:
      return None
    keys = np.asarray(media_keys, np.int64)
    if keys.shape != (n,):
      raise ValueError(f"media_keys: expected one per placeholder ({n}), found {keys.shape}")
    extra = np.zeros(len(ids), np.int64)
    extra[ids == pid] = keys
    return extra

  def cancel(self, request_id: str) -> None:
    """Cancel a request (any thread): it finishes with "cancelled" at the next step, its slot
    and pages freed. Unknown or finished requests are ignored."""
    with self._lock:
      self._inbox.append(("cancel", request_id))
    self.wake.set()

  def pause(self, request_id: str) -> None:
    """Pause a running (or waiting) request between steps (module doc): its slot is freed, its
    pages, KDA caches and (with speculative decoding) pending draft pairs kept for `resume`.
    ValueError for an unknown, finished or already paused request."""
    with self._step_lock:
      self._take_inbox()
      req = self._known(request_id, "pause")
      if request_id in self.paused:
        raise ValueError(f"pause: request {request_id!r} is already paused")
      for rec in self._resuming:
        if rec.req is req:            # resumed but not yet back in a slot: paused again
          self._resuming.remove(rec)
          self.paused[request_id] = rec
          self.counters["pauses"] += 1
          return
      if req in self.waiting:
        self.waiting.remove(req)
        self.paused[request_id] = _Paused(req)
        self.counters["pauses"] += 1
        return
      slot = next(s for s in self.slots if s.req is req)
      rec = _Paused(req, slot.length, slot.pages, slot.pieces, slot.next_token,
                    self.device.take_row(slot.tile, slot.row))
      slot.req, slot.pages, slot.pieces, slot.length = None, [], [], 0
      self.tables[slot.tile][slot.row] = NULL_PAGE
      if slot in self._prefilling:
        self._prefilling.remove(slot)
      self.paused[request_id] = rec
      self.counters["pauses"] += 1

  def resume(self, request_id: str) -> None:
    """Queue a paused request to continue (module doc): at the next step it takes a free slot
    before any waiting request. ValueError for an unknown, finished or not paused request."""
    with self._step_lock:
      self._take_inbox()
      req = self._known(request_id, "resume")
      rec = self.paused.pop(request_id, None)
      if rec is None:
        raise ValueError(f"resume: request {request_id!r} is not paused")
      if rec.kda is None:
        self.waiting.insert(0, req)
      else:
        self._resuming.append(rec)
      self.counters["resumes"] += 1
    self.wake.set()

  def _known(self, request_id: str, what: str) -> Request:
    req = self.requests.get(request_id)
    if req is None:
      raise ValueError(f"{what}: unknown request id {request_id!r}")
    if req.done:
      raise ValueError(f"{what}: request {request_id!r} has finished ({req.finish_reason})")
    return req

  def check(self) -> None:
    """The page bookkeeping (AssertionError if wrong): every page's reference count is the
    number of running slots, paused requests and cache entries that list it; the others are
    free."""
    refs = collections.Counter(p for s in self.slots if s.req for p in s.pages)
    refs.update(p for rec in [*self.paused.values(), *self._resuming] for p in rec.pages)
    refs.update(p for e in self.cache.entries.values() for p in e.pages)
    for p in range(1, self.allocator.num_pages):
      if self.allocator.refcount(p) != refs.get(p, 0):
        raise AssertionError(f"page {p}: {self.allocator.refcount(p)} references counted, "
                             f"{refs.get(p, 0)} held")
    if self.allocator.num_free != sum(1 for p in range(1, self.allocator.num_pages)
                                      if not refs.get(p)):
      raise AssertionError(f"pages: {self.allocator.num_free} on the free list")

  @property
  def has_work(self) -> bool:
    return bool(self._inbox or self.waiting or self._resuming or any(s.req for s in self.slots))

  def step(self) -> bool:
    """One scheduling step (module doc); whether anything was waiting or running."""
    with self._step_lock:
      return self._step()

  def _step(self) -> bool:
    self._take_inbox()
    if not (self.waiting or self._resuming or any(s.req for s in self.slots)):
      return False
    self.counters["steps"] += 1
    self._admit()
    decoding = self._decode()
    self._prefill(self.ec.step_tokens - decoding, did_work=decoding > 0)
    return True

  def generate(self, prompts: Sequence[Sequence[int]], params: RequestParams | Sequence[
      RequestParams] = RequestParams()) -> list[Request]:
    """Submit every prompt, step until all finish; the finished requests in order."""
    plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    ids = [self.submit(p, q) for p, q in zip(prompts, plist)]
    while self.step():
      pass
    return [self.requests.pop(i) for i in ids]

  def pop(self, request_id: str) -> Request:
    """Forget a finished request (its record)."""
    return self.requests.pop(request_id)

  def stats(self) -> dict:
    """Gauges and counters (the server's /metrics); any thread."""
    with self._step_lock:
      return self._stats()

  def _stats(self) -> dict:
    running = [s for s in self.slots if s.req]
    paused = [*self.paused.values(), *self._resuming]
    request_pages = {p for s in running for p in s.pages} | {p for r in paused for p in r.pages}
    return dict(
        waiting=len(self.waiting), running=len(running), paused=len(paused),
        pages_paused=len({p for r in paused for p in r.pages}),
        prefilling=sum(1 for s in running if s.pieces),
        pages_total=self.allocator.num_pages - 1, pages_used=self.allocator.num_used,
        pages_in_use=len(request_pages), pages_free=self.allocator.num_free,
        pages_cached=len(self.cache.pages_held - request_pages),
        cache_entries=len(self.cache.entries),
        cache_entries_host=sum(e.host is not None for e in self.cache.entries.values()),
        **{f"cache_{k}": v for k, v in self.cache.stats.items()},
        **self.counters, finish=dict(self.finish_counts))

  def fail_all(self, message: str) -> None:
    """Finish every running and waiting request with "error" (after a failed step)."""
    with self._step_lock:
      self._fail_all(message)

  def _fail_all(self, message: str) -> None:
    self._take_inbox()
    for s in self.slots:
      if s.req is not None:
        self._release(s, "error", message)
    for req in list(self.waiting):
      self.waiting.remove(req)
      self._finish_request(req, "error", message)
    for rec in list(self._resuming):
      self._drop_paused(rec, "error", message)

  def set_variables(self, variables) -> None:
    """Serve new weights (an RL policy after its update): only between requests (ValueError
    while any runs or waits); the prefix cache is dropped (its states were the old weights').
    Paused requests keep their caches (computed by the old weights: stale, module doc) and
    store no prefix-cache entries from then on."""
    with self._step_lock:
      self._take_inbox()
      if self.waiting or self._resuming or any(s.req for s in self.slots):
        raise ValueError("set_variables: requests are running or waiting")
      self.cache.clear()
      for rec in self.paused.values():
        rec.req.keyed = []
      self.device.set_variables(variables)

  def clear_cache(self) -> None:
    """Drop every prefix-cache entry (pages held only by the cache return to the free list)."""
    with self._step_lock:
      self.cache.clear()

  # ------------------------------------------------------------------ inbox and admission
  def _take_inbox(self) -> None:
    with self._lock:
      items, self._inbox = self._inbox, []
      self.wake.clear()
    for kind, x in items:
      if kind == "submit":
        self.waiting.append(x)
      else:
        self._cancel(x)

  def _cancel(self, rid: str) -> None:
    req = self.requests.get(rid)
    if req is None or req.done:
      return
    rec = self.paused.pop(rid, None) or next((r for r in self._resuming if r.req is req), None)
    if rec is not None:
      self._drop_paused(rec, "cancelled")
      return
    if req in self.waiting:
      self.waiting.remove(req)
      self._finish_request(req, "cancelled")
      return
    for s in self.slots:
      if s.req is req:
        self._release(s, "cancelled")

  def _drop_paused(self, rec: _Paused, reason: str, error: str | None = None) -> None:
    """Finish a paused (or resuming) request: its pages' references go."""
    if rec in self._resuming:
      self._resuming.remove(rec)
    rec.req.features = None
    self.allocator.decref(rec.pages)
    rec.pages, rec.kda = [], None
    self._finish_request(rec.req, reason, error)

  def _admit(self) -> None:
    ec = self.ec
    while self._resuming:                        # resumed requests first: no prefill, no pages
      free = [s for s in self.slots if s.req is None]
      if not free:
        return
      slot, rec = free[0], self._resuming.pop(0)
      self.device.put_row(rec.kda, slot.tile, slot.row)
      slot.req, slot.length, slot.pages = rec.req, rec.length, rec.pages
      slot.pieces, slot.next_token = rec.pieces, rec.next_token
      self.tables[slot.tile][slot.row] = NULL_PAGE
      self.tables[slot.tile][slot.row, :len(slot.pages)] = slot.pages
      if slot.pieces:
        self._prefilling.append(slot)
    while self.waiting:
      free = [s for s in self.slots if s.req is None]
      if not free:
        return
      slot, req = free[0], self.waiting[0]
      n = len(req.prompt)
      hit = self.cache.lookup(req.keyed, n) if req.keyed else None
      h = hit.length if hit else 0
      shared = list(hit.pages[:h // ec.page_size]) if hit else []
      total = -(-(n + req.params.max_tokens + ec.draft_len) // ec.page_size)
      need = total - len(shared)
      if not self.cache.evict_for(need, protect=hit):
        return                                   # wait for running requests to free pages
      self.waiting.pop(0)
      self.allocator.incref(shared)
      fresh = self.allocator.alloc(need)
      if h % ec.page_size:                       # copy-on-write of the partly filled page
        self.device.copy_page(hit.pages[h // ec.page_size], fresh[0])
      if hit:
        self.cache.restore(hit, slot.tile, slot.row)
      else:
        self.device.zero(slot.tile, slot.row)
      if req.media is not None:
        req.features = self.device.encode_media(req.media)
      slot.req, slot.length, slot.pages = req, h, shared + fresh
      slot.pieces = grid.pieces(req.prompt, ec.prefill_chunk, ec.boundary_token, start=h)
      self.tables[slot.tile][slot.row] = NULL_PAGE
      self.tables[slot.tile][slot.row, :len(slot.pages)] = slot.pages
      req.cached_tokens = h
      self.counters["prompt_tokens"] += n
      self.counters["cached_tokens"] += h
      self._prefilling.append(slot)

  # ------------------------------------------------------------------ decode and prefill
  def _sampling(self, slots: Sequence[_Slot | None]):
    """Per-row (seeds, counters, temperature, top_k, top_p); None rows get greedy zeros."""
    rows = [(s.req.params, len(s.req.tokens)) if s is not None else (None, 0) for s in slots]
    return (np.array([p.seed if p else 0 for p, _ in rows], np.uint32),
            np.array([c for _, c in rows], np.int32),
            np.array([p.temperature if p else 0.0 for p, _ in rows], np.float32),
            np.array([p.top_k if p else 0 for p, _ in rows], np.int32),
            np.array([p.top_p if p else 1.0 for p, _ in rows], np.float32))

  def _decode(self) -> int:
    """One decode program (a speculative round with draft_len) per tile with a decoding slot;
    the number of decoded rows."""
    if self.ec.draft_len:
      return self._rounds()
    rows_done = 0
    r = self.ec.tile_rows
    for tile in range(len(self.tables)):
      members = self.slots[tile * r:(tile + 1) * r]
      active = [s if (s.req is not None and not s.pieces) else None for s in members]
      if not any(active):
        continue
      out = self.device.decode(
          tile, [s.next_token if s else 0 for s in active],
          [s.length for s in members], self.tables[tile], [s is not None for s in active],
          self._sampling(active))
      self.counters["decode_calls"] += 1
      for i, s in enumerate(active):
        if s is not None:
          s.length += 1
          rows_done += 1
          self._emit(s, out, i)
    return rows_done

  def _rounds(self) -> int:
    rows_done = 0
    r, n = self.ec.tile_rows, self.ec.draft_len
    for tile in range(len(self.tables)):
      members = self.slots[tile * r:(tile + 1) * r]
      active = [s if (s.req is not None and not s.pieces) else None for s in members]
      if not any(active):
        continue
      d, num, y, lps, top = self.device.round(tile, [s.length for s in members],
                                              self.tables[tile], [s is not None for s in active],
                                              self._sampling(active))
      self.counters["decode_calls"] += 1
      for i, s in enumerate(active):
        if s is None:
          continue
        rows_done += 1
        self.counters["drafted"] += n
        self.counters["accepted"] += int(num[i])
        s.length += int(num[i]) + 1
        toks = [int(t) for t in d[i, :num[i]]] + [int(y[i])]
        for j, tok in enumerate(toks):
          tj = [] if top is None else [(int(a), float(b)) for a, b in zip(top[0][i, j],
                                                                          top[1][i, j])]
          if not self._emit_token(s, tok, float(lps[i, j]), tj):
            break
    return rows_done

  def _piece(self, slot: _Slot) -> Piece:
    """The host inputs of slot's next piece."""
    ec, req = self.ec, slot.req
    a, b = slot.pieces[0]
    width = grid.bucket(b - a, ec.buckets)
    toks = np.zeros(width, np.int32)
    toks[:b - a] = req.prompt[a:b]
    rows = None
    if req.features is not None:
      pid = self.config.media_placeholder_token_id
      k0, k = int((req.prompt[:a] == pid).sum()), int((req.prompt[a:b] == pid).sum())
      rows = req.features[k0:k0 + k] if k else None
    piece = Piece(slot.tile, slot.row, toks, b - a, a, self.tables[slot.tile][slot.row],
                  tuple(x[0] for x in self._sampling([slot])), rows)
    if ec.draft_len:   # the MTP layer's pairs (h_i, token i+1): the last one waits for a sample
      nxt = req.prompt[a + 1:b + 1]
      piece.next_tokens = np.zeros(width, np.int32)
      piece.next_tokens[:len(nxt)] = nxt
      piece.draft_n = b - a - (b == len(req.prompt))
    return piece

  def _prefill(self, budget: int, did_work: bool) -> None:
    """Pieces while the budget lasts: the oldest prefilling slot's next piece, with up to
    prefill_rows − 1 other slots' next pieces of the same bucket in the same program."""
    ec = self.ec
    while True:
      ready = [s for s in self._prefilling if s.req is not None and s.pieces]
      if not ready:
        return
      size = lambda s: s.pieces[0][1] - s.pieces[0][0]   # noqa: E731
      if size(ready[0]) > budget and did_work:
        return
      width = grid.bucket(size(ready[0]), ec.buckets)
      group, used = [], 0
      for s in ready:
        if len(group) < ec.prefill_rows and grid.bucket(size(s), ec.buckets) == width and (
            not group or used + size(s) <= budget):
          group.append(s)
          used += size(s)
      out, hidden = self.device.prefill([self._piece(s) for s in group])
      self.counters["prefill_calls"] += 1
      self.counters["prefill_tokens"] += used
      budget -= used
      did_work = True
      for i, slot in enumerate(group):
        req = slot.req
        a, b = slot.pieces.pop(0)
        slot.length = b
        key = dict(req.keyed).get(b)
        if key is not None:
          self.cache.insert(key, b, slot.pages, slot.tile, slot.row)
        if not slot.pieces:
          self._prefilling.remove(slot)
          if self._emit(slot, out, i) and ec.draft_len:
            self.device.set_pend(slot.tile, slot.row, hidden[i], int(out.tokens[i]))

  def warmup(self) -> None:
    """Compile every program now (decode, each prefill bucket, the row and page copies) with
    no effect on any slot; a server calls it before it takes requests."""
    with self._step_lock:
      ec, d = self.ec, self.device
      zero = (np.zeros(1, np.uint32), np.zeros(1, np.int32), np.zeros(1, np.float32),
              np.zeros(1, np.int32), np.ones(1, np.float32))
      rows = ec.tile_rows
      table = np.zeros((rows, ec.pages_per_seq), np.int32)
      idle = [np.zeros(rows, x.dtype) for x in zero]
      if ec.draft_len:
        d.round(0, np.zeros(rows, np.int32), table, np.zeros(rows, bool), idle)
      else:
        d.decode(0, np.zeros(rows, np.int32), np.zeros(rows, np.int32), table,
                 np.zeros(rows, bool), idle)
      for width in ec.buckets:
        piece = Piece(0, 0, np.zeros(width, np.int32), 0, 0, table[0],
                      tuple(x[0] for x in zero))
        if ec.draft_len:
          piece.next_tokens = np.zeros(width, np.int32)
        d.prefill([piece])
      if d.store is not None:
        d.save(0, 0, 0)
        d.load(0, 0, 0)
      d.zero(0, 0)
      d.put_row(d.take_row(0, 0), 0, 0)
      d.copy_page(0, 0)

  def _emit(self, slot: _Slot, out: Sampled, i: int) -> bool:
    """Row i of a program's samples through `_emit_token`."""
    top = [] if out.top_ids is None else [(int(a), float(b)) for a, b in
                                          zip(out.top_ids[i], out.top_logprobs[i])]
    return self._emit_token(slot, int(out.tokens[i]), float(out.logprobs[i]), top)

  def _emit_token(self, slot: _Slot, tok: int, logprob: float, top: list) -> bool:
    """Pass a sampled token through the slot's request's stop rules; finish it (False) or
    go on (True)."""
    req = slot.req
    if req.first_token_at is None:
      req.first_token_at = time.perf_counter()
    stopped = req.checker.add(tok)
    emitted = [] if (req.checker.reason == "stop_token" and not req.params.include_stop) else [
        tok]
    if emitted:
      req.tokens.append(tok)
      req.logprobs.append(logprob)
      req.top.append(top)
      self.counters["generated_tokens"] += 1
    reason = "stop" if stopped else (
        "length" if len(req.tokens) >= req.params.max_tokens else None)
    if req.on_update is not None and emitted:
      req.on_update(Update(req.id, emitted, [logprob], [top]))
    if reason is not None:
      self._release(slot, reason)
      return False
    slot.next_token = tok
    return True

  def _release(self, slot: _Slot, reason: str, error: str | None = None) -> None:
    """Free a slot: its pages' references, its block-table row; the request finishes."""
    req = slot.req
    req.features = None
    self.allocator.decref(slot.pages)
    slot.req, slot.pages, slot.pieces, slot.length = None, [], [], 0
    self.tables[slot.tile][slot.row] = NULL_PAGE
    if slot in self._prefilling:
      self._prefilling.remove(slot)
    self._finish_request(req, reason, error)

  def _finish_request(self, req: Request, reason: str, error: str | None = None) -> None:
    req.finish_reason, req.error, req.finished_at = reason, error, time.perf_counter()
    self.counters["finished"] += 1
    self.finish_counts[reason] = self.finish_counts.get(reason, 0) + 1
    if not req.keep:
      with self._lock:
        self.requests.pop(req.id, None)
    if req.on_update is not None:
      req.on_update(Update(req.id, [], [], [], True, reason, error, req))


class EngineLoop:
  """Runs `engine.step()` in a background thread while there is work; sleeps on
  `engine.wake` otherwise. `stop()` ends it. An exception in a step fails every running and
  waiting request with "error" (their clients get the message) and the loop goes on."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self._stop = threading.Event()
    self.thread = threading.Thread(target=self._run, name="k3jax-engine", daemon=True)
    self.errors: list[str] = []

  def start(self) -> "EngineLoop":
    self.thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    self.engine.wake.set()
    self.thread.join(timeout=30)

  def _run(self) -> None:
    eng = self.engine
    while not self._stop.is_set():
      try:
        worked = eng.step()
      except Exception as e:   # noqa: BLE001 — a failed step must not stop the server
        self.errors.append(repr(e))
        eng.fail_all(f"engine step failed: {e!r}")
        worked = False
      if not worked:
        eng.wake.wait(timeout=0.5)


__all__ = ["Engine", "EngineConfig", "EngineLoop", "Request", "RequestParams", "Update"]
