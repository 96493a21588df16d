"""StableLatentMoE against a per-token loop reference; routing bias; stats; collections."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import preset
from k3jax.layers.moe import StableLatentMoE


def _sig(x):
  return 1 / (1 + np.exp(-x))


def _act(cfg, a, b):
  if cfg.text.activation == "situ":
    return cfg.text.situ_beta1 * np.tanh(a / cfg.text.situ_beta1) * _sig(a) * cfg.text.situ_beta2 * np.tanh(
        b / cfg.text.situ_beta2)
  return a * _sig(a) * b


def _np_rms(x, w, eps=1e-5):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _np_moe(v, x, cfg):
  """Spec §6 one token at a time, float64: top-k of s+b, weights from s, experts, latent path."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), v["params"])
  bias = np.asarray(v["balance"]["gate"]["e_score_correction_bias"], np.float64)
  xs = np.asarray(x, np.float64).reshape(-1, cfg.text.d_model)
  out, chosen_all = [], []
  for xt in xs:
    s = _sig(xt @ p["gate"]["kernel"])
    chosen = np.argsort(-(s + bias), kind="stable")[:cfg.text.experts_per_token]
    w = s[chosen] / (s[chosen].sum() + 1e-20) * cfg.text.routed_scaling_factor
    z = xt @ p["routed_expert_down_proj"]["kernel"] if cfg.text.latent_moe_dim else xt
    u = np.zeros_like(z)
    for wi, e in zip(w, chosen):
      ex = p["experts"]
      u += wi * (_act(cfg, z @ ex["w1"][e], z @ ex["w3"][e]) @ ex["w2"][e])
    if cfg.text.latent_moe_dim:
      y = _np_rms(u, p["routed_expert_norm"]["weight"]) @ p["routed_expert_up_proj"]["kernel"]
    else:
      y = u
    sh = p["shared_experts"]
    y = y + _act(cfg, xt @ sh["gate_proj"]["kernel"], xt @ sh["up_proj"]["kernel"]) @ sh[
        "down_proj"]["kernel"]
    out.append(y)
    chosen_all.append(chosen)
  return np.stack(out).reshape(x.shape), np.stack(chosen_all)


def _init(cfg, x):
  mod = StableLatentMoE(cfg)
  return mod, nn.unbox(jax.jit(mod.init)(jax.random.key(1), x))


@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear"])  # latent SiTU | classic SwiGLU
def test_moe_matches_per_token_loop(name):
  cfg = preset(name)
  x = jax.random.normal(jax.random.key(0), (2, 7, cfg.text.d_model))
  mod, v = _init(cfg, x)
  assert set(v) == {"params", "balance"}
  np.testing.assert_array_equal(v["balance"]["gate"]["e_score_correction_bias"],
                                np.zeros(cfg.text.num_experts))
  # a non-trivial bias that actually changes the selection
  v["balance"]["gate"]["e_score_correction_bias"] = jnp.linspace(-0.3, 0.3, cfg.text.num_experts)
  got, st = jax.jit(lambda v, x: mod.apply(v, x, mutable=["stats"]))(v, x)
  ref, chosen = _np_moe(v, x, cfg)
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
  st = st["stats"]
  np.testing.assert_array_equal(st["load"], np.bincount(chosen.ravel(), minlength=cfg.text.num_experts))
  assert st["margin_hist"].shape == (cfg.text.num_experts, cfg.modes.qb_num_bins)
  assert st["margin_hist"].dtype == jnp.int32
  np.testing.assert_array_equal(st["margin_hist"].sum(1), np.full(cfg.text.num_experts, 14))
  assert int(st["dropped"]) == 0 and st["dropped"].dtype == jnp.int32
  if cfg.text.latent_moe_dim:
    e, ell, f = cfg.text.num_experts, cfg.text.latent_moe_dim, cfg.text.moe_intermediate_size
    assert v["params"]["experts"]["w1"].shape == (e, ell, f)
    assert v["params"]["experts"]["w2"].shape == (e, f, ell)
    assert v["params"]["shared_experts"]["gate_proj"]["kernel"].shape == (
        cfg.text.d_model, cfg.text.shared_intermediate_size)


