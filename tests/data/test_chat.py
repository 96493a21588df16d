"""XTML chat format (k3jax/data/chat.py): literal renderings, parse(render(c)) == c over generated
conversations (unicode, tool calls, options), errors naming the position, reply parsing, and the
byte tokenizer's single-id markers."""

import re

import pytest
from hypothesis import given, settings, strategies as st

from k3jax.data import chat
from k3jax.data.chat import Conversation, Message, Options, ToolCall, ToolSpec

# ---------------------------------------------------------------------- literal renderings
ADD = ToolSpec("add", "Add two integers.", {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}})


def test_render_literals():
  conv = Conversation((Message("system", "Be brief."), Message("user", "Hi")))
  assert chat.render(conv) == "[open]system[sep]Be brief.[end_of_msg][open]user[sep]Hi[end_of_msg]"
  # The prefix chooses the mode: thinking opens the think channel, instruct the response one.
  assert chat.render_prompt(conv) == chat.render(conv) + "[open]assistant[sep][open]think[sep]"
  assert chat.render_prompt(conv, thinking=False) == (
      chat.render(conv) + "[open]assistant[sep][open]response[sep]")
  assert chat.user_prompt("Hi", thinking=False) == (
      "[open]user[sep]Hi[end_of_msg][open]assistant[sep][open]response[sep]")


def test_render_literal_with_tools_and_options():
  conv = Conversation(
      (Message("user", "2+3?"),
       Message("assistant", None, think="add", tool_calls=(ToolCall("add", {"b": 3, "a": 2}),)),
       Message("tool", "5"),
       Message("assistant", "5")),
      options=Options(tools=(ADD,), effort="high"),
      turn_options=Options(effort="low"))
  assert chat.render(conv) == (
      '[open]options[sep]{"effort":"high","tools":[{"description":"Add two integers.",'
      '"name":"add","parameters":{"properties":{"a":{"type":"integer"},"b":{"type":"integer"}},'
      '"type":"object"}}]}[end_of_msg]'                      # global options: before the history
      "[open]user[sep]2+3?[end_of_msg]"
      "[open]assistant[sep][open]think[sep]add[close]"
      '[open]tools[sep][{"arguments":{"a":2,"b":3},"name":"add"}][close][end_of_msg]'
      "[open]tool[sep]5[end_of_msg]"
      "[open]assistant[sep][open]response[sep]5[close][end_of_msg]"
      '[open]turn_options[sep]{"effort":"low"}[end_of_msg]')  # one-shot: after it
  assert chat.parse(chat.render(conv)) == conv
  # An earlier conversation's rendering is a prefix of the longer one's (reusable KV/KDA state)
  # when only the one-shot options differ.
  shorter = Conversation(conv.messages[:2], options=conv.options)
  assert chat.render(conv).startswith(chat.render(shorter))


def test_empty_vs_absent_channels():
  a = Message("assistant", "", think="")
  b = Message("assistant", "")
  assert chat.render_message(a) == (
      "[open]assistant[sep][open]think[sep][close][open]response[sep][close][end_of_msg]")
  assert chat.render_message(b) == "[open]assistant[sep][open]response[sep][close][end_of_msg]"
  for m in (a, b, Message("assistant", None)):
    assert chat.parse(chat.render_message(m)).messages == (m,)


# ---------------------------------------------------------------------- round trip
_PIECES = st.sampled_from(["[", "]", "open", "sep", "close", "[open", "end_of_msg]", "\n", "{",
                           '"', "\\"])
_CHARS = st.characters(blacklist_categories=("Cs",))
TEXT = st.lists(st.one_of(st.text(_CHARS, max_size=6), _PIECES), max_size=5).map("".join).filter(
    lambda s: not chat._MARKER_RE.search(s))
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6)
NAME = st.text(st.characters(whitelist_categories=("Ll", "Lu", "Nd", "Lo")), min_size=1,
               max_size=8)
CALL = st.builds(ToolCall, NAME, st.dictionaries(TEXT, JSON, max_size=3))
OPTIONS = st.builds(Options, st.lists(st.builds(ToolSpec, NAME, TEXT, st.dictionaries(
    TEXT, JSON, max_size=2)), max_size=2).map(tuple), st.sampled_from([None, *chat.EFFORTS]))
MESSAGE = st.one_of(
    st.builds(Message, st.sampled_from(["system", "user", "tool"]), TEXT),
    st.builds(Message, st.just("assistant"), st.none() | TEXT, st.none() | TEXT,
              st.none() | st.lists(CALL, max_size=3).map(tuple)))
CONVERSATION = st.builds(Conversation, st.lists(MESSAGE, max_size=5).map(tuple),
                         st.none() | OPTIONS, st.none() | OPTIONS)


@settings(max_examples=200, deadline=None)
@given(CONVERSATION)
def test_round_trip(conv):
  text = chat.render(conv)
  assert chat.parse(text) == conv
  # The byte tokenizer: every marker is one id, and ids → text gives the rendering back.
  from k3jax.data.tokenizers import ByteTokenizer
  tok = ByteTokenizer()
  ids = tok.encode(text, specials=True)
  assert tok.decode(ids, specials=True) == text
  assert sum(int(i) in tok.chat_ids().values() for i in ids) == sum(
      text.count(m) for m in chat.MARKERS)


@settings(max_examples=50, deadline=None)
@given(st.builds(Message, st.just("assistant"), st.none() | TEXT, st.none() | TEXT,
                 st.none() | st.lists(CALL, max_size=2).map(tuple)), st.booleans(), TEXT)
