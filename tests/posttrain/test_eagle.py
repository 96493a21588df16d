"""EAGLE-3 draft: the fused feature input (against the float64 reference), the unrolled
training chain (against feeding one sequence in order), and chained speculative decoding
(greedy output = plain greedy, with every draft accepted and with some rejected)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.serve import generate as G
from k3jax.cache import Cache
from k3jax.config import preset
from k3jax.layers.mla import MLACache
from k3jax.model import K3Model
from k3jax.serve.sampling import SamplingParams
from k3jax.posttrain import eagle
from k3jax.serve.speculative import speculative_generate
from k3jax.config import config_from_dict, config_to_dict
from reference_model import reference_forward

B, T = 2, 10
# 5 layers, AttnRes blocks of 4: block 0 the embeddings, 1 layers 0–3, 2 (the last) layer 4.
BASE = dict(num_layers=5, mla_every=2)


@functools.lru_cache(maxsize=None)
def _setup():
  cfg = eagle.eagle_config(preset("tiny", **BASE), (1, 0, -1))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, cfg.text.vocab_size)
  v = nn.meta.unbox(jax.jit(K3Model(cfg).init)(jax.random.PRNGKey(0), tokens))

  def perturb(path, x):   # non-uniform AttnRes depth softmax
    s = jax.tree_util.keystr(path)
    if s.endswith("['proj']") and x.ndim == 1:
      return 0.2 * jax.random.normal(jax.random.PRNGKey(len(s)), x.shape)
    return x
  return cfg, jax.tree_util.tree_map_with_path(perturb, v), tokens


@functools.lru_cache(maxsize=None)
def _forward():
  """The jitted (logits, MTP logits) of `_setup`'s model, shared by the tests that need them
  (run eagerly, a tiny model's forward compiles each op alone: ~4x the jitted compile)."""
  cfg, _, _ = _setup()
  return jax.jit(lambda v, t: K3Model(cfg).apply(v, t, return_mtp=True))


def test_eagle_blocks_config():
  cfg = preset("tiny", eagle_blocks=(1, 2, -1))
  assert cfg.eagle_block_indices() == (1, 2, cfg.text.num_attn_res_blocks)
  assert config_from_dict(config_to_dict(cfg)) == cfg
  for bad, match in [(dict(eagle_blocks=(1, 9)), r"\[9\] out of range"),
                     (dict(eagle_blocks=()), "non-empty tuple"),
                     (dict(eagle_blocks=(1, -1), num_mtp_layers=0), "num_mtp_layers"),
                     (dict(eagle_blocks=(1,), attn_res_block_size=None), "AttnRes")]:
    with pytest.raises(ValueError, match=f"eagle_blocks.*{match}"):
      preset("tiny", **bad)
  with pytest.raises(ValueError, match="draft_fuse"):
    eagle.split_params({"mtp": {}, "lm_head": {}})


def test_fused_draft_input_matches_reference():
  """return_mtp with eagle_blocks: the MTP logits from draft_fuse(blocks 1, 0, last) equal the
  float64 reference's; and they differ from the plain MTP input's (the fusion is used)."""
  cfg, v, tokens = _setup()
  logits, mtp = _forward()(v, tokens)
  ref = reference_forward(cfg, v, tokens, mtp=True)
  assert ref["min_route_margin"] > 1e-5
  for got, want in [(logits, ref["logits"]), (mtp, ref["mtp_logits"])]:
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
  plain = reference_forward(cfg.replace(eagle_blocks=None), v, tokens, mtp=True)
  assert np.abs(plain["mtp_logits"] - ref["mtp_logits"]).max() > 1e-2


def test_chain_equals_one_sequence_fed_in_order():
  """Step k of the chain anchored at i (batched: every anchor's copy of the cache) equals the
  draft fed one sequence in order: positions 0 … i with the target's features, then its own
  hidden state k times; step 0 equals the full-sequence MTP logits."""
  cfg, v, tokens = _setup()
  draft, _ = eagle.split_params(v["params"])
  steps, stride = 3, 2
  out = jax.jit(lambda d, t: eagle.chain_logits(cfg, d, v, t, steps=steps,
                                                anchor_stride=stride))(draft, tokens)
  _, mtp = _forward()(v, tokens)
  np.testing.assert_allclose(out[0][1], mtp.reshape(B * (T - 1), -1), atol=1e-5)
  np.testing.assert_array_equal(out[0][2], 1.0)

  model = K3Model(cfg)
  _, feats = jax.jit(lambda v, t: model.apply(v, t, method=K3Model.draft_inputs))(v, tokens)
  draft_fn = jax.jit(lambda h, x, cache, n: model.apply(v, h, x, cache, n, True,
                                                         method=K3Model.draft))
  anchors = list(range(0, T - 1, stride))
  for b in (0, 1):
    for r, i in enumerate(anchors):
      cache = Cache(jnp.zeros((1,), jnp.int32), {}, MLACache.zeros(cfg, 1, T + steps),
                    jnp.zeros((1,), jnp.int32))
      # positions 0 … i real (one compiled shape: the rest of the row is not fed)
      _, h, cache = draft_fn(feats[b:b + 1, :-1], tokens[b:b + 1, 1:], cache, jnp.array([i + 1]))
      h = h[:, i:i + 1]
      for k in range(1, steps):
        row = b * len(anchors) + r
        valid = i + 1 + k <= T - 1
        assert float(out[k][2][row]) == float(valid)
        if not valid:
          break
        q, h, cache = draft_fn(h, tokens[b:b + 1, i + 1 + k:i + 2 + k], cache, jnp.array([1]))
        np.testing.assert_allclose(out[k][1][row], q[0, 0], atol=1e-5, err_msg=(b, i, k))


def _bigram_model():
  """A model whose layers all output zero: the target's greedy next token is g(x_t), a
  function of the current token alone, and the draft (its MTP layer zeroed too, eh_proj
  passing the token embedding through) drafts g(x_{t+1}): exactly the target's next token."""
  cfg, v, _ = _setup()
  d = cfg.text.d_model

  def zero(path, x):
    s = jax.tree_util.keystr(path)
    if "['embed_tokens']" in s or "['lm_head']" in s or "norm']" in s or "['proj']" in s:
      return x
    if "['eh_proj']" in s:   # [2d, d]: the enorm(embedding) half passes through
      return jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], 0)
    return jnp.zeros_like(x)
  return cfg, jax.tree_util.tree_map_with_path(zero, v)


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_chained_speculative_greedy_equals_plain_greedy(noise):
  """draft_len 3 under greedy: the output is plain greedy decoding token for token; with the
  exact bigram draft every draft is accepted (4 tokens per round), with a perturbed draft
  some are rejected."""
  cfg, v = _bigram_model()
  if noise:
    eh = v["params"]["mtp"]["eh_proj"]["kernel"]
    eh = eh + noise * jax.random.normal(jax.random.PRNGKey(3), eh.shape)
    v = {**v, "params": {**v["params"], "mtp": {**v["params"]["mtp"],
                                                "eh_proj": {"kernel": eh}}}}
  prompts = [[5, 17, 3, 99, 250, 7, 8, 1], [42, 43, 44, 45, 46]]
  greedy = SamplingParams(temperature=0.0)
  plain = G.generate(cfg, v, prompts, max_new_tokens=9, sampling=greedy)
  spec, stats = speculative_generate(cfg, v, prompts, max_new_tokens=9, sampling=greedy,
                                     draft_len=3)
  assert spec == plain
  if noise:
    assert 0.2 < stats["acceptance_rate"] < 0.8, stats
  else:
    assert stats["acceptance_rate"] == 1.0 and stats["tokens_per_round"] == 4.0, stats
  with pytest.raises(ValueError, match="draft_len"):
    speculative_generate(cfg, v, prompts, max_new_tokens=2, draft_len=0)
