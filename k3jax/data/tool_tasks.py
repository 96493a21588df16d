"""Tasks that need a Python tool, for agentic RL (docs/notes/rl.md, K3 §13): the prompt
declares a `python` tool; the answer is checked exactly by a verifier the policy never sees.

Three domains (each answer is one whitespace-free word; the last word of the final reply's
response channel is the answer, as in k3jax/data/rl_tasks.py):
  "bigmul"  the product of two 24–30-digit numbers (too long to multiply by hand);
  "strops"  a chain of string operations on a random 24-letter string — reverse, keep every
            k-th character, rotate each letter by n in the alphabet, swap case — that only
            code gets right letter for letter;
  "lookup"  a table of people (id, name, team, score) in the prompt: "the sum of the scores
            of everyone in <name>'s team, times <name>'s id" — two lookups and an aggregate.

The prompt (thinking mode: the reply opens the `think` channel):
  [open]options[sep]{"effort":"high","tools":[{"description":…,"name":"python",…}]}[end_of_msg]
  [open]user[sep]…question…[end_of_msg][open]assistant[sep][open]think[sep]
A tool call is an assistant `tools` channel, `[{"arguments":{"code":"print(…)"},
"name":"python"}]`; the environment (k3jax/posttrain/rl/env.py) answers with a `tool`
message holding the code's output. `reference_code(task)` is a program whose output is the
answer (tests run it in the sandbox: the tool makes every task solvable).
"""

from __future__ import annotations

import dataclasses
import string
from typing import Sequence

import numpy as np

from k3jax.data import chat
from k3jax.data.chat_tokens import ChatEncoder
from k3jax.data.tokenizers import ByteTokenizer

DOMAINS = ("bigmul", "strops", "lookup")
EFFORTS = chat.EFFORTS
PYTHON_TOOL = chat.ToolSpec(
    name="python", description="Run Python 3 code in a sandbox; returns what it prints.",
    parameters={"type": "object", "properties": {"code": {"type": "string"}},
                "required": ["code"]})
_TOKENIZER = ByteTokenizer()
_ENCODER = ChatEncoder(_TOKENIZER)
_NAMES = ("ada", "bo", "cy", "dee", "eli", "fay", "gus", "hal", "ivy", "jo", "kai", "lu",
          "max", "ned", "ora", "pia")
_TEAMS = ("red", "blue", "green", "gold")


@dataclasses.dataclass(frozen=True)
class ToolTask:
  """One agentic task. `conversation` / `tokens` are all the policy sees; `answer` and
  `spec` (the generating parameters) belong to the verifier."""
  uid: int
  domain: str
  effort: str
  question: str
  answer: str
  spec: tuple
  conversation: chat.Conversation
  tokens: tuple[int, ...]


def _bigmul(rng):
  a, b = (int("".join(str(d) for d in [rng.integers(1, 10)] + list(rng.integers(0, 10, n - 1))))
          for n in rng.integers(24, 31, 2))
  return f"Compute {a}*{b} exactly.", str(a * b), (a, b)


_OPS = ("reverse", "every", "rotate", "swapcase")


def _apply(op: str, arg: int, s: str) -> str:
  if op == "reverse":
    return s[::-1]
  if op == "every":
    return s[::arg]
  if op == "rotate":
    def rot(c):
      base = "a" if c.islower() else "A"
      return chr((ord(c) - ord(base) + arg) % 26 + ord(base))
    return "".join(rot(c) for c in s)
  return s.swapcase()


def _strops(rng):
  s = "".join(rng.choice(list(string.ascii_letters), 24))
  ops = [(_OPS[int(i)], int(rng.integers(2, 4)) if _OPS[int(i)] == "every" else
          int(rng.integers(1, 26))) for i in rng.permutation(4)[:3]]
  words = {"reverse": "reverse it", "every": "keep every {}-th character starting with the "
           "first", "rotate": "shift every letter {} places forward in the alphabet (wrapping, "
           "case kept)", "swapcase": "swap the case of every letter"}
  steps = "; then ".join(words[op].format(arg) for op, arg in ops)
  out = s
  for op, arg in ops:
    out = _apply(op, arg, out)
  return f"Take the string {s}: {steps}. Give the result.", out, (s, tuple(ops))


