"""The prefill grid: where a prompt's prefill is split, and the prefix keys of the split points.

A prompt is prefilled in pieces that end at fixed *absolute* positions — the split points:

  * every multiple of `chunk` (the grid),
  * every position right after a `boundary` token (a chat block's `[end_of_msg]`: a turn
    boundary), and
  * the end of the prompt.

Which points split a prompt below position p depends on tokens[:p] alone, so two prompts that
share a prefix up to a split point p compute every piece before p identically — the same
tokens, the same piece lengths, the same compiled shape (a piece of n tokens runs padded to
`bucket(n)`) — and reach bit-identical caches at p. That is what lets the engine resume a
prompt from a cached split point (a prefix-cache hit) and still compute, bit for bit, what a
cold prefill computes: the pieces after p are those a cold prefill runs too.

Checkpoints (the prefix cache's entries) are kept at the split points that are multiples of
`interval` or turn boundaries; an entry is keyed by `prefix_keys`: a chained SHA-256 of the
tokens before the point (and a salt naming the model and the grid).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np


def split_points(tokens: Sequence[int], chunk: int, boundary: int | None = None,
                 start: int = 0) -> list[int]:
  """The split points in (start, len(tokens)], ascending (the last is len(tokens))."""
  if chunk < 1:
    raise ValueError(f"chunk: expected >= 1, found {chunk}")
  n = len(tokens)
  points = set(range((start // chunk + 1) * chunk, n, chunk))
  if boundary is not None:
    ids = np.asarray(tokens)
    points.update(int(p) + 1 for p in np.flatnonzero(ids[start:n] == boundary) + start)
  points.add(n)
  return sorted(p for p in points if start < p <= n)


def pieces(tokens: Sequence[int], chunk: int, boundary: int | None = None,
           start: int = 0) -> list[tuple[int, int]]:
  """[(a, b)] consecutive prefill pieces from `start` (a split point, or 0) to the end."""
  points = split_points(tokens, chunk, boundary, start)
  return list(zip([start] + points[:-1], points))


def is_checkpoint(tokens: Sequence[int], p: int, interval: int,
                  boundary: int | None = None) -> bool:
  """Whether split point p keeps a checkpoint: a multiple of `interval`, or a turn boundary."""
  return p > 0 and (p % interval == 0 or (boundary is not None and int(tokens[p - 1]) == boundary))


def bucket(n: int, buckets: Sequence[int]) -> int:
  """The smallest compiled piece length holding n tokens (`buckets` ascending)."""
  for b in buckets:
    if n <= b:
      return b
  raise ValueError(f"piece of {n} tokens exceeds the largest prefill bucket {buckets[-1]}")


def prefix_keys(tokens: Sequence[int], points: Sequence[int], salt: bytes = b"",
                extra=None) -> list[bytes]:
  """Chained keys of tokens[:p] for each p in `points` (ascending): key(p) = sha256(key(prev)
  ‖ tokens[prev:p] as int32 bytes [‖ extra[prev:p] as int64 bytes]), key(0) = sha256(salt).
  `extra` [len(tokens)] int64: what else a position holds (a media placeholder: a digest of
  its image), so that equal keys ⇔ equal prefixes (up to SHA-256 collisions)."""
  ids = np.asarray(tokens, np.int32)
  ext = None if extra is None else np.asarray(extra, np.int64)
  key, prev, out = hashlib.sha256(salt).digest(), 0, []
  for p in points:
    more = b"" if ext is None else ext[prev:p].tobytes()
    key = hashlib.sha256(key + ids[prev:p].tobytes() + more).digest()
    out.append(key)
    prev = p
  return out


__all__ = ["split_points", "pieces", "is_checkpoint", "bucket", "prefix_keys"]
