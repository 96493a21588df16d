"""Batched sampling for RL through the project's decode path (k3jax/serve/generate.py: `prefill`
fills the KDA states and MLA caches, `decode_step` feeds one token per row).

Each row continues a prefix (a prompt, or a prompt plus the response so far when a partial
rollout resumes with recompute: the prefix is recomputed by prefill; with retained caches
partial rollouts go through the serving engine instead, k3jax/posttrain/rl/partial.py) for at
most limits[b] new tokens, and
stops at a stop token (kept as the response's last token: emitting it is an action the policy
is trained on). For every sampled token the rollout records its fp32 log-probability under
the sampling distribution, log_softmax(logits / temperature)[y_t] (temperature 0 = greedy,
recorded with temperature 1). Generation pauses once `stop_after` rows have finished in this
call (partial rollout, k3jax/posttrain/rl/partial.py), else when every row has.

Shapes are fixed by the caller: `width` = cache capacity = padded prefix length, so one
prefill and one decode compilation serve every call of a batch size.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.serve import generate as G
from k3jax.config import ModelConfig


@dataclasses.dataclass
class RolloutBatch:
  """tokens/logprobs [B, L] (right-padded with 0), lengths [B], finished [B] (stop token or
  limit reached), stopped [B] (stop token), steps (decode steps run), seconds (wall)."""
  tokens: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray
  finished: np.ndarray
  stopped: np.ndarray
  steps: int
  seconds: float

  def row(self, b: int) -> tuple[list[int], list[float]]:
    n = int(self.lengths[b])
    return self.tokens[b, :n].tolist(), self.logprobs[b, :n].tolist()


@functools.partial(jax.jit, static_argnums=2)
def _draw(key, logits, temperature: float):
  """(token [B] int32, its log-prob [B] fp32) from logits [B,V] (module doc)."""
  x = logits.astype(jnp.float32)
  if temperature > 0:
    x = x / temperature
    tok = jax.random.categorical(key, x, axis=-1).astype(jnp.int32)
  else:
    tok = jnp.argmax(x, axis=-1).astype(jnp.int32)
  lp = jax.nn.log_softmax(x, axis=-1)
  return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]


def sample(config: ModelConfig, variables, prefixes: Sequence[Sequence[int]],
           limits: Sequence[int], *, width: int, key: jax.Array,
           stop_tokens: Sequence[int] = (), temperature: float = 1.0,
           stop_after: int | None = None) -> RolloutBatch:
  """Continue each prefix by up to limits[b] tokens (module doc). A row with limit 0 is idle
  (padding of a fixed batch); it never counts as finished in this call."""
  t0 = time.perf_counter()
  b = len(prefixes)
  limits = np.asarray(limits, np.int64)
  if limits.shape != (b,) or (limits < 0).any():
    raise ValueError(f"limits: expected {b} non-negative ints, found {limits.tolist()}")
  if temperature < 0:
    raise ValueError(f"temperature: expected >= 0, found {temperature}")
  toks, lens = G.padded_prompts(prefixes)
  if (lens + limits > width).any():
    i = int(np.argmax(lens + limits - width))
    raise ValueError(f"prefixes: row {i} has {lens[i]} prefix tokens + limit {limits[i]} > "
                     f"width={width} (the cache capacity)")
  toks = np.pad(toks, ((0, 0), (0, width - toks.shape[1])))
  variables = G.unbox(variables)
  variables = {k: v for k, v in variables.items() if k in ("params", "balance")}
  logits, cache = G.prefill(config, variables, toks, lens, max_len=width, chunk=width)
  stop_ids = np.array(sorted(set(int(t) for t in stop_tokens)), np.int64)
  cap = int(limits.max()) if b else 0
  out_t = np.zeros((b, max(cap, 1)), np.int32)
  out_lp = np.zeros((b, max(cap, 1)), np.float32)
  n = np.zeros(b, np.int64)
  active = limits > 0
  stopped = np.zeros(b, bool)
  real = int(active.sum())
  target = real if stop_after is None else min(int(stop_after), real)
  steps = 0
  while active.any():
    key, sub = jax.random.split(key)
    tok, lp = _draw(sub, logits, float(temperature))
    tok, lp = np.asarray(tok), np.asarray(lp)
    steps += 1
    rows = np.nonzero(active)[0]
    out_t[rows, n[rows]] = tok[rows]
    out_lp[rows, n[rows]] = lp[rows]
    n[rows] += 1
    hit_stop = np.isin(tok, stop_ids) & active
    stopped |= hit_stop
    active &= ~hit_stop & (n < limits)
    if real - int(active.sum()) >= target or not active.any():
      break
    logits, cache = G.decode_step(config, variables, cache, tok, active)
  finished = (limits > 0) & ~active
  return RolloutBatch(out_t, out_lp, n.astype(np.int32), finished, stopped, steps,
                      time.perf_counter() - t0)


def rollout(config: ModelConfig, variables, prompts: Sequence[Sequence[int]],
            max_new_tokens: int, *, key: jax.Array, width: int | None = None,
            stop_tokens: Sequence[int] = (), temperature: float = 1.0) -> RolloutBatch:
  """Sample a response for every prompt (waits for all; `sample` with equal limits)."""
  width = width or max(len(p) for p in prompts) + max_new_tokens
  return sample(config, variables, prompts, [max_new_tokens] * len(prompts), width=width,
                key=key, stop_tokens=stop_tokens, temperature=temperature)


def sequences(prefixes: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
              width: int) -> tuple[np.ndarray, np.ndarray]:
  """(seqs [B, width] = prefix + response right-padded, prefix lengths [B]) for scoring."""
  seqs = np.zeros((len(prefixes), width), np.int32)
  for i, (p, r) in enumerate(zip(prefixes, responses)):
    row = list(p) + list(r)
    if len(row) > width:
      raise ValueError(f"sequences: row {i} has {len(row)} tokens > width={width}")
    seqs[i, :len(row)] = row
  return seqs, np.array([len(p) for p in prefixes], np.int32)
