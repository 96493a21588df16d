"""Tokenizer, corpora, packing, iterator state and curriculum (k3jax/data/corpus.py)."""

import json

import numpy as np
import pytest

from k3jax.data import corpus as D
from k3jax.data import tokenizers


def test_tokenizer_roundtrip_and_specials():
  tok = tokenizers.ByteTokenizer(272)
  ids = tok.encode("héllo\n", bos=True, eos=True)
  assert ids.tolist() == [tokenizers.BOS, *"héllo\n".encode(), tokenizers.EOS]
  assert tok.decode(ids) == "héllo\n"
  assert tok.decode(ids, specials=True) == "<bos>héllo\n<eos>"
  with pytest.raises(ValueError, match="vocab_size"):
    tokenizers.ByteTokenizer(260)


def test_packing_segments_and_masks():
  # Two documents "ab" and "c" in one window (+ the start of a third).
  stream = np.array([tokenizers.BOS, 97, 98, tokenizers.EOS, tokenizers.BOS, 99, tokenizers.EOS, tokenizers.BOS, 100], np.uint16)
  b = D.pack_windows(stream[None, :])
  assert b["inputs"][0].tolist() == [tokenizers.BOS, 97, 98, tokenizers.EOS, tokenizers.BOS, 99, tokenizers.EOS]
  assert b["targets"][0].tolist() == [97, 98, tokenizers.EOS, tokenizers.BOS, 99, tokenizers.EOS, tokenizers.BOS]
  assert b["mtp_targets"][0].tolist() == [98, tokenizers.EOS, tokenizers.BOS, 99, tokenizers.EOS, tokenizers.BOS, 100]
  assert b["segment_ids"][0].tolist() == [1, 1, 1, 1, 2, 2, 2]
  # No prediction from EOS into the next document (EOS -> BOS), nor MTP across it.
  assert b["loss_mask"][0].tolist() == [1, 1, 1, 0, 1, 1, 0]
  assert b["mtp_mask"][0].tolist() == [1, 1, 0, 0, 1, 0, 0]


def test_abstract_batch_is_the_packed_batch():
  b = D.pack_windows(np.zeros((3, 7), np.uint16))
  assert {k: (s.shape, s.dtype) for k, s in D.abstract_batch(3, 5).items()} == {
      k: (v.shape, v.dtype) for k, v in b.items()}


def test_user_text_jsonl_npy_and_split(tmp_path):
  for i in range(30):
    (tmp_path / f"doc{i:02d}.txt").write_text(f"document number {i}\n" * 3)
  with open(tmp_path / "more.jsonl", "w") as f:
    for i in range(20):
      f.write(json.dumps({"text": f"json line {i}"}) + "\n")
  c = D.load_corpus(str(tmp_path), eval_percent=20.0)
  total = 30 + 20
  assert sum(c.num_docs) == total and 0 < c.num_docs[1] < total
  # Every document appears exactly once across the two splits, framed by BOS/EOS.
  assert int((c.train == tokenizers.BOS).sum() + (c.eval == tokenizers.BOS).sum()) == total
  text = tokenizers.ByteTokenizer().decode(np.concatenate([c.train, c.eval]))
  assert all(f"document number {i}\n" in text for i in range(30))
  # Deterministic: the same split when loaded again (cache bypassed by another percent).
  c2 = D.load_corpus(str(tmp_path), eval_percent=20.0 + 1e-9)
  np.testing.assert_array_equal(c.train, c2.train)

  shard = tmp_path / "npy" / "tok.npy"
  shard.parent.mkdir()
  np.save(shard, np.arange(1000) % 256)
  c3 = D.load_corpus(str(shard), eval_percent=10.0)
  assert len(c3.train) == 900 and c3.eval.tolist() == (np.arange(900, 1000) % 256).tolist()


def _write_array_record(path, arrays_or_bytes):
  import io
  from array_record.python.array_record_module import ArrayRecordWriter
  w = ArrayRecordWriter(str(path), "group_size:1")
  for a in arrays_or_bytes:
    if isinstance(a, bytes):
      w.write(a)
    else:
      b = io.BytesIO()
      np.save(b, a)
      w.write(b.getvalue())
  w.close()


