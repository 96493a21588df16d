"""Gated MLA layer against a naive per-head numpy softmax attention."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import preset
from k3jax.layers.mla import MLA


def _np_rms(x, w, eps=1e-5):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _np_mla(p, x, cfg, seg=None):
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  x = np.asarray(x, np.float64)
  b, t, _ = x.shape
  h, nope, rope = cfg.text.num_heads, cfg.text.qk_nope_head_dim, cfg.text.qk_rope_head_dim
  if cfg.text.q_lora_rank is None:
    q = np.einsum("btd,dhk->bthk", x, p["q_proj"]["kernel"])
  else:
    qa = _np_rms(x @ p["q_a_proj"]["kernel"], p["q_a_layernorm"]["weight"], eps=1e-6)
    q = np.einsum("btr,rhk->bthk", qa, p["q_b_proj"]["kernel"])
  kv = x @ p["kv_a_proj_with_mqa"]["kernel"]
  c, k_pe = kv[..., :cfg.text.kv_lora_rank], kv[..., cfg.text.kv_lora_rank:]
  kvb = np.einsum("btl,lhk->bthk", _np_rms(c, p["kv_a_layernorm"]["weight"], eps=1e-6),
                  p["kv_b_proj"]["kernel"])
  k_nope, v = kvb[..., :nope], kvb[..., nope:]
  scale = (nope + rope) ** -0.5
  o = np.zeros((b, t, h, cfg.text.v_head_dim))
  mx = np.full(h, -np.inf)
  for bi in range(b):
    for hi in range(h):
      for ti in range(t):
        keys = [j for j in range(ti + 1) if seg is None or seg[bi, j] == seg[bi, ti]]
        logits = np.array([(q[bi, ti, hi, :nope] @ k_nope[bi, j, hi]
                            + q[bi, ti, hi, nope:] @ k_pe[bi, j]) * scale for j in keys])
        mx[hi] = max(mx[hi], logits.max())
        w = np.exp(logits - logits.max())
        w /= w.sum()
        o[bi, ti, hi] = sum(wj * v[bi, j, hi] for wj, j in zip(w, keys))
  if cfg.text.mla_output_gate:
    o = o / (1 + np.exp(-np.einsum("btd,dhv->bthv", x, p["g_proj"]["kernel"])))
  return np.einsum("bthv,hvd->btd", o, p["o_proj"]["kernel"]), mx


@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear"])  # q_a/q_b + gate | q_proj, no gate
def test_layer_matches_naive_attention(name):
  cfg = preset(name)
  x = jax.random.normal(jax.random.key(0), (2, 9, cfg.text.d_model))
  seg = np.array([[0] * 4 + [1] * 5, [0] * 9])
  mod = MLA(cfg)
  v = nn.unbox(jax.jit(mod.init)(jax.random.key(1), x))
  got, stats = jax.jit(lambda v, x, s: mod.apply(v, x, s, mutable=["stats"]))(
      v, x, jnp.asarray(seg))
  ref, ref_mx = _np_mla(v["params"], x, cfg, seg)
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
  assert stats["stats"]["max_logit"].shape == (cfg.text.num_heads,)
  np.testing.assert_allclose(stats["stats"]["max_logit"], ref_mx, rtol=1e-4, atol=1e-5)
  p = v["params"]
  assert ("g_proj" in p) == cfg.text.mla_output_gate
  assert ("q_a_proj" in p) == (cfg.text.q_lora_rank is not None) != ("q_proj" in p)
  assert p["kv_a_proj_with_mqa"]["kernel"].shape == (
      cfg.text.d_model, cfg.text.kv_lora_rank + cfg.text.qk_rope_head_dim)
  assert p["kv_b_proj"]["kernel"].shape == (
      cfg.text.kv_lora_rank, cfg.text.num_heads, cfg.text.qk_nope_head_dim + cfg.text.v_head_dim)
  assert "stats" not in jax.jit(mod.init)(jax.random.key(1), x)  # init sows nothing
