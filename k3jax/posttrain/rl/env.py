"""The tool environment and multi-turn agentic rollouts through the serving engine (K3 §13).

A trajectory is one token list: the task's prompt (global options with the python tool and
the effort, the user's question, the assistant's thinking opening), then turns. A turn: the
engine generates the assistant's reply (`Engine.submit` with the whole conversation so far;
its prefix cache holds the KDA checkpoint and MLA pages at every earlier turn boundary, so
only the tokens after the previous prompt's last boundary are prefilled); the environment
(`ToolEnv.after_reply`) reads it:

  * a reply cut at the turn's token cap is closed by the environment (`[close]` /
    `[end_of_msg]` as needed, not the policy's tokens) and told so in a tool message;
  * tool calls (the `tools` channel): each `python` call's `code` runs in the sandbox
    (k3jax/posttrain/rl/sandbox.py); its output or error, or an error for an unknown tool or
    bad arguments, or for a reply that does not parse, comes back as a `role: "tool"`
    message, then the next assistant opening — the next turn;
  * no tool call: the response channel is the final answer and the trajectory ends
    ("answer"); it also ends at `max_turns` replies ("turn_limit") or when the next turn would
    pass `max_tokens` tokens in all ("token_limit").

Only the policy's own tokens carry loss: `policy[j]` marks the tokens the engine sampled
(each reply, its `[end_of_msg]` included); the prompt, tool messages, closings and openings
are the environment's. `logprobs[j]` holds the engine's fp32 log-prob of each sampled token,
log_softmax(logits)[y] of the model's own distribution — the temperature-1 sampling
distribution, which is what RL samples from, so they equal the trainer's
(`logprobs.token_logprobs`) on the same sequence.

Media (the visual tool task, k3jax/data/visual_tasks.py): `ToolEnv(tools=("crop",),
vision_config=…, media_id=…)`. A trajectory's `images` are the images of its placeholders in
order (the task's prompt images first); a `crop` call {"cell": "B3"} answers with a tool
message whose media block is that cell of the task's full image (`[open]tool[sep]` the
crop's placeholders, then "cell B3"); the image joins `images` when the message joins the
tokens. Every request carries the trajectory's images as one media stream of
`media_length` patches (`media`), with a digest per placeholder as its prefix-cache key, so a
later turn resumes from the cache like a text one. `withheld` tools are answered with a tool
error ("error: the crop tool is unavailable"): the figure's tool-withheld condition;
`withheld="all"` answers every call `TOOL_UNAVAILABLE`.

Effort (the report's T(y)): `effort_tokens` = thinking tokens (text in `think` channels),
plus, for agentic tasks, the tokens of every tool call's arguments (their canonical JSON).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import numpy as np

from k3jax.data import chat
from k3jax.data.chat_tokens import ChatEncoder
from k3jax.data.tokenizers import ByteTokenizer
from k3jax.posttrain.rl import sandbox
from k3jax.serve.engine import Engine, RequestParams

FINISHES = ("answer", "turn_limit", "token_limit", "media_token")
TOOLS = ("python", "crop")
TOOL_UNAVAILABLE = "error: tool unavailable"   # every call's answer when no tool is available


@dataclasses.dataclass
class Turn:
  """One reply: where its request's prompt ended, the prefix-cache hit the engine reported
  (tokens not recomputed), the reply's tokens and why the engine stopped."""
  prompt_len: int
  cached: int
  reply: list[int]
  finish_reason: str


@dataclasses.dataclass
class Trajectory:
  """tokens: prompt + everything after; policy / logprobs: per token after prompt_len."""
  task: object
  tokens: list[int]
  prompt_len: int
  policy: list[bool] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  turns: list[Turn] = dataclasses.field(default_factory=list)
  results: list[sandbox.Result] = dataclasses.field(default_factory=list)
  finish: str | None = None
  response: str | None = None
  thinking_tokens: int = 0
  argument_tokens: int = 0
  images: list = dataclasses.field(default_factory=list)   # of the placeholders, in order
  tool_calls: int = 0                                      # calls made (any tool)

  def append(self, ids: Sequence[int], policy: bool, logprobs: Sequence[float] = ()):
    ids = [int(i) for i in ids]
    self.tokens += ids
    self.policy += [policy] * len(ids)
    self.logprobs += list(logprobs) if policy else [0.0] * len(ids)

  def effort_tokens(self, agentic: bool = True) -> int:
    """T(y): thinking tokens, + tool-call argument tokens for agentic tasks (module doc)."""
    return self.thinking_tokens + (self.argument_tokens if agentic else 0)


