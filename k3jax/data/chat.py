"""The XTML chat format: conversations as data, `render` to text, `parse` back (K3 docs/k3.md §13).

The spec fixes the four markers (`[open]`, `[sep]`, `[close]`, `[end_of_msg]`), the roles, the
assistant channels `think` / `response` / `tools`, that thinking vs instruct mode is chosen by the
prefix, and that global options come before the history and one-shot options after it (so the
KV/KDA state of an earlier prefix stays reusable). The concrete grammar below is ours; it uses
nothing but the markers (no whitespace is added anywhere):

    conversation  = [block("options", OPTS)] (message | block("turn_options", OPTS))*
    block(h, x)   = "[open]" h "[sep]" x "[end_of_msg]"
    message       = block(role, TEXT)                  role in system / user / tool
                  | "[open]assistant[sep]" channel* "[end_of_msg]"
    channel       = "[open]" name "[sep]" TEXT "[close]"   name in think / response / tools,
                                                          each at most once, in that order
    OPTS          = compact JSON object: {"effort": "low"|"high"|"max", "tools": [ToolSpec…]}
    tools channel = compact JSON array of {"arguments": {...}, "name": "..."} (keys sorted)

TEXT is any string without a marker in it. Example (instruct mode, one tool call):

    [open]user[sep]2+3?[end_of_msg][open]assistant[sep][open]tools[sep][{"arguments":{"a":2,
    "b":3},"name":"add"}][close][end_of_msg][open]tool[sep]5[end_of_msg]

Mode. `render_prompt(conv, thinking=True)` ends with `[open]assistant[sep][open]think[sep]`: the
model continues by thinking; `thinking=False` ends with `[open]assistant[sep][open]response[sep]`:
it answers at once (instruct). The reply is generated until `[end_of_msg]`; `parse_reply` turns
the generated text back into an assistant `Message`. One-shot options belong to the next reply:
they are rendered after the history, just before that reply's opening.

Errors. `parse` raises `ValueError` naming the offset (and line:col) of the problem: an unknown
role or channel, a message not closed by `[end_of_msg]`, a channel not closed by `[close]`, a
marker where text was expected, bad JSON. `render` refuses content holding a marker.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

OPEN, SEP, CLOSE, END = "[open]", "[sep]", "[close]", "[end_of_msg]"
MARKERS = (OPEN, SEP, CLOSE, END)
ROLES = ("system", "user", "assistant", "tool")
CHANNELS = ("think", "response", "tools")
EFFORTS = ("low", "high", "max")          # the three RL effort levels (§13)
GLOBAL_OPTIONS, TURN_OPTIONS = "options", "turn_options"
_MARKER_RE = re.compile("|".join(re.escape(m) for m in MARKERS))


def canonical_json(value) -> str:
  """Compact canonical JSON (sorted keys, UTF-8 kept); NaN/inf refused."""
  try:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"),
                      allow_nan=False)
  except (TypeError, ValueError) as e:
    raise ValueError(f"not JSON-serialisable: {e}") from None


def _normalise_json(value, what: str):
  """The value as JSON would give it back (tuples → lists): equality survives a round trip."""
  try:
    return json.loads(canonical_json(value))
  except ValueError as e:
    raise ValueError(f"{what}: {e}") from None


# ---------------------------------------------------------------------- data model
@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One call in an assistant's `tools` channel: a tool name and a JSON object of arguments."""
  name: str
  arguments: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"ToolCall.name: a non-empty string is required, found {self.name!r}")
    if not isinstance(self.arguments, dict):
      raise ValueError(f"ToolCall({self.name!r}).arguments: a dict (JSON object) is required, "
                       f"found {type(self.arguments).__name__}")
    object.__setattr__(self, "arguments",
                       _normalise_json(self.arguments, f"ToolCall({self.name!r}).arguments"))


@dataclasses.dataclass(frozen=True)
class ToolSpec:
  """A tool declaration (global option): name, description, JSON-schema of its arguments."""
  name: str
  description: str = ""
  parameters: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"ToolSpec.name: a non-empty string is required, found {self.name!r}")
    if not isinstance(self.description, str):
      raise ValueError(f"ToolSpec({self.name!r}).description: a string is required")
    object.__setattr__(self, "parameters",
                       _normalise_json(self.parameters, f"ToolSpec({self.name!r}).parameters"))


