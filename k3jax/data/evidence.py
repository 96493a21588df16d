"""Synthetic evidence tasks: rows whose answer needs facts from far apart in the row.

The long-context cool-down (docs/k3.md §8) mixes in "synthetic tasks whose answers need
evidence from across the whole context". A task row is one document of exactly `T + 2` tokens
(the window `corpus.pack_windows` splits into inputs, targets and MTP targets):

    [BOS] filler … fact … filler … fact … filler … question answer [EOS] [BOS]

Filler is natural text (a window of a token stream; special tokens in it become newlines).
Facts and the question each start with the special token SEP, which filler never holds, so a
fact is unambiguous wherever it sits. Byte tokens (k3jax/data/tokenizers.py):

  "kv"     key–value lookup. Facts `SEP kkkk=dddd` (4 lowercase letters, 4 digits; `num_facts`
           of them, distinct keys); question `SEP ?kkkk=` about one of them → `dddd`.
  "chain"  two-hop lookup. Facts `SEP aaaa>bbbb` (4 letters each), among them a → b and
           b → c; question `SEP ?aaaa>>` → `cccc` (the value of the value). Both hops are
           needed; the other facts are distractors.
  "count"  counting over the whole row. Markers `SEP !` placed n times (1 ≤ n ≤ 9); question
           `SEP ?!` → the digit n.

`distance`: tokens from the earliest piece of evidence to the question's first token — the
queried fact (kv), the earlier of the two hops (chain; the other lies uniformly between), the
first marker (count; the others uniformly between). `make_row(..., distance=d)` places it at
exactly d; the answer is always the last tokens before the row's EOS at index T.

Checking. `check_logits(row, logits)` is exact and needs one forward pass: the answer is
correct when the argmax of the logits at every answer position is the answer token. That is
exact greedy decoding's verdict: if the first argmax is right the next position sees the same
prefix greedy decoding would, and so on. `check_tokens(row, generated)` compares generated
tokens (e.g. from the serving path) with the answer.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from k3jax.data.tokenizers import BOS, EOS, NUM_BYTES, SEP

TASKS = ("kv", "chain", "count")
KEY_LEN = 4
_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
_DIGITS = np.frombuffer(b"0123456789", np.uint8)
_NEWLINE = 10


@dataclasses.dataclass(frozen=True)
class EvidenceRow:
  """One task row. tokens [T+2]; answer = tokens[answer_start : answer_start + len(answer)];
  evidence: first token of each piece of evidence; question: first token of the question."""
  task: str
  tokens: np.ndarray
  answer_start: int
  answer: tuple[int, ...]
  evidence: tuple[int, ...]
  question: int

  @property
  def distance(self) -> int:
    return self.question - min(self.evidence)

  @property
  def seq_len(self) -> int:
    return len(self.tokens) - 2


def _word(rng: np.random.Generator, alphabet: np.ndarray) -> bytes:
  return bytes(alphabet[rng.integers(0, len(alphabet), KEY_LEN)])


def _distinct_words(rng: np.random.Generator, n: int) -> list[bytes]:
  out: list[bytes] = []
  while len(out) < n:
    w = _word(rng, _LETTERS)
    if w not in out:
      out.append(w)
  return out


def _ids(*parts) -> np.ndarray:
  """Token ids of a sequence of parts: ints are single ids, bytes their bytes."""
  out = []
  for p in parts:
    out.extend([p] if isinstance(p, int) else list(p))
  return np.asarray(out, np.int64)


def _filler(rng: np.random.Generator, stream: np.ndarray | None, n: int) -> np.ndarray:
  """n tokens of natural text from `stream` (specials → newline), or random lowercase words
  when there is no stream."""
  if stream is None or len(stream) < n:
    words = rng.integers(0, len(_LETTERS), n)
    text = _LETTERS[words].astype(np.int64)
    text[rng.random(n) < 0.18] = ord(" ")
    return text
  off = int(rng.integers(0, len(stream) - n + 1))
  x = np.asarray(stream[off:off + n], np.int64)
  return np.where(x >= NUM_BYTES, _NEWLINE, x)


def _free_slots(rng: np.random.Generator, lo: int, hi: int, length: int,
                taken: list[tuple[int, int]], tries: int = 200) -> int | None:
  """A start s in [lo, hi − length] whose [s, s + length) overlaps no interval of `taken`."""
  if hi - length < lo:
    return None
  for _ in range(tries):
    s = int(rng.integers(lo, hi - length + 1))
    if all(s + length <= a or s >= b for a, b in taken):
      return s
  return None


def max_distance(task: str, seq_len: int) -> int:
  """The largest distance `make_row` can place at row length `seq_len`."""
  q, a = _question_answer_len(task)
  return seq_len - a - q - 1


def _question_answer_len(task: str) -> tuple[int, int]:
  return {"kv": (2 + KEY_LEN + 1, KEY_LEN), "chain": (2 + KEY_LEN + 2, KEY_LEN),
          "count": (3, 1)}[task]


def min_distance(task: str) -> int:
  """The smallest distance: the evidence must fit before the question."""
  return {"kv": 2 + 2 * KEY_LEN, "chain": 2 * (2 + 2 * KEY_LEN), "count": 2}[task]


def make_row(rng: np.random.Generator, task: str, seq_len: int, *, distance: int | None = None,
             filler: np.ndarray | None = None, num_facts: int = 4) -> EvidenceRow:
  """One row of `task` at row length `seq_len` (module doc). `distance`: None draws it
  uniformly in [min_distance, max_distance]; `filler`: a token stream for the text around
  the facts (None: random letters); `num_facts`: facts in a kv / chain row (≥ 2 for chain)."""
  if task not in TASKS:
    raise ValueError(f"task: expected one of {TASKS}, found {task!r}")
  lo, hi = min_distance(task), max_distance(task, seq_len)
  if hi < lo:
    raise ValueError(f"seq_len: {seq_len} is too short for a {task!r} row (needs > "
                     f"{seq_len - hi + lo})")
  d = int(rng.integers(lo, hi + 1)) if distance is None else int(distance)
  if not lo <= d <= hi:
    raise ValueError(f"distance: expected a value in [{lo}, {hi}] for task {task!r} at "
                     f"seq_len={seq_len}, found {d}")
  if num_facts < (2 if task == "chain" else 1):
    raise ValueError(f"num_facts: expected >= {2 if task == 'chain' else 1}, found {num_facts}")
  span = seq_len + 2
  row = np.empty(span, np.int64)
  row[0] = BOS
  row[1:seq_len] = _filler(rng, filler, seq_len - 1)
  row[seq_len], row[seq_len + 1] = EOS, BOS
  q_len, a_len = _question_answer_len(task)
  answer_start = seq_len - a_len
  qpos = answer_start - q_len
  first = qpos - d
  taken: list[tuple[int, int]] = []

  def put(pos: int, ids: np.ndarray) -> int:
    row[pos:pos + len(ids)] = ids
    taken.append((pos, pos + len(ids)))
    return pos

  evidence: list[int] = []
  if task == "kv":
    keys = _distinct_words(rng, num_facts)
    values = [_word(rng, _DIGITS) for _ in keys]
    evidence.append(put(first, _ids(SEP, keys[0], b"=", values[0])))
    for k, v in zip(keys[1:], values[1:]):
      fact = _ids(SEP, k, b"=", v)
      s = _free_slots(rng, 1, qpos, len(fact), taken)
      if s is not None:
        put(s, fact)
    question, answer = _ids(SEP, b"?", keys[0], b"="), _ids(values[0])
  elif task == "chain":
    words = _distinct_words(rng, num_facts + 1)
    a, b, c = words[:3]
    hop1, hop2 = _ids(SEP, a, b">", b), _ids(SEP, b, b">", c)
    # The earlier hop sits at the distance; which hop comes first is random.
    early, late = (hop1, hop2) if rng.random() < 0.5 else (hop2, hop1)
    evidence.append(put(first, early))
    s = _free_slots(rng, first + len(early), qpos, len(late), taken)
    evidence.append(put(first + len(early) if s is None else s, late))
    for w in words[3:]:   # distractors: facts about other words
      fact = _ids(SEP, w, b">", _word(rng, _LETTERS))
      s = _free_slots(rng, 1, qpos, len(fact), taken)
      if s is not None:
        put(s, fact)
    question, answer = _ids(SEP, b"?", a, b">>"), _ids(c)
  else:   # count
    n = int(rng.integers(1, 10))
    marker = _ids(SEP, b"!")
    evidence.append(put(first, marker))
    placed = 1
    while placed < n:
      s = _free_slots(rng, first + len(marker), qpos, len(marker), taken)
      if s is None:   # no room for more markers: the count is what was placed
        break
      evidence.append(put(s, marker))
      placed += 1
    question, answer = _ids(SEP, b"?!"), _ids(str(placed).encode())
  row[qpos:answer_start] = question
  row[answer_start:seq_len] = answer
  return EvidenceRow(task, row, answer_start, tuple(int(t) for t in answer),
                     tuple(sorted(evidence)), qpos)


def answer_mask(rows: Sequence[EvidenceRow], weight: float = 1.0) -> np.ndarray:
  """[B, T] float32: `weight` at the input positions whose target is an answer token, else 0
  (add it to a loss mask to weight the answers)."""
  t = rows[0].seq_len
  m = np.zeros((len(rows), t), np.float32)
  for i, r in enumerate(rows):
    m[i, r.answer_start - 1:r.answer_start - 1 + len(r.answer)] = weight
  return m


def check_logits(row: EvidenceRow, logits: np.ndarray) -> bool:
  """Exact: the argmax of `logits` [T, V] (the row's inputs tokens[:T]) at every answer
  position is the answer token (module doc: greedy decoding's verdict)."""
  logits = np.asarray(logits)
  if logits.ndim != 2 or logits.shape[0] != row.seq_len:
    raise ValueError(f"logits: expected [T={row.seq_len}, vocab], found {logits.shape}")
  pos = np.arange(row.answer_start - 1, row.answer_start - 1 + len(row.answer))
  return bool(np.all(np.argmax(logits[pos], axis=-1) == np.asarray(row.answer)))


def check_tokens(row: EvidenceRow, generated: Sequence[int]) -> bool:
  """Exact: the first len(answer) generated tokens are the answer."""
  return tuple(int(t) for t in generated[:len(row.answer)]) == row.answer


def sample_rows(seed: int, step: int, batch_size: int, seq_len: int,
                tasks: Sequence[str] = TASKS, filler: np.ndarray | None = None,
                num_facts: int = 4) -> list[EvidenceRow]:
  """B rows of step `step` (a pure function of its arguments); row r's task is
  tasks[(step·B + r) mod len(tasks)], its distance uniform."""
  rows = []
  for r in range(batch_size):
    rng = np.random.default_rng([seed, step, r, 0xE1])
    task = tasks[(step * batch_size + r) % len(tasks)]
    rows.append(make_row(rng, task, seq_len, filler=filler, num_facts=num_facts))
  return rows


__all__ = ["TASKS", "EvidenceRow", "make_row", "min_distance", "max_distance", "answer_mask",
           "check_logits", "check_tokens", "sample_rows"]
