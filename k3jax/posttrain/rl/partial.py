"""Partial rollouts (docs/k3.md §13): N prompts × K completions stay active; a round of generation
pauses once ⌈λ·(active trajectories)⌉ of them have finished; the unfinished ones are queued
and resumed first in the next round, after which they continue the same token list. Two ways
to resume:

  recompute (retain_cache=False, the reference): each round is one `rollout.sample` call; a
    resumed trajectory's prefix (prompt + response so far) is recomputed by prefill under the
    then-current policy.
  retained caches (retain_cache=True): the rounds run through the serving engine
    (k3jax/serve/engine.py), one request per trajectory for its whole life. At a round's end
    the unfinished requests are paused (`Engine.pause`: slot freed, MLA pages and the KDA row
    kept); the next round resumes them (`Engine.resume`) with no prefill. New weights between
    rounds (`Engine.set_variables`) leave the paused caches as they are: a resumed trajectory
    continues from a cache the older policies computed, as the report's partial rollouts do;
    the per-token importance weights below correct for it. A finished request's pages are
    released at once; `close` cancels the paused ones. The engine reports each token's
    log-prob under the distribution it was drawn from (`EngineConfig(logprobs="sampling")`:
    log_softmax(logits / temperature), the trainer's `token_logprobs(..., temperature)`), so
    any temperature works; greedy rows report the model's own, as the recompute path does.

Bookkeeping. Every trajectory is created once (K per admitted prompt, as a group) and is at any
time in exactly one place: the resume queue (unfinished), its group's pending list (finished,
waiting for the group's other members), or handed out in a completed group (all K finished,
ready for the group baseline). `check()` verifies this. New groups are admitted only whole
(K free slots); slots left over are idle rows of the fixed batch.

Stale tokens. A resumed trajectory's earlier tokens were sampled by older policies. Each token
keeps its behaviour log-prob log μ_t (under the policy that sampled it) and that policy's
version; the update weighs token t by ρ_t = exp(log π_θ(y_t) − log μ_t) inside the clipped
surrogate (k3jax/posttrain/rl/losses.py), so stale tokens are corrected token by token.
`cache_versions` records, per token, the oldest policy version whose computation is in the cache
it was sampled from (recompute: the sampling version; retained caches: the version of the
trajectory's first round) — a token is sampled by the current policy alone only when both
versions are the current one.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.posttrain.rl import rollout as rollout_lib
from k3jax.data.rl_tasks import Task, TaskSampler
from k3jax.serve.engine import Engine, EngineConfig, RequestParams


@dataclasses.dataclass
class Trajectory:
  """One completion of a task. tokens/logprobs/versions grow as rounds resume it."""
  tid: int
  gid: int
  task: Task
  limit: int                      # most response tokens
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  cache_versions: list[int] = dataclasses.field(default_factory=list)
  finished: bool = False
  stopped: bool = False
  rounds: int = 0                 # rounds it was generated in (> 1: resumed)
  request_id: str | None = None   # its engine request (retained caches)
  first_version: int | None = None

  @property
  def prefix(self) -> list[int]:
    return list(self.task.tokens) + self.tokens


@dataclasses.dataclass
class RoundStats:
  active: int          # real rows generated this round
  resumed: int         # of which resumed from the queue
  finished: int        # finished this round
  new_tokens: int
  steps: int           # decode steps
  seconds: float
  prefill_tokens: int = 0   # tokens run through prefill (the recompute path: every prefix)


class PartialRollout:
  """The trajectory pool of partial rollouts (module doc).

  n_prompts (N), k (K), lam (λ in (0, 1]; 1 = wait for all). `limit_fn(task, rng) → int`
  sets each trajectory's length cap (default max_new_tokens). retain_cache: resume through the
  serving engine's pause / resume instead of recomputing prefixes (module doc); `engine`
  holds it once the first round has run."""

  def __init__(self, sampler: TaskSampler, *, n_prompts: int, k: int, lam: float,
               max_new_tokens: int, width: int, stop_tokens: Sequence[int] = (),
               temperature: float = 1.0, limit_fn: Callable | None = None, seed: int = 0,
               retain_cache: bool = False):
    if n_prompts < 1 or k < 1:
      raise ValueError(f"n_prompts/k: expected >= 1, found {n_prompts}/{k}")
    if not 0 < lam <= 1:
      raise ValueError(f"lam: expected a value in (0, 1], found {lam}")
    if temperature < 0:
      raise ValueError(f"temperature: expected >= 0, found {temperature}")
    self.retain_cache = retain_cache
    self.engine: Engine | None = None
    self._engine_version: int | None = None
    self.sampler, self.n, self.k, self.lam = sampler, n_prompts, k, lam
    self.max_new_tokens, self.width = max_new_tokens, width
    self.stop_tokens, self.temperature = tuple(stop_tokens), temperature
    self.limit_fn = limit_fn
    self._rng = np.random.default_rng(seed)
    self.queue: collections.deque[Trajectory] = collections.deque()
    self.pending: dict[int, list[Trajectory]] = {}      # gid → its K trajectories
    self.created = 0
    self.handed_out: set[int] = set()
    self._gid = 0

  @property
  def slots(self) -> int:
    return self.n * self.k

  def _admit(self, free: int) -> list[Trajectory]:
    new = []
    while free - len(new) >= self.k:
      task = self.sampler.sample(1)[0]
      gid = self._gid
      self._gid += 1
      group = []
      for _ in range(self.k):
        limit = self.max_new_tokens if self.limit_fn is None else int(
            self.limit_fn(task, self._rng))
        if not 1 <= limit <= self.max_new_tokens:
          raise ValueError(f"limit_fn: expected a cap in [1, {self.max_new_tokens}], "
                           f"found {limit}")
        group.append(Trajectory(self.created, gid, task, limit))
        self.created += 1
      self.pending[gid] = group
      new += group
    return new

  def round(self, config: ModelConfig, variables, version: int, key: jax.Array
            ) -> tuple[list[list[Trajectory]], RoundStats]:
    """Generate one round; returns (completed groups, each K trajectories, and stats)."""
    if self.retain_cache:
      return self._engine_round(config, variables, version, key)
    rows = []
    while self.queue and len(rows) < self.slots:        # resumed first
      rows.append(self.queue.popleft())
    resumed = len(rows)
    rows += self._admit(self.slots - len(rows))
    prefixes = [t.prefix for t in rows] + [[0]] * (self.slots - len(rows))
    limits = [t.limit - len(t.tokens) for t in rows] + [0] * (self.slots - len(rows))
    target = math.ceil(self.lam * len(rows))
    out = rollout_lib.sample(config, variables, prefixes, limits, width=self.width, key=key,
                             stop_tokens=self.stop_tokens, temperature=self.temperature,
                             stop_after=target)
    done = 0
    for i, t in enumerate(rows):
      toks, lps = out.row(i)
      t.tokens += toks
      t.logprobs += lps
      t.versions += [version] * len(toks)
      t.cache_versions += [version] * len(toks)
      t.rounds += 1
      if out.finished[i]:
        t.finished, t.stopped = True, bool(out.stopped[i])
        done += 1
      else:
        self.queue.append(t)
    stats = RoundStats(len(rows), resumed, done, int(out.lengths.sum()), out.steps, out.seconds,
                       prefill_tokens=sum(len(p) for p in prefixes[:len(rows)]))
    return self._completed(rows), stats

  def _completed(self, rows: list[Trajectory]) -> list[list[Trajectory]]:
    completed = []
    for gid in sorted({t.gid for t in rows}):
      group = self.pending[gid]
      if all(t.finished for t in group):
        del self.pending[gid]
        self.handed_out.update(t.tid for t in group)
        completed.append(group)
    return completed

  # ------------------------------------------------------------------ retained caches
  def engine_config(self) -> EngineConfig:
    """The rollout engine: one slot per trajectory of the pool in one decode tile, a context of
    `width`, pieces of 128 tokens (one compiled bucket: an RL prompt is one piece) two groups'
    prompts (2K) at a time, a step budget that prefills every new prompt at once, no prefix
    cache (a group's K prompts are admitted in the same step: nothing to hit); log-probs of
    the sampling distribution (the behaviour policy at `temperature`)."""
    page, chunk = 16, 128
    return EngineConfig(num_slots=self.slots, tile_rows=self.slots, max_len=self.width,
                        page_size=page, prefill_chunk=chunk, prefill_buckets=(chunk,),
                        step_tokens=self.slots * self.width, prefix_cache=False,
                        num_checkpoints=0, num_top_logprobs=0,
                        prefill_rows=min(self.slots, 2 * self.k), logprobs="sampling")

  def _engine_round(self, config, variables, version, key):
    t0 = time.perf_counter()
    eng = self.engine
    if eng is None:
      eng = self.engine = Engine(config, _policy_copy(variables), self.engine_config())
      self._engine_version = version
    elif version != self._engine_version:
      eng.set_variables(_policy_copy(variables))   # paused requests keep their caches
      self._engine_version = version
    rows = []
    while self.queue and len(rows) < self.slots:        # resumed first
      rows.append(self.queue.popleft())
    resumed = len(rows)
    for t in rows:
      eng.resume(t.request_id)
    new = self._admit(self.slots - len(rows))
    # One draw shape whatever the number of new trajectories (no compile per count).
    seeds = np.asarray(jax.random.randint(key, (self.slots,), 0, 2 ** 31 - 1))
    for t, seed in zip(new, seeds):
      t.first_version = version
      t.request_id = eng.submit(
          list(t.task.tokens), RequestParams(max_tokens=t.limit, temperature=self.temperature,
                                             seed=int(seed), stop_tokens=self.stop_tokens,
                                             include_stop=True), cache_prefix=False)
    rows += new
    target = math.ceil(self.lam * len(rows))
    calls, prefill = eng.counters["decode_calls"], eng.counters["prefill_tokens"]
    reqs = [eng.requests[t.request_id] for t in rows]
    while sum(r.done for r in reqs) < target and eng.step():
      pass
    done = new_tokens = 0
    for t, req in zip(rows, reqs):
      n = len(req.tokens) - len(t.tokens)
      t.tokens += req.tokens[len(t.tokens):]
      t.logprobs += req.logprobs[len(t.logprobs):]
      t.versions += [version] * n
      t.cache_versions += [t.first_version] * n
      t.rounds += 1
      new_tokens += n
      if req.done:
        t.finished, t.stopped = True, req.finish_reason == "stop"
        eng.pop(t.request_id)
        done += 1
      else:
        eng.pause(t.request_id)
        self.queue.append(t)
    stats = RoundStats(len(rows), resumed, done, new_tokens,
                       eng.counters["decode_calls"] - calls, time.perf_counter() - t0,
                       prefill_tokens=eng.counters["prefill_tokens"] - prefill)
    return self._completed(rows), stats

  def close(self) -> None:
    """Cancel the paused requests of the queued trajectories (their pages return to the
    pool); the trajectories stay queued, as with recompute. Retained caches only."""
    if self.engine is None:
      return
    for t in self.queue:
      self.engine.cancel(t.request_id)
    self.engine.step()                 # takes the cancellations in
    for t in self.queue:
      self.engine.pop(t.request_id)
      t.request_id = None

  def check(self) -> None:
    """Every created trajectory is in exactly one place (module doc); AssertionError if not."""
    queued = [t.tid for t in self.queue]
    waiting = [t.tid for g in self.pending.values() for t in g if t.finished]
    places = queued + waiting + sorted(self.handed_out)
    if len(places) != len(set(places)) or set(places) != set(range(self.created)):
      raise AssertionError(f"partial rollout: trajectories lost or duplicated (created "
                           f"{self.created}, queued {len(queued)}, waiting {len(waiting)}, "
                           f"handed out {len(self.handed_out)})")
    if any(t.finished for t in self.queue):
      raise AssertionError("partial rollout: a finished trajectory is in the resume queue")
    unfinished_pending = {t.tid for g in self.pending.values() for t in g if not t.finished}
    if unfinished_pending != set(queued):
      raise AssertionError("partial rollout: an unfinished trajectory is not queued")
    if self.engine is not None:
      paused = {t.request_id for t in self.queue if t.request_id is not None}
      if set(self.engine.paused) != paused:
        raise AssertionError(f"partial rollout: {len(self.engine.paused)} paused engine "
                             f"requests, {len(paused)} queued trajectories hold one")
      if any(s.req is not None for s in self.engine.slots) or self.engine.waiting:
        raise AssertionError("partial rollout: engine requests run between rounds")
      self.engine.check()


def _policy_copy(variables):
  """Copies of the policy's arrays, each keeping its sharding (the trainer's step may donate
  the originals): on a mesh the engine's programs run on the sharded weights (GSPMD), on one
  device there."""
  return jax.tree.map(jnp.array,
                      {k: v for k, v in dict(variables).items() if k in ("params", "balance")})