@dataclasses.dataclass(frozen=True)
class Options:
  """Options block: tool declarations and reasoning effort (None = the model's default)."""
  tools: tuple[ToolSpec, ...] = ()
  effort: str | None = None

  def __post_init__(self):
    object.__setattr__(self, "tools", tuple(self.tools))
    if self.effort is not None and self.effort not in EFFORTS:
      raise ValueError(f"Options.effort: one of {EFFORTS} or None, found {self.effort!r}")

  def to_json(self) -> str:
    d: dict[str, Any] = {}
    if self.effort is not None:
      d["effort"] = self.effort
    if self.tools:
      d["tools"] = [dataclasses.asdict(t) for t in self.tools]
    return canonical_json(d)

  @classmethod
  def from_json(cls, text: str) -> "Options":
    d = json.loads(text)
    if not isinstance(d, dict):
      raise ValueError(f"options must be a JSON object, found {type(d).__name__}")
    unknown = set(d) - {"effort", "tools"}
    if unknown:
      raise ValueError(f"unknown option(s) {sorted(unknown)} (known: effort, tools)")
    tools = d.get("tools", [])
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
      raise ValueError("options.tools must be a list of objects")
    try:
      return cls(tools=tuple(ToolSpec(**t) for t in tools), effort=d.get("effort"))
    except TypeError as e:
      raise ValueError(f"options.tools: {e}") from None


@dataclasses.dataclass(frozen=True)
class Message:
  """A message. system / user / tool: `content` is its text. assistant: `content` is the
  `response` channel, `think` the `think` channel, `tool_calls` the `tools` channel; None = the
  channel is absent ("" = present and empty)."""
  role: str
  content: str | None = ""
  think: str | None = None
  tool_calls: tuple[ToolCall, ...] | None = None

  def __post_init__(self):
    if self.role not in ROLES:
      raise ValueError(f"Message.role: one of {ROLES}, found {self.role!r}")
    if self.tool_calls is not None:
      object.__setattr__(self, "tool_calls", tuple(self.tool_calls))
    if self.role != "assistant":
      if self.think is not None or self.tool_calls is not None:
        raise ValueError(f"Message({self.role!r}): only assistant messages have think / "
                         f"tool_calls channels")
      if not isinstance(self.content, str):
        raise ValueError(f"Message({self.role!r}).content: a string is required")
    for f in ("content", "think"):
      v = getattr(self, f)
      if v is not None and not isinstance(v, str):
        raise ValueError(f"Message({self.role!r}).{f}: a string or None, found {type(v).__name__}")


@dataclasses.dataclass(frozen=True)
class Conversation:
  """Global options, the history, and one-shot options for the next reply. `options_at`:
  one-shot options given during the conversation, (i, Options) = a `turn_options` block right
  before messages[i] (it applies to the next assistant reply after it; e.g. an effort changed
  mid-conversation), i ascending, each 0 < i < len(messages)."""
  messages: tuple[Message, ...] = ()
  options: Options | None = None
  turn_options: Options | None = None
  options_at: tuple[tuple[int, Options], ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "messages", tuple(self.messages))
    at = tuple((int(i), o) for i, o in self.options_at)
    idx = [i for i, _ in at]
    if idx != sorted(set(idx)) or any(not 0 < i < len(self.messages) for i in idx):
      raise ValueError(f"Conversation.options_at: positions must be ascending, distinct and "
                       f"inside (0, {len(self.messages)}), found {idx}")
    object.__setattr__(self, "options_at", at)


# ---------------------------------------------------------------------- render
# A rendering is a list of segments, each (kind, string): MARK a marker, NAME a header or
# channel name (structure spelled in text), TEXT a message's or an option block's content.
# `render` joins them (refusing a marker inside TEXT: the text form could not be parsed back);
# the token encoder (k3jax/data/chat_tokens.py) maps MARK to the marker's id and everything
# else to ordinary text, so content never produces a control token.
MARK, NAME, TEXT = "mark", "name", "text"


def _text(s: str, where: str) -> str:
  m = _MARKER_RE.search(s)
  if m:
    raise ValueError(f"{where}: the text holds the marker {m.group()!r} at offset {m.start()} "
                     f"(markers cannot appear inside content)")
  return s


def _block_segments(header: str, body: str) -> list[tuple[str, str]]:
  return [(MARK, OPEN), (NAME, header), (MARK, SEP), (TEXT, body), (MARK, END)]


def message_segments(m: Message) -> list[tuple[str, str]]:
  """One message as segments (see MARK / NAME / TEXT)."""
  if m.role != "assistant":
    return _block_segments(m.role, m.content)
  parts = [(MARK, OPEN), (NAME, "assistant"), (MARK, SEP)]
  for name, value in (("think", m.think), ("response", m.content),
                      ("tools", None if m.tool_calls is None else
                       canonical_json([dataclasses.asdict(c) for c in m.tool_calls]))):
    if value is not None:
      parts += [(MARK, OPEN), (NAME, name), (MARK, SEP), (TEXT, value), (MARK, CLOSE)]
  return parts + [(MARK, END)]


def conversation_segments(conv: Conversation) -> list[list[tuple[str, str]]]:
  """The conversation's blocks in order ([global options] messages [one-shot options]), each
  a list of segments ending with the `[end_of_msg]` marker."""
  return [segs for _, segs in conversation_blocks(conv)]


