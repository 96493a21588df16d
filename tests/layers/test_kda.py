"""KDA layer against a float64 numpy reference: per-token loops for convs and the delta rule."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isolation import assert_isolated
from k3jax.config import preset
from k3jax.layers.kda import KDA, short_conv


def _sigmoid(x):
  return 1 / (1 + np.exp(-x))


def _np_rms(x, w, eps=1e-5):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _np_kda_layer(p, x, cfg, seg=None):
  """Spec §3 written out per token, float64."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  x = np.asarray(x, np.float64)
  b, t, _ = x.shape
  h, dk = cfg.text.kda_num_heads, cfg.text.kda_head_dim
  seg = np.zeros((b, t), int) if seg is None else np.asarray(seg)

  def proj_conv(name):
    y = np.einsum("btd,dhk->bthk", x, p[f"{name}_proj"]["kernel"])
    w = p[f"{name}_conv1d"]
    out = np.zeros_like(y)
    for bi in range(b):
      for ti in range(t):
        for tap in range(w.shape[0]):
          src = ti - (w.shape[0] - 1 - tap)
          if src >= 0 and seg[bi, src] == seg[bi, ti]:
            out[bi, ti] += w[tap] * y[bi, src]
    return out * _sigmoid(out)

  q, k, v = proj_conv("q"), proj_conv("k"), proj_conv("v")
  q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
  k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
  z = np.einsum("btr,rhk->bthk", x @ p["f_a_proj"]["kernel"], p["f_b_proj"]["kernel"])
  if cfg.text.kda_a_log_axis == "head":
    rate = np.exp(p["A_log"])[:, None]     # [H,1]: one rate per head
  else:
    rate = np.exp(p["A_log"])[None, :]     # [1,K]: one per key channel, shared by the heads
  if cfg.text.kda_lower_bound is None:
    g = -rate * np.logaddexp(0, z + p["dt_bias"])
  else:
    g = cfg.text.kda_lower_bound * _sigmoid(rate * (z + p["dt_bias"]))
  beta = _sigmoid(np.einsum("btd,dh->bth", x, p["b_proj"]["kernel"]))
  o = np.zeros((b, t, h, dk))
  for bi in range(b):
    for hi in range(h):
      s = np.zeros((dk, dk))
      for ti in range(t):
        if ti and seg[bi, ti] != seg[bi, ti - 1]:
          s = np.zeros((dk, dk))
        kt, vt = k[bi, ti, hi], v[bi, ti, hi]
        s = np.exp(g[bi, ti, hi])[:, None] * s
        s = s + beta[bi, ti, hi] * np.outer(kt, vt - s.T @ kt)
        o[bi, ti, hi] = s.T @ (q[bi, ti, hi] * dk ** -0.5)
  if cfg.text.full_rank_gates:
    gate = np.einsum("btd,dhv->bthv", x, p["g_proj"]["kernel"])
  else:
    gate = np.einsum("btr,rhv->bthv", x @ p["g_a_proj"]["kernel"], p["g_b_proj"]["kernel"])
  o = _np_rms(o, p["o_norm"]) * _sigmoid(gate)
  return np.einsum("bthv,hvd->btd", o, p["o_proj"]["kernel"])


@functools.lru_cache(maxsize=None)
def _setup(name, t=20, seed=0, a_log_axis="head"):
  cfg = preset(name, kda_a_log_axis=a_log_axis)
  x = jax.random.normal(jax.random.key(seed), (2, t, cfg.text.d_model))
  mod = KDA(cfg)
  v = nn.unbox(jax.jit(mod.init)(jax.random.key(seed + 1), x))
  return cfg, mod, v, x


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("name,a_log_axis", [("tiny", "head"), ("tiny_kimi_linear", "head"),
                                              ("tiny", "channel")])