@dataclasses.dataclass(frozen=True)
class ReplyTokens:
  """A reply read at the token level: the message (None when it does not parse; `error`
  says why), its text tokens per channel, and the closing tokens a cut reply needs."""
  message: chat.Message | None
  error: str | None
  channel_tokens: dict
  closing: tuple[int, ...]


class ToolEnv:
  """The environment (module doc). limits: the sandbox's; max_turns: replies per trajectory;
  max_tokens: tokens per trajectory (prompt included; at most the engine's max_len);
  max_reply_tokens: one reply's cap; tool_chars: a tool message's longest text.
  tools: the tools offered (`TOOLS`); withheld: offered tools answered "error: the <name> tool
  is unavailable", or "all": every call, well formed or not, whatever its name, is answered
  `TOOL_UNAVAILABLE` and nothing runs (the "without the tool" arm of an evaluation; the
  prompt still declares the tools); vision_config,
  media_id, media_length: a multimodal policy's tower, placeholder id and stream length
  (needed by `crop`)."""

  def __init__(self, *, limits: sandbox.Limits = sandbox.Limits(), max_turns: int = 4,
               max_tokens: int = 512, max_reply_tokens: int = 128, tool_chars: int = 400,
               tokenizer=None, tools: Sequence[str] = ("python",),
               withheld: Sequence[str] | str = (), vision_config=None,
               media_id: int | None = None, media_length: int | None = None):
    if max_turns < 1 or max_tokens < 1 or max_reply_tokens < 1:
      raise ValueError("ToolEnv: max_turns, max_tokens and max_reply_tokens must be >= 1")
    every = isinstance(withheld, str)
    if every and withheld != "all":
      raise ValueError(f"ToolEnv.withheld: tool names or 'all', found {withheld!r}")
    withheld = () if every else tuple(withheld)
    bad = [t for t in tuple(tools) + withheld if t not in TOOLS]
    if bad or not tools:
      raise ValueError(f"ToolEnv.tools / withheld: names from {TOOLS}, found {bad or tools}")
    if "crop" in tools and (vision_config is None or media_id is None):
      raise ValueError("ToolEnv(tools=('crop',)): needs vision_config and media_id (a "
                       "multimodal model's tower and placeholder id)")
    self.limits, self.max_turns, self.max_tokens = limits, max_turns, max_tokens
    self.max_reply_tokens, self.tool_chars = max_reply_tokens, tool_chars
    self.tools = tuple(tools)
    self.withheld = tuple(tools) if every else withheld
    self.all_withheld = every
    self.vision_config, self.media_id = vision_config, media_id
    self.media_length = media_length or (vision_config.pack_buckets[0] if vision_config
                                         else None)
    self.tokenizer = tokenizer or ByteTokenizer()
    self.encoder = ChatEncoder(self.tokenizer, media_id=media_id)
    self.ids = self.encoder.marker_ids
    self.names = {v: k for k, v in self.ids.items()}
    self.opening = self.encoder.reply_opening("thinking")

  # ---------------------------------------------------------------- reading a reply
  def read_reply(self, reply: Sequence[int]) -> ReplyTokens:
    """The reply (tokens after the thinking opening) at the token level."""
    end = self.ids[chat.END]
    parts, run, channel, counts = [], [], "think", {}
    state = "text"                     # text | between | header
    header: list[int] = []
    for t in reply:
      t = int(t)
      if t in self.names:
        if run:
          parts.append(self.tokenizer.decode(run))
          run = []
        parts.append(self.names[t])
        m = self.names[t]
        if m == chat.OPEN:
          state, header = "header", []
        elif m == chat.SEP:
          channel = self.tokenizer.decode(header) if state == "header" else channel
          state = "text"
        elif m == chat.CLOSE:
          state = "between"
        elif m == chat.END:
          break
        continue
      run.append(t)
      if state == "header":
        header.append(t)
      elif state == "text":
        counts[channel] = counts.get(channel, 0) + 1
    if run:
      parts.append(self.tokenizer.decode(run))
    closing = ()
    if not reply or int(reply[-1]) != end:
      closing = {"text": (self.ids[chat.CLOSE], end), "between": (end,),
                 "header": (self.ids[chat.SEP], self.ids[chat.CLOSE], end)}[state]
      parts += [self.names[c] for c in closing]
    text = "".join(parts)
    for i, p in enumerate(parts):
      if p not in chat.MARKERS and any(m in p for m in chat.MARKERS):
        return ReplyTokens(None, "a marker spelled inside text", counts, closing)
    try:
      return ReplyTokens(chat.parse_reply(text, thinking=True), None, counts, closing)
    except ValueError as e:
      return ReplyTokens(None, str(e), counts, closing)

  # ---------------------------------------------------------------- the environment's turn
  def _tool_message(self, text: str, images: Sequence = ()) -> list[int]:
    counts = self.media_pixels(images)[2] if images else ()
    return self.encoder.segments(chat.message_segments(chat.Message("tool", text)), counts)

  def media_pixels(self, images: Sequence):
    """(pixel_values, grid [n, 3], merged tokens per image) of images, by the tower's
    preprocessing (k3jax/data/sft.py `media_pixels`)."""
    from k3jax.data.sft import media_pixels
    return media_pixels(self.vision_config, images)

  def media(self, traj: Trajectory):
    """(Media of one stream of `media_length` patches, a key per placeholder) of the
    trajectory's images; (None, None) without images."""
    if not traj.images:
      return None, None
    from k3jax.vision.media import media_from_pixels
    pv, grid, merged = self.media_pixels(traj.images)
    keys = []
    for im, n in zip(traj.images, merged):
      digest = hashlib.blake2b(np.ascontiguousarray(im).tobytes(), digest_size=8).digest()
      keys += [int.from_bytes(digest, "little", signed=True)] * n
    return media_from_pixels(self.vision_config, pv, grid, length=self.media_length), keys

  def batch_media(self, trajs: Sequence[Trajectory]):
    """The training rows' media: stream b = trajectory b's images (an empty stream when it
    has none), all of `media_length` patches."""
    from k3jax.data.captions import empty_stream
    from k3jax.vision.media import stack_media
    return stack_media([self.media(t)[0] if t.images else
                        empty_stream(self.vision_config, self.media_length) for t in trajs])

  def run_tool(self, call: chat.ToolCall, traj: Trajectory | None = None
               ) -> tuple[str, tuple]:
    """One tool call's (result text, images) (errors as text: the policy reads them).
    `withheld="all"`: no tool at all, every call (whatever its name) is answered
    TOOL_UNAVAILABLE; named `withheld` tools answer that they are unavailable."""
    if self.all_withheld:
      return TOOL_UNAVAILABLE, ()
    if call.name not in self.tools:
      return (f"error: unknown tool {call.name!r} (available: {', '.join(self.tools)})", ())
    if call.name in self.withheld:
      return f"error: the {call.name} tool is unavailable", ()
    if call.name == "crop":
      from k3jax.data import visual_tasks
      image = getattr(getattr(traj, "task", None), "image", None)
      if image is None:
        return "error: crop: this task has no image to crop", ()
      try:
        if set(call.arguments) != {"cell"}:
          raise ValueError('crop takes {"cell": "<A1-D4>"}')
        cell = call.arguments["cell"]
        out = visual_tasks.crop(image, cell)
      except ValueError as e:
        return f"error: {e}", ()
      return visual_tasks.tool_text(cell), (out,)
    return self.run_call(call, traj), ()

  def run_call(self, call: chat.ToolCall, traj: Trajectory | None = None) -> str:
    """One python call's result text (errors as text: the policy reads them)."""
    if self.all_withheld:
      return TOOL_UNAVAILABLE
    if call.name != "python" or "python" not in self.tools:
      return self.run_tool(call, traj)[0]
    code = call.arguments.get("code")
    if set(call.arguments) != {"code"} or not isinstance(code, str):
      return 'error: python takes {"code": "<python source>"}'
    result = sandbox.run_python(code, self.limits)
    if traj is not None:
      traj.results.append(result)
    return result.tool_text(self.tool_chars)

  def after_reply(self, traj: Trajectory, reply: Sequence[int], logprobs: Sequence[float],
                  finish_reason: str, cached: int, prompt_len: int) -> list[int] | None:
    """Record a reply and act on it (module doc): the next request's prompt, or None when
    the trajectory has ended (`traj.finish` set)."""
    if self.media_id is not None and self.media_id in reply:
      # A sampled media placeholder has no image behind it: the reply is kept up to it (each
      # kept token's log-prob is still its own) and the trajectory ends (module doc).
      cut = list(reply).index(self.media_id)
      traj.turns.append(Turn(prompt_len, cached, list(reply[:cut]), finish_reason))
      traj.append(reply[:cut], True, logprobs[:cut])
      return self._end(traj, "media_token")
    traj.turns.append(Turn(prompt_len, cached, list(reply), finish_reason))
    traj.append(reply, True, logprobs)
    read = self.read_reply(reply)
    traj.thinking_tokens += read.channel_tokens.get("think", 0)
    traj.append(read.closing, False)
    msg = read.message
    notes = []
    if read.closing:
      notes.append((f"error: the reply was cut at {len(reply)} tokens", ()))
    elif msg is None:
      notes.append((f"error: the reply does not parse: {read.error}", ()))
    elif not msg.tool_calls:
      traj.response = msg.content
      return self._end(traj, "answer")
    if msg is not None and msg.tool_calls:
      for call in msg.tool_calls:
        traj.tool_calls += 1
        traj.argument_tokens += len(self.encoder.text(chat.canonical_json(call.arguments)))
        notes.append(self.run_tool(call, traj))
    if len(traj.turns) >= self.max_turns:
      return self._end(traj, "turn_limit")
    more = [i for text, ims in notes for i in self._tool_message(text, ims)] + list(
        self.opening)
    if len(traj.tokens) + len(more) + 1 > self.max_tokens:
      return self._end(traj, "token_limit")
    traj.append(more, False)
    traj.images += [im for _, ims in notes for im in ims]
    return list(traj.tokens)

  @staticmethod
  def _end(traj: Trajectory, finish: str) -> None:
    """End a trajectory: the environment's tokens after the policy's last one dropped (they
    carry no loss and nothing follows them)."""
    traj.finish = finish
    n = len(traj.policy)
    while n and not traj.policy[n - 1]:
      n -= 1
    del traj.policy[n:], traj.logprobs[n:], traj.tokens[traj.prompt_len + n:]
    return None

  def reply_cap(self, traj: Trajectory) -> int:
    return min(self.max_reply_tokens, self.max_tokens - len(traj.tokens))


