"""A procedurally generated image–text corpus: coloured shapes, their captions, packed batches.

Nothing is downloaded: every sample is rendered with numpy from a seed, and its caption can only
be predicted from the pixels. Three kinds (weights `KINDS`):
  one    one shape in one quadrant of a 56 or 84 px image:  "a red square at the top left."
  many   2–3 shapes of one colour and kind, 84 px:           "three blue circles."
  clip   one shape moving over 2–4 frames of 56 px:          "the green triangle moves up."
The caption's first content word (word 1) is always the colour: the figure of
experiments/eval_vision.py (its accuracy with the true images vs images of other captions).
Colours get a small per-sample jitter and the background mild noise, so a colour is a region of
the palette, not one exact value.

Determinism and split. Sample i of a split is `render(np.random.default_rng([seed, split, i]))`
(split 0 = train, 1 = eval); a training batch draws its samples from
`default_rng([seed, 0, step, row])`, so a batch is a pure function of (seed, step, shapes of
the batch), and the iterator state is the step (as in k3jax/data/corpus.py).

Tokens of a sample (byte tokenizer, k3jax/data/corpus.py):
    [BOS] [MEDIA] × (h/2)(w/2) caption-bytes [EOS]
— the placeholders hold the projected vision tokens (K3Model `media=`). A sample of n tokens
gives n−1 positions: inputs = s[:-1], targets = s[1:], mtp_targets = s[2:] (then PAD). The loss
mask is explicit (`sample_arrays`): a position counts iff its target is a caption byte or EOS —
never a placeholder (nothing to predict there), never BOS, never padding; `mtp_mask` likewise
for the token two ahead. So the loss is the caption's loss given the media, the first caption
byte predicted from the last placeholder.

Batches (`pack_rows`). Samples are packed in order into rows of T positions (each sample its own
segment; the rest of a row is PAD in one more segment, mask 0) while both the row's tokens and
its patches fit (T, and the stream length L): row b's media is stream b of the batch's `Media`
(S = B streams of one bucket length L; a text row's stream is empty, num_merged 0), so `jit`
sees one shape per run. Placeholders are replaced row-major over [B, T] against stream 0, then
1, …, which is exactly sample order.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
from PIL import Image

from k3jax.data import chat
from k3jax.data.corpus import StepIterator, pack_windows
from k3jax.data.tokenizers import BOS, EOS, MEDIA, NUM_BYTES, PAD
from k3jax.vision.media import Media, media_from_pixels, stack_media
from k3jax.vision.packing import META_FIELDS
from k3jax.vision.preprocess import preprocess

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 90, 235),
           "yellow": (235, 210, 40)}
SHAPES = ("square", "circle", "triangle")
COUNTS = {1: "one", 2: "two", 3: "three"}
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
KINDS = {"one": 0.5, "many": 0.25, "clip": 0.25}
BACKGROUND = 24
TRAIN, EVAL = 0, 1


@dataclasses.dataclass(frozen=True)
class Sample:
  """One rendered sample: frames [t, H, W, 3] uint8, the caption and what it names."""
  frames: np.ndarray
  caption: str
  kind: str
  colour: str
  shape: str
  count: int
  where: str            # "top left" (one), "" (many), the direction (clip)

  @property
  def colour_span(self) -> tuple[int, int]:
    """Byte range [start, end) of the colour word (the first content word) in the caption."""
    start = len(self.caption.split(" ")[0]) + 1
    return start, start + len(self.colour)


def _mask(shape: str, size: int, cx: float, cy: float, r: float) -> np.ndarray:
  """[size, size] bool: pixels of a shape of half-size r centred at (cx, cy)."""
  yy, xx = np.mgrid[0:size, 0:size] + 0.5
  if shape == "square":
    return (np.abs(xx - cx) <= r) & (np.abs(yy - cy) <= r)
  if shape == "circle":
    return (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r
  if shape == "triangle":      # apex up, base 2r wide at the bottom
    return (yy >= cy - r) & (yy <= cy + r) & (np.abs(xx - cx) <= (yy - (cy - r)) / 2)
  raise ValueError(f"shape: expected one of {SHAPES}, found {shape!r}")


def _canvas(rng, size: int) -> np.ndarray:
  noise = rng.integers(-8, 9, size=(size, size, 3))
  return np.clip(BACKGROUND + noise, 0, 255).astype(np.int32)


def _paint(img: np.ndarray, mask: np.ndarray, rgb: np.ndarray) -> None:
  img[mask] = rgb


def render(rng: np.random.Generator) -> Sample:
  """One random sample (see the module doc); a pure function of the generator's state."""
  kind = list(KINDS)[rng.choice(len(KINDS), p=list(KINDS.values()))]
  colour = list(COLOURS)[rng.integers(len(COLOURS))]
  shape = SHAPES[rng.integers(len(SHAPES))]
  rgb = np.clip(np.asarray(COLOURS[colour]) + rng.integers(-12, 13, size=3), 0, 255)
  if kind == "one":
    size = int(rng.choice([56, 84]))
    half = size // 2
    r = float(rng.uniform(size / 12, size / 6))
    top, left = bool(rng.integers(2)), bool(rng.integers(2))
    # Inside its quadrant with a pixel of margin, so "top left" is unambiguous.
    cx = rng.uniform(r + 1, half - r - 1) + (0 if left else half)
    cy = rng.uniform(r + 1, half - r - 1) + (0 if top else half)
    img = _canvas(rng, size)
    _paint(img, _mask(shape, size, cx, cy, r), rgb)
    where = f"{'top' if top else 'bottom'} {'left' if left else 'right'}"
    return Sample(img[None].astype(np.uint8), f"a {colour} {shape} at the {where}.", kind,
                  colour, shape, 1, where)
  if kind == "many":
    size, count = 84, int(rng.integers(2, 4))
    img = _canvas(rng, size)
    placed: list[tuple[float, float, float]] = []
    while len(placed) < count:     # rejection sampling: shapes never touch
      r = float(rng.uniform(5, 9))
      cx, cy = rng.uniform(r + 1, size - r - 1, size=2)
      if all(np.hypot(cx - x, cy - y) > (r + q) * 1.5 + 2 for x, y, q in placed):
        placed.append((cx, cy, r))
        _paint(img, _mask(shape, size, cx, cy, r), rgb)
    return Sample(img[None].astype(np.uint8), f"{COUNTS[count]} {colour} {shape}s.", kind,
                  colour, shape, count, "")
  size, t = 56, int(rng.integers(2, 5))
  direction = list(DIRECTIONS)[rng.integers(len(DIRECTIONS))]
  dx, dy = DIRECTIONS[direction]
  r, step = float(rng.uniform(5, 8)), float(rng.uniform(6, 9))
  travel = step * (t - 1)
  lo, hi = r + 1, size - r - 1
  # Start so that the whole path stays inside the frame.
  cx = rng.uniform(lo + travel * (dx < 0), hi - travel * (dx > 0))
  cy = rng.uniform(lo + travel * (dy < 0), hi - travel * (dy > 0))
  frames = []
  for k in range(t):
    img = _canvas(rng, size)
    _paint(img, _mask(shape, size, cx + dx * step * k, cy + dy * step * k, r), rgb)
    frames.append(img)
  return Sample(np.stack(frames).astype(np.uint8), f"the {colour} {shape} moves {direction}.",
                kind, colour, shape, 1, direction)


