"""The OpenAI-compatible protocol: request bodies → engine requests, engine tokens → responses.

No web framework here (k3jax/serve/server.py serves it); everything is plain data in and out.

Chat (`/v1/chat/completions`). `messages` become a `chat.Conversation` encoded by the one chat
encoder (k3jax/data/chat_tokens.py: content is always ordinary text): roles system (and
"developer"), user, assistant, tool; an assistant's `reasoning_content` is its think channel,
`content` its response channel and `tool_calls` ({"function": {"name", "arguments": JSON
text}}) its tools channel; a `tool` message's content is the tool's result. `tools`
({"type": "function", "function": {name, description, parameters}}) and `reasoning_effort`
(low | high | max) are the conversation's global options. The reply opens in thinking mode
unless `chat_template_kwargs: {"thinking": false}` (or `"thinking": false`) asks for instruct
mode. User content may hold `image_url` parts with `data:` URLs (a multimodal model; at most
`max_images` per request). Generation stops at `[end_of_msg]`; the reply's tokens are parsed
back *as tokens* (`ReplyParser`: a marker is a marker id, never its spelling in text): the think
channel comes back as `reasoning_content`, the response as `content`, the tools channel as
OpenAI `tool_calls` (finish_reason "tool_calls").

Completions (`/v1/completions`): `prompt` is one text (ordinary text, no special tokens) or one
list of token ids.

Sampling: temperature [0, 2] (0: greedy), top_p (0, 1], top_k ≥ 0 (an extension), seed, stop
(≤ 4 strings), max_tokens / max_completion_tokens (default: the context left, at most
`default_max_tokens`), n = 1, logprobs / top_logprobs (≤ the engine's `num_top_logprobs`).
Penalties other than 0 are refused. Every refusal is an `APIError` with an OpenAI-style body
({"error": {"message", "type", "param", "code"}}) and a 4xx status.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import time
from typing import Any, Sequence

from k3jax.data import chat
from k3jax.data.chat_tokens import ChatEncoder
from k3jax.serve.engine import RequestParams

MAX_STOP = 4


class APIError(Exception):
  """An OpenAI-style error: HTTP status and {"error": {message, type, param, code}}."""

  def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
  return APIError(400, message, param=param, code=code)


@dataclasses.dataclass
class Prepared:
  """A validated request, ready for `Engine.submit`."""
  kind: str                          # "chat" | "completion"
  prompt: list[int]
  params: RequestParams
  stream: bool = False
  include_usage: bool = False
  logprobs: bool = False
  top_logprobs: int = 0
  thinking: bool = True
  images: list[bytes] = dataclasses.field(default_factory=list)   # decoded image files
  image_messages: dict = dataclasses.field(default_factory=dict)  # message → its images
  conversation: Any = None
  body: dict | None = None


# ---------------------------------------------------------------------- field readers
def _get(body: dict, name: str, kinds, default=None, *, what: str | None = None):
  v = body.get(name, default)
  if v is None:
    return default
  if isinstance(v, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
    raise _bad(f"'{name}' must be {what or kinds}, found {v!r}", name)
  if not isinstance(v, kinds):
    raise _bad(f"'{name}' must be {what or kinds}, found {type(v).__name__}", name)
  return v


def _number(body, name, default, lo, hi, *, lo_open=False):
  v = _get(body, name, (int, float), default, what="a number")
  if not ((lo < v if lo_open else lo <= v) and v <= hi):
    raise _bad(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], found {v}", name)
  return float(v)


class Protocol:
  """Request parsing and response building for one served model.

  tokenizer / encoder: the model's tokenizer and its `ChatEncoder`; max_len: the context;
  vision: the model's `VisionConfig` or None; stop_ids: ids that always end a completion
  (the tokenizer's EOS).
  """

  def __init__(self, *, model_name: str, tokenizer, encoder: ChatEncoder, max_len: int,
               default_max_tokens: int = 256, max_images: int = 4, num_top: int = 5,
               vision=None, stop_ids: Sequence[int] = (), vocab_size: int):
    self.model_name, self.tokenizer, self.encoder = model_name, tokenizer, encoder
    self.vocab_size = vocab_size
    self.max_len, self.default_max_tokens = max_len, default_max_tokens
    self.max_images, self.num_top, self.vision = max_images, num_top, vision
    self.stop_ids = tuple(int(i) for i in stop_ids)

  # ------------------------------------------------------------------ common
  def check_model(self, body: dict) -> None:
    name = body.get("model")
    if not isinstance(name, str) or not name:
      raise _bad("'model' is required (a string)", "model")
    if name != self.model_name:
      raise APIError(404, f"The model '{name}' does not exist; this server serves "
                     f"'{self.model_name}'", param="model", code="model_not_found")

  def _sampling(self, body: dict, prompt_len: int, stop_ids: Sequence[int]) -> RequestParams:
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
      v = body.get(name)
      if v not in (None, 0, 0.0, 1.0 if name == "repetition_penalty" else 0):
        raise _bad(f"'{name}' is not supported (only the default)", name)
    n = _get(body, "n", int, 1, what="an integer")
    if n != 1:
      raise _bad(f"'n' must be 1 (one choice per request), found {n}", "n")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _get(body, "top_k", int, 0, what="an integer")
    top_k = 0 if top_k == -1 else top_k            # -1: off, as other servers take it
    if top_k < 0:
      raise _bad(f"'top_k' must be >= 0 (0: off), found {top_k}", "top_k")
    seed = _get(body, "seed", int, 0, what="an integer") % (2 ** 32)
    stop = body.get("stop")
    if stop is None:
      stops = ()
    elif isinstance(stop, str):
      stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
      stops = tuple(stop)
    else:
      raise _bad("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP or any(not s for s in stops):
      raise _bad(f"'stop' takes at most {MAX_STOP} non-empty strings, found {list(stops)}",
                 "stop")
    room = self.max_len - prompt_len
    if room < 1:
      raise _bad(f"This model's maximum context length is {self.max_len} tokens; the prompt "
                 f"has {prompt_len}", "messages", "context_length_exceeded")
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is None:
      max_tokens = min(room, self.default_max_tokens)
    else:
      name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
      if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise _bad(f"'{name}' must be an integer >= 1, found {mt!r}", name)
      if mt > room:
        raise _bad(f"This model's maximum context length is {self.max_len} tokens; the prompt "
                   f"has {prompt_len} and '{name}' asks for {mt} more", name,
                   "context_length_exceeded")
      max_tokens = mt
    return RequestParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                         top_p=top_p, seed=seed, stop_tokens=tuple(stop_ids) + self.stop_ids,
                         stop_strings=stops)

  def _stream_and_logprobs(self, body: dict, p: Prepared, chat_style: bool) -> None:
    p.stream = bool(_get(body, "stream", bool, False, what="a boolean"))
    opts = _get(body, "stream_options", dict, {}, what="an object")
    p.include_usage = bool(opts.get("include_usage", False))
    if chat_style:
      p.logprobs = bool(_get(body, "logprobs", bool, False, what="a boolean"))
      top = _get(body, "top_logprobs", int, 0, what="an integer")
      if top and not p.logprobs:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
      top = _get(body, "logprobs", int, None, what="an integer")
      p.logprobs = top is not None
      top = top or 0
    if not 0 <= top <= self.num_top:
      raise _bad(f"top log-probs must be in [0, {self.num_top}], found {top}",
                 "top_logprobs" if chat_style else "logprobs")
    p.top_logprobs = top

  # ------------------------------------------------------------------ /v1/completions
  def completion(self, body: Any) -> Prepared:
    if not isinstance(body, dict):
      raise _bad("The request body must be a JSON object")
    self.check_model(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]
    if isinstance(prompt, str):
      ids = self.encoder.text(prompt)
    elif isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt):
      ids = list(prompt)
    else:
      raise _bad("'prompt' must be one string or one list of token ids", "prompt")
    if not ids:
      raise _bad("'prompt' encodes to zero tokens", "prompt")
    vocab = self.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
      raise _bad(f"'prompt' token ids must be in [0, {vocab})", "prompt")
    if body.get("echo") or body.get("suffix") or (body.get("best_of") or 1) != 1:
      raise _bad("'echo', 'suffix' and 'best_of' are not supported")
    p = Prepared("completion", ids, self._sampling(body, len(ids), ()))
    self._stream_and_logprobs(body, p, chat_style=False)
    return p

  # ------------------------------------------------------------------ /v1/chat/completions
  def chat(self, body: Any) -> Prepared:
    if not isinstance(body, dict):
      raise _bad("The request body must be a JSON object")
    self.check_model(body)
    conv, images, counts = self.conversation(body)
    kwargs = _get(body, "chat_template_kwargs", dict, {}, what="an object")
    thinking = kwargs.get("thinking", body.get("thinking", True))
    if not isinstance(thinking, bool):
      raise _bad(f"'thinking' must be a boolean, found {thinking!r}", "thinking")
    p = Prepared("chat", [], RequestParams(), thinking=thinking, images=images,
                 image_messages=counts, conversation=conv, body=body)
    self._stream_and_logprobs(body, p, chat_style=True)
    return p

  def encode_chat(self, p: Prepared, media_counts: dict | None = None) -> Prepared:
    """The prompt of a prepared chat; media_counts: {message index: [placeholders per image]}
    once the images are preprocessed."""
    try:
      enc = self.encoder.encode(p.conversation, reply="thinking" if p.thinking else "instruct",
                                media=media_counts)
    except ValueError as e:
      raise _bad(str(e), "messages") from None
    p.prompt = enc.ids.tolist()
    p.params = self._sampling(p.body, len(p.prompt), (self.encoder.end_id,))
    return p

  def conversation(self, body: dict):
    """(Conversation, images [bytes], {message index: number of images}) from the body."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
      raise _bad("'messages' must be a non-empty list", "messages")
    out, images, counts = [], [], {}
    for i, m in enumerate(msgs):
      where = f"messages[{i}]"
      if not isinstance(m, dict):
        raise _bad(f"{where} must be an object", where)
      role = m.get("role")
      if role == "developer":
        role = "system"
      if role not in chat.ROLES:
        raise _bad(f"{where}.role must be one of system, developer, user, assistant, tool; "
                   f"found {role!r}", f"{where}.role")
      text, imgs = self._content(m.get("content"), f"{where}.content", role)
      if imgs:
        counts[len(out)] = len(imgs)
        images += imgs
      if role == "assistant":
        think = m.get("reasoning_content")
        if think is not None and not isinstance(think, str):
          raise _bad(f"{where}.reasoning_content must be a string", f"{where}.reasoning_content")
        calls = self._tool_calls(m.get("tool_calls"), where)
        content = text if (m.get("content") is not None or (think is None and calls is None)) \
            else None
        out.append(chat.Message("assistant", content, think, calls))
      else:
        out.append(chat.Message(role, text))
    if len(images) > self.max_images:
      raise _bad(f"Too many images: {len(images)} (at most {self.max_images} per request)",
                 "messages", "too_many_images")
    options = self._options(body)
    return chat.Conversation(tuple(out), options), images, counts

  def _content(self, content, where: str, role: str) -> tuple[str, list[bytes]]:
    if content is None:
      return "", []
    if isinstance(content, str):
      return content, []
    if not isinstance(content, list):
      raise _bad(f"{where} must be a string or a list of parts", where)
    texts, images = [], []
    for j, part in enumerate(content):
      pw = f"{where}[{j}]"
      kind = part.get("type") if isinstance(part, dict) else None
      if kind == "text" and isinstance(part.get("text"), str):
        texts.append(part["text"])
      elif kind == "image_url":
        if role != "user":
          raise _bad(f"{pw}: images are accepted in user messages only", pw)
        if self.vision is None:
          raise _bad(f"{pw}: this model takes no images (a text-only model)", pw,
                     "images_not_supported")
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        images.append(_data_url(url, pw))
      else:
        raise _bad(f"{pw} must be {{'type': 'text', 'text': ...}} or {{'type': 'image_url', "
                   f"'image_url': {{'url': ...}}}}", pw)
    return "".join(texts), images

  def _tool_calls(self, calls, where: str):
    if calls is None:
      return None
    if not isinstance(calls, list):
      raise _bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for j, c in enumerate(calls):
      cw = f"{where}.tool_calls[{j}]"
      fn = c.get("function") if isinstance(c, dict) else None
      if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _bad(f"{cw} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
                   cw)
      args = fn.get("arguments", "{}")
      try:
        args = json.loads(args) if isinstance(args, str) else args
      except json.JSONDecodeError as e:
        raise _bad(f"{cw}.function.arguments is not JSON: {e.msg}", cw) from None
      if not isinstance(args, dict):
        raise _bad(f"{cw}.function.arguments must be a JSON object", cw)
      out.append(chat.ToolCall(fn["name"], args))
    return tuple(out)

  def _options(self, body: dict) -> chat.Options | None:
    tools = _get(body, "tools", list, [], what="a list")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
      raise _bad("'tool_choice' supports 'auto' and 'none'", "tool_choice")
    specs = []
    for j, t in enumerate(tools if choice != "none" else []):
      fn = t.get("function") if isinstance(t, dict) else None
      if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _bad(f"tools[{j}] must be {{'type': 'function', 'function': {{'name', "
                   f"'description', 'parameters'}}}}", f"tools[{j}]")
      try:
        specs.append(chat.ToolSpec(fn["name"], fn.get("description") or "",
                                   fn.get("parameters") or {}))
      except ValueError as e:
        raise _bad(f"tools[{j}]: {e}", f"tools[{j}]") from None
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in chat.EFFORTS:
      raise _bad(f"'reasoning_effort' must be one of {', '.join(chat.EFFORTS)}, found "
                 f"{effort!r}", "reasoning_effort")
    if not specs and effort is None:
      return None
    return chat.Options(tools=tuple(specs), effort=effort)


def _data_url(url, where: str) -> bytes:
  if not isinstance(url, str) or not url.startswith("data:"):
    raise _bad(f"{where}: images must be given inline as 'data:image/...;base64,...' URLs "
               f"(this server fetches nothing)", where, "invalid_image_url")
  head, _, data = url.partition(",")
  if not head.endswith(";base64"):
    raise _bad(f"{where}: the data URL must be base64-encoded", where, "invalid_image_url")
  try:
    return base64.b64decode(data, validate=True)
  except (binascii.Error, ValueError):
    raise _bad(f"{where}: the data URL's base64 does not decode", where,
               "invalid_image_url") from None


# ---------------------------------------------------------------------- reply parsing
class TextStream:
  """Incremental text of a growing list of token ids: `push` returns what can be shown now —
  a multi-byte character split across tokens is held back until it is whole, and with stop
  strings the last characters that could begin one are held back. `final` cuts at the first
  stop string."""

  def __init__(self, decode, stops: Sequence[str] = ()):
    self.decode, self.stops = decode, tuple(stops)
    self.ids: list[int] = []
    self.sent = 0
    self.stopped = False

  def text(self) -> str:
    t = self.decode(self.ids)
    cut = min((i for i in (t.find(s) for s in self.stops) if i >= 0), default=None)
    if cut is not None:
      self.stopped = True
      return t[:cut]
    return t

  def push(self, ids: Sequence[int]) -> str:
    self.ids += list(ids)
    t = self.text()
    stable = len(t)
    while stable > self.sent and t[stable - 1] == "\ufffd":
      stable -= 1
    if self.stops and not self.stopped:
      hold = max(len(s) for s in self.stops) - 1
      stable = min(stable, len(t) - hold)
    if stable <= self.sent:
      return ""
    out, self.sent = t[self.sent:stable], stable
    return out

  def final(self) -> str:
    t = self.text()
    out, self.sent = t[self.sent:], len(t)
    return out


class ReplyParser:
  """An assistant reply, token by token, into its channels (the module doc's rules).

  marker_ids: {marker: id}; thinking: the reply opened in the think channel (else response).
  `feed(ids)` → deltas [{"reasoning_content": s} | {"content": s}]; `finish()` → the last
  deltas and the reply as (think, content, tool_calls [chat.ToolCall] or None). A tools
  channel whose text is not a JSON list of {"name", "arguments"} comes back as content."""

  def __init__(self, decode, marker_ids: dict, thinking: bool, stops: Sequence[str] = ()):
    self.decode = decode
    self.ids = {v: k for k, v in marker_ids.items()}
    self.channel = "think" if thinking else "response"
    self.state = "body"
    self.header: list[int] = []
    self.streams = {"think": TextStream(decode, stops), "response": TextStream(decode, stops)}
    self.tools: list[int] = []
    self.seen = {self.channel}

  def _route(self, ch: str, tok: int, deltas: list) -> None:
    if ch == "tools":
      self.tools.append(tok)
      return
    s = self.streams[ch].push([tok])
    if s:
      deltas.append({"reasoning_content" if ch == "think" else "content": s})

  def feed(self, ids: Sequence[int]) -> list[dict]:
    deltas: list[dict] = []
    for tok in ids:
      tok = int(tok)
      marker = self.ids.get(tok)
      if self.state == "body":
        if marker == chat.CLOSE:
          self.state = "between"
        elif marker == chat.OPEN:
          self.state, self.header = "header", []
        elif marker in (chat.END, chat.SEP):
          continue
        else:
          self._route(self.channel, tok, deltas)
      elif self.state == "between":
        if marker == chat.OPEN:
          self.state, self.header = "header", []
        elif marker is None:               # text outside a channel: the response's
          self._route("response", tok, deltas)
      else:                                # header
        if marker == chat.SEP:
          name = self.decode(self.header)
          self.channel = name if name in chat.CHANNELS else "response"
          self.seen.add(self.channel)
          self.state = "body"
        elif marker is None:
          self.header.append(tok)
    return deltas

  def finish(self):
    deltas = []
    for ch, key in (("think", "reasoning_content"), ("response", "content")):
      s = self.streams[ch].final()
      if s:
        deltas.append({key: s})
    think = self.streams["think"].text() if "think" in self.seen else None
    resp = self.streams["response"]
    content = resp.text() if ("response" in self.seen or resp.ids) else None
    calls = None
    if self.tools:
      text = self.decode(self.tools)
      try:
        raw = json.loads(text)
        if not isinstance(raw, list) or not all(
            isinstance(c, dict) and set(c) == {"name", "arguments"} for c in raw):
          raise ValueError
        calls = [chat.ToolCall(c["name"], c["arguments"]) for c in raw]
      except (ValueError, TypeError):
        content = (content or "") + text     # not a tool call: the model's text
        deltas.append({"content": text})
    return deltas, (think, content, calls)


# ---------------------------------------------------------------------- responses
def tool_calls_json(calls: Sequence[chat.ToolCall], rid: str) -> list[dict]:
  return [{"id": f"call_{rid}_{j}", "type": "function",
           "function": {"name": c.name, "arguments": chat.canonical_json(c.arguments)}}
          for j, c in enumerate(calls)]


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens,
          "prompt_tokens_details": {"cached_tokens": cached}}


def chat_logprobs(tokenizer, tokens, logprobs, tops, top_n: int) -> list[dict]:
  """Chat `logprobs.content` entries."""
  def entry(t, lp):
    s = tokenizer.decode([t], specials=True)
    return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
  return [{**entry(t, lp), "top_logprobs": [entry(i, l) for i, l in top[:top_n]]}
          for t, lp, top in zip(tokens, logprobs, tops)]


def now() -> int:
  return int(time.time())


__all__ = ["APIError", "Prepared", "Protocol", "ReplyParser", "TextStream", "tool_calls_json",
           "usage", "chat_logprobs"]