def test_array_record_documents_split_by_record_and_large_vocab(tmp_path):
  # 40 pre-tokenized documents with ids above 65535 (a real tokenizer's vocabulary): every
  # document lands whole in one split, ids intact (uint32 storage when the vocab needs it).
  docs = [np.arange(i, i + 5 + i % 7, dtype=np.int64) * 1000 + 70_000 for i in range(40)]
  _write_array_record(tmp_path / "toks.array_record", docs)
  c = D.load_corpus(str(tmp_path), eval_percent=25.0, vocab_size=163_840)
  assert c.train.dtype == np.uint32 and sum(c.num_docs) == 40 and 0 < c.num_docs[1] < 40
  want_eval = [d for i, d in enumerate(docs)
               if D.in_eval(f"toks.array_record:{i}", 25.0)]
  want_train = [d for d in docs if not any(d is e for e in want_eval)]
  np.testing.assert_array_equal(c.eval, np.concatenate(want_eval))
  np.testing.assert_array_equal(c.train, np.concatenate(want_train))
  # The iterator reads the wide ids back unchanged.
  it = D.DataIterator(c, batch_size=2, seq_len=4, seed=0)
  assert int(next(it)["inputs"].max()) >= 70_000
  with pytest.raises(ValueError, match="outside"):
    D.load_corpus(str(tmp_path / "toks.array_record"), vocab_size=512)
  (tmp_path / "bad").mkdir()
  _write_array_record(tmp_path / "bad" / "x.array_record", [b"not an array"])
  with pytest.raises(ValueError, match="record 0 is not an np.save'd array"):
    D.load_corpus(str(tmp_path / "bad" / "x.array_record"))


def test_split_does_not_depend_on_where_the_data_lives(tmp_path):
  # The same documents under two roots (a directory and a glob of it) split the same way.
  for root in ("a", "b/deeper"):
    d = tmp_path / root / "docs"
    d.mkdir(parents=True)
    for i in range(40):
      (d / f"doc{i:02d}.txt").write_text(f"document {i}\n")
  a = D.load_corpus(str(tmp_path / "a" / "docs"), eval_percent=25.0)
  b = D.load_corpus(str(tmp_path / "b" / "deeper" / "docs"), eval_percent=25.0)
  g = D.load_corpus(str(tmp_path / "b" / "deeper" / "docs" / "*.txt"), eval_percent=25.0)
  assert 0 < a.num_docs[1] < 40
  for c in (b, g):
    np.testing.assert_array_equal(a.train, c.train)
    np.testing.assert_array_equal(a.eval, c.eval)
  want = sorted(f"document {i}\n" for i in range(40) if D.in_eval(f"doc{i:02d}.txt", 25.0))
  text = tokenizers.ByteTokenizer().decode(a.eval).replace("\n", "\n|").split("|")
  assert sorted(t for t in text if t) == want


def test_one_text_file_is_split_at_its_tail(tmp_path):
  # One file is one document: its last eval_percent% of tokens are held out, whatever its name.
  body = "".join(f"line {i}\n" for i in range(100)).encode()
  for name in ("x.txt", "README.md"):
    (tmp_path / name).write_bytes(body)
    c = D.load_corpus(str(tmp_path / name), eval_percent=10.0)
    stream = np.concatenate([[tokenizers.BOS], np.frombuffer(body, np.uint8), [tokenizers.EOS]])
    cut = len(stream) - len(stream) // 10
    assert c.train.tolist() == stream[:cut].tolist() and c.eval.tolist() == stream[cut:].tolist()


def test_a_split_without_training_tokens_is_an_error(tmp_path):
  # Two documents that both hash into a 99.99% eval split leave nothing to train on.
  for i in range(2):
    (tmp_path / f"d{i}.txt").write_text("text")
  with pytest.raises(ValueError, match=r"no training tokens: all 2 documents .*eval_percent"):
    D.load_corpus(str(tmp_path), eval_percent=99.99)