def test_layer_matches_per_token_reference(name, a_log_axis, backend):
  # tiny: bounded decay + full-rank gate; tiny_kimi_linear: softplus decay + rank-r gate;
  # "channel": A_log [K], one rate per key channel shared by the heads (the kernels take g
  # only, so the Pallas kernel runs it unchanged);
  # "pallas": the same layer through the Pallas KDA kernel (interpreted here), packed rows too
  cfg, mod, v, x = _setup(name, a_log_axis=a_log_axis)  # T = 20 > chunk (16): crosses a chunk
  if backend == "pallas":
    cfg = cfg.replace(kernel_backend="pallas")
    mod = KDA(cfg)
    assert "pallas_call" in str(jax.make_jaxpr(mod.apply)(v, x[:, :16]))
  # row 1 starts with row 0's second document: packing must give identical outputs for it
  x = x.at[1].set(jnp.concatenate([x[0, 7:], x[0, :7]]))
  seg = jnp.asarray(np.array([[0] * 7 + [1] * 13, [0] * 13 + [1] * 7]), jnp.int32)
  got = jax.jit(mod.apply)(v, x, seg)
  ref = _np_kda_layer(v["params"], x, cfg, seg)
  np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())
  np.testing.assert_allclose(got[0, 7:], got[1, :13], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("a_log_axis", ["head", "channel"])
def test_decode_from_cache_matches_reference(a_log_axis):
  """Prefill 12 tokens into an empty cache (chunked), then decode the rest one token at a
  time (`kda_step`), each feed continuing from the cache: the outputs are the float64
  reference's for the whole sequence, for both readings of A_log."""
  from k3jax.layers.feed import Feed
  from k3jax.layers.kda import KDACache
  cfg, mod, v, x = _setup("tiny", a_log_axis=a_log_axis)
  ref = _np_kda_layer(v["params"], x, cfg)
  cache = KDACache.zeros(cfg, x.shape[0])
  apply = jax.jit(lambda v, x, cache, feed: mod.apply(v, x, cache=cache, feed=feed))
  outs, pos = [], 0
  for n in (12,) + (1,) * (x.shape[1] - 12):
    feed = Feed(jnp.full((x.shape[0],), pos, jnp.int32), jnp.full((x.shape[0],), n, jnp.int32))
    out, cache = apply(v, x[:, pos:pos + n], cache, feed)
    outs.append(out)
    pos += n
  got = jnp.concatenate(outs, axis=1)
  np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())


def test_param_shapes_follow_contract():
  cfg, _, v, _ = _setup("tiny")
  d, h, k, r, w = cfg.text.d_model, cfg.text.kda_num_heads, cfg.text.kda_head_dim, cfg.text.kda_gate_rank, 4
  p = v["params"]
  shapes = {
      "q_proj": (d, h, k), "k_proj": (d, h, k), "v_proj": (d, h, k), "q_conv1d": (w, h, k),
      "f_a_proj": (d, r), "f_b_proj": (r, h, k), "b_proj": (d, h), "g_proj": (d, h, k),
      "A_log": (h,), "dt_bias": (h, k), "o_norm": (k,), "o_proj": (h, k, d)}
  for name, shape in shapes.items():
    leaf = p[name]["kernel"] if isinstance(p[name], dict) else p[name]
    assert leaf.shape == shape, name
  np.testing.assert_array_equal(p["o_norm"], np.ones(k))
  # the per-channel reading: A_log [K], replicated (every head's shard uses all of it)
  channel = nn.get_partition_spec(jax.eval_shape(
      KDA(cfg.replace(kda_a_log_axis="channel")).init, jax.random.key(0), _setup("tiny")[3]))
  assert channel["params"]["A_log"] == jax.sharding.PartitionSpec("head_dim")


def test_short_conv_taps_in_time_order():
  x = jnp.arange(1.0, 6.0).reshape(1, 5, 1, 1)
  kern = jnp.array([100.0, 10.0, 1.0]).reshape(3, 1, 1)  # tap 2 multiplies the current token
  y = short_conv(x, kern)[0, :, 0, 0]
  np.testing.assert_allclose(y, [1, 12, 123, 234, 345])
  seg = jnp.array([[0, 0, 1, 1, 1]])
  np.testing.assert_allclose(short_conv(x, kern, seg)[0, :, 0, 0], [1, 12, 3, 34, 345])


def test_short_conv_packed_documents_are_bitwise_isolated():
  """Taps that would reach into a previous document read an exact zero: the middle document's
  outputs and input gradients are bit-for-bit the same whatever the other documents hold."""
  rng = np.random.default_rng(4)
  x, alt = (jnp.asarray(rng.normal(size=(2, 11, 2, 3)), jnp.float32) for _ in range(2))
  kern = jnp.asarray(rng.normal(size=(4, 2, 3)), jnp.float32)
  seg = np.array([[0] * 3 + [1] * 5 + [2] * 3, [0] * 11])
  op = lambda x, kern: short_conv(x, kern, jnp.asarray(seg, jnp.int32))
  assert_isolated(op, [x, kern], [alt, kern], seg == 1, per_token=[True, False])


def test_bad_input():
  cfg, mod, v, _ = _setup("tiny")
  with pytest.raises(ValueError, match="KDA: x must be"):
    mod.apply(v, jnp.zeros((2, 4, cfg.text.d_model + 1)))
