"""Long-context rows: long documents upsampled, cleaned, and kept whole where the row allows.

The cool-down of the context curriculum (docs/k3.md §8: 256K → 1M, "long-document cleaning,
upsampling") needs rows in which one document spans much of the row; the plain packer of
k3jax/data/corpus.py cuts random windows out of the stream, so a long document is almost
always cut at both ends. Here a row of `T + 2` tokens (the same window `pack_windows` splits
into inputs / targets / MTP targets) is built around one *anchor* document:

  - anchors are drawn with probability ∝ length × (`upsample` when the document has at least
    `long_threshold` tokens, else 1): token-weighted, so short documents are not favoured by
    their number, and long ones `upsample` times more often than their share of the stream;
  - an anchor that fits the row (length ≤ T + 2) starts the row at its BOS and stays whole;
    the rest of the row is filled with *short* documents (drawn uniformly), the last one cut
    at the row's end: long documents are never filler, so one that fits a row is never cut
    (unless the stream has no short document at all);
  - an anchor longer than the row contributes a random window of T + 2 of its tokens (the
    row then holds a piece of one document: its longest possible context);
  - cleaning (`is_clean`) drops documents before any of that: mostly repeated lines
    (boilerplate, generated tables) or mostly non-text bytes;
  - with `evidence_fraction` > 0 that share of the rows are synthetic evidence tasks instead
    (k3jax/data/evidence.py: facts far apart in the row, a question at its end), their filler
    taken from the same documents, their answer tokens optionally weighted in the loss mask.

Documents are the corpus's `[BOS] bytes [EOS]` units (`documents(stream)` finds them), so
`pack_windows` gives the segment ids and masks of the row as for any other window.

Iteration. Row r of step s is drawn from `numpy.random.default_rng([seed, s, r])`: a batch is
a pure function of (documents, seed, step, batch size, seq_len), the iterator state is the step
(plus a fingerprint of the documents), exactly like `corpus.DataIterator`; a curriculum's
seq_len may change from one step to the next without disturbing anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import numpy as np

from k3jax.data import corpus as corpus_lib
from k3jax.data import evidence
from k3jax.data.tokenizers import BOS, EOS


# ---------------------------------------------------------------------- documents
def documents(stream: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(starts, lengths) [N] int64 of the `[BOS] … [EOS]` documents of a token stream: one per
  BOS, reaching to the next BOS (or the end). Tokens before the first BOS are left out."""
  starts = np.flatnonzero(np.asarray(stream) == BOS).astype(np.int64)
  ends = np.append(starts[1:], len(stream))
  return starts, ends - starts


def is_clean(tokens: np.ndarray, *, max_repeat_fraction: float = 0.3,
             min_text_fraction: float = 0.9) -> bool:
  """Whether a document is kept: its most repeated line (of ≥ 8 bytes) covers at most
  `max_repeat_fraction` of its bytes, and at least `min_text_fraction` of its bytes are
  printable ASCII, tab, newline or bytes of UTF-8 sequences (≥ 0x80). Special tokens (BOS,
  EOS) are not counted."""
  b = np.asarray(tokens)
  b = b[b < 256].astype(np.uint8)
  if b.size == 0:
    return False
  text = (b >= 32) | (b == 9) | (b == 10) | (b == 13)
  if text.mean() < min_text_fraction:
    return False
  lines = bytes(b).split(b"\n")
  counts: dict[bytes, int] = {}
  for line in lines:
    if len(line.strip()) >= 8:
      counts[line] = counts.get(line, 0) + 1
  if counts:
    worst = max(counts.items(), key=lambda kv: kv[1] * (len(kv[0]) + 1))
    if worst[1] > 1 and worst[1] * (len(worst[0]) + 1) > max_repeat_fraction * b.size:
      return False
  return True


