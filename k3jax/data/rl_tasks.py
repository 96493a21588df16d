"""Procedurally generated verifiable tasks as XTML chat prompts (docs/k3.md §13, k3jax/data/chat.py).

Three domains, each with an exact checker:
  "arith"   "Compute 7*8." → "56" (a op b, op in + - *, operands 0..9)
  "sort"    "Sort 5,2,9." → "2,5,9" (3 to 5 digits, ascending, comma-joined)
  "puzzle"  "Which digit is missing: 3,0,8,1,6,2,9,4,7?" → "5" (a shuffle of 0..9 less one)

The prompt is one user turn in thinking mode with the reasoning effort as a global option
(K3 §13: RL prompts think; the effort is an input option):
  [open]options[sep]{"effort":"low"}[end_of_msg][open]user[sep]Compute 7*8.[end_of_msg]
  [open]assistant[sep][open]think[sep]
and the reply thinks, closes the `think` channel, answers in the `response` channel and ends
the message:
  ....[close][open]response[sep]56[close][end_of_msg]
It is generated until `[end_of_msg]` (`STOP_TOKEN`, kept as the reply's last token).
`read_reply` reads a reply at the token level: its thinking tokens (the text tokens of the
`think` channel: T(y) of a general task, the effort budget's measure, as
`env.Trajectory.effort_tokens(agentic=False)` counts them) and its response channel. The
answer is the last whitespace-separated word of the response channel of a complete reply
(one that parses through `[end_of_msg]`); a reply cut at its cap, or one that does not parse,
has no answer. With `effort_option=False` the prompt has no options block at all (the task's
effort still names its teacher and τ): the prompt a (domain × effort) teacher is trained on
and scores with (k3jax/posttrain/rl/rewards.py `strip_effort`).
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
from k3jax.data.tokenizers import CHAT_END, ByteTokenizer

DOMAINS = ("arith", "sort", "puzzle")
EFFORTS = chat.EFFORTS
STOP_TOKEN = CHAT_END            # ends the assistant's message (after its response)
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


def conversation(question: str, effort: str | None) -> chat.Conversation:
  """The conversation of one question: the effort as a global option (none for None), one
  user turn."""
  options = None if effort is None else chat.Options(effort=effort)
  return chat.user_conversation(question, options=options)


def render(question: str, effort: str | None) -> str:
  """The XTML prompt of one question (module doc), as text (thinking mode)."""
  return chat.render_prompt(conversation(question, effort), thinking=True)


def prompt_tokens(question: str, effort: str | None) -> tuple[int, ...]:
  """The prompt's ids (thinking mode, no BOS) by the one chat encoder; effort None: no
  options block."""
  ids = _ENCODER.encode(conversation(question, effort), reply="thinking", bos=False).ids
  return tuple(int(i) for i in ids)


def encode(text: str) -> tuple[int, ...]:
  """Response text → ids (ordinary text: a special name typed in it stays bytes)."""
  return tuple(_ENCODER.text(text))


def decode(tokens: Sequence[int]) -> str:
  """Response ids → text (the stop token and other specials dropped)."""
  return _TOKENIZER.decode(list(tokens))


def make_task(rng: np.random.Generator, uid: int, domain: str, effort: str,
              effort_option: bool = True) -> Task:
  """One task; `effort_option=False`: the prompt carries no options block (module doc)."""
  if effort not in EFFORTS:
    raise ValueError(f"effort: expected one of {EFFORTS}, found {effort!r}")
  q, a = _question(rng, domain)
  return Task(uid, domain, effort, q, a, prompt_tokens(q, effort if effort_option else None))


@dataclasses.dataclass(frozen=True)
class Reply:
  """A generated reply read at the token level (module doc): `thinking_tokens` = text tokens
  in the `think` channel; `response` = the response channel's text of a complete reply (None
  when the reply is cut, does not parse or has no response channel)."""
  thinking_tokens: int
  response: str | None
  complete: bool


_NAMES = {v: k for k, v in _ENCODER.marker_ids.items()}


def read_reply(tokens: Sequence[int]) -> Reply:
  """Read the reply that continues the thinking opening (module doc); tokens after the first
  `[end_of_msg]` are ignored."""
  parts, run, channel, state, header, thinking = [], [], "think", "text", [], 0
  complete = False
  for t in tokens:
    t = int(t)
    name = _NAMES.get(t)
    if name is None:
      if 0 <= t < 256:
        run.append(t)
        if state == "header":
          header.append(t)
        elif state == "text" and channel == "think":
          thinking += 1
      continue                      # other specials (pad, eos …) are not text
    if run:
      parts.append(_TOKENIZER.decode(run))
      run = []
    parts.append(name)
    if name == chat.OPEN:
      state, header = "header", []
    elif name == chat.SEP:
      if state == "header":
        channel = _TOKENIZER.decode(header)
      state = "text"
    elif name == chat.CLOSE:
      state = "between"
    else:                           # [end_of_msg]
      complete = True
      break
  if run:
    parts.append(_TOKENIZER.decode(run))
  if not complete or any(p not in chat.MARKERS and any(m in p for m in chat.MARKERS)
                         for p in parts):
    return Reply(thinking, None, complete)
  try:
    msg = chat.parse_reply("".join(parts), thinking=True)
  except ValueError:
    return Reply(thinking, None, True)
  return Reply(thinking, msg.content, True)


def thinking_tokens(tokens: Sequence[int]) -> int:
  """T(y) of a general task: the reply's thinking tokens (`read_reply`)."""
  return read_reply(tokens).thinking_tokens


