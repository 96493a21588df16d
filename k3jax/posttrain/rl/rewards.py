"""Rewards of the RL stage (docs/k3.md §13): the verifiable task reward, the effort budget and the
MOPD per-token reward from the teacher of the prompt's (domain, effort).

Task reward: 1 when the response's answer is exact (k3jax/data/rl_tasks.py), else 0.
Effort budget: with b₀(x) the mean T of the initial policy on prompt x and τ_d(r) the
  domain's factor at round r (linear from tau_start to tau_end over anneal_rounds, then held),
  the reward becomes −1 when T(y) > τ_d(r)·b₀(x) (T(y) = thinking tokens for general tasks,
  thinking + tool-call argument tokens for agentic ones; T(y) = τ·b₀ is within budget).
MOPD: r_t = clip(sg[log π_teacher(y_t|x',y<t) − log π_θ(y_t|x,y<t)], −R_max, R_max); the
  stop-gradient makes it a reward (a number), not a loss through π_θ. The student sees the
  prompt x with its effort option; the teacher of (domain, effort) scores x' = x without it
  (`strip_effort`: the effort removed from every options block, a block left empty removed),
  and the same response tokens y, so r_t pairs the two log-probs of the same token y_t.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.posttrain.rl import logprobs as lp_lib
from k3jax.data import chat, tool_tasks
from k3jax.data.chat_tokens import ChatEncoder
from k3jax.data.rl_tasks import DOMAINS, Task, is_correct
from k3jax.data.tokenizers import ByteTokenizer

_ENCODER = ChatEncoder(ByteTokenizer())
_IDS = _ENCODER.marker_ids


def task_rewards(tasks: Sequence[Task], responses: Sequence[str]) -> np.ndarray:
  """[n] float32: 1 for an exact answer, 0 otherwise."""
  if len(tasks) != len(responses):
    raise ValueError(f"tasks/responses: {len(tasks)} tasks, {len(responses)} responses")
  return np.array([float(is_correct(t, r)) for t, r in zip(tasks, responses)], np.float32)


def budget_violations(lengths, b0, tau) -> np.ndarray:
  """[n] bool: T(y) > τ·b₀(x) (lengths, b0, tau broadcast)."""
  return np.asarray(lengths, np.float64) > np.asarray(tau, np.float64) * np.asarray(b0, np.float64)


def apply_budget(rewards, lengths, b0, tau) -> np.ndarray:
  """The task reward with −1 where the response is over budget."""
  return np.where(budget_violations(lengths, b0, tau), -1.0, rewards).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class TauSchedule:
  """τ per domain, annealed linearly from tau_start to tau_end over anneal_rounds rounds."""
  tau_start: Mapping[str, float]
  tau_end: Mapping[str, float]
  anneal_rounds: Mapping[str, int]

  def __post_init__(self):
    for name in ("tau_start", "tau_end", "anneal_rounds"):
      m = getattr(self, name)
      for d, v in m.items():
        if d not in DOMAINS + tool_tasks.DOMAINS:
          raise ValueError(f"budget.{name}: unknown domain {d!r} (domains: "
                           f"{DOMAINS + tool_tasks.DOMAINS})")
        if not v > 0 and not (name == "anneal_rounds" and v == 0):
          raise ValueError(f"budget.{name}[{d!r}]: expected > 0, found {v}")

  @classmethod
  def uniform(cls, tau_start: float, tau_end: float, anneal_rounds: int,
              domains: Sequence[str] = DOMAINS) -> "TauSchedule":
    return cls({d: tau_start for d in domains}, {d: tau_end for d in domains},
               {d: anneal_rounds for d in domains})

  def __call__(self, domain: str, round_index: int) -> float:
    if domain not in self.tau_start:
      raise ValueError(f"budget: no τ schedule for domain {domain!r}")
    a, b, n = self.tau_start[domain], self.tau_end[domain], self.anneal_rounds[domain]
    frac = 1.0 if n == 0 else min(1.0, max(0, round_index) / n)
    return a + (b - a) * frac


def mopd_reward(teacher_lp: jax.Array, student_lp: jax.Array, r_max: float) -> jax.Array:
  """clip(sg[teacher_lp − student_lp], −r_max, r_max) per token (fp32)."""
  if not r_max > 0:
    raise ValueError(f"mopd.r_max: expected > 0, found {r_max}")
  diff = jax.lax.stop_gradient(teacher_lp.astype(jnp.float32) - student_lp.astype(jnp.float32))
  return jnp.clip(diff, -r_max, r_max)


def strip_effort(prompt: Sequence[int]) -> list[int]:
  """The prompt's ids without the effort option (byte-tokenizer ids, k3jax/data/chat_tokens.py):
  every `options` / `turn_options` block loses its `effort`; a block left with no option is
  removed whole; every other token is kept in order."""
  prompt = [int(t) for t in prompt]
  out, i, n = [], 0, len(prompt)
  heads = {h: _ENCODER.text(h) for h in (chat.GLOBAL_OPTIONS, chat.TURN_OPTIONS)}
  while i < n:
    if prompt[i] == _IDS[chat.OPEN]:
      for head, hid in heads.items():
        j = i + 1 + len(hid)
        if prompt[i + 1:j] == hid and j < n and prompt[j] == _IDS[chat.SEP]:
          try:
            end = prompt.index(_IDS[chat.END], j)
          except ValueError:
            raise ValueError(f"strip_effort: the {head} block at {i} is not closed") from None
          opts = chat.Options.from_json(bytes(prompt[j + 1:end]).decode("utf-8"))
          if opts.tools:
            out += _ENCODER.segments([(chat.MARK, chat.OPEN), (chat.NAME, head),
                                      (chat.MARK, chat.SEP),
                                      (chat.TEXT, chat.Options(opts.tools).to_json()),
                                      (chat.MARK, chat.END)])
          i = end + 1
          break
      else:
        out.append(prompt[i])
        i += 1
      continue
    out.append(prompt[i])
    i += 1
  return out


def stripped_rows(seqs, prompt_lens, resp_width: int) -> tuple[np.ndarray, np.ndarray]:
  """(seqs, prompt_lens) with every row's prompt `strip_effort`-ed and its resp_width tokens
  after the prompt kept (so response position t is the same token in both)."""
  seqs, plens = np.asarray(seqs), np.asarray(prompt_lens)
  out = np.zeros_like(seqs)
  lens = np.zeros_like(plens)
  for b in range(seqs.shape[0]):
    p = int(plens[b])
    prompt = strip_effort(seqs[b, :p])
    row = prompt + seqs[b, p:p + resp_width].tolist()
    out[b, :len(row)] = row
    lens[b] = len(prompt)
  return out, lens


class Teachers:
  """The MOPD teachers: {(domain, effort): (config, variables)}; any config whose vocabulary
  is the policy's. `score` gives every row the log-probs of its own teacher, one batched
  training forward per teacher over its rows. With `strip_effort` (default) a teacher scores
  the prompt without its effort option (module doc): the student alone is conditioned on it."""

  def __init__(self, teachers: Mapping[tuple[str, str], tuple[ModelConfig, dict]],
               vocab_size: int, strip_effort: bool = True):
    for key, (cfg, _) in teachers.items():
      if cfg.text.vocab_size != vocab_size:
        raise ValueError(f"teacher {key}: vocab_size {cfg.text.vocab_size} differs from the "
                         f"policy's {vocab_size} (the tokens must mean the same)")
    self.teachers = dict(teachers)
    self.strip_effort = strip_effort

  def has(self, domain: str, effort: str) -> bool:
    return (domain, effort) in self.teachers

  def score(self, keys: Sequence[tuple[str, str]], seqs, prompt_lens, resp_width: int,
            temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(teacher logp [B, resp_width] fp32, has_teacher [B] bool) for rows with (domain,
    effort) `keys`; rows without a teacher get 0 and False. Column t is the log-prob of the
    row's response token t (the prompt stripped of its effort option first, when set)."""
    seqs = np.asarray(seqs)
    if self.strip_effort and self.teachers:
      seqs, prompt_lens = stripped_rows(seqs, prompt_lens, resp_width)
    out = np.zeros((seqs.shape[0], resp_width), np.float32)
    has = np.zeros(seqs.shape[0], bool)
    for key, (cfg, variables) in self.teachers.items():
      rows = [i for i, k in enumerate(keys) if tuple(k) == key]
      if not rows:
        continue
      # Pad the row set to the whole batch: one compiled shape per teacher.
      idx = np.array(rows + [rows[0]] * (seqs.shape[0] - len(rows)))
      lp = lp_lib.token_logprobs(cfg, variables, seqs[idx], np.asarray(prompt_lens)[idx],
                                 resp_width, temperature)
      out[rows] = lp[:len(rows)]
      has[rows] = True
    return out, has