@dataclasses.dataclass(frozen=True)
class LongDocs:
  """The kept documents of a stream and how anchors are drawn (module doc).

  stream [N] tokens; starts, lengths [D] of the kept documents; long_threshold: tokens from
  which a document is "long"; upsample: extra weight of long documents as anchors."""
  stream: np.ndarray
  starts: np.ndarray
  lengths: np.ndarray
  long_threshold: int
  upsample: float

  @classmethod
  def from_stream(cls, stream: np.ndarray, *, long_threshold: int, upsample: float = 4.0,
                  clean: bool = True) -> "LongDocs":
    if long_threshold < 2:
      raise ValueError(f"long_threshold: expected >= 2 tokens, found {long_threshold}")
    if upsample < 1:
      raise ValueError(f"upsample: expected >= 1 (1: the stream's own mix), found {upsample}")
    starts, lengths = documents(stream)
    if clean:
      keep = np.array([is_clean(stream[s:s + n]) for s, n in zip(starts, lengths)], bool)
      starts, lengths = starts[keep], lengths[keep]
    if len(starts) == 0:
      raise ValueError("stream: no (clean) [BOS] … [EOS] documents")
    return cls(stream, starts, lengths, int(long_threshold), float(upsample))

  @property
  def is_long(self) -> np.ndarray:
    return self.lengths >= self.long_threshold

  def anchor_probabilities(self) -> np.ndarray:
    """[D] probability of each document to anchor a row (module doc)."""
    w = self.lengths.astype(np.float64) * np.where(self.is_long, self.upsample, 1.0)
    return w / w.sum()

  def long_token_fraction(self, upsampled: bool = True) -> float:
    """Expected share of long documents among the anchor tokens (the stream's own share when
    `upsampled` is False)."""
    p = self.anchor_probabilities() if upsampled else (
        self.lengths / self.lengths.sum())
    return float(p[self.is_long].sum())

  def fingerprint(self) -> dict:
    h = hashlib.md5(np.ascontiguousarray(self.lengths).tobytes())
    h.update(np.ascontiguousarray(self.stream[:: max(1, len(self.stream) // 4096)]).tobytes())
    return {"documents": int(len(self.lengths)), "tokens": int(self.lengths.sum()),
            "long_threshold": self.long_threshold, "upsample": self.upsample,
            "md5": h.hexdigest()}

  def doc(self, i: int) -> np.ndarray:
    s = int(self.starts[i])
    return self.stream[s:s + int(self.lengths[i])]


# ---------------------------------------------------------------------- rows
def build_row(docs: LongDocs, rng: np.random.Generator, span: int) -> tuple[np.ndarray, int]:
  """(one row of `span` tokens, the anchor's document index), module doc."""
  p = docs.anchor_probabilities()
  anchor = int(rng.choice(len(p), p=p))
  tokens = docs.doc(anchor)
  if len(tokens) >= span:   # longer than the row: a random window of it
    off = int(rng.integers(0, len(tokens) - span + 1))
    return np.asarray(tokens[off:off + span]), anchor
  short = np.flatnonzero(~docs.is_long)
  parts, used = [tokens], len(tokens)
  while used < span:
    if len(short):
      filler = docs.doc(int(short[int(rng.integers(0, len(short)))]))
    else:   # every document is long: fill with the beginning of another one
      filler = docs.doc(int(rng.integers(0, len(docs.lengths))))
    parts.append(filler[:span - used])
    used += len(parts[-1])
  return np.concatenate(parts).astype(np.int64), anchor


def sample_rows(docs: LongDocs, seed: int, step: int, batch_size: int, seq_len: int, *,
                evidence_fraction: float = 0.0, tasks: Sequence[str] = evidence.TASKS
                ) -> tuple[np.ndarray, list[evidence.EvidenceRow | int]]:
  """([B, T+2] tokens of step `step`, per row its anchor document index or its
  `evidence.EvidenceRow`); a pure function. Each row is an evidence task with probability
  `evidence_fraction` (task and distance drawn uniformly; filler from the documents' stream),
  else a long-document row."""
  span = seq_len + 2
  rows, what = [], []
  for r in range(batch_size):
    rng = np.random.default_rng([seed, step, r])
    if evidence_fraction and rng.random() < evidence_fraction:
      task = tasks[int(rng.integers(0, len(tasks)))]
      ev = evidence.make_row(rng, task, seq_len, filler=docs.stream)
      rows.append(ev.tokens)
      what.append(ev)
    else:
      row, a = build_row(docs, rng, span)
      rows.append(row)
      what.append(a)
  return np.stack(rows), what


class LongDocIterator(corpus_lib.StepIterator):
  """Checkpointable batches of long-document rows with evidence tasks mixed in
  (`corpus.StepIterator`): the batch of a step is `pack_windows` of `sample_rows` at the
  curriculum's seq_len of that step; the answer tokens of evidence rows weigh
  `answer_weight` in the loss mask."""

  def __init__(self, docs: LongDocs, batch_size: int, seq_len: int, seed: int = 0,
               curriculum: Sequence[tuple[int, int]] = (), *, evidence_fraction: float = 0.0,
               tasks: Sequence[str] = evidence.TASKS, answer_weight: float = 1.0):
    if batch_size <= 0:
      raise ValueError(f"train.batch_size: expected > 0, found {batch_size}")
    if not 0 <= evidence_fraction <= 1:
      raise ValueError(f"evidence_fraction: expected a value in [0, 1], found "
                       f"{evidence_fraction}")
    bad = [t for t in tasks if t not in evidence.TASKS]
    if bad or not tasks:
      raise ValueError(f"tasks: expected names from {evidence.TASKS}, found {list(tasks)}")
    self.docs, self.batch_size, self.seed = docs, batch_size, seed
    self.seq_len, self.curriculum = seq_len, tuple(curriculum)
    self.evidence_fraction, self.tasks = float(evidence_fraction), tuple(tasks)
    self.answer_weight = float(answer_weight)
    self.step = 0

  def seq_len_at(self, step: int) -> int:
    return corpus_lib.seq_len_at(step, self.seq_len, self.curriculum)

  def batch(self, step: int, batch_size: int | None = None,
            seq_len: int | None = None) -> dict[str, np.ndarray]:
    """The batch of `step` (default: the iterator's batch size and that step's seq_len)."""
    rows, what = sample_rows(self.docs, self.seed, step, batch_size or self.batch_size,
                             seq_len or self.seq_len_at(step),
                             evidence_fraction=self.evidence_fraction, tasks=self.tasks)
    out = corpus_lib.pack_windows(rows)
    for i, w in enumerate(what):
      if isinstance(w, evidence.EvidenceRow) and self.answer_weight != 1.0:
        answer = evidence.answer_mask([w])[0] > 0
        out["loss_mask"][i] = np.where(answer, self.answer_weight, out["loss_mask"][i])
    return out

  def fingerprint(self) -> dict:
    return self.docs.fingerprint()


def whole_documents(row: np.ndarray) -> list[tuple[int, int]]:
  """(start, end) of each document of a row that is whole in it (its BOS and its EOS both
  inside); for tests and statistics."""
  out, start = [], None
  for i, t in enumerate(np.asarray(row)):
    if t == BOS:
      start = i
    elif t == EOS and start is not None:
      out.append((start, i + 1))
      start = None
  return out


__all__ = ["documents", "is_clean", "LongDocs", "build_row", "sample_rows", "LongDocIterator",
           "whole_documents"]
