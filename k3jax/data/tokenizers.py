"""Tokenizers: the byte tokenizer every embedded corpus uses, and the Kimi `tiktoken.model`
vocabulary of released checkpoints.

Byte tokenizer. Ids 0–255 are the bytes themselves; the special tokens follow (`PAD`=256,
`BOS`=257, `EOS`=258, `SEP`=259, `MEDIA`=260 (the media placeholder), the XTML chat markers
(`k3jax/data/chat.py`) `[open]`=261, `[sep]`=262, `[close]`=263, `[end_of_msg]`=264, then reserved
ids up to 256+16). `tiny` (272) and `small` (512) vocabularies both hold them; a model's
extra ids are simply never produced. `encode(text, specials=True)` maps the specials' names
(`<bos>` …, the chat markers) in the text to their single ids; `decode(ids, specials=True)`
writes them back.

Kimi vocabulary (`TiktokenTokenizer`): the `tiktoken.model` file that ships with Kimi
checkpoints, read without the `tiktoken` package.

File format: one line per token, "<base64 of the token's bytes> <rank>"; the rank is the token id
and the BPE merge priority (lower merges first). Special tokens (ids after the base vocabulary,
e.g. `[BOS]`, `<|im_end|>`) are read from `tokenizer_config.json` (`added_tokens_decoder`) next to
the file when it exists; ids without an entry decode to nothing (reserved slots).

Encoding is byte-level BPE as tiktoken does it: the text is split into pieces with the Kimi
pre-tokenisation regex, each piece's UTF-8 bytes start as single bytes and the adjacent pair whose
concatenation has the lowest rank is merged until no pair is in the vocabulary. The regex uses
Unicode classes and set intersection (`\\p{Han}`, `&&`), which need the third-party `regex`
module: `encode` raises a clear error without it; `decode` needs nothing.
`encode(text, specials=True)` encodes the special tokens' strings found in the text as their
single ids (the XTML chat markers `[open]`, `[sep]`, `[close]`, `[end_of_msg]` among them:
`chat_ids()` gives theirs, or a clear error naming the file when one is missing).
Everything is read from a local directory; nothing is downloaded.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
from typing import Iterable

import numpy as np

from k3jax.data.chat import MARKERS

NUM_BYTES = 256
PAD, BOS, EOS, SEP, MEDIA = 256, 257, 258, 259, 260
CHAT_OPEN, CHAT_SEP, CHAT_CLOSE, CHAT_END = 261, 262, 263, 264   # XTML markers (k3jax/data/chat.py)
NUM_SPECIAL = 16
SPECIAL_NAMES = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", SEP: "<sep>", MEDIA: "<media>",
                 CHAT_OPEN: "[open]", CHAT_SEP: "[sep]", CHAT_CLOSE: "[close]",
                 CHAT_END: "[end_of_msg]"}
_SPECIAL_IDS = {name: i for i, name in SPECIAL_NAMES.items()}


_SPECIAL_SPLIT = re.compile(b"(" + b"|".join(re.escape(n.encode()) for n in sorted(
    _SPECIAL_IDS, key=len, reverse=True)) + b")")


class ByteTokenizer:
  """Bytes are ids 0–255, specials 256–271. `vocab_size` is the model's (≥ 272)."""

  def __init__(self, vocab_size: int = NUM_BYTES + NUM_SPECIAL):
    if vocab_size < NUM_BYTES + NUM_SPECIAL:
      raise ValueError(f"vocab_size: the byte tokenizer needs at least "
                       f"{NUM_BYTES + NUM_SPECIAL} ids, found {vocab_size}")
    self.vocab_size = vocab_size
    self.pad_id, self.bos_id, self.eos_id, self.sep_id = PAD, BOS, EOS, SEP

  def encode(self, text: str | bytes, bos: bool = False, eos: bool = False,
             specials: bool = False) -> np.ndarray:
    """Text → int32 ids [n (+2)]. `specials`: the names in `SPECIAL_NAMES` (`<bos>`, `[open]`
    …) found in the text become their single ids instead of bytes."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    if specials:
      ids = []
      for k, piece in enumerate(_SPECIAL_SPLIT.split(data)):
        ids.append(np.array([_SPECIAL_IDS[piece.decode()]], np.int32) if k % 2 else
                   np.frombuffer(piece, dtype=np.uint8).astype(np.int32))
      ids = np.concatenate(ids)
    else:
      ids = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
    parts = ([np.array([BOS], np.int32)] if bos else []) + [ids] + (
        [np.array([EOS], np.int32)] if eos else [])
    return np.concatenate(parts)

  def chat_ids(self) -> dict[str, int]:
    """{XTML marker: its id} (k3jax/data/chat.py)."""
    return {SPECIAL_NAMES[i]: i for i in (CHAT_OPEN, CHAT_SEP, CHAT_CLOSE, CHAT_END)}

  def decode(self, ids: Iterable[int], specials: bool = False) -> str:
    """Ids → text; special tokens are dropped (or written as `<bos>` … when `specials`)."""
    out, buf = [], bytearray()
    for i in np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).ravel().tolist():
      if 0 <= i < NUM_BYTES:
        buf.append(i)
      elif specials:
        out.append(buf.decode("utf-8", errors="replace"))
        buf = bytearray()
        out.append(SPECIAL_NAMES.get(i, f"<special_{i}>"))
    out.append(buf.decode("utf-8", errors="replace"))
    return "".join(out)



# ---------------------------------------------------------------------- Kimi tiktoken vocabulary
# Kimi K2/K3 pre-tokenisation pattern (tokenization_kimi.py), joined with "|".
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def read_ranks(path: str | os.PathLike) -> dict[bytes, int]:
  """{token bytes: rank} from a tiktoken-format file; ValueError naming the bad line."""
  ranks: dict[bytes, int] = {}
  with open(path, "rb") as f:
    for n, line in enumerate(f, 1):
      line = line.strip()
      if not line:
        continue
      parts = line.split()
      if len(parts) != 2:
        raise ValueError(f"{path}:{n}: expected '<base64> <rank>', found {line[:60]!r}")
      try:
        ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
      except (ValueError, base64.binascii.Error) as e:
        raise ValueError(f"{path}:{n}: bad entry {line[:60]!r}: {e}") from None
  return ranks


class TiktokenTokenizer:
  """Byte-level BPE tokenizer over a tiktoken vocabulary.

  `TiktokenTokenizer.from_dir(checkpoint_dir)` reads `tiktoken.model` (+ specials from
  `tokenizer_config.json`). encode(text) → list[int]; decode(ids) → str.
  """

  def __init__(self, ranks: dict[bytes, int], special_tokens: dict[str, int] | None = None,
               pattern: str = KIMI_PATTERN):
    self.ranks = ranks
    self.special_tokens = dict(special_tokens or {})
    self._decoder = {r: b for b, r in ranks.items()}
    self._special_decoder = {i: s for s, i in self.special_tokens.items()}
    self.pattern = pattern
    self.vocab_size = max([*self._decoder, *self._special_decoder, -1]) + 1
    self.bos_id = self.special_tokens.get("[BOS]")
    self.eos_id = self.special_tokens.get("[EOS]", self.special_tokens.get("<|im_end|>"))
    self.source = "the special tokens given"

  @classmethod
  def from_dir(cls, path: str | os.PathLike) -> "TiktokenTokenizer":
    path = os.fspath(path)
    model = path if os.path.isfile(path) else os.path.join(path, "tiktoken.model")
    if not os.path.exists(model):
      raise ValueError(f"tokenizer: no tiktoken.model at {model}")
    specials = {}
    cfg = os.path.join(os.path.dirname(model), "tokenizer_config.json")
    if os.path.exists(cfg):
      with open(cfg) as f:
        added = json.load(f).get("added_tokens_decoder", {})
      specials = {v["content"]: int(k) for k, v in added.items()}
    tok = cls(read_ranks(model), specials)
    tok.source = f"{cfg} (added_tokens_decoder)" if os.path.exists(cfg) else (
        f"{cfg}, which does not exist")
    return tok

  def chat_ids(self) -> dict[str, int]:
    """{XTML marker: its special-token id}; ValueError naming the markers missing."""
    missing = [m for m in MARKERS if m not in self.special_tokens]
    if missing:
      raise ValueError(f"tokenizer: the chat marker(s) {missing} are not special tokens of "
                       f"{self.source}; the XTML chat format needs each as one token")
    return {m: self.special_tokens[m] for m in MARKERS}

  # ------------------------------------------------------------------ encoding
  @functools.cached_property
  def _regex(self):
    try:
      import regex  # optional: only encoding with the Kimi pattern needs it
    except ImportError:
      raise ValueError("tokenizer: encoding with the Kimi pattern needs the `regex` module "
                       "(Unicode classes); decoding works without it") from None
    return regex.compile(self.pattern, flags=regex.V1)

  def _bpe(self, piece: bytes) -> list[int]:
    if piece in self.ranks:
      return [self.ranks[piece]]
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
      best, best_rank = -1, None
      for i in range(len(parts) - 1):
        r = self.ranks.get(parts[i] + parts[i + 1])
        if r is not None and (best_rank is None or r < best_rank):
          best, best_rank = i, r
      if best < 0:
        break
      parts[best:best + 2] = [parts[best] + parts[best + 1]]
    out = []
    for p in parts:
      if p not in self.ranks:
        raise ValueError(f"tokenizer: byte {p!r} is not in the vocabulary (not byte-complete)")
      out.append(self.ranks[p])
    return out

  @functools.cached_property
  def _special_split(self):
    names = sorted(self.special_tokens, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(n) for n in names) + ")") if names else None

  def encode(self, text: str, bos: bool = False, specials: bool = False) -> list[int]:
    """Text → ids. Special-token strings in the text are encoded as plain text, or, with
    `specials`, as their single ids."""
    ids = [self.bos_id] if bos and self.bos_id is not None else []
    pieces = [text]
    if specials and self._special_split is not None:
      pieces = self._special_split.split(text)
    for k, piece in enumerate(pieces):
      if k % 2:
        ids.append(self.special_tokens[piece])
        continue
      for m in self._regex.finditer(piece):
        ids.extend(self._bpe(m.group().encode("utf-8")))
    return ids

  # ------------------------------------------------------------------ decoding
  def decode_bytes(self, ids: Iterable[int], specials: bool = False) -> bytes:
    out = []
    for i in ids:
      i = int(i)
      if i in self._decoder:
        out.append(self._decoder[i])
      elif i in self._special_decoder:
        if specials:
          out.append(self._special_decoder[i].encode())
      elif not 0 <= i < self.vocab_size:
        raise ValueError(f"ids: token id {i} outside [0, vocab_size={self.vocab_size})")
    return b"".join(out)

  def decode(self, ids: Iterable[int], specials: bool = False) -> str:
    """Ids → text (invalid UTF-8 from partial multi-byte tokens becomes U+FFFD)."""
    return self.decode_bytes(ids, specials).decode("utf-8", errors="replace")


__all__ = ["TiktokenTokenizer", "read_ranks", "KIMI_PATTERN"]