def _lookup(rng):
  n = int(rng.integers(8, 13))
  names = [_NAMES[int(i)] for i in rng.permutation(len(_NAMES))[:n]]
  rows = [(int(100 + i * 7 + rng.integers(0, 7)), nm, _TEAMS[int(rng.integers(0, 4))],
           int(rng.integers(10, 100))) for i, nm in enumerate(names)]
  who = rows[int(rng.integers(0, n))]
  total = sum(r[3] for r in rows if r[2] == who[2])
  table = "\n".join(f"{i},{nm},{team},{score}" for i, nm, team, score in rows)
  q = (f"Table (id,name,team,score):\n{table}\nWhat is the sum of the scores of everyone in "
       f"{who[1]}'s team, multiplied by {who[1]}'s id?")
  return q, str(total * who[0]), (tuple(rows), who[1])


_MAKERS = {"bigmul": _bigmul, "strops": _strops, "lookup": _lookup}


def conversation(question: str, effort: str) -> chat.Conversation:
  """Global options (the effort and the python tool), then the user's question."""
  return chat.user_conversation(question, options=chat.Options((PYTHON_TOOL,), effort))


def prompt_tokens(conv: chat.Conversation) -> tuple[int, ...]:
  """The prompt's ids (thinking mode, no BOS) by the one chat encoder."""
  ids = _ENCODER.encode(conv, reply="thinking", bos=False).ids
  return tuple(int(i) for i in ids)


def make_task(rng: np.random.Generator, uid: int, domain: str, effort: str) -> ToolTask:
  if domain not in DOMAINS:
    raise ValueError(f"domain: expected one of {DOMAINS}, found {domain!r}")
  if effort not in EFFORTS:
    raise ValueError(f"effort: expected one of {EFFORTS}, found {effort!r}")
  q, a, spec = _MAKERS[domain](rng)
  conv = conversation(q, effort)
  return ToolTask(uid, domain, effort, q, a, spec, conv, prompt_tokens(conv))


def extract_answer(response: str | None) -> str | None:
  """The last whitespace-separated word of the final response, None if there is none."""
  words = (response or "").split()
  return words[-1].rstrip(".") if words else None


def is_correct(task: ToolTask, response: str | None) -> bool:
  """The hidden verifier: exact match of the final answer."""
  return extract_answer(response) == task.answer


def reference_code(task: ToolTask) -> str:
  """A Python program that prints the answer (what a good tool call looks like)."""
  if task.domain == "bigmul":
    a, b = task.spec
    return f"print({a}*{b})"
  if task.domain == "strops":
    s, ops = task.spec
    lines = [f"s = {s!r}"]
    for op, arg in ops:
      lines.append({"reverse": "s = s[::-1]", "every": f"s = s[::{arg}]",
                    "swapcase": "s = s.swapcase()",
                    "rotate": ("s = ''.join(chr((ord(c) - ord(b) + %d) %% 26 + ord(b)) for c, b"
                               " in ((c, 'a' if c.islower() else 'A') for c in s))" % arg)}[op])
    return "\n".join(lines + ["print(s)"])
  rows, who = task.spec
  return (f"rows = {list(rows)!r}\nme = [r for r in rows if r[1] == {who!r}][0]\n"
          "print(sum(r[3] for r in rows if r[2] == me[2]) * me[0])")


class ToolTaskSampler:
  """Draws tool tasks uniformly over `domains` × `efforts`, reproducibly from `seed`."""

  def __init__(self, domains: Sequence[str] = DOMAINS, efforts: Sequence[str] = EFFORTS,
               seed: int = 0):
    bad = [d for d in domains if d not in DOMAINS] + [e for e in efforts if e not in EFFORTS]
    if bad or not domains or not efforts:
      raise ValueError(f"domains/efforts: expected non-empty subsets of {DOMAINS} and "
                       f"{EFFORTS}, found {tuple(domains)} and {tuple(efforts)}")
    self.domains, self.efforts = tuple(domains), tuple(efforts)
    self._rng = np.random.default_rng(seed)
    self._next = 0

  def sample(self, n: int) -> list[ToolTask]:
    out = []
    for _ in range(n):
      d = self.domains[int(self._rng.integers(0, len(self.domains)))]
      e = self.efforts[int(self._rng.integers(0, len(self.efforts)))]
      out.append(make_task(self._rng, self._next, d, e))
      self._next += 1
    return out


__all__ = ["DOMAINS", "PYTHON_TOOL", "ToolTask", "ToolTaskSampler", "make_task",
           "is_correct", "extract_answer", "reference_code", "conversation", "prompt_tokens"]
