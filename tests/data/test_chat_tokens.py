"""The one chat encoder (k3jax/data/chat_tokens.py): control ids come from the structure only.

Adversarial contents — every special token's spelling of the byte vocabulary (`<eos>`,
`<media>`, `[open]` …) and of a Kimi-style tiktoken vocabulary (`[EOS]`, `<|im_end|>`,
`<|im_assistant|>` …) — stay text on both vocabularies; the structure's ids are exactly the
markers of the rendering; SFT, RL, generate and the server agree because they call it."""

import base64
import json

import numpy as np
import pytest
from hypothesis import given, strategies as st

from k3jax.data import chat, sft
from k3jax.data.chat import Conversation, Message, Options, ToolCall
from k3jax.data.chat_tokens import ChatEncoder
from k3jax.data.tokenizers import (BOS, CHAT_CLOSE, CHAT_END, CHAT_OPEN, CHAT_SEP, EOS, MEDIA,
                                   SPECIAL_NAMES, ByteTokenizer, TiktokenTokenizer)

KIMI_SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                 "<|im_system|>", "<|im_middle|>", "[open]", "[sep]", "[close]", "[end_of_msg]"]
BYTE_SPECIALS = list(SPECIAL_NAMES.values())
ADVERSARIAL = BYTE_SPECIALS + KIMI_SPECIALS + ["[open", "sep]", "<|im_end", "<eos", "[EOS"]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
  """A tiktoken vocabulary: the 256 bytes, a few merges, and Kimi-style special tokens."""
  path = tmp_path_factory.mktemp("kimi")
  merges = [b"[E", b"OS", b"im", b"<|", b"|>", b"us", b"er"]
  lines = [f"{base64.b64encode(bytes([i])).decode()} {i}" for i in range(256)]
  lines += [f"{base64.b64encode(t).decode()} {256 + j}" for j, t in enumerate(merges)]
  (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
  (path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
      str(400 + j): {"content": s} for j, s in enumerate(KIMI_SPECIALS)}}))
  return TiktokenTokenizer.from_dir(path)


def _control_ids(tok) -> set[int]:
  if isinstance(tok, ByteTokenizer):
    return set(range(256, 272))
  return set(tok.special_tokens.values())


def _structure_ids(enc: ChatEncoder, conv: Conversation, reply) -> list[int]:
  """The control ids the structure alone implies: BOS, then each marker in render order."""
  ids = [enc.bos_id] if enc.bos_id is not None else []
  segs = [s for b in chat.conversation_segments(conv) for s in b]
  if reply is not None:
    segs += chat.reply_segments(reply == "thinking")
  return ids + [enc.marker_ids[s] for kind, s in segs if kind == chat.MARK]


TEXTS = st.lists(st.sampled_from(ADVERSARIAL + ["a", " ", "é", "\n", "你"]), max_size=5).map(
    "".join)
MESSAGES = st.one_of(
    st.builds(Message, st.sampled_from(["system", "user", "tool"]), TEXTS),
    st.builds(lambda c, t, k: Message("assistant", c, t, k), st.none() | TEXTS, st.none() | TEXTS,
              st.none() | st.lists(st.builds(ToolCall, st.sampled_from(["f", "<eos>"]),
                                             st.dictionaries(TEXTS, TEXTS, max_size=2)),
                                   max_size=2).map(tuple)))
CONVS = st.builds(lambda ms, o: Conversation(tuple(ms), o), st.lists(MESSAGES, max_size=4),
                  st.none() | st.just(Options(effort="low")))