def test_bias_changes_selection_never_weights():
  """Forcing an expert into every top-k with the bias: its weight is still s_e / Σ s (unbiased)."""
  cfg = preset("tiny", latent_moe_dim=None, num_shared_experts=0, routed_scaling_factor=1.0)
  x = jax.random.normal(jax.random.key(2), (1, 6, cfg.text.d_model))
  mod, v = _init(cfg, x)
  # experts share w1/w3, and expert e's w2 is (e + 1)·w2_0: y_t = E(x_t) · Σ_i p_i (e_i + 1),
  # so y1/y0 reveals exactly the weights p the layer used under each bias.
  ex = v["params"]["experts"]
  ex["w2"] = jnp.stack([ex["w2"][0] * (e + 1) for e in range(cfg.text.num_experts)])
  ex["w1"] = jnp.broadcast_to(ex["w1"][0], ex["w1"].shape)
  ex["w3"] = jnp.broadcast_to(ex["w3"][0], ex["w3"].shape)
  apply = jax.jit(mod.apply)
  scores = _sig(np.asarray(x[0], np.float64) @ np.asarray(v["params"]["gate"]["kernel"]))
  big = np.zeros(cfg.text.num_experts)
  big[np.argmin(scores.mean(0))] = 10.0  # the least-liked expert joins every top-k
  v2 = {**v, "balance": {"gate": {"e_score_correction_bias": jnp.asarray(big, jnp.float32)}}}
  y0 = np.asarray(apply(v, x), np.float64)[0]
  y1 = np.asarray(apply(v2, x), np.float64)[0]

  def factor(s, bias):
    chosen = np.argsort(-(s + bias), kind="stable")[:cfg.text.experts_per_token]
    return np.dot(s[chosen] / s[chosen].sum(), chosen + 1), set(chosen)

  changed = 0
  for t in range(x.shape[1]):
    f0, c0 = factor(scores[t], 0 * big)
    f1, c1 = factor(scores[t], big)
    changed += c0 != c1
    np.testing.assert_allclose(y1[t], y0[t] * f1 / f0, rtol=1e-4, atol=1e-6)
  assert changed >= x.shape[1] - 1  # the bias changed (almost) every token's selection


def test_capacity_drops_are_counted():
  cfg = preset("tiny", moe_capacity_factor=0.25)
  x = jax.random.normal(jax.random.key(3), (2, 8, cfg.text.d_model))
  mod, v = _init(cfg, x)
  # all tokens prefer expert 0 and 1 → capacity ceil(0.25·16·2/8)=1 per expert drops most pairs
  v["balance"]["gate"]["e_score_correction_bias"] = jnp.array([5.0, 5.0] + [0.0] * 6)
  _, st = mod.apply(v, x, mutable=["stats"])
  assert int(st["stats"]["dropped"]) == 2 * 16 - 2
  np.testing.assert_array_equal(st["stats"]["load"][:2], [16, 16])


def test_bad_input():
  cfg = preset("tiny")
  mod = StableLatentMoE(cfg)
  v = nn.unbox(jax.eval_shape(mod.init, jax.random.key(0), jnp.zeros((1, 2, cfg.text.d_model))))
  with pytest.raises(ValueError, match="StableLatentMoE: x must be"):
    mod.apply(v, jnp.zeros((2, cfg.text.d_model)))


def test_xla_and_pallas_backends_agree():
  """kernel_backend selects the expert path (sort-based XLA vs the Pallas grouped matmul,
  interpreted on CPU); the layer's output and stats are the same."""
  cfg = preset("tiny")
  x = jax.random.normal(jax.random.key(3), (2, 8, cfg.text.d_model), jnp.float32)
  mod, v = _init(cfg, x)
  outs = {}
  for be in ("xla", "pallas"):
    y, st = StableLatentMoE(cfg.replace(kernel_backend=be)).apply(v, x, mutable=["stats"])
    outs[be] = (np.asarray(y), jax.tree.map(np.asarray, st))
  np.testing.assert_allclose(outs["pallas"][0], outs["xla"][0], rtol=1e-5, atol=1e-5)
  jax.tree.map(np.testing.assert_array_equal, outs["pallas"][1], outs["xla"][1])


def test_expert_grad_barrier_orders_the_backward_only():
  """`expert_grad_barrier`: the same output and gradients (values), and the backward pass
  holds one optimization barrier over the latent input's and the expert weights' cotangents
  (none without the mode, none in the forward)."""
  cfg = preset("tiny")
  x = jax.random.normal(jax.random.key(4), (2, 8, cfg.text.d_model))
  outs = {}
  for on in (False, True):
    c = cfg.replace(expert_grad_barrier=on)
    mod, v = _init(c, x)

    def loss(p, x_, mod=mod, v=v):
      return jnp.sum(jnp.sin(mod.apply({**v, "params": p}, x_)))

    g = jax.jit(jax.grad(loss, argnums=(0, 1)))
    outs[on] = (mod.apply(v, x), g(v["params"], x))
    hlo = g.lower(v["params"], x).as_text()
    fwd = jax.jit(mod.apply).lower(v, x).as_text()
    assert hlo.count("optimization_barrier") == (1 if on else 0) and (
        "optimization_barrier" not in fwd)
  np.testing.assert_array_equal(outs[True][0], outs[False][0])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               outs[True][1], outs[False][1])
