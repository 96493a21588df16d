"""The visual tool task (k3jax/data/visual_tasks.py): the named cell holds the answer's colour,
the crop is that cell at full resolution, the overview a box average, the demonstration's
tokens, media and loss mask line up, and the checker is exact."""

import numpy as np
import pytest

from k3jax.config import preset
from k3jax.data import captions, chat, sft
from k3jax.data import visual_tasks as V
from k3jax.data.tokenizers import CHAT_END, MEDIA, ByteTokenizer

VISION = preset("tiny_multimodal").vision
TASKS = V.VisualTaskSampler(seed=3).sample(24)


def _fg(img):
  return np.abs(img.astype(int) - captions.BACKGROUND).max(-1) > 40


def _colour(img):
  palette = {k: np.asarray(v, float) for k, v in captions.COLOURS.items()}
  mean = img[_fg(img)].astype(float).mean(0)
  return min(palette, key=lambda k: np.abs(palette[k] - mean).sum())


def test_the_named_cell_holds_the_answer_and_the_crop_is_that_cell():
  for t in TASKS:
    assert t.image.shape == (V.SIZE, V.SIZE, 3) and t.image.dtype == np.uint8
    cells = [c for c, _, _ in t.spec]
    assert len(set(cells)) == 4 and sorted(col for _, col, _ in t.spec) == sorted(
        captions.COLOURS)
    for cell, colour, _ in t.spec:
      c = V.crop(t.image, cell)
      r, k = V.parse_cell(cell)
      assert np.array_equal(c, t.image[56 * r:56 * r + 56, 56 * k:56 * k + 56])
      assert 20 < _fg(c).sum() < 56 * 56 // 4 and _colour(c) == colour
      # the shape lies inside its cell: no foreground on the cell's border
      assert not _fg(c)[[0, -1]].any() and not _fg(c)[:, [0, -1]].any()
    empty = [V.cell_name(r, k) for r in range(4) for k in range(4)
             if V.cell_name(r, k) not in cells]
    assert all(_fg(V.crop(t.image, e)).sum() == 0 for e in empty)
    assert t.question == f"What colour is the shape in cell {t.cell}?"
    assert dict((c, col) for c, col, _ in t.spec)[t.cell] == t.answer


def test_overview_is_a_box_average_and_shapes_are_small_in_it():
  t = TASKS[0]
  ov = t.images[0]
  assert ov.shape == (V.OVERVIEW, V.OVERVIEW, 3)
  assert ov[5, 7, 1] == np.round(t.image[20:24, 28:32, 1].astype(float).mean())
  # Each shape covers at most a few overview pixels (a 14 px cell each).
  assert 0 < _fg(ov).sum() <= 4 * 25


def test_prompt_tokens_and_the_checker():
  t = TASKS[1]
  tok = ByteTokenizer()
  ids = np.asarray(t.tokens)
  assert int((ids == MEDIA).sum()) == V.MERGED
  assert ids[0] != 257                                          # no BOS: as tool_tasks
  text = tok.decode([i for i in t.tokens if i < 256])
  assert '"name":"crop"' in text and t.question in text
  assert t.answer not in text.replace(t.question, "")          # the answer is hidden
  assert V.is_correct(t, f"It is {t.answer}.")
  assert not V.is_correct(t, f"{t.answer} or not")
  assert not V.is_correct(t, None)
  with pytest.raises(ValueError, match="cell"):
    V.parse_cell("E1")
  with pytest.raises(ValueError, match="domain"):
    V.make_task(np.random.default_rng(0), 0, domain="bigmul")


def test_demonstration_media_tokens_and_mask_line_up():
  t = TASKS[2]
  conv, images = V.demonstration(t)
  assert chat.parse(chat.render(conv)) == conv
  e = sft.encode_media(VISION, conv, images, bos=False)
  ids = np.concatenate([e.arrays["inputs"], e.arrays["targets"][-1:]])
  assert np.array_equal(ids[:len(t.tokens) - 6], np.asarray(t.tokens[:-6]))   # same prompt
  ph = np.nonzero(ids == MEDIA)[0]
  assert len(ph) == 2 * V.MERGED and e.grid.tolist() == [[1, 4, 4], [1, 4, 4]]
  tool_at = ph[V.MERGED:]
  text = ByteTokenizer().decode([int(i) for i in ids[tool_at[-1] + 1:] if i < 256])
  assert text.startswith(f"cell {t.cell}")
  # loss exactly on the two replies: their tokens after "[open]assistant[sep]" through
  # [end_of_msg]; nothing of the prompt, the tool message or its placeholders
  mask = sft.assistant_mask(ids)
  trained = ByteTokenizer().decode([int(i) for i, m in zip(ids, mask) if m and i < 256])
  assert trained == 'think' + 'tools[{"arguments":{"cell":"%s"},"name":"crop"}]' % t.cell + \
      'think' + 'response' + t.answer
  assert not mask[ph].any() and mask[-1] and ids[-1] == CHAT_END
  assert np.array_equal(e.arrays["loss_mask"], mask[1:].astype(np.float32))
  # the media stream: the overview's patches, then the crop's, in placeholder order
  pv, grid, merged = sft.media_pixels(VISION, [t.images[0], V.crop(t.image, t.cell)])
  assert np.array_equal(e.pixel_values, pv) and merged == [4, 4]
  withheld, im = V.demonstration(t, withheld=True)
  assert list(im) == [0] and withheld.messages[2].content == V.WITHHELD