def sample(seed: int, split: int, index: int) -> Sample:
  """Sample `index` of a split (TRAIN or EVAL): deterministic by (seed, split, index)."""
  return render(np.random.default_rng([seed, split, index]))


# ---------------------------------------------------------------------- tokens and masks
def is_text(ids: np.ndarray) -> np.ndarray:
  """Targets that carry loss: bytes and EOS (not BOS, MEDIA, PAD or other specials)."""
  ids = np.asarray(ids)
  return (ids < NUM_BYTES) | (ids == EOS)


def sample_tokens(caption: str, num_merged: int) -> np.ndarray:
  """[BOS] [MEDIA]×num_merged caption-bytes [EOS] → int32 [num_merged + len(bytes) + 2]."""
  text = np.frombuffer(caption.encode("utf-8"), np.uint8).astype(np.int32)
  return np.concatenate([[BOS], np.full(num_merged, MEDIA, np.int32), text, [EOS]]).astype(
      np.int32)


def sample_arrays(tokens: np.ndarray) -> dict[str, np.ndarray]:
  """A sample's tokens [n] → its n−1 positions: inputs, targets, mtp_targets (PAD past the
  end), loss_mask = is_text(target), mtp_mask = is_text(token two ahead) (float32)."""
  s = np.asarray(tokens, np.int32)
  mtp = np.concatenate([s[2:], [PAD]]).astype(np.int32)
  return dict(inputs=s[:-1], targets=s[1:], mtp_targets=mtp,
              loss_mask=is_text(s[1:]).astype(np.float32),
              mtp_mask=(is_text(mtp) & (mtp != PAD)).astype(np.float32))


