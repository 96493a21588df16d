"""Long-document rows (k3jax/data/long_docs.py): cleaning, upsampling, whole documents,
evidence rows mixed in, checkpointable iteration."""

import numpy as np
import pytest

from k3jax.data import corpus as D
from k3jax.data import evidence as E
from k3jax.data import long_docs as L
from k3jax.data.tokenizers import BOS, EOS


def _doc(n: int, fill: int) -> np.ndarray:
  body = np.full(n - 2, fill, np.int64)
  body[::7] = 10   # newlines: lines of 6 identical bytes (shorter than a "line" for cleaning)
  return np.concatenate([[BOS], body, [EOS]])


def _stream(seed=0):
  """20 short documents (10–40 tokens) and 4 long ones (200–300 tokens)."""
  rng = np.random.default_rng(seed)
  docs = [_doc(int(rng.integers(10, 41)), 97 + i % 20) for i in range(20)]
  docs += [_doc(int(rng.integers(200, 301)), 65 + i) for i in range(4)]
  order = rng.permutation(len(docs))
  return np.concatenate([docs[i] for i in order])


def test_documents_and_cleaning():
  s = _stream()
  starts, lengths = L.documents(s)
  assert len(starts) == 24 and lengths.sum() == len(s)
  assert all(s[a] == BOS and s[a + n - 1] == EOS for a, n in zip(starts, lengths))
  assert L.is_clean(np.frombuffer(b"def f(x):\n  return x + 1\n\n\ndef g(y):\n  return y\n", np.uint8))
  assert not L.is_clean(np.frombuffer(b"the same long line here\n" * 20 + b"end\n", np.uint8))
  assert not L.is_clean(np.arange(0, 32, dtype=np.int64).repeat(4))     # control bytes


def test_upsampling_raises_the_long_share_and_rows_keep_long_documents_whole():
  s = _stream()
  natural = L.LongDocs.from_stream(s, long_threshold=100, upsample=1.0)
  docs = L.LongDocs.from_stream(s, long_threshold=100, upsample=4.0)
  assert docs.long_token_fraction() > natural.long_token_fraction() == pytest.approx(
      natural.long_token_fraction(upsampled=False))
  rows, anchors = L.sample_rows(docs, seed=1, step=0, batch_size=64, seq_len=398)
  long_rows = 0
  for row, a in zip(rows, anchors):
    n = int(docs.lengths[a])
    if docs.is_long[a]:
      long_rows += 1
      # A long document that fits the row starts it at its BOS and stays whole.
      np.testing.assert_array_equal(row[:n], docs.doc(a))
      assert (0, n) in L.whole_documents(row)
      # Filler after it is short documents only.
      assert all(e - b < 100 for b, e in L.whole_documents(row)[1:])
  # 4 long documents of ~250 tokens against ~500 short tokens: upsampled, most anchors long.
  assert long_rows / len(rows) > 0.8
  assert rows.shape == (64, 400)


def test_a_document_longer_than_the_row_gives_a_window_of_it():
  s = _stream()
  docs = L.LongDocs.from_stream(s, long_threshold=100, upsample=1e6)   # long anchors only
  rows, anchors = L.sample_rows(docs, seed=0, step=0, batch_size=8, seq_len=98)
  for row, a in zip(rows, anchors):
    doc = docs.doc(a)
    assert len(doc) > 100
    hits = [i for i in range(len(doc) - 99) if np.array_equal(doc[i:i + 100], row)]
    assert hits


def test_iterator_mixes_evidence_rows_and_resumes():
  s = _stream()
  docs = L.LongDocs.from_stream(s, long_threshold=100)
  cur = D.parse_curriculum("2:62")
  it = L.LongDocIterator(docs, 16, 126, seed=3, curriculum=cur, evidence_fraction=0.5,
                         answer_weight=4.0)
  batches = [next(it) for _ in range(4)]
  assert [b["inputs"].shape for b in batches] == [(16, 62)] * 2 + [(16, 126)] * 2
  state = it.get_state()
  rows, what = L.sample_rows(docs, 3, 3, 16, 126, evidence_fraction=0.5)
  ev = [w for w in what if isinstance(w, E.EvidenceRow)]
  assert 0 < len(ev) < 16
  np.testing.assert_array_equal(batches[3]["inputs"], rows[:, :126])
  # Answer tokens weigh 4 in the loss mask; everything else is the packer's mask.
  weighted = batches[3]["loss_mask"] == 4.0
  assert weighted.sum() == sum(len(r.answer) for r in ev)
  it2 = L.LongDocIterator(docs, 16, 126, seed=3, curriculum=cur, evidence_fraction=0.5,
                          answer_weight=4.0)
  it2.set_state(state)
  np.testing.assert_array_equal(next(it2)["inputs"], next(it)["inputs"])
  with pytest.raises(ValueError, match="seed"):
    L.LongDocIterator(docs, 16, 126, seed=4).set_state(state)
  with pytest.raises(ValueError, match="evidence_fraction"):
    L.LongDocIterator(docs, 16, 126, evidence_fraction=2.0)