def test_bad_sources(tmp_path):
  with pytest.raises(ValueError, match="cannot read"):
    D.load_corpus(str(tmp_path / "missing.txt"))
  (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
  with pytest.raises(ValueError, match="'text' field"):
    D.load_corpus(str(tmp_path / "bad.jsonl"))
  np.save(tmp_path / "big.npy", np.array([1, 2, 5000]))
  with pytest.raises(ValueError, match="outside"):
    D.load_corpus(str(tmp_path / "big.npy"))


def test_stdlib_corpus_is_deterministic_and_split_by_file():
  files = D.stdlib_files()
  assert [n for n, _ in files] == sorted(n for n, _ in files)
  assert any(n == "json/__init__.py" for n, _ in files)
  c = D.load_corpus("stdlib")
  n_eval = sum(D.in_eval(n, 2.0) for n, _ in files)
  assert 0 < n_eval < len(files) // 10
  assert len(c.train) > 1_000_000 and len(c.eval) > 1_000


def test_iterator_resume_and_curriculum(tmp_path):
  stream = np.tile(np.arange(256, dtype=np.uint16), 50)
  c = D.Corpus(train=stream, eval=stream[:500], source="test", num_docs=(1, 1))
  cur = D.parse_curriculum("3:8,2:16")
  assert cur == ((3, 8), (2, 16))
  it = D.DataIterator(c, 4, 32, seed=5, curriculum=cur)
  batches = [next(it) for _ in range(8)]
  assert [b["inputs"].shape[1] for b in batches] == [8, 8, 8, 16, 16, 32, 32, 32]
  # The window is consecutive stream tokens.
  w = batches[0]["inputs"][0]
  assert np.all(np.diff(w) % 256 == 1)
  # Resume after 3 batches continues the exact stream.
  it2 = D.DataIterator(c, 4, 32, seed=5, curriculum=cur)
  for _ in range(3):
    next(it2)
  it3 = D.DataIterator(c, 4, 32, seed=5, curriculum=cur)
  it3.set_state(json.loads(json.dumps(it2.get_state())))
  for b in batches[3:]:
    nb = next(it3)
    for k in b:
      np.testing.assert_array_equal(b[k], nb[k])
  other = D.Corpus(train=stream[:-1], eval=stream[:500], source="test", num_docs=(1, 1))
  with pytest.raises(ValueError, match="data iterator state"):
    D.DataIterator(other, 4, 32, seed=5).set_state(it2.get_state())
  with pytest.raises(ValueError, match="curriculum"):
    D.parse_curriculum("10-64")
  with pytest.raises(ValueError, match="seq_len"):
    D.DataIterator(c, 4, len(stream), seed=0)


def test_unigram_entropy():
  assert D.unigram_entropy(np.array([0, 1, 2, 3] * 10), 272) == pytest.approx(np.log(4))


def test_chat_markers_are_single_ids():
  """The XTML markers (k3jax/data/chat.py) are the reserved ids 261–264: one id each with
  `specials=True`, plain bytes without; the earlier specials keep their ids."""
  from k3jax.data import chat
  tok = tokenizers.ByteTokenizer(272)
  assert (tokenizers.PAD, tokenizers.BOS, tokenizers.EOS, tokenizers.SEP, tokenizers.MEDIA) == (256, 257, 258, 259, 260)
  assert tok.chat_ids() == {"[open]": 261, "[sep]": 262, "[close]": 263, "[end_of_msg]": 264}
  for marker, i in tok.chat_ids().items():
    assert tok.encode(marker, specials=True).tolist() == [i]
    assert tok.encode(marker).tolist() == list(marker.encode())     # text, by default
  text = chat.render_prompt(chat.Conversation((chat.Message("user", "héllo [x]"),)))
  ids = tok.encode(text, bos=True, specials=True)
  assert ids.tolist() == [tokenizers.BOS, 261, *b"user", 262, *"héllo [x]".encode(), 264,
                          261, *b"assistant", 262, 261, *b"think", 262]
  assert tok.decode(ids, specials=True) == "<bos>" + text
  assert tok.decode(ids) == "userhéllo [x]assistantthink"           # specials dropped
