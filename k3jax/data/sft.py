"""Supervised fine-tuning data: chat conversations → packed [B, T] rows with an assistant mask.

JSONL schema (one conversation per line; blank lines are skipped):

    {"messages": [MESSAGE, ...], "options": OPTIONS}          "options" optional

    MESSAGE = {"role": "system" | "user" | "tool", "content": STRING}
            | {"role": "assistant", "think": STRING, "response": STRING,
               "tool_calls": [{"name": STRING, "arguments": OBJECT}, ...]}
    OPTIONS = {"effort": "low" | "high" | "max", "tools": [{"name", "description",
               "parameters"}, ...]}                          (k3jax.data.chat.Options, both optional)

It maps one to one onto `k3jax.data.chat.Conversation(messages, options)`: an assistant's `think`,
`response` and `tool_calls` are `Message.think`, `.content` and `.tool_calls` (an absent key is
an absent channel, "" a present empty one; `content` is accepted for `response`, not both);
at least one channel. Every conversation needs an assistant message (it is what is trained).
One-shot `turn_options` are refused: in the chat format they follow the whole history, i.e.
they would come after the reply they are meant for. `read_jsonl` raises ValueError
"FILE:LINE: messages[2].tool_calls[0].arguments: expected an object, found list" for a line
that is not JSON, an unknown or missing key, a wrong type, an unknown role, a marker inside
a text, or a conversation with no assistant message.

Tokens (byte tokenizer, k3jax/data/corpus.py): a conversation is `[BOS]` followed by its
blocks as the one chat encoder writes them (`k3jax/data/chat_tokens.py`): the four XTML markers
from the structure as their single ids (261–264), every text as its UTF-8 bytes (a special
name such as `<bos>` typed inside a text stays bytes) — the prompt layout of `generate --chat`
and of the server, which use the same encoder.

Loss mask. A token is an *assistant token* iff it lies inside an assistant message after the
header, i.e. from the token following `[open]assistant[sep]` through that message's
`[end_of_msg]` inclusive (its channel markers and names, its texts and the tools JSON). Nothing
else is trained: BOS, options, system / user / tool messages and every
`[open]assistant[sep]` header (generation is given the header). Row position t predicts token
t+1, so `loss_mask[t] = assistant(token t+1)`; the MTP head predicts t+2:
`mtp_mask[t] = assistant(token t+2)` (an assistant token is preceded by its three-token header
at least, so both targets lie in the conversation of position t).

Packing. A row holds `seq_len + 1` tokens (inputs are the first seq_len, targets the last
seq_len). Conversations are shuffled by the seed, then placed whole, first fit among the last
`OPEN_ROWS` rows still open (a new row when none has room). A conversation longer than a row is
left out and counted (`Packed.too_long`, logged as a warning; never truncated). Row arrays
(`[R, seq_len + 2]` with a PAD column for the MTP targets): the k-th conversation of a row has
`segment_ids` k + 1, the padding after them its own id (the model's attention and KDA state
never cross a segment), PAD tokens and a zero mask.

Batches. Step s takes rows s·B … s·B + B − 1 of an endless sequence of epochs, epoch e being
the rows in the order `default_rng([seed, 1, e]).permutation(R)`: a batch is a pure function
of (data, seed, step), so the iterator state is the step (plus a fingerprint of the packed
rows, checked on resume) and a resumed run sees the very same batches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any, Sequence

import numpy as np

from k3jax.data import chat
from k3jax.data.chat_tokens import ChatEncoder
from k3jax.data import corpus, sft_tasks
from k3jax.data import tokenizers

log = logging.getLogger("k3jax.train")

# The one chat encoder (k3jax/data/chat_tokens.py) over the byte tokenizer: markers from the
# structure, every text as bytes.
_ENCODER = ChatEncoder(tokenizers.ByteTokenizer())
OPEN_ROWS = 8          # first fit looks back over this many open rows (linear time)
_ASSISTANT = np.frombuffer(b"assistant", np.uint8).astype(np.int32)


# ---------------------------------------------------------------------- schema
_MESSAGE_KEYS = {"system": {"role", "content"}, "user": {"role", "content"},
                 "tool": {"role", "content"},
                 "assistant": {"role", "think", "response", "content", "tool_calls"}}


def _type(v) -> str:
  return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null",
          int: "number", float: "number"}.get(type(v), type(v).__name__)


def _need(cond: bool, field: str, msg: str) -> None:
  if not cond:
    raise ValueError(f"{field}: {msg}")


def _message(m: Any, field: str) -> chat.Message:
  _need(isinstance(m, dict), field, f"expected an object, found {_type(m)}")
  role = m.get("role")
  _need("role" in m, field, "missing key 'role'")
  _need(isinstance(role, str) and role in _MESSAGE_KEYS, f"{field}.role",
        f"expected one of {', '.join(chat.ROLES)}, found {role!r}")
  unknown = sorted(set(m) - _MESSAGE_KEYS[role])
  _need(not unknown, field, f"unknown key(s) {unknown} for a {role} message (allowed: "
        f"{', '.join(sorted(_MESSAGE_KEYS[role]))})")
  if role != "assistant":
    _need("content" in m, field, f"missing key 'content' (a {role} message's text)")
    _need(isinstance(m["content"], str), f"{field}.content",
          f"expected a string, found {_type(m['content'])}")
    msg = chat.Message(role, m["content"])
  else:
    _need(not ("content" in m and "response" in m), field,
          "both 'content' and 'response' given (they are the same channel)")
    response = m.get("response", m.get("content"))
    rkey = "response" if "response" in m else "content"
    _need(response is None or isinstance(response, str), f"{field}.{rkey}",
          f"expected a string, found {_type(response)}")
    think = m.get("think")
    _need(think is None or isinstance(think, str), f"{field}.think",
          f"expected a string, found {_type(think)}")
    calls = m.get("tool_calls")
    if calls is not None:
      _need(isinstance(calls, list), f"{field}.tool_calls",
            f"expected a list, found {_type(calls)}")
      parsed = []
      for j, c in enumerate(calls):
        cf = f"{field}.tool_calls[{j}]"
        _need(isinstance(c, dict), cf, f"expected an object, found {_type(c)}")
        _need(set(c) <= {"name", "arguments"} and "name" in c, cf,
              f"expected keys 'name' and 'arguments', found {sorted(c)}")
        _need(isinstance(c["name"], str) and c["name"], f"{cf}.name",
              f"expected a non-empty string, found {c['name']!r}")
        args = c.get("arguments", {})
        _need(isinstance(args, dict), f"{cf}.arguments", f"expected an object, found "
              f"{_type(args)}")
        try:
          parsed.append(chat.ToolCall(c["name"], args))
        except ValueError as e:
          raise ValueError(f"{cf}.arguments: {e}") from None
      calls = tuple(parsed)
    _need(not (think is None and response is None and calls is None), field,
          "an assistant message needs at least one of 'think', 'response', 'tool_calls'")
    msg = chat.Message("assistant", response, think, calls)
  chat.render_message(msg, field)         # a marker inside a text: named by field and offset
  return msg


def conversation_from_json(obj: Any) -> chat.Conversation:
  """One decoded JSONL object → Conversation (module doc); ValueError "field: problem"."""
  _need(isinstance(obj, dict), "line", f"expected a JSON object, found {_type(obj)}")
  _need("turn_options" not in obj, "turn_options",
        "not supported in SFT data (one-shot options follow the whole history in the chat "
        "format, i.e. after the reply they are for); put them in 'options'")
  unknown = sorted(set(obj) - {"messages", "options"})
  _need(not unknown, "line", f"unknown key(s) {unknown} (allowed: messages, options)")
  _need("messages" in obj, "line", "missing key 'messages'")
  msgs = obj["messages"]
  _need(isinstance(msgs, list) and msgs, "messages",
        f"expected a non-empty list, found {_type(msgs) if not isinstance(msgs, list) else '[]'}")
  messages = tuple(_message(m, f"messages[{i}]") for i, m in enumerate(msgs))
  _need(any(m.role == "assistant" for m in messages), "messages",
        "no assistant message (nothing to train on)")
  options = None
  if "options" in obj:
    _need(isinstance(obj["options"], dict), "options",
          f"expected an object, found {_type(obj['options'])}")
    try:
      options = chat.Options.from_json(json.dumps(obj["options"]))
      chat.render(chat.Conversation((), options))
    except ValueError as e:
      raise ValueError(f"options: {e}") from None
  return chat.Conversation(messages, options)


def conversation_to_json(conv: chat.Conversation) -> dict:
  """The inverse of `conversation_from_json` (what one JSONL line holds)."""
  if conv.turn_options is not None:
    raise ValueError("turn_options: not representable in SFT data (module doc)")
  out: dict[str, Any] = {"messages": []}
  for m in conv.messages:
    if m.role != "assistant":
      out["messages"].append({"role": m.role, "content": m.content})
      continue
    d: dict[str, Any] = {"role": "assistant"}
    if m.think is not None:
      d["think"] = m.think
    if m.content is not None:
      d["response"] = m.content
    if m.tool_calls is not None:
      d["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in m.tool_calls]
    out["messages"].append(d)
  if conv.options is not None:
    out["options"] = json.loads(conv.options.to_json())
  return out


def read_jsonl(path: str) -> list[chat.Conversation]:
  """Every conversation of a JSONL file; ValueError "PATH:LINE: field: problem"."""
  convs = []
  try:
    f = open(path, "rb")
  except OSError as e:
    raise ValueError(f"data.sft_file: cannot read {path!r} ({e.strerror})") from None
  with f:
    for n, raw in enumerate(f, start=1):
      if not raw.strip():
        continue
      try:
        obj = json.loads(raw)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
      try:
        convs.append(conversation_from_json(obj))
      except ValueError as e:
        raise ValueError(f"{path}:{n}: {e}") from None
  if not convs:
    raise ValueError(f"data.sft_file: {path!r} holds no conversation")
  return convs


def write_jsonl(path: str, convs: Sequence[chat.Conversation]) -> None:
  """Conversations → JSONL (a temporary file renamed when complete)."""
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    for c in convs:
      f.write(json.dumps(conversation_to_json(c), ensure_ascii=False) + "\n")
  os.replace(tmp, path)


# ---------------------------------------------------------------------- tokens and mask
def assistant_mask(tokens: np.ndarray) -> np.ndarray:
  """[n] bool: the assistant tokens of a tokenized conversation (module doc's rule).

  A message starts at a `[open]` that is the first token or follows `[end_of_msg]`; when its
  header is `[open]assistant[sep]`, everything after that `[sep]` through the next
  `[end_of_msg]` is an assistant token."""
  tokens = np.asarray(tokens)
  mask = np.zeros(len(tokens), bool)
  n_head = len(_ASSISTANT) + 2
  i, start_of_msg = 0, True
  while i < len(tokens):
    tok = int(tokens[i])
    if start_of_msg and tok == tokenizers.CHAT_OPEN and i + n_head <= len(tokens) and (
        int(tokens[i + n_head - 1]) == tokenizers.CHAT_SEP
        and np.array_equal(tokens[i + 1:i + n_head - 1], _ASSISTANT)):
      ends = np.nonzero(tokens[i + n_head:] == tokenizers.CHAT_END)[0]
      stop = i + n_head + (int(ends[0]) + 1 if len(ends) else len(tokens) - i - n_head)
      mask[i + n_head:stop] = True
      i, start_of_msg = stop, True
      continue
    start_of_msg = tok == tokenizers.CHAT_END or tok == tokenizers.BOS
    i += 1
  return mask


def tokenize(conv: chat.Conversation) -> tuple[np.ndarray, np.ndarray]:
  """Conversation → (ids [n] int32 = [BOS] + render with marker ids, assistant mask [n] bool)."""
  ids = _ENCODER.encode(conv).ids
  return ids, assistant_mask(ids)


# ---------------------------------------------------------------------- packing
@dataclasses.dataclass(frozen=True)
class Packed:
  """Rows of whole conversations (module doc). Arrays are [R, seq_len + 2]."""
  tokens: np.ndarray          # int32, PAD after the conversations
  assistant: np.ndarray       # bool: assistant token (module doc)
  segment_ids: np.ndarray     # int32: 1, 2, … per conversation, then the padding's own id
  seq_len: int
  num_conversations: int      # packed
  too_long: int               # left out: longer than seq_len + 1 tokens
  longest: int                # tokens of the longest conversation seen (packed or not)

  @property
  def num_rows(self) -> int:
    return len(self.tokens)

  def fill(self) -> float:
    """Fraction of the rows' seq_len + 1 slots holding conversation tokens."""
    used = int((self.tokens[:, :self.seq_len + 1] != tokenizers.PAD).sum())
    return used / max(1, self.num_rows * (self.seq_len + 1))

  def summary(self) -> dict:
    return {"conversations": self.num_conversations, "too_long": self.too_long,
            "rows": self.num_rows, "fill": round(self.fill(), 4), "longest": self.longest,
            "assistant_tokens": int(self.assistant.sum())}

  def fingerprint(self) -> dict:
    h = hashlib.md5()
    for a in (self.tokens, self.assistant, self.segment_ids):
      h.update(np.ascontiguousarray(a).tobytes())
    return {"source": "sft", "rows": self.num_rows, "seq_len": self.seq_len,
            "md5": h.hexdigest()}


def pack(examples: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int,
         seed: int | None = 0) -> Packed:
  """(ids, mask) pairs → `Packed` rows (module doc). `seed=None` keeps the given order."""
  if seq_len < 2:
    raise ValueError(f"train.seq_len: expected >= 2, found {seq_len}")
  cap = seq_len + 1
  order = (np.arange(len(examples)) if seed is None else
           np.random.default_rng([seed, 0]).permutation(len(examples)))
  rows: list[list[int]] = []
  used: list[int] = []
  too_long = longest = 0
  for i in order.tolist():
    n = len(examples[i][0])
    longest = max(longest, n)
    if n > cap:
      too_long += 1
      continue
    for r in range(max(0, len(rows) - OPEN_ROWS), len(rows)):
      if used[r] + n <= cap:
        rows[r].append(i)
        used[r] += n
        break
    else:
      rows.append([i])
      used.append(n)
  width = seq_len + 2
  tokens = np.full((len(rows), width), tokenizers.PAD, np.int32)
  assistant = np.zeros((len(rows), width), bool)
  segs = np.zeros((len(rows), width), np.int32)
  for r, members in enumerate(rows):
    at = 0
    for k, i in enumerate(members):
      ids, mask = examples[i]
      tokens[r, at:at + len(ids)] = ids
      assistant[r, at:at + len(ids)] = mask
      segs[r, at:at + len(ids)] = k + 1
      at += len(ids)
    segs[r, at:] = len(members) + 1
  if too_long:
    log.warning("sft: %d of %d conversations are longer than a row of seq_len + 1 = %d tokens "
                "(longest %d) and are left out", too_long, len(examples), cap, longest)
  return Packed(tokens, assistant, segs, seq_len, len(examples) - too_long, too_long, longest)


def rows_to_batch(tokens: np.ndarray, assistant: np.ndarray,
                  segment_ids: np.ndarray) -> dict[str, np.ndarray]:
  """[B, T+2] row arrays → the trainer's batch dict (all [B, T]; module doc)."""
  return dict(inputs=tokens[:, :-2], targets=tokens[:, 1:-1], mtp_targets=tokens[:, 2:],
              segment_ids=segment_ids[:, :-2],
              loss_mask=assistant[:, 1:-1].astype(np.float32),
              mtp_mask=assistant[:, 2:].astype(np.float32))


def batch_rows(num_rows: int, seed: int, step: int, batch_size: int) -> np.ndarray:
  """Row indices [B] of `step` (module doc: epochs of seeded permutations)."""
  idx = step * batch_size + np.arange(batch_size)
  epochs, pos = idx // num_rows, idx % num_rows
  perms = {int(e): np.random.default_rng([seed, 1, int(e)]).permutation(num_rows)
           for e in np.unique(epochs)}
  return np.array([perms[int(e)][p] for e, p in zip(epochs, pos)], np.int64)


class SFTIterator(corpus.StepIterator):
  """Checkpointable SFT batches (`corpus.StepIterator`; module doc)."""

  def __init__(self, packed: Packed, batch_size: int, seed: int = 0):
    if packed.num_rows == 0:
      raise ValueError(f"data.source='sft': no conversation fits a row of train.seq_len + 1 = "
                       f"{packed.seq_len + 1} tokens ({packed.too_long} too long, longest "
                       f"{packed.longest}); raise train.seq_len")
    if batch_size <= 0:
      raise ValueError(f"train.batch_size: expected > 0, found {batch_size}")
    self.packed, self.batch_size, self.seed, self.step = packed, batch_size, seed, 0

  def seq_len_at(self, step: int) -> int:
    del step
    return self.packed.seq_len

  def batch(self, step: int) -> dict[str, np.ndarray]:
    r = batch_rows(self.packed.num_rows, self.seed, step, self.batch_size)
    p = self.packed
    return rows_to_batch(p.tokens[r], p.assistant[r], p.segment_ids[r])

  def fingerprint(self) -> dict:
    return self.packed.fingerprint()


def eval_batches(packed: Packed, num_batches: int, batch_size: int) -> list[dict]:
  """The held-out rows in order, `num_batches` batches at most (the last one completed by
  all-padding rows, which carry no loss)."""
  out = []
  for b in range(min(num_batches, -(-packed.num_rows // batch_size))):
    sl = slice(b * batch_size, (b + 1) * batch_size)
    tok, ast, seg = packed.tokens[sl], packed.assistant[sl], packed.segment_ids[sl]
    short = batch_size - len(tok)
    if short:
      tok = np.concatenate([tok, np.full((short, tok.shape[1]), tokenizers.PAD, np.int32)])
      ast = np.concatenate([ast, np.zeros((short, ast.shape[1]), bool)])
      seg = np.concatenate([seg, np.ones((short, seg.shape[1]), np.int32)])
    out.append(rows_to_batch(tok, ast, seg))
  return out


# ---------------------------------------------------------------------- the training data
def conversations(sft_file: str = "", eval_percent: float = 2.0, seed: int = 0,
                  num_train: int = 20000, num_eval: int = 256
                  ) -> tuple[list[chat.Conversation], list[chat.Conversation]]:
  """(train, held-out) conversations: those of `sft_file` (held out by line, md5("NAME:LINE")
  of the file's own name like text corpora, `eval_percent`), else the embedded tasks (k3jax/data/sft_tasks.py:
  `num_train` / `num_eval` samples of `seed`)."""
  if sft_file:
    convs = read_jsonl(sft_file)
    name = os.path.basename(sft_file)   # where the file lives never changes the split
    held = [corpus.in_eval(f"{name}:{i}", eval_percent) for i in range(len(convs))]
    return ([c for c, h in zip(convs, held) if not h], [c for c, h in zip(convs, held) if h])
  train = sft_tasks.samples(seed, num_train, sft_tasks.TRAIN)
  held = sft_tasks.samples(seed, num_eval, sft_tasks.HELDOUT)
  return [s.conversation for s in train], [s.conversation for s in held]


def training_data(train: Sequence[chat.Conversation], held: Sequence[chat.Conversation],
              seq_len: int, batch_size: int, seed: int, num_eval_batches: int):
  """(train SFTIterator, eval batches): `train` packed into rows of `seq_len` (shuffled by
  `seed`), `held` into `num_eval_batches` batches."""
  packed = pack([tokenize(c) for c in train], seq_len, seed)
  log.info("sft: train %s", packed.summary())
  it = SFTIterator(packed, batch_size, seed)
  evals = []
  if num_eval_batches and held:
    held_packed = pack([tokenize(c) for c in held], seq_len, None)
    evals = eval_batches(held_packed, num_eval_batches, batch_size)
  return it, evals




# ---------------------------------------------------------------------- media conversations
# Conversations with images (K3 §11 media in the chat format): the images of message i (each
# [H, W, 3] uint8, or [t, H, W, 3] a clip) put (h/2)(w/2) media placeholders right after
# that message's `[sep]`, before its text, in order (k3jax/data/chat_tokens.py); the row's
# media stream holds their patches in the same order, so placeholders and merged vision
# tokens line up (k3jax/vision/media.py `place_media`). The loss mask is `assistant_mask`'s:
# placeholders, like every user and tool token, carry none.
def media_pixels(vision_config, images) -> tuple[np.ndarray, np.ndarray, list[int]]:
  """(pixel_values [Σ t·h·w, 3, p, p], grid [n, 3], merged tokens per image) of `images`
  (each [H, W, 3] or [t, H, W, 3] uint8) by `k3jax.vision.preprocess`."""
  from PIL import Image
  from k3jax.vision.preprocess import preprocess
  items = []
  for k, im in enumerate(images):
    a = np.asarray(im)
    if a.dtype != np.uint8 or a.ndim not in (3, 4) or a.shape[-1] != 3:
      raise ValueError(f"images[{k}]: expected uint8 [H, W, 3] or [t, H, W, 3], found "
                       f"{a.dtype} {a.shape}")
    items.append([Image.fromarray(f) for f in a] if a.ndim == 4 else Image.fromarray(a))
  pv, grid = preprocess(vision_config, items)
  grid = np.asarray(grid, np.int32).reshape(-1, 3)
  return pv, grid, [int(g[1] // 2 * (g[2] // 2)) for g in grid]


def encode_media(vision_config, conv: chat.Conversation, images,
                 media_id: int = tokenizers.MEDIA, bos: bool = True):
  """A conversation and its images ({message index: (image, …)}) → `captions.Encoded` (the
  positions of [BOS] (with `bos`) + blocks, loss on the assistant tokens, and the media) for
  `captions.pack_rows`."""
  from k3jax.data import captions
  order = sorted(images)
  bad = [i for i in order if not 0 <= i < len(conv.messages)]
  if bad:
    raise ValueError(f"images: message indices {bad} out of range [0, {len(conv.messages)})")
  flat = [im for i in order for im in images[i]]
  if not flat:
    raise ValueError("images: a media conversation needs at least one image")
  pv, grid, merged = media_pixels(vision_config, flat)
  counts, k = {}, 0
  for i in order:
    counts[i] = merged[k:k + len(images[i])]
    k += len(images[i])
  ids = ChatEncoder(tokenizers.ByteTokenizer(), media_id=media_id).encode(
      conv, media=counts, bos=bos).ids
  mask = assistant_mask(ids)
  nxt = np.concatenate([ids[2:], [tokenizers.PAD]]).astype(np.int32)
  arrays = dict(inputs=ids[:-1], targets=ids[1:], mtp_targets=nxt,
                loss_mask=mask[1:].astype(np.float32),
                mtp_mask=np.concatenate([mask[2:], [False]]).astype(np.float32))
  return captions.Encoded(arrays, pv, grid)


class MediaSFTIterator(corpus.StepIterator):
  """Checkpointable SFT batches of media conversations drawn from a generator
  (`corpus.StepIterator`).

  `make(rng)` → (Conversation, images) (encoded with [BOS] when `bos`); row b of step s packs the conversations drawn from
  `default_rng([seed, 0, s, b])` until the next would not fit `seq_len` tokens or `length`
  patches (as `captions.ShapesIterator`): a batch is a pure function of (seed, step), and
  the iterator state is the step. Batches: `captions.pack_rows` (a `Media` of B streams)."""

  def __init__(self, vision_config, make, batch_size: int, seq_len: int, length: int,
               seed: int = 0, name: str = "sft_media", bos: bool = True):
    if length not in vision_config.pack_buckets:
      raise ValueError(f"data.media_length: expected one of the vision config's pack_buckets "
                       f"{vision_config.pack_buckets}, found {length}")
    if batch_size <= 0:
      raise ValueError(f"train.batch_size: expected > 0, found {batch_size}")
    self.vision_config, self.make, self.batch_size = vision_config, make, batch_size
    self.seq_len, self.length, self.seed, self.name, self.step = seq_len, length, seed, name, 0
    self.bos = bos

  def seq_len_at(self, step: int) -> int:
    del step
    return self.seq_len

  def batch(self, step: int) -> dict:
    from k3jax.data import captions
    rows = []
    for b in range(self.batch_size):
      rng = np.random.default_rng([self.seed, 0, step, b])
      rows.append(captions.fill_row(
          lambda: encode_media(self.vision_config, *self.make(rng), bos=self.bos),
          self.seq_len, self.length, "a conversation"))
    return captions.pack_rows(self.vision_config, rows, self.seq_len, self.length)

  def fingerprint(self) -> dict:
    return {"source": self.name, "seq_len": self.seq_len, "media_length": self.length}


def media_eval_batches(vision_config, items, batch_size: int, seq_len: int, length: int,
                       bos: bool = True) -> list[dict]:
  """Held-out (Conversation, images) items packed in order into batches (the last completed
  with copies of its first row, their masks zero)."""
  from k3jax.data import captions
  rows = captions.fill_rows([encode_media(vision_config, c, im, bos=bos) for c, im in items],
                            seq_len, length)
  out = []
  for s in range(0, len(rows), batch_size):
    part = rows[s:s + batch_size]
    real = len(part)
    batch = captions.pack_rows(vision_config, part + [part[0]] * (batch_size - real), seq_len,
                               length)
    batch["loss_mask"][real:] = 0
    batch["mtp_mask"][real:] = 0
    out.append(batch)
  return out


def caption_chats(rng: np.random.Generator):
  """One shapes-corpus sample in chat form (`captions.chat_form`)."""
  from k3jax.data import captions
  return captions.chat_form(captions.render(rng))


def caption_training_data(vision_config, batch_size: int, seq_len: int, length: int,
                          seed: int, num_eval_batches: int):
  """data.source="sft_captions": (train `MediaSFTIterator` of the caption corpus in chat
  form, held-out eval batches of its EVAL split)."""
  from k3jax.data import captions
  it = MediaSFTIterator(vision_config, caption_chats, batch_size, seq_len, length, seed,
                        name="sft_captions")
  evals = []
  if num_eval_batches:
    n = max(1, num_eval_batches * batch_size * seq_len // 80)
    items = [captions.chat_form(s) for s in captions.eval_samples(seed, n)]
    evals = media_eval_batches(vision_config, items, batch_size, seq_len, length)
    evals = evals[:num_eval_batches]
  return it, evals
