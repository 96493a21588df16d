"""Synthetic evidence tasks (k3jax/data/evidence.py): rows, distances, exact checkers."""

import numpy as np
import pytest

from k3jax.data import corpus as D
from k3jax.data import evidence as E
from k3jax.data.tokenizers import BOS, EOS, SEP


def _text(ids) -> str:
  return bytes(int(t) if t < 256 else ord("|") for t in ids).decode("latin-1")


def _facts(row: E.EvidenceRow) -> list[str]:
  """The SEP-introduced pieces before the question, as text (SEP shown as '|')."""
  t = row.tokens[:row.question]
  starts = np.flatnonzero(t == SEP)
  return [_text(t[s + 1:s + 1 + 9]) for s in starts]


@pytest.mark.parametrize("task", E.TASKS)
def test_rows_have_the_evidence_at_the_distance_and_an_answer_it_determines(task):
  filler = np.frombuffer(b"some natural text = with ? and ! and > signs\n" * 200, np.uint8)
  for seed, d in enumerate([E.min_distance(task), 100, E.max_distance(task, 256)]):
    row = E.make_row(np.random.default_rng(seed), task, 256, distance=d,
                     filler=filler.astype(np.int64))
    tok = row.tokens
    assert tok.shape == (258,) and tok[0] == BOS and tok[256] == EOS
    assert row.distance == d and row.tokens[row.question] == SEP
    assert row.answer_start + len(row.answer) == 256
    assert tuple(tok[row.answer_start:256]) == row.answer
    # SEP appears only at the facts and the question (filler never holds it).
    assert set(np.flatnonzero(tok == SEP)) >= set(row.evidence) | {row.question}
    question = _text(tok[row.question + 1:row.answer_start])
    answer = _text(row.answer)
    facts = _facts(row)
    if task == "kv":
      key = question[1:5]
      assert question == f"?{key}=" and f"{key}={answer}" in facts
    elif task == "chain":
      a = question[1:5]
      b = [f[5:9] for f in facts if f.startswith(a + ">")]
      assert len(b) == 1 and f"{b[0]}>{answer}" in facts
    else:
      assert question == "?!" and int(answer) == sum(f.startswith("!") for f in facts)


def test_bad_arguments_name_the_field():
  rng = np.random.default_rng(0)
  with pytest.raises(ValueError, match="task"):
    E.make_row(rng, "sum", 128)
  with pytest.raises(ValueError, match="distance"):
    E.make_row(rng, "kv", 128, distance=500)
  with pytest.raises(ValueError, match="seq_len"):
    E.make_row(rng, "chain", 16)


def test_checkers_are_exact():
  row = E.make_row(np.random.default_rng(3), "kv", 64, distance=30)
  logits = np.zeros((64, 272), np.float32)
  for i, a in enumerate(row.answer):
    logits[row.answer_start - 1 + i, a] = 1.0
  assert E.check_logits(row, logits)
  logits[row.answer_start + 1, (row.answer[2] + 1) % 272] = 2.0   # one answer token wrong
  assert not E.check_logits(row, logits)
  assert E.check_tokens(row, list(row.answer) + [EOS])
  assert not E.check_tokens(row, list(row.answer[:3]))
  # The answer mask selects the input positions whose targets are the answer.
  b = D.pack_windows(row.tokens[None])
  m = E.answer_mask([row], 5.0)
  assert m.sum() == 5.0 * len(row.answer)
  assert tuple(b["targets"][0][m[0] > 0]) == row.answer


def test_sample_rows_is_a_pure_function_cycling_tasks():
  a = E.sample_rows(7, 3, 6, 128)
  b = E.sample_rows(7, 3, 6, 128)
  assert [r.task for r in a] == list(E.TASKS) * 2
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x.tokens, y.tokens)
  c = E.sample_rows(7, 4, 6, 128)
  assert any(not np.array_equal(x.tokens, y.tokens) for x, y in zip(a, c))
