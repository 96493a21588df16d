"""Decode path: token-by-token logits equal the full forward (both held to the float64
reference); caches; prefix reuse; speculative.

All tests share one compiled shape set per config (batch 2, prefill chunk 8, cache 32 slots),
so the expensive compilations happen once per config.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.serve import generate as G
from k3jax.config import preset
from k3jax.model import K3Model
from k3jax.serve.sampling import SamplingParams
from k3jax.serve import speculative
from reference_model import reference_forward

B, T, S, CHUNK = 2, 12, 32, 8
# tiny with 8 layers (prefix 0–3, one scanned group 4–7, AttnRes blocks appended at 0 and 4):
# every structural case of tiny at ~60% of its compile time. tiny_kimi_linear with MLA in key
# blocks of 4 (`mla_key_block`): the full forward from the latents, and the serving path's
# absorbed attention reading its 32-slot buffer 4 slots at a time, skipping the blocks after
# the last position.
OVERRIDES = {"tiny": dict(num_layers=8), "tiny_kimi_linear": dict(mla_key_block=4)}
LENGTHS = np.array([12, 7])
TOL = 1e-4      # caches (states, latents) of two decoding orders
REL_TOL = 1e-4  # logits vs the float64 reference: ≤ REL_TOL · max|reference|


@functools.lru_cache(maxsize=None)
def _model(name):
  cfg = preset(name, **OVERRIDES[name])
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, cfg.text.vocab_size))
  v = nn.meta.unbox(jax.jit(K3Model(cfg).init)(jax.random.PRNGKey(0), tokens[:, :4]))

  # Non-zero AttnRes pseudo-queries, so the depth softmax is not a uniform average.
  def perturb(path, x):
    s = jax.tree_util.keystr(path)
    if s.endswith("['proj']") and x.ndim == 1:
      return 0.2 * jax.random.normal(jax.random.PRNGKey(len(s)), x.shape)
    return x
  v = jax.tree_util.tree_map_with_path(perturb, v)
  full = np.asarray(jax.jit(K3Model(cfg).apply)(v, tokens))
  ref = reference_forward(cfg, v, tokens)
  assert ref["min_route_margin"] > 1e-5   # no routing decision within fp32 rounding of a tie
  # Decoding and the full forward are two fp32 computations of the same logits: each is held
  # to the float64 reference (tests/reference_model.py), not to the other.
  np.testing.assert_allclose(full, ref["logits"], atol=REL_TOL * np.abs(ref["logits"]).max())
  return cfg, v, tokens, ref["logits"]


@functools.lru_cache(maxsize=None)
def _decoded(name):
  """Prefill 3/2 tokens, then decode the rest one by one (rows stop at their lengths)."""
  cfg, v, tokens, _ = _model(name)
  start = np.array([3, 2])
  lg, cache = G.prefill(cfg, v, tokens[:, :CHUNK], start, max_len=S, chunk=CHUNK)
  got = {(b, start[b] - 1): np.asarray(lg[b]) for b in range(B)}
  pos = start.copy()
  while (pos < LENGTHS).any():
    active = pos < LENGTHS
    tok = tokens[np.arange(B), np.minimum(pos, T - 1)]
    lg, cache = G.decode_step(cfg, v, cache, tok, active)
    for b in np.flatnonzero(active):
      got[(b, pos[b])] = np.asarray(lg[b])
    pos = pos + active
  return got, cache


@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear"])
def test_decode_and_prefill_match_full_forward(name):
  cfg, v, tokens, ref = _model(name)   # ref: float64 logits of the full forward
  got, _ = _decoded(name)
  assert len(got) == (LENGTHS - [3, 2] + 1).sum()
  tol = REL_TOL * np.abs(ref).max()
  for (b, t), logits in got.items():
    np.testing.assert_allclose(logits, ref[b, t], atol=tol, err_msg=f"decode row {b} pos {t}")
  logits, _, _ = G.prefill(cfg, v, tokens, LENGTHS, max_len=S, chunk=CHUNK, return_all=True)
  for b in range(B):
    np.testing.assert_allclose(logits[b, :LENGTHS[b]], ref[b, :LENGTHS[b]], atol=tol)


@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear"])
def test_prefix_prefill_plus_decode_equals_whole_prefill_caches(name):
  cfg, v, tokens, _ = _model(name)
  _, dec = _decoded(name)
  _, whole = G.prefill(cfg, v, tokens, LENGTHS, max_len=S, chunk=CHUNK)
  np.testing.assert_array_equal(dec.lengths, LENGTHS)
  np.testing.assert_array_equal(whole.lengths, LENGTHS)
  kinds = set()
  for a, b in zip(dec.layers, whole.layers):
    kinds.add(type(a).__name__)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
      np.testing.assert_allclose(x, y, atol=TOL)
    if isinstance(a, G.MLACache):   # slots past each length are untouched zeros
      for r in range(B):
        assert not np.asarray(a.c_kv[r, LENGTHS[r]:]).any()
  assert kinds == {"KDACache", "MLACache"}


def test_rewind_leaves_cache_as_if_draft_never_fed():
  cfg, v, tokens, _ = _model("tiny")
  _, cache = G.prefill(cfg, v, tokens[:, :CHUNK], np.array([5, 4]), max_len=S, chunk=CHUNK)
  uv = G.unbox(v)
  feed = jnp.asarray(tokens[:, 8:10])
  _, _, after, aux = G._jitted(cfg, "step")(uv, cache, feed, jnp.full((B,), 2, jnp.int32))
  keep = jnp.array([1, 2])
  rew = speculative.rewind(after, cache, aux, keep)
  _, one = G.decode_step(cfg, v, cache, feed[:, 0], active=np.array([True, True]))
  _, two = G.decode_step(cfg, v, one, feed[:, 1], active=np.array([False, True]))
  np.testing.assert_array_equal(rew.lengths, two.lengths)
  for x, y in zip(jax.tree_util.tree_leaves(rew.layers), jax.tree_util.tree_leaves(two.layers)):
    np.testing.assert_allclose(x, y, atol=1e-5)


def test_speculative_greedy_equals_plain_greedy():
  cfg, v, tokens, _ = _model("tiny")
  prompts = [list(tokens[0, :8]), list(tokens[1, :5])]   # prefill shape [2, 8] as elsewhere
  greedy = SamplingParams(temperature=0.0)
  plain = G.generate(cfg, v, prompts, max_new_tokens=6, sampling=greedy, max_len=S)
  spec, stats = speculative.speculative_generate(cfg, v, prompts, max_new_tokens=6,
                                                 sampling=greedy, max_len=S)
  assert spec == plain
  assert 0.0 <= stats["acceptance_rate"] <= 1.0 and stats["rounds"] >= 3


def test_bad_input_errors():
  cfg = preset("tiny")
  v = {"params": {}}
  with pytest.raises(ValueError, match="max_len"):
    G.generate(cfg, v, [[1, 2, 3]], max_new_tokens=10, max_len=8)
  with pytest.raises(ValueError, match="capacity"):
    G.prefill(cfg, v, np.ones((1, 9), np.int32), np.array([9]), max_len=8)
  with pytest.raises(ValueError, match="empty"):
    G.generate(cfg, v, [[1], []], max_new_tokens=2)
  with pytest.raises(ValueError, match="at least one token"):
    G.prefill(cfg, v, np.ones((1, 4), np.int32), np.array([0]))
  with pytest.raises(ValueError, match="vocab_size"):
    G.prefill(cfg, v, np.array([[1, cfg.text.vocab_size]]), np.array([2]))
  with pytest.raises(ValueError, match="vocab_size"):
    G.prefill(cfg, v, np.array([[1, -1]]), np.array([2]))
  model = K3Model(cfg)
  cache = model.init_cache(2, 8)
  with pytest.raises(ValueError, match=r"extend: num_new .* \[B\]=\[2\]"):
    model.apply(v, np.ones((2, 3), np.int32), cache, np.ones((3,), np.int32),
                method=K3Model.extend)
  with pytest.raises(ValueError, match="tokens must be an int array"):
    model.apply(v, np.ones((2,), np.int32), cache, np.ones((2,), np.int32),
                method=K3Model.extend)
  with pytest.raises(ValueError, match=r"draft: hidden must be \[B,T,d\]"):
    model.apply(v, np.ones((2, 3, 5), np.float32), np.ones((2, 3), np.int32), cache,
                np.ones((2,), np.int32), method=K3Model.draft)


def test_prefill_with_media_matches_the_full_forward_then_decodes():
  """An image's placeholders at prefill: the last logits equal `K3Model.apply(media=)` over the
  whole prompt, and each decode step equals the full forward over prompt + generated tokens
  (the image stays in the cache). A text-only model refuses media.

  One jitted forward over prompt + the decoded token serves both: by causality its logits at
  the prompt's last position are the forward's over the prompt alone (an eager forward
  compiles each op alone, several times the jitted compile)."""
  from k3jax.vision.media import media_from_pixels
  cfg = preset("tiny_multimodal", num_layers=4)
  vcfg, ph = cfg.vision, cfg.media_placeholder_token_id
  pixels = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (16, 3, 14, 14)))
  media = media_from_pixels(vcfg, pixels, [[1, 4, 4]])             # 4 merged tokens
  prompt = np.array([[257, ph, ph, ph, ph, 97, 32]], np.int32)
  v = nn.meta.unbox(jax.jit(K3Model(cfg).init)(jax.random.PRNGKey(0), prompt))
  model = K3Model(cfg.for_inference())
  forward = jax.jit(lambda v, t, media: model.apply(v, t, media=media))
  logits, cache = G.prefill(cfg, v, prompt, [7], max_len=9, media=media)   # = generate's
  tok = np.argmax(np.asarray(logits), -1)
  step, cache = G.decode_step(cfg, v, cache, tok)
  grown = jnp.asarray(np.concatenate([prompt, tok[:, None]], 1))
  full = forward(v, grown, media)
  np.testing.assert_allclose(logits, full[:, -2], atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(step, full[:, -1], atol=1e-4, rtol=1e-4)
  without = forward(v, grown, None)      # the image matters to the prediction
  assert np.abs(np.asarray(full[:, -2] - without[:, -2])).max() > 1e-3
  out = G.generate(cfg, v, [prompt[0].tolist()], max_new_tokens=2, media=media)
  assert out[0][0] == int(tok[0])
  with pytest.raises(ValueError, match="placeholders"):
    G.prefill(cfg, v, prompt[:, :4], [4], media=media)
  with pytest.raises(ValueError, match="no vision tower"):   # refused before any compile
    G.prefill(preset("tiny", num_layers=4), v, prompt[:, 5:], [2], media=media)
