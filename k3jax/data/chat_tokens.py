"""The one chat encoder: a `chat.Conversation` → token ids, for SFT, RL, generate and the server.

Structure and content are kept apart (`chat.message_segments`): the XTML markers come from the
structure and are the tokenizer's marker ids; headers, channel names and every content text are
encoded as ordinary text (`specials=False`), and media placeholders are inserted from the
structure too. So whatever a user types — `<eos>`, `<media>`, `[open]`, `[EOS]`,
`<|im_end|>` — stays text: no content string can produce a control token. (Encoding the
rendered XTML text with special tokens enabled, as generate once did, turned such strings into
control ids; `chat.render` still refuses a marker inside content, since its text form could
not be parsed back, but the encoder needs no such rule.)

    enc = ChatEncoder(tokenizer, media_id=config.media_placeholder_token_id)
    e = enc.encode(conv, reply="thinking")   # the prompt of the next assistant turn
    e.ids                                    # [n] int32: [BOS] blocks… assistant opening
    e.boundaries                             # positions right after each block's [end_of_msg]

Layout: `[BOS]` (when `bos` and the tokenizer has one), then the blocks of
`chat.conversation_segments` in order, then, with `reply` ("thinking" | "instruct"), the
assistant's opening (`chat.reply_segments`). `media[i]` (placeholder counts, one per image of
message i) puts that many placeholder ids right after message i's `[sep]`, before its text, in
order. `boundaries` are the turn boundaries the serving engine checkpoints at: a later turn of
the same conversation shares every block before them token for token.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from k3jax.data import chat

REPLY_MODES = ("thinking", "instruct")


@dataclasses.dataclass(frozen=True)
class EncodedChat:
  """ids [n] int32; boundaries: positions p with ids[p-1] a block's closing `[end_of_msg]`."""
  ids: np.ndarray
  boundaries: tuple[int, ...]


class ChatEncoder:
  """Encodes conversations with one tokenizer (`ByteTokenizer` or `TiktokenTokenizer`).

  tokenizer: needs `encode(text)` (ordinary text, no specials), `chat_ids()` (ValueError
  naming a missing marker) and `bos_id` (None: no BOS). media_id: the placeholder id of a
  multimodal model (`ModelConfig.media_placeholder_token_id`), None for text only.
  """

  def __init__(self, tokenizer, media_id: int | None = None):
    self.tokenizer = tokenizer
    self.marker_ids = dict(tokenizer.chat_ids())
    self.bos_id = getattr(tokenizer, "bos_id", None)
    self.media_id = media_id

  @property
  def end_id(self) -> int:
    """The `[end_of_msg]` id: generation of a reply stops there."""
    return self.marker_ids[chat.END]

  def text(self, s: str) -> list[int]:
    """Ordinary text → ids; special-token spellings inside it stay text."""
    return [int(i) for i in np.asarray(self.tokenizer.encode(s), np.int64).reshape(-1)]

  def segments(self, segs: Sequence[tuple[str, str]], media: Sequence[int] = ()) -> list[int]:
    """Segments (`chat.MARK` / `NAME` / `TEXT`) → ids; `media` placeholder runs go right after
    the first `[sep]` (a message's content starts there)."""
    ids: list[int] = []
    placed = not media
    for kind, s in segs:
      if kind == chat.MARK:
        ids.append(self.marker_ids[s])
        if s == chat.SEP and not placed:
          ids += self._placeholders(media)
          placed = True
      elif s:
        ids += self.text(s)
    return ids

  def _placeholders(self, counts: Sequence[int]) -> list[int]:
    if self.media_id is None:
      raise ValueError("media: the model has no media placeholder (a text-only model)")
    for n in counts:
      if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"media: placeholder counts must be positive ints, found {n!r}")
    return [int(self.media_id)] * int(sum(counts))

  def reply_opening(self, mode: str) -> list[int]:
    """The assistant turn's opening for `mode` ("thinking" | "instruct")."""
    if mode not in REPLY_MODES:
      raise ValueError(f"reply: expected one of {REPLY_MODES} or None, found {mode!r}")
    return self.segments(chat.reply_segments(mode == "thinking"))

  def encode(self, conv: chat.Conversation, *, reply: str | None = None, bos: bool = True,
             media: Mapping[int, Sequence[int]] | None = None) -> EncodedChat:
    """The conversation's ids (module doc). reply: None (the conversation alone: SFT rows),
    "thinking" or "instruct" (a prompt, ending with the assistant's opening)."""
    media = dict(media or {})
    bad = [i for i in media if not 0 <= i < len(conv.messages)]
    if bad:
      raise ValueError(f"media: message indices {bad} out of range [0, {len(conv.messages)})")
    ids: list[int] = [int(self.bos_id)] if bos and self.bos_id is not None else []
    boundaries = []
    for m, segs in chat.conversation_blocks(conv):
      ids += self.segments(segs, media.get(m, ()) if m is not None else ())
      boundaries.append(len(ids))
    if reply is not None:
      ids += self.reply_opening(reply)
    return EncodedChat(np.asarray(ids, np.int32), tuple(boundaries))


__all__ = ["ChatEncoder", "EncodedChat", "REPLY_MODES"]