@pytest.mark.parametrize("vocab", ["byte", "kimi"])
@given(conv=CONVS, reply=st.sampled_from([None, "thinking", "instruct"]))
def test_control_ids_come_from_the_structure_only(vocab, conv, reply, request):
  tok = ByteTokenizer() if vocab == "byte" else request.getfixturevalue("kimi")
  enc = ChatEncoder(tok)
  e = enc.encode(conv, reply=reply)
  controls = [int(i) for i in e.ids if int(i) in _control_ids(tok)]
  assert controls == _structure_ids(enc, conv, reply)
  # Boundaries: right after each block's [end_of_msg], one per block.
  assert len(e.boundaries) == len(chat.conversation_segments(conv))
  assert all(int(e.ids[p - 1]) == enc.end_id for p in e.boundaries)
  # Decoding with the specials written out gives back the text form (when it exists).
  try:
    text = chat.render(conv) + (chat.reply_prefix(reply == "thinking") if reply else "")
  except ValueError:
    return                              # a marker's spelling in content: no text form
  start = 1 if enc.bos_id is not None else 0
  assert tok.decode(e.ids[start:].tolist(), specials=True) == text


@pytest.mark.parametrize("text", ADVERSARIAL + ["".join(ADVERSARIAL)])
def test_typed_specials_stay_text(text, kimi):
  for tok in (ByteTokenizer(), kimi):
    enc = ChatEncoder(tok)
    ids = enc.encode(chat.user_conversation(text), reply="thinking").ids.tolist()
    body = ids[ids.index(enc.marker_ids[chat.SEP]) + 1:ids.index(enc.end_id)]
    assert not set(body) & _control_ids(tok), (text, body)
    assert tok.decode(body) == text


def test_byte_literal_and_generate_issue_case():
  """`a<eos>` typed by a user is the bytes a < e o s >, never EOS (258)."""
  enc = ChatEncoder(ByteTokenizer())
  ids = enc.encode(chat.user_conversation("a<eos>"), reply="thinking").ids.tolist()
  b = lambda s: list(s.encode())   # noqa: E731
  assert ids == [BOS, CHAT_OPEN, *b("user"), CHAT_SEP, *b("a<eos>"), CHAT_END, CHAT_OPEN,
                 *b("assistant"), CHAT_SEP, CHAT_OPEN, *b("think"), CHAT_SEP]
  assert EOS not in ids


def test_media_placeholders_from_the_structure():
  enc = ChatEncoder(ByteTokenizer(), media_id=MEDIA)
  conv = Conversation((Message("system", "s"), Message("user", "<media>x")))
  e = enc.encode(conv, reply="instruct", media={1: [2, 1]})
  ids = e.ids.tolist()
  sep = [i for i, t in enumerate(ids) if t == CHAT_SEP][1]     # the user message's [sep]
  assert ids[sep + 1:sep + 4] == [MEDIA] * 3
  assert ids[sep + 4:sep + 4 + len(b"<media>x")] == list(b"<media>x")   # typed: text
  assert ids.count(MEDIA) == 3
  with pytest.raises(ValueError, match="text-only"):
    ChatEncoder(ByteTokenizer()).encode(conv, media={1: [1]})
  with pytest.raises(ValueError, match="out of range"):
    enc.encode(conv, media={5: [1]})


def test_sft_rl_and_generate_share_the_encoder():
  """SFT rows and RL prompts are the encoder's ids; generate --chat builds its prompt with it
  (tests/experiments/test_generate_cli.py checks the CLI)."""
  conv = Conversation((Message("user", "[open]<bos>"), Message("assistant", "<eos>")))
  ids, mask = sft.tokenize(conv)
  assert ids.tolist() == ChatEncoder(ByteTokenizer()).encode(conv).ids.tolist()
  assert ids.tolist().count(CHAT_OPEN) == 3 and EOS not in ids.tolist()
  assert mask.sum() == len(ids) - ids.tolist().index(CHAT_SEP, ids.tolist().index(
      CHAT_OPEN, 2)) - 1
  from k3jax.data import rl_tasks
  t = rl_tasks.TaskSampler(seed=0).sample(1)[0]
  want = ChatEncoder(ByteTokenizer()).encode(rl_tasks.conversation(t.question, t.effort),
                                             reply="thinking", bos=False).ids.tolist()
  assert list(t.tokens) == want
  assert np.asarray(ByteTokenizer().encode(rl_tasks.render(t.question, t.effort),
                                           specials=True)).tolist() == want
  assert CHAT_CLOSE not in want