def conversation_blocks(conv: Conversation) -> list[tuple[int | None, list[tuple[str, str]]]]:
  """The blocks of `conversation_segments`, each with its message index (None: an options
  block)."""
  out: list = []
  if conv.options is not None:
    out.append((None, _block_segments(GLOBAL_OPTIONS, conv.options.to_json())))
  at = dict(conv.options_at)
  for i, m in enumerate(conv.messages):
    if i in at:
      out.append((None, _block_segments(TURN_OPTIONS, at[i].to_json())))
    out.append((i, message_segments(m)))
  if conv.turn_options is not None:
    out.append((None, _block_segments(TURN_OPTIONS, conv.turn_options.to_json())))
  return out


def reply_segments(thinking: bool = True) -> list[tuple[str, str]]:
  """The assistant turn's opening as segments; it chooses the mode (thinking or instruct)."""
  return [(MARK, OPEN), (NAME, "assistant"), (MARK, SEP), (MARK, OPEN),
          (NAME, "think" if thinking else "response"), (MARK, SEP)]


def _join(segments, where: str) -> str:
  return "".join(_text(s, where) if kind == TEXT else s for kind, s in segments)


def render_message(m: Message, where: str = "message") -> str:
  """One message as XTML text."""
  if m.role != "assistant":
    return _join(message_segments(m), f"{where} ({m.role})")
  out = []
  for kind, s in message_segments(m):   # name the channel a marker was found in
    out.append(s if kind != TEXT else _text(s, f"{where} (assistant {out[-2]})"))
  return "".join(out)


def render(conv: Conversation) -> str:
  """The conversation as XTML text: [global options] messages [one-shot options]."""
  out = []
  if conv.options is not None:
    out.append(_join(_block_segments(GLOBAL_OPTIONS, conv.options.to_json()), "options"))
  at = dict(conv.options_at)
  for i, m in enumerate(conv.messages):
    if i in at:
      out.append(_join(_block_segments(TURN_OPTIONS, at[i].to_json()), f"options_at[{i}]"))
    out.append(render_message(m, f"messages[{i}]"))
  if conv.turn_options is not None:
    out.append(_join(_block_segments(TURN_OPTIONS, conv.turn_options.to_json()),
                     "turn_options"))
  return "".join(out)


def reply_prefix(thinking: bool = True) -> str:
  """The assistant turn's opening; it chooses the mode (thinking or instruct)."""
  return _join(reply_segments(thinking), "reply")


def render_prompt(conv: Conversation, thinking: bool = True) -> str:
  """What generation starts from: the conversation, then the assistant's opening."""
  return render(conv) + reply_prefix(thinking)


def user_conversation(text: str, system: str | None = None,
                      options: Options | None = None) -> Conversation:
  """A one-turn conversation: an optional system message, then the user's `text`."""
  msgs = ([Message("system", system)] if system is not None else []) + [Message("user", text)]
  return Conversation(tuple(msgs), options=options)


def user_prompt(text: str, thinking: bool = True, system: str | None = None,
                options: Options | None = None) -> str:
  """`render_prompt` of a one-turn conversation (an optional system message, then `text`)."""
  return render_prompt(user_conversation(text, system, options), thinking)


# ---------------------------------------------------------------------- parse
def _where(text: str, pos: int) -> str:
  line = text.count("\n", 0, pos) + 1
  col = pos - (text.rfind("\n", 0, pos) + 1) + 1
  return f"offset {pos} (line {line}, col {col})"


