"""SFT on conversations with media (k3jax/data/sft.py, the shapes corpus in chat form): the
encoding round-trips, placeholders sit right after the user's `[sep]` and match the row's
media stream, the loss covers the assistant's tokens only, the trainer's data source, and a
few SFT steps through the multimodal model lower the loss on a fixed batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import preset
from k3jax.data import captions, chat, sft
from k3jax.data.tokenizers import BOS, CHAT_END, CHAT_SEP, MEDIA, PAD, ByteTokenizer

VISION = preset("tiny_multimodal").vision
TOK = ByteTokenizer()


def test_caption_chat_form_round_trip_mask_and_placeholders():
  for i in range(12):
    s = captions.sample(0, captions.TRAIN, i)
    conv, images = captions.chat_form(s)
    assert chat.parse(chat.render(conv)) == conv
    assert conv.messages[0].content == captions.DESCRIBE and conv.messages[1].content == \
        s.caption
    e = sft.encode_media(VISION, conv, images)
    ids = np.concatenate([e.arrays["inputs"], e.arrays["targets"][-1:]])
    n = int(np.prod(e.grid[0, 1:]) // 4)
    assert ids[0] == BOS and int((ids == MEDIA).sum()) == n == (s.frames.shape[1] // 28) ** 2
    # [BOS] [open] "user" [sep] then the placeholders, then the question's bytes
    first = int(np.nonzero(ids == MEDIA)[0][0])
    assert ids[first - 1] == CHAT_SEP and TOK.decode(ids[2:first - 1].tolist()) == "user"
    assert np.all(ids[first:first + n] == MEDIA)
    assert TOK.decode(ids[first + n:first + n + len(captions.DESCRIBE)].tolist()) == \
        captions.DESCRIBE
    # loss on exactly the assistant's channel markers, "response", the caption and the end
    m = e.arrays["loss_mask"] > 0
    trained = e.arrays["targets"][m]
    assert TOK.decode([int(t) for t in trained if t < 256]) == "response" + s.caption
    assert trained[-1] == CHAT_END and not (e.arrays["targets"][m] == MEDIA).any()
    assert int(m.sum()) == len(s.caption.encode()) + len("response") + 4   # [open] [sep] [close] [end]
    assert e.num_patches == int(np.prod(e.grid[0])) and e.pixel_values.shape[0] == \
        e.num_patches


def test_batches_align_media_with_placeholders_and_resume():
  it = sft.MediaSFTIterator(VISION, sft.caption_chats, 3, 128, 128, seed=1)
  b = next(it)
  assert b["inputs"].shape == (3, 128) and b["media"].patches.shape[:2] == (3, 128)
  np.testing.assert_array_equal((b["inputs"] == MEDIA).sum(1), b["media"].num_merged)
  assert (b["loss_mask"][b["inputs"] == PAD] == 0).all()
  assert (b["segment_ids"].max(1) >= 2).all()                  # packed rows end in padding
  again = sft.MediaSFTIterator(VISION, sft.caption_chats, 3, 128, 128, seed=1)
  again.set_state(it.get_state())
  assert again.step == 1
  np.testing.assert_array_equal(next(again)["inputs"], it.batch(1)["inputs"])
  with pytest.raises(ValueError, match="media_length"):
    sft.MediaSFTIterator(VISION, sft.caption_chats, 3, 128, 100)
  with pytest.raises(ValueError, match="images\\[0\\]"):
    sft.media_pixels(VISION, [np.zeros((8, 8), np.uint8)])


def test_trainer_source_and_sft_steps_lower_the_loss():
  import optax
  from k3jax.train.run import base_config, run_config
  from k3jax.train.state import init_variables
  from k3jax.train.step import lm_loss
  from k3jax.train.trainer import make_data
  c = base_config("tiny_multimodal")
  c.model.update(dict(num_layers=2, mla_every=2, first_dense_layers=2,
                      attn_res_block_size=None, num_mtp_layers=0))     # dense: a quick compile
  c.data.source, c.data.media_length = "sft_captions", 128
  c.train.update(dict(batch_size=2, seq_len=128, steps=6, eval_every=1, eval_batches=1))
  run = run_config(c)
  config = run.model
  it, evals, _ = make_data(run, config)
  assert isinstance(it, sft.MediaSFTIterator) and len(evals) == 1
  assert (evals[0]["inputs"] == MEDIA).sum() == int(evals[0]["media"].num_merged.sum())
  batch = jax.tree.map(jnp.asarray, next(it))
  # The training loss (lm_loss, the trainer's, media through the tower) under plain Adam: a
  # cheap compile; the trainer's own step is the same loss.
  loss = lm_loss(config, 0.0)
  variables = init_variables(config, jax.random.PRNGKey(0))
  params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}
  tx = optax.adam(3e-3)

  @jax.jit
  def step(params, opt):
    f = lambda p: loss.fn({"params": p, **rest}, batch, loss.totals(batch))[0]  # noqa: E731
    value, grads = jax.value_and_grad(f)(params)
    upd, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, upd), opt, value

  opt = tx.init(params)
  losses = []
  for _ in range(6):
    params, opt, value = step(params, opt)
    losses.append(float(value))
  assert losses[-1] < 0.8 * losses[0], losses
  text = base_config("tiny")
  text.data.source = "sft_captions"
  with pytest.raises(ValueError, match="sft_captions"):
    make_data(run_config(text), run_config(text).model)
