"""The embedded SFT dataset: procedurally generated chat tasks with exactly checkable answers.

Tasks (`TASKS`), each one user turn and the assistant's answer in its `response` channel:
  add         "What is 37+58?"                         → "95"        (operands 0–99)
  sub         "What is 58-21?"                         → "37"        (a ≥ b, 0–99)
  reverse     "Reverse the word kelp."                 → "plek"      (3–6 random letters)
  upper       "Write kelp in upper case."              → "KELP"
  count       "How many times does e occur in geese?"  → "3"         (1, 2 or 3 times)
  calculator  "Use the calculator to compute 412*37."  → a `tools` call
              calculator({"expression": "412*37"}), the tool's message "15244", then "15244"
              (the calculator is declared in the global options; a ×: 10–999 by 10–99)

Mode: each conversation is in thinking mode (every assistant message opens with a short
`think` channel naming the job) or instruct mode (no `think`; a tool-calling message then
has an empty `response`, since instruct replies open that channel), half and half.

Split. A problem (its task and operands, `Sample.key`) is held out iff
md5(key) mod 10 == 0, whatever the seed: the held-out set never shares a problem with the
training set. Sample i of a split is drawn from `default_rng([seed, split, i])` (redrawn until
its problem is in the split), so each (seed, split) gives its own reproducible list.

Checking. `check(sample, reply)` is exact: the reply's `response` channel equals the answer,
character for character. `calculator(expression)` is the tool: integers joined by + - *
evaluated with the usual precedence (no `eval`), or an "error: …" text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import string

import numpy as np

from k3jax.data import chat

TASKS = ("add", "sub", "reverse", "upper", "count", "calculator")
TRAIN, HELDOUT = 0, 1
HELDOUT_MOD = 10
CALCULATOR = chat.ToolSpec("calculator", "Integer arithmetic.", {"expression": "string"})
_EXPR = re.compile(r"^\s*-?\d+(\s*[-+*]\s*-?\d+)*\s*$")


@dataclasses.dataclass(frozen=True)
class Sample:
  """One task instance: the whole gold conversation and its final answer."""
  task: str
  key: str                          # the problem, e.g. "add:37,58" (decides the split)
  conversation: chat.Conversation   # gold: user turn … final assistant answer
  answer: str                       # the final assistant message's response channel
  thinking: bool                    # whether its assistant messages open with `think`

  def prompt(self) -> chat.Conversation:
    """The conversation up to (not including) the first assistant message."""
    msgs = self.conversation.messages
    first = next(i for i, m in enumerate(msgs) if m.role == "assistant")
    return chat.Conversation(msgs[:first], self.conversation.options)


def heldout(key: str) -> bool:
  """Whether problem `key` belongs to the held-out split (module doc)."""
  h = int.from_bytes(hashlib.md5(key.encode()).digest()[:8], "little")
  return h % HELDOUT_MOD == 0


def calculator(expression: str) -> str:
  """The calculator tool: an integer expression with + - * → its value as text."""
  if not isinstance(expression, str) or not _EXPR.match(expression):
    return "error: expected integers joined by + - *"
  # A sum of products; where a number is expected, "-" negates it (the pattern allows one).
  terms, sign, prod, neg, want_number = [], 1, 1, False, True
  for t in re.findall(r"\d+|[-+*]", expression):
    if want_number and t == "-":
      neg = True
    elif want_number:
      prod, neg, want_number = prod * (-int(t) if neg else int(t)), False, False
    elif t == "*":
      want_number = True
    else:
      terms.append(sign * prod)
      sign, prod, want_number = (1 if t == "+" else -1), 1, True
  terms.append(sign * prod)
  return str(sum(terms))


def _word(rng, lo=3, hi=6) -> str:
  n = int(rng.integers(lo, hi + 1))
  return "".join(rng.choice(list(string.ascii_lowercase), n))


def _assistant(thinking: bool, think: str, response: str | None = None,
               calls: tuple[chat.ToolCall, ...] | None = None) -> chat.Message:
  if not thinking and response is None:
    response = ""           # instruct replies open the response channel
  return chat.Message("assistant", response, think if thinking else None, calls)


def _draw(task: str, rng, thinking: bool) -> Sample:
  options = None
  if task in ("add", "sub"):
    a, b = int(rng.integers(0, 100)), int(rng.integers(0, 100))
    if task == "sub" and a < b:
      a, b = b, a
    op = "+" if task == "add" else "-"
    key, answer = f"{task}:{a},{b}", str(a + b if task == "add" else a - b)
    user = f"What is {a}{op}{b}?"
    think = f"Add {a} and {b}." if task == "add" else f"Subtract {b} from {a}."
    msgs = [chat.Message("user", user), _assistant(thinking, think, answer)]
  elif task in ("reverse", "upper", "count"):
    w = _word(rng)
    if task == "reverse":
      key, answer = f"reverse:{w}", w[::-1]
      user, think = f"Reverse the word {w}.", f"Reverse the letters of {w}."
    elif task == "upper":
      key, answer = f"upper:{w}", w.upper()
      user, think = f"Write {w} in upper case.", f"Upper-case {w}."
    else:
      # The letter occurs 1, 2 or 3 times (uniformly): no single answer wins.
      c, k = w[0], int(rng.integers(1, 4))
      others = [x for x in string.ascii_lowercase if x != c]
      letters = list(rng.choice(others, len(w) + k - 1)) + [c] * k
      w = "".join(letters[i] for i in rng.permutation(len(letters)))
      key, answer = f"count:{w},{c}", str(k)
      user, think = f"How many times does {c} occur in {w}?", f"Count {c} in {w}."
    msgs = [chat.Message("user", user), _assistant(thinking, think, answer)]
  elif task == "calculator":
    a, b = int(rng.integers(10, 1000)), int(rng.integers(10, 100))
    expr = f"{a}*{b}"
    key, answer = f"calculator:{expr}", calculator(expr)
    options = chat.Options(tools=(CALCULATOR,))
    msgs = [chat.Message("user", f"Use the calculator to compute {expr}."),
            _assistant(thinking, "Use the calculator.",
                       calls=(chat.ToolCall("calculator", {"expression": expr}),)),
            chat.Message("tool", answer),
            _assistant(thinking, "Got the result.", answer)]
  else:
    raise ValueError(f"task: expected one of {TASKS}, found {task!r}")
  return Sample(task, key, chat.Conversation(tuple(msgs), options), answer, thinking)


def sample(seed: int, split: int, index: int, tasks=TASKS) -> Sample:
  """Sample `index` of `split` (TRAIN or HELDOUT) for `seed` (module doc)."""
  if split not in (TRAIN, HELDOUT):
    raise ValueError(f"split: expected TRAIN (0) or HELDOUT (1), found {split!r}")
  rng = np.random.default_rng([seed, split, index])
  task = tasks[int(rng.integers(0, len(tasks)))]
  thinking = bool(rng.integers(0, 2))
  while True:
    s = _draw(task, rng, thinking)
    if heldout(s.key) == (split == HELDOUT):
      return s


def samples(seed: int, n: int, split: int, tasks=TASKS) -> list[Sample]:
  """The first `n` samples of `split` for `seed`."""
  for t in tasks:
    if t not in TASKS:
      raise ValueError(f"tasks: unknown task {t!r} (known: {', '.join(TASKS)})")
  return [sample(seed, split, i, tuple(tasks)) for i in range(n)]


def check(s: Sample, reply: chat.Message | None) -> bool:
  """Exact match of the final reply's response channel with the answer (None: no reply)."""
  return reply is not None and reply.role == "assistant" and reply.content == s.answer


def run_tool(call: chat.ToolCall) -> chat.Message:
  """The tool message answering one call (the calculator; anything else is an error text)."""
  if call.name != CALCULATOR.name:
    return chat.Message("tool", f"error: unknown tool {call.name}")
  expr = call.arguments.get("expression")
  if set(call.arguments) != {"expression"} or not isinstance(expr, str):
    return chat.Message("tool", "error: expected the argument expression (a string)")
  return chat.Message("tool", calculator(expr))