class _Parser:
  def __init__(self, text: str):
    self.text, self.pos = text, 0

  def error(self, msg: str, pos: int | None = None):
    pos = self.pos if pos is None else pos
    raise ValueError(f"XTML at {_where(self.text, pos)}: {msg}")

  def at(self, marker: str) -> bool:
    return self.text.startswith(marker, self.pos)

  def expect(self, marker: str, what: str):
    if not self.at(marker):
      got = self.text[self.pos:self.pos + 20]
      self.error(f"expected {marker!r} {what}, found "
                 f"{got!r}" if got else f"expected {marker!r} {what}, found the end of the text")
    self.pos += len(marker)

  def text_until(self, marker: str, what: str, opened: int | None = None) -> str:
    """Text up to the next marker, which must be `marker` (`opened`: where `what` began)."""
    m = _MARKER_RE.search(self.text, self.pos)
    if m is None:
      where = "" if opened is None else f" (opened at offset {opened})"
      self.error(f"{what}{where} is not closed: no {marker!r} before the end of the text")
    if m.group() != marker:
      self.error(f"unexpected marker {m.group()!r} inside {what} (expected {marker!r})",
                 m.start())
    s = self.text[self.pos:m.start()]
    self.pos = m.end()
    return s

  def header(self) -> tuple[str, int]:
    start = self.pos
    self.expect(OPEN, "to start a message")
    return self.text_until(SEP, "a message header"), start

  def json(self, s: str, start: int, what: str):
    try:
      return json.loads(s)
    except json.JSONDecodeError as e:
      self.error(f"{what}: bad JSON: {e.msg}", start + e.pos)

  def options(self, start: int) -> Options:
    body_start = self.pos
    body = self.text_until(END, "an options block", start)
    try:
      return Options.from_json(body)
    except json.JSONDecodeError as e:
      self.error(f"options: bad JSON: {e.msg}", body_start + e.pos)
    except ValueError as e:
      self.error(f"options: {e}", start)

  def assistant(self) -> Message:
    chans: dict[str, Any] = {}
    last = -1
    while not self.at(END):
      if self.pos >= len(self.text):
        self.error("assistant message is not closed: no '[end_of_msg]' before the end of the "
                   "text")
      start = self.pos
      self.expect(OPEN, "to start a channel (or '[end_of_msg]' to end the message)")
      name = self.text_until(SEP, "a channel header")
      if name not in CHANNELS:
        self.error(f"unknown channel {name!r} (known: {', '.join(CHANNELS)})", start)
      if CHANNELS.index(name) <= last:
        self.error(f"channel {name!r} repeated or out of order (order: "
                   f"{', '.join(CHANNELS)}, each at most once)", start)
      last = CHANNELS.index(name)
      body_start = self.pos
      body = self.text_until(CLOSE, f"channel {name!r}", start)
      if name == "tools":
        calls = self.json(body, body_start, "tools channel")
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and set(c) == {"name", "arguments"} for c in calls):
          self.error('tools channel: expected a JSON list of {"name": ..., "arguments": {...}}',
                     body_start)
        try:
          body = tuple(ToolCall(c["name"], c["arguments"]) for c in calls)
        except ValueError as e:
          self.error(f"tools channel: {e}", body_start)
      chans[name] = body
    self.pos += len(END)
    return Message("assistant", chans.get("response"), chans.get("think"), chans.get("tools"))

  def conversation(self) -> Conversation:
    options = turn_options = None
    messages, options_at = [], []
    while self.pos < len(self.text):
      if turn_options is not None and not self.at(OPEN + TURN_OPTIONS + SEP):
        if not messages:
          self.error("one-shot options must follow a message (global options come first)")
        options_at.append((len(messages), turn_options))
        turn_options = None
      header, start = self.header()
      if header == GLOBAL_OPTIONS:
        if messages or options is not None or turn_options is not None:
          self.error("global options must come first, before any message, and once", start)
        options = self.options(start)
      elif header == TURN_OPTIONS:
        if turn_options is not None:
          self.error("two one-shot options blocks in a row", start)
        turn_options = self.options(start)
      elif header == "assistant":
        messages.append(self.assistant())
      elif header in ROLES:
        messages.append(Message(header, self.text_until(END, f"{header} message", start)))
      else:
        self.error(f"unknown role {header!r} (known: {', '.join(ROLES)}, "
                   f"{GLOBAL_OPTIONS}, {TURN_OPTIONS})", start)
    return Conversation(tuple(messages), options, turn_options, tuple(options_at))


def parse(text: str) -> Conversation:
  """XTML text → Conversation (the inverse of `render`); ValueError naming the position."""
  return _Parser(text).conversation()


def parse_reply(generated: str, thinking: bool = True, complete: bool = True) -> Message:
  """The assistant message that `generated` continues from `reply_prefix(thinking)`.

  Text after the first `[end_of_msg]` is ignored. `complete=False` accepts a reply cut short
  (no `[end_of_msg]`, e.g. at max_new_tokens): the open channel and message are closed first.
  """
  text = reply_prefix(thinking) + generated
  end = text.find(END)
  if end >= 0:
    text = text[:end + len(END)]
  elif not complete:
    last = max((text.rfind(m), m) for m in MARKERS)
    if last[1] == OPEN:                  # a channel header cut short: drop it
      text, last = text[:last[0]], (0, CLOSE)
    text += (CLOSE if last[1] == SEP else "") + END
  conv = parse(text)
  if len(conv.messages) != 1:   # pragma: no cover (the prefix opens exactly one message)
    raise ValueError("reply: expected one assistant message")
  return conv.messages[0]


__all__ = ["OPEN", "SEP", "CLOSE", "END", "MARKERS", "ROLES", "CHANNELS", "EFFORTS",
           "ToolCall", "ToolSpec", "Options", "Message", "Conversation", "render",
           "render_message", "render_prompt", "reply_prefix", "user_prompt", "parse",
           "parse_reply", "canonical_json", "MARK", "NAME", "TEXT", "message_segments",
           "conversation_segments", "conversation_blocks", "reply_segments",
           "user_conversation"]
