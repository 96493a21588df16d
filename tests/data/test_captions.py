"""The shapes corpus (k3jax/data/captions.py): captions follow the pixels, samples and batches
are deterministic by seed, and the loss mask covers caption tokens only."""

import numpy as np
import pytest

from k3jax.config import preset
from k3jax.data import captions
from k3jax.data.tokenizers import BOS, EOS, MEDIA, PAD

VISION = preset("tiny_multimodal").vision
SAMPLES = [captions.sample(0, captions.TRAIN, i) for i in range(120)]


def _foreground(frame):
  """[H, W] bool: pixels far from the (noisy, dark) background."""
  return np.abs(frame.astype(int) - captions.BACKGROUND).max(-1) > 40


def test_named_colour_is_the_rendered_colour():
  palette = {k: np.asarray(v, float) for k, v in captions.COLOURS.items()}
  for s in SAMPLES:
    fg = _foreground(s.frames[0])
    assert fg.sum() > 20, s.caption
    mean = s.frames[0][fg].astype(float).mean(0)
    nearest = min(palette, key=lambda k: np.abs(palette[k] - mean).sum())
    assert nearest == s.colour, (s.caption, mean)
    assert s.caption[slice(*s.colour_span)] == s.colour


def test_named_shape_position_count_and_motion_follow_the_pixels():
  fill = {"square": 1.0, "circle": np.pi / 4, "triangle": 0.5}   # area / bounding box
  kinds = set()
  for s in SAMPLES:
    kinds.add(s.kind)
    fg = _foreground(s.frames[0])
    ys, xs = np.nonzero(fg)
    if s.kind == "one":
      box = (np.ptp(ys) + 1) * (np.ptp(xs) + 1)
      ratio = fg.sum() / box
      assert min(fill, key=lambda k: abs(fill[k] - ratio)) == s.shape, (s.caption, ratio)
      half = s.frames.shape[1] / 2
      assert ("top" in s.where) == (ys.max() < half), s.caption
      assert ("left" in s.where) == (xs.max() < half), s.caption
    elif s.kind == "many":
      assert s.caption.split(" ")[0] == captions.COUNTS[s.count] and 2 <= s.count <= 3
      # Shapes never touch: count the 4-connected components of the foreground.
      seen, comps = np.zeros_like(fg), 0
      for y, x in zip(ys, xs):
        if seen[y, x]:
          continue
        comps += 1
        stack = [(y, x)]
        while stack:
          a, b = stack.pop()
          if 0 <= a < fg.shape[0] and 0 <= b < fg.shape[1] and fg[a, b] and not seen[a, b]:
            seen[a, b] = True
            stack += [(a + 1, b), (a - 1, b), (a, b + 1), (a, b - 1)]
      assert comps == s.count, s.caption
    else:
      assert 2 <= s.frames.shape[0] <= 4
      c0 = np.argwhere(_foreground(s.frames[0])).mean(0)
      c1 = np.argwhere(_foreground(s.frames[-1])).mean(0)
      dy, dx = c1 - c0
      moved = {"left": -dx, "right": dx, "up": -dy, "down": dy}
      assert max(moved, key=moved.get) == s.where and moved[s.where] > 4, s.caption
  assert kinds == {"one", "many", "clip"}


def test_deterministic_by_seed_and_split():
  a, b = captions.sample(3, captions.TRAIN, 7), captions.sample(3, captions.TRAIN, 7)
  assert a.caption == b.caption and np.array_equal(a.frames, b.frames)
  other = [captions.sample(4, captions.TRAIN, 7), captions.sample(3, captions.EVAL, 7)]
  assert all(not np.array_equal(o.frames, a.frames) if o.frames.shape == a.frames.shape
             else True for o in other)
  it1 = captions.ShapesIterator(VISION, 3, 128, 128, seed=1)
  it2 = captions.ShapesIterator(VISION, 3, 128, 128, seed=1)
  b1 = [next(it1) for _ in range(2)][1]
  it2.set_state(it1.get_state() | {"step": 1})
  b2 = next(it2)
  for k in ("inputs", "targets", "loss_mask", "segment_ids"):
    np.testing.assert_array_equal(b1[k], b2[k])
  np.testing.assert_array_equal(b1["media"].patches, b2["media"].patches)
  with pytest.raises(ValueError, match="data iterator state"):
    captions.ShapesIterator(VISION, 3, 128, 64, seed=1).set_state(it1.get_state())


def test_loss_mask_is_caption_tokens_only():
  toks = captions.sample_tokens("ab.", 4)
  np.testing.assert_array_equal(toks, [BOS, MEDIA, MEDIA, MEDIA, MEDIA, 97, 98, 46, EOS])
  arr = captions.sample_arrays(toks)
  # Targets: 4 placeholders (no loss), then "a" (predicted from the last placeholder), "b",
  # ".", EOS.
  np.testing.assert_array_equal(arr["loss_mask"], [0, 0, 0, 0, 1, 1, 1, 1])
  np.testing.assert_array_equal(arr["mtp_mask"], [0, 0, 0, 1, 1, 1, 1, 0])
  np.testing.assert_array_equal(arr["mtp_targets"][-1], PAD)

  batch = captions.ShapesIterator(VISION, 4, 128, 128, seed=0).batch(0)
  t, m = batch["targets"], batch["loss_mask"]
  assert np.all(m[t == MEDIA] == 0) and np.all(m[t == PAD] == 0) and np.all(m[t == BOS] == 0)
  assert np.all(m[(t < 256) | (t == EOS)] == 1)
  # Every row: one placeholder per merged vision token of its own stream, in order.
  ph = (batch["inputs"] == MEDIA).sum(1)
  np.testing.assert_array_equal(ph, batch["media"].num_merged)
  assert batch["media"].patches.shape == (4, 128, VISION.patch_dim)
  # Caption tokens = Σ (caption bytes + EOS) over the packed samples.
  seg = batch["segment_ids"]
  assert m.sum() == sum(((batch["targets"][r] < 256) | (batch["targets"][r] == EOS)).sum()
                        for r in range(4))
  assert (seg[:, -1] > seg[:, 0]).all()     # padding is a segment of its own


def test_text_rows_have_empty_media_and_eval_shuffle_keeps_captions():
  stream = np.tile(np.frombuffer(b"hello world ", np.uint8).astype(np.uint16), 40)
  it = captions.ShapesIterator(VISION, 6, 64, 128, seed=0, text_fraction=0.5, text_stream=stream,
                             text_fingerprint={"n": len(stream)})
  batch = it.batch(0)
  text = (batch["inputs"] == MEDIA).sum(1) == 0
  assert 0 < text.sum() < 6
  np.testing.assert_array_equal(batch["media"].num_merged[text], 0)
  assert (batch["media"].meta["segment_ids"][text] == -1).all()
  with pytest.raises(ValueError, match="text_fraction"):
    captions.ShapesIterator(VISION, 2, 64, 128, text_fraction=0.5)

  samples = captions.eval_samples(0, 12)
  true = captions.eval_batches(VISION, samples, 4, 128, 128)
  shuf = captions.eval_batches(VISION, samples, 4, 128, 128, shuffled=True)
  caption = lambda bs: [int(x) for b in bs for r, mk in zip(b["targets"], b["loss_mask"])
                        for x in r[mk > 0]]
  assert caption(true) == caption(shuf)          # the same caption tokens are scored
  assert not np.array_equal(true[0]["media"].patches, shuf[0]["media"].patches)