def rollout(engine: Engine, tasks: Sequence, env: ToolEnv, *, temperature: float = 1.0,
            seed: int = 0) -> list[Trajectory]:
  """Run every task to its end through the engine (module doc): all trajectories' turns are
  in flight together; each finished reply is handed to the environment and the next turn
  submitted at once. Request seeds are fixed by (seed, trajectory, turn)."""
  end = env.ids[chat.END]
  if engine.ec.max_len < env.max_tokens:
    raise ValueError(f"env.max_tokens={env.max_tokens} exceeds the engine's max_len="
                     f"{engine.ec.max_len}")
  trajs = [Trajectory(t, list(t.tokens), len(t.tokens), images=list(getattr(t, "images", ())))
           for t in tasks]
  active: dict[str, tuple[int, int]] = {}

  def submit(i: int):
    traj = trajs[i]
    cap = env.reply_cap(traj)
    if cap < 1:
      env._end(traj, "token_limit")
      return
    s = (seed * 1_000_003 + i * 7919 + len(traj.turns) * 104_729) % 2 ** 32
    params = RequestParams(max_tokens=cap, temperature=temperature, seed=s, stop_tokens=(end,),
                           include_stop=True)
    media, keys = env.media(traj)
    active[engine.submit(traj.tokens, params, media=media, media_keys=keys)] = (
        i, len(traj.tokens))

  for i in range(len(trajs)):
    submit(i)
  while active:
    engine.step()
    for rid, (i, plen) in list(active.items()):
      req = engine.requests[rid]
      if not req.done:
        continue
      engine.pop(rid)
      del active[rid]
      if req.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"rollout: request {rid} ended with {req.finish_reason}: "
                           f"{req.error}")
      if env.after_reply(trajs[i], req.tokens, req.logprobs, req.finish_reason,
                         req.cached_tokens, plen) is not None:
        submit(i)
  return trajs