def reply_tokens(thinking: str, response: str, end: bool = True) -> tuple[int, ...]:
  """The ids of a reply that thinks `thinking` and answers `response` (after the prompt's
  thinking opening): think text, `[close]`, the response channel, `[end_of_msg]`."""
  segs = chat.message_segments(chat.Message("assistant", response, thinking))
  ids = _ENCODER.segments(segs)
  head = len(_ENCODER.segments(chat.reply_segments(True)))   # the prompt's opening
  ids = ids[head:]
  return tuple(ids if end else ids[:-1])


def extract_answer(response: str | None) -> str | None:
  """The last whitespace-separated word of the response, or None for an empty one."""
  words = (response or "").split()
  return words[-1] if words else None


def is_correct(task: Task, response: str | None) -> bool:
  """Exact check of a response channel's text against the task's answer."""
  return extract_answer(response) == task.answer


def reply_correct(task: Task, tokens: Sequence[int]) -> bool:
  """Exact check of a generated reply (ids): the answer of its response channel."""
  return is_correct(task, read_reply(tokens).response)


class TaskSampler:
  """Draws tasks uniformly over `domains` × `efforts`, reproducibly from `seed`. A task family
  sets `known` (its domains) and `make` (rng, uid, domain, effort → task)."""
  known: tuple[str, ...] = DOMAINS
  make = staticmethod(make_task)

  def __init__(self, domains: Sequence[str] | None = None, efforts: Sequence[str] = EFFORTS,
               seed: int = 0, effort_option: bool = True):
    domains = self.known if domains is None else tuple(domains)
    for d in domains:
      if d not in self.known:
        raise ValueError(f"domains: expected names from {self.known}, found {d!r}")
    for e in efforts:
      if e not in EFFORTS:
        raise ValueError(f"efforts: expected names from {EFFORTS}, found {e!r}")
    if not domains or not efforts:
      raise ValueError("domains/efforts: need at least one of each")
    self.domains, self.efforts = tuple(domains), tuple(efforts)
    self.effort_option = effort_option
    self._rng = np.random.default_rng(seed)
    self._next = 0

  def sample(self, n: int) -> list:
    out = []
    for _ in range(n):
      d = self.domains[int(self._rng.integers(0, len(self.domains)))]
      e = self.efforts[int(self._rng.integers(0, len(self.efforts)))]
      out.append(self.make(self._rng, self._next, d, e) if self.effort_option
                 else self.make(self._rng, self._next, d, e, effort_option=False))
      self._next += 1
    return out

  def state(self) -> dict:
    return {"next": self._next, "rng": self._rng.bit_generator.state}

  def restore(self, state: dict) -> None:
    self._next = int(state["next"])
    self._rng.bit_generator.state = state["rng"]


def filler_range(effort: str | None, max_filler: int) -> tuple[int, int]:
  """The cold start's thinking lengths (lo, hi), inclusive: 0..max_filler for None; for an
  effort level its third of that range, in EFFORTS order (max_filler 8: low 0–2, high 3–5,
  max 6–8)."""
  if effort is None:
    return 0, max_filler
  if effort not in EFFORTS:
    raise ValueError(f"effort: expected one of {EFFORTS}, found {effort!r}")
  if max_filler + 1 < len(EFFORTS):
    raise ValueError(f"max_filler: by effort needs >= {len(EFFORTS) - 1}, found {max_filler}")
  part = np.array_split(np.arange(max_filler + 1), len(EFFORTS))[EFFORTS.index(effort)]
  return int(part[0]), int(part[-1])


def sft_reply(task: Task, rng: np.random.Generator, max_filler: int = 8,
              by_effort: bool = False) -> tuple[int, ...]:
  """Cold-start data (ids after the prompt): a reply that thinks 0..max_filler filler dots,
  then answers exactly — thinking lengths vary, so that an effort budget has something to
  remove. `by_effort`: the length drawn from the task's effort level's third of that range
  (`filler_range`), so the cold start already reads the effort option."""
  lo, hi = filler_range(task.effort if by_effort else None, max_filler)
  return reply_tokens("." * int(rng.integers(lo, hi + 1)), task.answer)
