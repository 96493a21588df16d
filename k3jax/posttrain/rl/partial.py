"""Partial rollouts (docs/k3.md §13): N prompts × K completions stay active; a round of generation
pauses once ⌈λ·(active trajectories)⌉ of them have finished; the unfinished ones are queued
and resumed first in the next round, their prefix (prompt + response so far) recomputed by
prefill under the then-current policy, after which they continue the same token list.

Bookkeeping. Every trajectory is created once (K per admitted prompt, as a group) and is at any
time in exactly one place: the resume queue (unfinished), its group's pending list (finished,
waiting for the group's other members), or handed out in a completed group (all K finished,
ready for the group baseline). `check()` verifies this. New groups are admitted only whole
(K free slots); slots left over are idle rows of the fixed batch.

Stale tokens. A resumed trajectory's earlier tokens were sampled by older policies. Each token
keeps its behaviour log-prob log μ_t (under the policy that sampled it) and that policy's
version; the update weighs token t by ρ_t = exp(log π_θ(y_t) − log μ_t) inside the clipped
surrogate (k3jax/posttrain/rl/losses.py), so stale tokens are corrected token by token.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, Sequence

import jax
import numpy as np

from k3jax.config import ModelConfig
from k3jax.posttrain.rl import rollout as rollout_lib
from k3jax.data.rl_tasks import Task, TaskSampler


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
  finished: bool = False
  stopped: bool = False
  rounds: int = 0                 # rounds it was generated in (> 1: resumed)

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


class PartialRollout:
  """The trajectory pool of partial rollouts (module doc).

  n_prompts (N), k (K), lam (λ in (0, 1]; 1 = wait for all). `limit_fn(task, rng) → int`
  sets each trajectory's length cap (default max_new_tokens)."""

  def __init__(self, sampler: TaskSampler, *, n_prompts: int, k: int, lam: float,
               max_new_tokens: int, width: int, stop_tokens: Sequence[int] = (),
               temperature: float = 1.0, limit_fn: Callable | None = None, seed: int = 0):
    if n_prompts < 1 or k < 1:
      raise ValueError(f"n_prompts/k: expected >= 1, found {n_prompts}/{k}")
    if not 0 < lam <= 1:
      raise ValueError(f"lam: expected a value in (0, 1], found {lam}")
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
      t.rounds += 1
      if out.finished[i]:
        t.finished, t.stopped = True, bool(out.stopped[i])
        done += 1
      else:
        self.queue.append(t)
    completed = []
    for gid in sorted({t.gid for t in rows}):
      group = self.pending[gid]
      if all(t.finished for t in group):
        del self.pending[gid]
        self.handed_out.update(t.tid for t in group)
        completed.append(group)
    stats = RoundStats(len(rows), resumed, done, int(out.lengths.sum()), out.steps, out.seconds)
    return completed, stats

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