def training_rows(trajs: Sequence[Trajectory], width: int, resp_width: int):
  """(seqs [B,width], prompt_lens [B], mask [B,resp_width], behaviour_lp [B,resp_width]) for
  the RL step (k3jax/posttrain/rl/update.py): mask = the policy's own tokens. Every row needs
  prompt_len + resp_width <= width (the trainer reads resp_width tokens after the prompt)."""
  b = len(trajs)
  seqs = np.zeros((b, width), np.int32)
  plens = np.zeros(b, np.int32)
  mask = np.zeros((b, resp_width), np.float32)
  blp = np.zeros((b, resp_width), np.float32)
  for i, t in enumerate(trajs):
    n = len(t.tokens) - t.prompt_len
    if t.prompt_len + resp_width > width or n > resp_width:
      raise ValueError(f"trajectory {i}: {len(t.tokens)} tokens ({n} after the prompt) "
                       f"exceed width={width} / resp_width={resp_width}")
    seqs[i, :len(t.tokens)] = t.tokens
    plens[i] = t.prompt_len
    mask[i, :n] = t.policy
    blp[i, :n] = t.logprobs
  return seqs, plens, mask, blp


__all__ = ["FINISHES", "TOOLS", "TOOL_UNAVAILABLE", "ToolEnv", "Trajectory", "Turn", "ReplyTokens",
           "rollout", "training_rows"]