def test_reply_round_trip(msg, thinking, junk):
  """What a model generates after render_prompt parses back into the message (text after
  [end_of_msg] is ignored)."""
  prefix = chat.reply_prefix(thinking)
  full = chat.render_message(msg)
  if not full.startswith(prefix):
    return                              # this message is not reachable from this mode's prefix
  assert chat.parse_reply(full[len(prefix):] + junk, thinking) == msg


def test_parse_reply_truncated():
  assert chat.parse_reply("hmm[close][open]response[sep]The ans", complete=False) == Message(
      "assistant", "The ans", think="hmm")
  assert chat.parse_reply("hmm[close][open]", complete=False) == Message(
      "assistant", None, think="hmm")
  assert chat.parse_reply("4", thinking=False, complete=False) == Message("assistant", "4")
  with pytest.raises(ValueError, match="not closed"):
    chat.parse_reply("hmm", complete=True)


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize("text,pos,match", [
    ("[open]user[sep]hi", 15, r"user message \(opened at offset 0\) is not closed"),
    ("[open]user[sep]hi[end_of_msg][open]robot[sep]x[end_of_msg]", 29, "unknown role 'robot'"),
    ("[open]assistant[sep][open]answer[sep]x[close][end_of_msg]", 20, "unknown channel 'answer'"),
    ("[open]user[sep]a[close]b[end_of_msg]", 16, "unexpected marker '\\[close\\]'"),
    ("[open]user[sep]a[open]b[end_of_msg]", 16, "unexpected marker '\\[open\\]'"),
    ("[open]assistant[sep][open]think[sep]x[end_of_msg]", 37, "unexpected marker"),
    ("[open]assistant[sep][open]response[sep]x[close]", 47, "not closed"),
    ("[open]assistant[sep][open]response[sep]a[close][open]think[sep]b[close][end_of_msg]", 47,
     "out of order"),
    ("[open]assistant[sep][open]tools[sep][{\"name\": 1}][close][end_of_msg]", 36, "tools channel"),
    ("[open]assistant[sep][open]tools[sep][{][close][end_of_msg]", 38, "bad JSON"),
    ("hello", 0, "expected '\\[open\\]'"),
    ("[open]user[sep]a[end_of_msg][open]options[sep]{}[end_of_msg]", 28, "global options"),
    ('[open]options[sep]{"effort":"huge"}[end_of_msg]', 0, "effort"),
    ("[open]turn_options[sep]{}[end_of_msg][open]user[sep]a[end_of_msg]", 37,
     "must follow a message"),
    ("[open]user[sep]a[end_of_msg][open]turn_options[sep]{}[end_of_msg]"
     "[open]turn_options[sep]{}[end_of_msg]", 65, "two one-shot options blocks"),
])
def test_parse_errors_name_the_position(text, pos, match):
  with pytest.raises(ValueError, match=match) as e:
    chat.parse(text)
  assert re.search(rf"offset {pos} \(line 1, col {pos + 1}\)", str(e.value)), str(e.value)


def test_error_line_and_column():
  with pytest.raises(ValueError, match=r"offset 30 \(line 2, col 14\).*unknown role 'bot'"):
    chat.parse("[open]user[sep]a\nb[end_of_msg][open]bot[sep][end_of_msg]")
  with pytest.raises(ValueError, match=r"offset 19 \(line 2, col 3\).*unexpected marker"):
    chat.parse("[open]user[sep]a\nbc[close][end_of_msg]")


def test_render_refuses_markers_in_content():
  with pytest.raises(ValueError, match=r"messages\[1\] \(user\).*'\[sep\]' at offset 2"):
    chat.render(Conversation((Message("user", "ok"), Message("user", "a [sep] b"))))
  with pytest.raises(ValueError, match="assistant tools"):
    chat.render_message(Message("assistant", None, tool_calls=(ToolCall("f", {"x": "[close]"}),)))


def test_data_model_errors():
  with pytest.raises(ValueError, match="role"):
    Message("robot", "x")
  with pytest.raises(ValueError, match="only assistant"):
    Message("user", "x", think="y")
  with pytest.raises(ValueError, match="arguments"):
    ToolCall("f", {"x": object()})
  with pytest.raises(ValueError, match="arguments"):
    ToolCall("f", {"x": float("nan")})
  with pytest.raises(ValueError, match="effort"):
    Options(effort="medium")
  assert ToolCall("f", {"x": (1, 2)}).arguments == {"x": [1, 2]}   # JSON-normalised


def test_effort_changed_mid_conversation():
  """One-shot options between messages (the effort of the next reply changed during the
  conversation): rendered in place, parsed back, encoded with a turn boundary after them."""
  from k3jax.data.chat_tokens import ChatEncoder
  from k3jax.data.tokenizers import ByteTokenizer
  conv = Conversation((Message("user", "a"), Message("assistant", "b"), Message("user", "c")),
                      options=Options(effort="low"),
                      options_at=((2, Options(effort="max")),))
  text = chat.render(conv)
  assert text == ('[open]options[sep]{"effort":"low"}[end_of_msg][open]user[sep]a[end_of_msg]'
                  '[open]assistant[sep][open]response[sep]b[close][end_of_msg]'
                  '[open]turn_options[sep]{"effort":"max"}[end_of_msg]'
                  '[open]user[sep]c[end_of_msg]')
  assert chat.parse(text) == conv
  e = ChatEncoder(ByteTokenizer()).encode(conv, reply="thinking", bos=False)
  assert len(e.boundaries) == 5 and ByteTokenizer().decode(
      list(e.ids[:e.boundaries[3]]), specials=True) == text[:text.index("[open]user[sep]c")]
  with pytest.raises(ValueError, match="options_at"):
    Conversation((Message("user", "a"),), options_at=((1, Options()),))
