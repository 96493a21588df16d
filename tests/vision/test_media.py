"""Media in the token stream: `place_media` against an explicit loop, and `K3Model(media=)`
against the standalone tower (`k3jax.vision.encode`) and the text-only model."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from k3jax.config import preset
from k3jax.model import K3Model
from k3jax.vision import encode
from k3jax.vision.media import (Media, media_from_pixels, place_media, place_media_reference,
                                stack_media)

PID = 260
GRID = [[1, 4, 6], [2, 2, 2]]          # an image (6 merged tokens) and a 2-frame clip (1)


@pytest.fixture(scope="module")
def model():
  # Four text layers (one KDA group + its MLA), no MTP: the tests are about the media path.
  cfg = preset("tiny_multimodal", num_layers=4, num_mtp_layers=0)
  m = K3Model(cfg)
  return cfg, m, nn.unbox(m.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))


@functools.cache
def _forward(m):
  """The model's logits, jitted (run eagerly, each op of a tiny model compiles alone: several
  times the jitted compile); `media` None is the text-only program."""
  return jax.jit(lambda v, t, media: m.apply(v, t, media=media))


def _pixels(grid, seed=0):
  n = sum(t * h * w for t, h, w in grid)
  return np.random.default_rng(seed).normal(size=(n, 3, 14, 14)).astype(np.float32)


def _tokens(rows):
  """rows: [(length, [placeholder positions])] → int32 [B, T] of byte 'A' and placeholders."""
  t = max(n for n, _ in rows)
  out = np.full((len(rows), t), 65, np.int32)
  for i, (_, where) in enumerate(rows):
    out[i, where] = PID
  return out


_place_jit = jax.jit(place_media, static_argnums=4)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_place_media_matches_loop(data):
  s, m, b, t = 3, 6, 2, 12    # fixed shapes: one compile; counts and positions vary
  counts = [data.draw(st.integers(0, m)) for _ in range(s)]
  total = sum(counts)
  extra = data.draw(st.integers(0, 2))  # placeholders beyond the features keep their embedding
  n = min(total + extra, b * t)
  flat = np.full(b * t, 7, np.int32)
  flat[data.draw(st.permutations(range(b * t)))[:n]] = PID
  tokens = flat.reshape(b, t)
  rng = np.random.default_rng(data.draw(st.integers(0, 99)))
  emb = rng.normal(size=(b, t, 5)).astype(np.float32)
  feats = rng.normal(size=(s, m, 5)).astype(np.float32)
  got = _place_jit(jnp.asarray(emb), jnp.asarray(tokens), jnp.asarray(feats),
                    jnp.asarray(counts, jnp.int32), PID)
  want = place_media_reference(emb, tokens, feats, np.asarray(counts), PID)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_media_embeddings_are_the_projected_tower_outputs(model):
  """K3Model's embeddings with media = token embeddings with the standalone `encode` outputs
  (two streams: the samples of stream 0, then stream 1) at the placeholders, in order."""
  cfg, m, v = model
  grids = [GRID, [[1, 2, 4]]]
  px = [_pixels(g, i) for i, g in enumerate(grids)]
  length = cfg.vision.pack_buckets[0]
  media = stack_media([media_from_pixels(cfg.vision, p, g, length=length)
                       for p, g in zip(px, grids)])
  tokens = _tokens([(12, [1, 2, 3, 4, 5, 6, 9]), (12, [0, 10])])
  got = jax.jit(lambda v, t, md: m.apply(v, t, md, method=lambda mod, t, md: mod._embed(t, md)))(
      v, jnp.asarray(tokens), media)
  vision = {"params": {k: v["params"][k] for k in ("vision_tower", "mm_projector")}}
  feats = [np.asarray(encode(cfg.vision, vision, p, g)) for p, g in zip(px, grids)]
  assert [f.shape[0] for f in feats] == [7, 2]
  emb = np.asarray(v["params"]["embed_tokens"]["embedding"])[tokens]
  want = place_media_reference(emb, tokens, np.stack([np.pad(f, ((0, 7 - len(f)), (0, 0)))
                                                      for f in feats]), [7, 2], PID)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  assert np.abs(want - emb).max() > 0.1  # the placeholders really were replaced


def test_text_before_the_first_placeholder_is_unchanged_and_media_change_the_rest(model):
  cfg, m, v = model
  media = media_from_pixels(cfg.vision, _pixels(GRID), GRID)
  tokens = jnp.asarray(_tokens([(16, [4, 5, 6, 7, 8, 9, 12])]))
  with_media = np.asarray(_forward(m)(v, tokens, media))
  text_only = np.asarray(_forward(m)(v, tokens, None))
  np.testing.assert_allclose(with_media[:, :4], text_only[:, :4], atol=1e-4)
  assert np.abs(with_media[:, 4:] - text_only[:, 4:]).max() > 1e-2


def test_placeholder_count_and_media_errors(model):
  cfg, m, v = model
  media = media_from_pixels(cfg.vision, _pixels(GRID), GRID)
  for where in ([1, 2, 3], list(range(8))):   # 3 and 8 placeholders for 7 merged tokens
    with pytest.raises(ValueError, match=r"hold \d media placeholders \(id 260\) but the media "
                                         r"give 7 merged vision tokens"):
      m.apply(v, jnp.asarray(_tokens([(12, where)])), media=media)
  bad = media.replace(patches=media.patches[..., :-1])
  with pytest.raises(ValueError, match=r"media.patches: expected \[S, L, 588\]"):
    m.apply(v, jnp.asarray(_tokens([(12, list(range(7)))])), media=bad)
  # A text-only model refuses media while tracing: abstract variables, nothing computed.
  text = K3Model(preset("tiny", num_layers=2))
  tv = jax.eval_shape(text.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  with pytest.raises(ValueError, match="media given but config.vision is None"):
    jax.eval_shape(lambda tv: text.apply(tv, jnp.zeros((1, 4), jnp.int32), media=media), tv)
  with pytest.raises(ValueError, match="stack_media: streams of different lengths"):
    stack_media([media, media_from_pixels(cfg.vision, _pixels(GRID), GRID, length=128)])


def test_caption_loss_trains_the_tower_under_jit(model):
  """Gradients of a loss on the text after the image reach every vision parameter."""
  cfg, m, v = model
  media = jax.tree.map(jnp.asarray, media_from_pixels(cfg.vision, _pixels(GRID), GRID))
  tokens = jnp.asarray(_tokens([(14, [1, 2, 3, 4, 5, 6, 7])]))

  @jax.jit
  def loss(params):
    logits = m.apply({**v, "params": params}, tokens, media=media)
    return -jax.nn.log_softmax(logits[:, 8:-1]).mean()

  grads = jax.grad(loss)(v["params"])
  for name in ("vision_tower", "mm_projector"):
    norms = [float(jnp.abs(g).max()) for g in jax.tree.leaves(grads[name])]
    assert min(norms) > 0, (name, norms)
