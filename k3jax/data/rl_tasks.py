"""Procedurally generated verifiable tasks as XTML chat prompts (docs/k3.md §13, k3jax/data/chat.py).

Three domains, each with an exact checker:
  "arith"   "Compute 7*8." → "56" (a op b, op in + - *, operands 0..9)
  "sort"    "Sort 5,2,9." → "2,5,9" (3 to 5 digits, ascending, comma-joined)
  "puzzle"  "Which digit is missing: 3,0,8,1,6,2,9,4,7?" → "5" (a shuffle of 0..9 less one)

The prompt is one user turn in instruct mode with the reasoning effort as a global option:
  [open]options[sep]{"effort":"low"}[end_of_msg][open]user[sep]Compute 7*8.[end_of_msg]
  [open]assistant[sep][open]response[sep]
and the reply is generated until `[close]` (the response channel's end; `STOP_TOKEN`).
The answer is the last whitespace-separated word of the response, so a response may carry
any amount of text before it (the effort budget is what keeps it short).
Tokens are the byte tokenizer's (k3jax/data/corpus.py), written by the one chat encoder
(k3jax/data/chat_tokens.py: the XTML markers from the structure as single ids, texts as bytes;
no BOS, as rollouts have always been prompted).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from k3jax.data import chat
from k3jax.data.chat_tokens import ChatEncoder
from k3jax.data.tokenizers import CHAT_CLOSE, ByteTokenizer

DOMAINS = ("arith", "sort", "puzzle")
EFFORTS = chat.EFFORTS
STOP_TOKEN = CHAT_CLOSE          # ends the response channel
_TOKENIZER = ByteTokenizer()
_ENCODER = ChatEncoder(_TOKENIZER)


@dataclasses.dataclass(frozen=True)
class Task:
  """One prompt: `uid` is unique per sampler; `tokens` the rendered prompt's ids."""
  uid: int
  domain: str
  effort: str
  question: str
  answer: str
  tokens: tuple[int, ...]


def _question(rng: np.random.Generator, domain: str) -> tuple[str, str]:
  if domain == "arith":
    a, b = (int(x) for x in rng.integers(0, 10, 2))
    op = "+-*"[int(rng.integers(0, 3))]
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"Compute {a}{op}{b}.", str(value)
  if domain == "sort":
    xs = [int(x) for x in rng.integers(0, 10, int(rng.integers(3, 6)))]
    return f"Sort {','.join(map(str, xs))}.", ",".join(map(str, sorted(xs)))
  if domain == "puzzle":
    digits = [int(x) for x in rng.permutation(10)]
    missing = digits.pop(int(rng.integers(0, 10)))
    return f"Which digit is missing: {','.join(map(str, digits))}?", str(missing)
  raise ValueError(f"domain: expected one of {DOMAINS}, found {domain!r}")


def conversation(question: str, effort: str) -> chat.Conversation:
  """The conversation of one question: the effort as a global option, one user turn."""
  return chat.user_conversation(question, options=chat.Options(effort=effort))


def render(question: str, effort: str) -> str:
  """The XTML prompt of one question (module doc), as text."""
  return chat.render_prompt(conversation(question, effort), thinking=False)


def prompt_tokens(question: str, effort: str) -> tuple[int, ...]:
  """The prompt's ids (instruct mode, no BOS) by the one chat encoder."""
  ids = _ENCODER.encode(conversation(question, effort), reply="instruct", bos=False).ids
  return tuple(int(i) for i in ids)


def encode(text: str) -> tuple[int, ...]:
  """Response text → ids (ordinary text: a special name typed in it stays bytes)."""
  return tuple(_ENCODER.text(text))


def decode(tokens: Sequence[int]) -> str:
  """Response ids → text (the stop token and other specials dropped)."""
  return _TOKENIZER.decode(list(tokens))


def make_task(rng: np.random.Generator, uid: int, domain: str, effort: str) -> Task:
  if effort not in EFFORTS:
    raise ValueError(f"effort: expected one of {EFFORTS}, found {effort!r}")
  q, a = _question(rng, domain)
  return Task(uid, domain, effort, q, a, prompt_tokens(q, effort))


def extract_answer(response: str) -> str | None:
  """The last whitespace-separated word of the response, or None for an empty one."""
  words = response.split()
  return words[-1] if words else None


def is_correct(task: Task, response: str) -> bool:
  """Exact check of a response text against the task's answer."""
  return extract_answer(response) == task.answer


class TaskSampler:
  """Draws tasks uniformly over `domains` × `efforts`, reproducibly from `seed`."""

  def __init__(self, domains: Sequence[str] = DOMAINS, efforts: Sequence[str] = EFFORTS,
               seed: int = 0):
    for d in domains:
      if d not in DOMAINS:
        raise ValueError(f"domains: expected names from {DOMAINS}, found {d!r}")
    for e in efforts:
      if e not in EFFORTS:
        raise ValueError(f"efforts: expected names from {EFFORTS}, found {e!r}")
    if not domains or not efforts:
      raise ValueError("domains/efforts: need at least one of each")
    self.domains, self.efforts = tuple(domains), tuple(efforts)
    self._rng = np.random.default_rng(seed)
    self._next = 0

  def sample(self, n: int) -> list[Task]:
    out = []
    for _ in range(n):
      d = self.domains[int(self._rng.integers(0, len(self.domains)))]
      e = self.efforts[int(self._rng.integers(0, len(self.efforts)))]
      out.append(make_task(self._rng, self._next, d, e))
      self._next += 1
    return out

  def state(self) -> dict:
    return {"next": self._next, "rng": self._rng.bit_generator.state}

  def restore(self, state: dict) -> None:
    self._next = int(state["next"])
    self._rng.bit_generator.state = state["rng"]


def sft_response(task: Task, rng: np.random.Generator, max_filler: int = 8) -> str:
  """A correct response with 0..max_filler filler dots before the answer: cold-start data
  whose lengths vary, so that an effort budget has something to remove."""
  return "." * int(rng.integers(0, max_filler + 1)) + " " + task.answer