# ---------------------------------------------------------------------- media
def pixels(vision_config, s: Sample) -> tuple[np.ndarray, np.ndarray]:
  """(pixel_values [t·h·w, 3, p, p], grid (t, h, w)) of a sample via
  `k3jax.vision.preprocess` — the same path as `generate --image / --video`."""
  frames = [Image.fromarray(f) for f in s.frames]
  pv, grid = preprocess(vision_config, [frames if s.kind == "clip" else frames[0]])
  return pv, grid[0]


def empty_stream(vision_config, length: int):
  """A `Media` stream of `length` padding patches and no sample (num_merged 0): the media of a
  text-only row. Padding follows `k3jax.vision.packing.pack`'s convention."""
  meta = {f: np.zeros((1, length), np.int32) for f in META_FIELDS if f != "merge_weight"}
  meta["merge_weight"] = np.zeros((1, length), np.float32)
  meta["segment_ids"][:] = -1
  for f in ("heights", "widths", "num_frames"):
    meta[f][:] = 1
  meta["merge_index"][:] = (length // 4) * 4       # the dump row
  return Media(patches=np.zeros((1, length, vision_config.patch_dim), np.float32), meta=meta,
               num_merged=np.zeros((1,), np.int32))


@dataclasses.dataclass
class Encoded:
  """A caption sample paired with (possibly another sample's) media, ready to pack."""
  arrays: dict
  pixel_values: np.ndarray
  grid: np.ndarray

  @property
  def num_tokens(self) -> int:
    return len(self.arrays["inputs"])

  @property
  def num_patches(self) -> int:
    """Patches of its media: grid is one sample's (t, h, w) or [n, 3] for n images."""
    return int(np.prod(np.reshape(self.grid, (-1, 3)), axis=1).sum())


def encode(vision_config, caption_sample: Sample, media_sample: Sample | None = None
           ) -> Encoded:
  """Tokens of `caption_sample`'s caption with the media (and placeholder count) of
  `media_sample` (default: its own)."""
  m = caption_sample if media_sample is None else media_sample
  pv, grid = pixels(vision_config, m)
  merged = int(grid[1] // 2 * (grid[2] // 2))
  return Encoded(sample_arrays(sample_tokens(caption_sample.caption, merged)), pv, grid)



def fill_row(sample, seq_len: int, length: int, what: str) -> list:
  """Encoded samples (`sample()` → an object with num_tokens / num_patches) drawn until the
  next would overflow a row of seq_len tokens and `length` patches; ValueError naming both
  limits when even the first does not fit (`what` names the sample in it)."""
  row, n, p = [], 0, 0
  while True:
    e = sample()
    if n + e.num_tokens > seq_len or p + e.num_patches > length:
      if not row:
        raise ValueError(f"{what} of {e.num_tokens} tokens / {e.num_patches} patches does not "
                         f"fit train.seq_len={seq_len} / data.media_length={length}")
      return row
    row.append(e)
    n, p = n + e.num_tokens, p + e.num_patches

def pack_rows(vision_config, rows: Sequence[Sequence[Encoded] | dict], seq_len: int,
              length: int) -> dict:
  """Rows → a batch dict (module doc): inputs, targets, segment_ids, loss_mask, mtp_targets,
  mtp_mask [B, T] and media (a `Media` of B streams of `length` patches). A row is a list of
  `Encoded` samples (they must fit: Σ tokens ≤ T, Σ patches ≤ length) or a text row (a dict of
  [T] arrays from `k3jax.data.corpus.pack_windows`, empty stream)."""
  keys = ("inputs", "targets", "segment_ids", "loss_mask", "mtp_targets", "mtp_mask")
  out = {k: [] for k in keys}
  streams = []
  for b, row in enumerate(rows):
    if isinstance(row, dict):
      for k in keys:
        out[k].append(np.asarray(row[k]))
      streams.append(empty_stream(vision_config, length))
      continue
    if not row:
      raise ValueError(f"pack_rows: row {b} holds no sample")
    n = sum(e.num_tokens for e in row)
    p = sum(e.num_patches for e in row)
    if n > seq_len or p > length:
      raise ValueError(f"pack_rows: row {b} holds {n} tokens / {p} patches, more than "
                       f"seq_len={seq_len} / length={length}")
    cat = {k: np.concatenate([e.arrays[k] for e in row]) for k in row[0].arrays}
    cat["segment_ids"] = np.concatenate([np.full(e.num_tokens, i + 1, np.int32)
                                         for i, e in enumerate(row)])
    pad = seq_len - n
    fill = {"inputs": PAD, "targets": PAD, "mtp_targets": PAD, "loss_mask": 0, "mtp_mask": 0,
            "segment_ids": len(row) + 1}
    for k in keys:
      out[k].append(np.concatenate([cat[k], np.full(pad, fill[k], cat[k].dtype)]))
    streams.append(media_from_pixels(
        vision_config, np.concatenate([e.pixel_values for e in row]),
        np.concatenate([np.reshape(e.grid, (-1, 3)) for e in row]), length=length))
  batch = {k: np.stack(v).astype(np.float32 if k.endswith("mask") else np.int32)
           for k, v in out.items()}
  batch["media"] = stack_media(streams)
  return batch


def fill_rows(items: Sequence[Encoded], seq_len: int, length: int) -> list[list[Encoded]]:
  """Greedy packing in order: a new row whenever the next sample would not fit."""
  rows: list[list[Encoded]] = [[]]
  n = p = 0
  for e in items:
    if e.num_tokens > seq_len or e.num_patches > length:
      raise ValueError(f"a sample of {e.num_tokens} tokens / {e.num_patches} patches does not fit "
                       f"a row of seq_len={seq_len} / media length={length}")
    if rows[-1] and (n + e.num_tokens > seq_len or p + e.num_patches > length):
      rows.append([])
      n = p = 0
    rows[-1].append(e)
    n, p = n + e.num_tokens, p + e.num_patches
  return rows


# ---------------------------------------------------------------------- iteration
class ShapesIterator(StepIterator):
  """Checkpointable batches of the shapes corpus, optionally interleaved with text rows.

  Row b of step s: with probability `text_fraction` (drawn from default_rng([seed, 0, s, b]))
  a window of T+2 tokens of `text_stream` (a text row, empty media stream); otherwise samples
  rendered from that generator, packed until the next would not fit T tokens or `length`
  patches. State: `k3jax.data.corpus.StepIterator`.
  """

  def __init__(self, vision_config, batch_size: int, seq_len: int, length: int, seed: int = 0,
               text_fraction: float = 0.0, text_stream: np.ndarray | None = None,
               text_fingerprint: dict | None = None):
    if not 0.0 <= text_fraction <= 1.0:
      raise ValueError(f"data.text_fraction: expected a value in [0, 1], found {text_fraction}")
    if text_fraction > 0 and (text_stream is None or len(text_stream) < seq_len + 2):
      raise ValueError(f"data.text_fraction={text_fraction}: needs a text corpus of at least "
                       f"{seq_len + 2} tokens")
    if length not in vision_config.pack_buckets:
      raise ValueError(f"data.media_length: expected one of the vision config's pack_buckets "
                       f"{vision_config.pack_buckets}, found {length}")
    self.vision_config, self.batch_size, self.seq_len = vision_config, batch_size, seq_len
    self.length, self.seed, self.text_fraction = length, seed, text_fraction
    self.text_stream, self.text_fingerprint = text_stream, text_fingerprint
    self.step = 0

  def seq_len_at(self, step: int) -> int:
    del step
    return self.seq_len

  def batch(self, step: int) -> dict:
    rows = []
    for b in range(self.batch_size):
      rng = np.random.default_rng([self.seed, TRAIN, step, b])
      if self.text_fraction and rng.random() < self.text_fraction:
        off = int(rng.integers(0, len(self.text_stream) - self.seq_len - 1))
        w = np.asarray(self.text_stream[off:off + self.seq_len + 2])[None]
        rows.append({k: v[0] for k, v in pack_windows(w).items()})
        continue
      rows.append(fill_row(lambda: encode(self.vision_config, render(rng)), self.seq_len,
                           self.length, "a sample"))
    return pack_rows(self.vision_config, rows, self.seq_len, self.length)

  def fingerprint(self) -> dict:
    return {"source": "shapes", "seq_len": self.seq_len, "media_length": self.length,
            "text_fraction": self.text_fraction, "text": self.text_fingerprint}


# ---------------------------------------------------------------------- chat form
DESCRIBE = "Describe the image."


def chat_form(s: Sample, question: str = DESCRIBE) -> tuple:
  """A sample as a chat conversation (SFT data, k3jax/data/sft.py `MediaSFTIterator`):
  user = the image (a clip: its frames) then `question`; assistant = the caption (instruct
  mode: the response channel). Returns (Conversation, {0: (media,)}), media [H, W, 3] uint8
  or, for a clip, [t, H, W, 3]."""
  conv = chat.Conversation((chat.Message("user", question), chat.Message("assistant",
                                                                          s.caption)))
  return conv, {0: (s.frames if s.kind == "clip" else s.frames[0],)}


def eval_samples(seed: int, num: int) -> list[Sample]:
  """The first `num` samples of the held-out split."""
  return [sample(seed, EVAL, i) for i in range(num)]


def eval_batches(vision_config, samples: Sequence[Sample], batch_size: int, seq_len: int,
                 length: int, *, shuffled: bool = False) -> list[dict]:
  """Batches of the held-out captions, packed in order; `shuffled`: caption i gets the media
  of sample i+1 (mod n), i.e. every caption sees the image of another one. The last batch is
  filled up with copies of its rows (fixed shapes); the masks of those copies are zero."""
  n = len(samples)
  items = [encode(vision_config, samples[i], samples[(i + 1) % n] if shuffled else None)
           for i in range(n)]
  rows = fill_rows(items, seq_len, length)
  out = []
  for s in range(0, len(rows), batch_size):
    part = rows[s:s + batch_size]
    filler = len(part)
    part = part + [part[0]] * (batch_size - len(part))
    batch = pack_rows(vision_config, part, seq_len, length)
    batch["loss_mask"][filler:] = 0
    batch["mtp_mask"][filler:] = 0
    out.append(batch)
  return out


__all__ = ["COLOURS", "SHAPES", "KINDS", "Sample", "render", "sample", "is_text",
           "sample_tokens", "sample_arrays", "pixels", "empty_stream", "encode", "pack_rows",
           "fill_rows", "ShapesIterator", "eval_samples", "eval_batches", "chat_form",
           "DESCRIBE"]
