"""tiktoken-format vocabulary: reading, BPE merges by rank, specials, round trips, errors."""

import base64
import json

import pytest

from k3jax.data.tokenizers import TiktokenTokenizer, read_ranks


def _write_vocab(tmp_path, extra):
  lines = [f"{base64.b64encode(bytes([i])).decode()} {i}" for i in range(256)]
  lines += [f"{base64.b64encode(t).decode()} {256 + j}" for j, t in enumerate(extra)]
  (tmp_path / "tiktoken.model").write_text("\n".join(lines) + "\n")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
      "300": {"content": "[BOS]"}, "301": {"content": "[EOS]"}}}))
  return tmp_path


def test_bpe_merges_lowest_rank_first(tmp_path):
  # ranks: "ll"=256, "he"=257, "hell"=258, "lo"=259, " w"=260.
  tok = TiktokenTokenizer.from_dir(_write_vocab(tmp_path, [b"ll", b"he", b"hell", b"lo", b" w"]))
  assert tok.vocab_size == 302 and tok.bos_id == 300 and tok.eos_id == 301
  # "hello": h e l l o → "ll" (256) first → h e ll o → "he" (257) → he ll o → "hell" (258).
  # ("lo" never forms: the l's were merged first.)
  assert tok.encode("hello") == [258, ord("o")]
  # " world" is one regex piece: " w"(260) then o r l d stay single bytes.
  assert tok.encode("hello world") == [258, ord("o"), 260, ord("o"), ord("r"), ord("l"), ord("d")]
  assert tok.encode("hi", bos=True) == [300, ord("h"), ord("i")]


def test_round_trip_unicode_and_specials(tmp_path):
  tok = TiktokenTokenizer.from_dir(_write_vocab(tmp_path, [b"\xe4\xbd", b"\xe4\xbd\xa0"]))
  text = "你好, it's 12345 héllo!\n\n  end"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert ids[0] == 257                           # "你": e4+bd (256), then +a0 (257)
  assert tok.decode([300, 104, 301]) == "h"
  assert tok.decode([300, 104, 301], specials=True) == "[BOS]h[EOS]"
  assert tok.decode([0xE4]) == "\ufffd"          # partial UTF-8 is replaced, not an error


def test_bad_files_and_ids(tmp_path):
  p = tmp_path / "tiktoken.model"
  p.write_text("aGk= 0\nnot-a-line\n")
  with pytest.raises(ValueError, match=":2:"):
    read_ranks(p)
  with pytest.raises(ValueError, match="no tiktoken.model"):
    TiktokenTokenizer.from_dir(tmp_path / "missing")
  tok = TiktokenTokenizer.from_dir(_write_vocab(tmp_path, []))
  with pytest.raises(ValueError, match="outside"):
    tok.decode([999])


def _with_chat_markers(path, markers=("[open]", "[sep]", "[close]", "[end_of_msg]")):
  cfg = json.loads((path / "tokenizer_config.json").read_text())
  for j, m in enumerate(markers):
    cfg["added_tokens_decoder"][str(310 + j)] = {"content": m}
  (path / "tokenizer_config.json").write_text(json.dumps(cfg))
  return path


def test_chat_markers_from_the_tokenizer_files(tmp_path):
  """The XTML markers' ids come from tokenizer_config.json; each is one token with
  specials=True, and a rendered conversation round-trips through encode → decode."""
  from k3jax.data import chat
  tok = TiktokenTokenizer.from_dir(_with_chat_markers(_write_vocab(tmp_path, [b"ll"])))
  assert tok.chat_ids() == {"[open]": 310, "[sep]": 311, "[close]": 312, "[end_of_msg]": 313}
  conv = chat.Conversation((chat.Message("user", "hello 你好"),
                            chat.Message("assistant", "ok", think="hm")))
  text = chat.render(conv)
  ids = tok.encode(text, specials=True)
  assert [i for i in ids if i >= 310] == [310, 311, 313, 310, 311, 310, 311, 312, 310, 311, 312,
                                          313]
  assert tok.decode(ids, specials=True) == text
  assert chat.parse(tok.decode(ids, specials=True)) == conv
  assert 310 not in tok.encode(text)                 # without specials: plain text


def test_chat_markers_missing_are_named(tmp_path):
  tok = TiktokenTokenizer.from_dir(_with_chat_markers(_write_vocab(tmp_path, []),
                                                      ("[open]", "[sep]")))
  with pytest.raises(ValueError, match=r"\['\[close\]', '\[end_of_msg\]'\].*tokenizer_config"):
    tok.chat_ids()
