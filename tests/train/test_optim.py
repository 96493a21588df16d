"""Per-Head Muon, parameter labels and QK-Clip (k3jax/train/optim.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax.config import preset
from k3jax.train import optim


def _svals(x):
  return np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)


def test_newton_schulz_singular_values_near_one():
  g = jax.random.normal(jax.random.PRNGKey(0), (3, 24, 40))
  for m in np.asarray(optim.newton_schulz(g)):
    s = _svals(m)
    # 5 quintic steps with (3.4445, -4.7750, 2.0315) land the singular values in ~[0.7, 1.2].
    assert s.min() > 0.6 and s.max() < 1.25, s
  # The orthogonal direction of G: U Vᵀ (up to that spread).
  u, _, vt = np.linalg.svd(np.asarray(g[0], np.float64), full_matrices=False)
  cos = np.sum(np.asarray(optim.newton_schulz(g[0])) * (u @ vt)) / np.sqrt(24 * np.sum(
      np.asarray(optim.newton_schulz(g[0])) ** 2))
  assert cos > 0.97


def test_tall_and_wide_are_transposes():
  g = jax.random.normal(jax.random.PRNGKey(1), (16, 48))
  np.testing.assert_allclose(optim.newton_schulz(g.T), optim.newton_schulz(g).T, atol=1e-5)


@pytest.mark.parametrize("path,shape,blocks", [
    ("params/layers_0/self_attn/q_proj/kernel", (32, 4, 8), [(32, 8)] * 4),          # per head
    ("params/layers_0/self_attn/o_proj/kernel", (4, 8, 32), [(8, 32)] * 4),          # per head
    ("params/layers_1/block_sparse_moe/experts/w1", (5, 16, 12), [(16, 12)] * 5),    # per expert
    ("params/layers_1/block_sparse_moe/gate/kernel", (32, 8), [(32, 8)]),            # whole
    ("params/body/layers_0/self_attn/kv_b_proj/kernel", (2, 16, 4, 12), [(16, 12)] * 8),
    ("params/body/layers_1/block_sparse_moe/experts/w2", (2, 3, 12, 16), [(12, 16)] * 6),
])
def test_muon_blocks_are_orthogonal_per_block(path, shape, blocks):
  g = jax.random.normal(jax.random.PRNGKey(2), shape)
  out = np.asarray(optim.orthogonalize_blocks(g, path, scale=0.2))
  batch, fin, fout = optim.muon_blocks(path, shape)
  mats = np.transpose(out, batch + (fin, fout)).reshape(-1, shape[fin], shape[fout])
  assert [m.shape for m in mats] == blocks
  for m in mats:
    s = _svals(m) / (0.2 * max(m.shape) ** 0.5)     # remove the 0.2·√max(fan_in, fan_out) scale
    assert s.min() > 0.6 and s.max() < 1.25, (path, s)


def test_per_head_independence():
  """Changing head 1's gradient leaves head 0's (and the other layer's) update unchanged."""
  path = "params/body/layers_3/self_attn/q_b_proj/kernel"     # [G, in, H, hd]
  g = jax.random.normal(jax.random.PRNGKey(3), (2, 16, 3, 8))
  g2 = g.at[:, :, 1].multiply(7.0).at[1, :, 2].add(3.0)
  a = optim.orthogonalize_blocks(g, path)
  b = optim.orthogonalize_blocks(g2, path)
  np.testing.assert_array_equal(a[:, :, 0], b[:, :, 0])
  np.testing.assert_array_equal(a[0, :, 2], b[0, :, 2])
  assert not np.allclose(a[1, :, 2], b[1, :, 2])
  # Each block equals Newton–Schulz of that block alone.
  np.testing.assert_allclose(a[1, :, 1], optim.newton_schulz(g[1, :, 1]) * 0.2 * 16 ** 0.5,
                             atol=1e-5)
  # Experts: expert 0 of [E, in, out] does not see expert 1.
  e = jax.random.normal(jax.random.PRNGKey(4), (2, 8, 6))
  p = "params/layers_1/block_sparse_moe/experts/w3"
  np.testing.assert_array_equal(optim.orthogonalize_blocks(e, p)[0],
                                optim.orthogonalize_blocks(e.at[1].set(0.5), p)[0])


@pytest.mark.parametrize("path,shape,label", [
    ("params/embed_tokens/embedding", (272, 64), "adam"),
    ("params/lm_head/kernel", (64, 272), "adam"),
    ("params/norm/weight", (64,), "adam"),
    ("params/layers_0/self_attn/A_log", (2,), "adam"),
    ("params/layers_0/self_attn/dt_bias", (2, 16), "adam"),
    ("params/body/layers_0/self_attn/dt_bias", (2, 2, 16), "adam"),
    ("params/layers_0/self_attn/q_conv1d/kernel", (4, 2, 16), "adam"),
    ("params/layers_0/self_attention_res/proj", (64,), "adam"),
    ("params/layers_0/self_attn/q_proj/kernel", (64, 2, 16), "muon"),
    ("params/body/layers_0/self_attn/b_proj/kernel", (2, 64, 2), "muon"),
    ("params/mtp/eh_proj/kernel", (128, 64), "muon"),
    ("balance/body/layers_0/block_sparse_moe/gate/e_score_correction_bias", (2, 8), "balance"),
])
def test_param_labels(path, shape, label):
  assert optim.param_label(path, shape) == label


def test_muon_momentum_nesterov_and_decay():
  """One step: update = -lr·(scaled NS(g + μ·g) + wd·p); second step uses the momentum."""
  lr, wd, mu = 0.1, 0.1, 0.95
  p = {"params": {"x": {"kernel": jnp.ones((8, 4)) * 0.5}}, "balance": {}}
  g1 = {"params": {"x": {"kernel": jax.random.normal(jax.random.PRNGKey(5), (8, 4))}},
        "balance": {}}
  tx = optim.make_optimizer(lambda s: lr, weight_decay=wd, momentum=mu)
  st = tx.init(p)
  u, st = tx.update(g1, st, p)
  g = g1["params"]["x"]["kernel"]
  want = -lr * (optim.newton_schulz(g + mu * g) * 0.2 * 8 ** 0.5 + wd * 0.5)
  np.testing.assert_allclose(u["params"]["x"]["kernel"], want, atol=1e-5)
  u2, _ = tx.update(g1, st, p)
  m2 = mu * g + g
  want2 = -lr * (optim.newton_schulz(g + mu * m2) * 0.2 * 8 ** 0.5 + wd * 0.5)
  np.testing.assert_allclose(u2["params"]["x"]["kernel"], want2, atol=1e-5)


def test_scanned_parameter_is_updated_layer_by_layer():
  """A scanned [G, ...] kernel (updated in a fori_loop, in place) gets, for two steps, exactly
  the updates and momenta of G separate unscanned kernels; a 1-group stack takes the plain path."""
  tx = optim.make_optimizer(lambda s: 0.1, weight_decay=0.1)
  for groups in (3, 1):
    shape = (groups, 8, 2, 4)                                       # [G, in, H, hd]: per head
    w = jax.random.normal(jax.random.PRNGKey(8), shape)
    gs = [jax.random.normal(jax.random.PRNGKey(9 + i), shape) for i in range(2)]
    stacked = lambda x: {"params": {"body": {"layers_0": {"self_attn": {"q_proj": {  # noqa: E731
        "kernel": x}}}}}, "balance": {}}
    single = lambda x: {"params": {"layers_0": {"self_attn": {"q_proj": {  # noqa: E731
        "kernel": x}}}}, "balance": {}}
    st = tx.init(stacked(w))
    sts = [tx.init(single(w[l])) for l in range(groups)]
    for g in gs:
      u, st = jax.jit(tx.update)(stacked(g), st, stacked(w))
      for l in range(groups):
        ul, sts[l] = tx.update(single(g[l]), sts[l], single(w[l]))
        np.testing.assert_allclose(u["params"]["body"]["layers_0"]["self_attn"]["q_proj"]
                                   ["kernel"][l], ul["params"]["layers_0"]["self_attn"]
                                   ["q_proj"]["kernel"], rtol=1e-5, atol=1e-6)


def test_bf16_first_moments():
  """mu_dtype=bfloat16 stores Muon's momentum and Adam's mu in bf16 (Adam's nu keeps the
  parameter's dtype); step 1 equals the fp32 run (the momentum starts at 0 and the Nesterov
  direction is formed in fp32), step 2 differs from it only by the bf16 rounding of μ."""
  lr, wd = 0.1, 0.1
  p = {"params": {"x": {"kernel": jnp.ones((8, 4)) * 0.5}, "embed_tokens": {"embedding":
       jnp.ones((6, 4))}}, "balance": {}}
  g = jax.tree.map(lambda a: jax.random.normal(jax.random.PRNGKey(a.size), a.shape), p)
  runs = {}
  for dt in (None, jnp.bfloat16):
    tx = optim.make_optimizer(lambda s: lr, weight_decay=wd, mu_dtype=dt)
    st = tx.init(p)
    u1, st = tx.update(g, st, p)
    u2, st = tx.update(g, st, p)
    runs[dt] = (u1, u2, st)
  moments = {str(x.dtype) for x in jax.tree.leaves(runs[jnp.bfloat16][2]) if x.ndim}
  assert moments == {"bfloat16", "float32"}              # mu bf16, Adam's nu fp32
  is_muon = lambda x: isinstance(x, optim.MuonState)  # noqa: E731
  (muon,) = [x for x in jax.tree.leaves(runs[jnp.bfloat16][2], is_leaf=is_muon) if is_muon(x)]
  assert muon.mu["params"]["x"]["kernel"].dtype == jnp.bfloat16
  for a, b in zip(jax.tree.leaves(runs[None][0]), jax.tree.leaves(runs[jnp.bfloat16][0])):
    np.testing.assert_allclose(a, b, atol=1e-6)
  diffs = [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
           for a, b in zip(jax.tree.leaves(runs[None][1]), jax.tree.leaves(runs[jnp.bfloat16][1]))
           if a.size]
  assert 0 < max(diffs) < 2e-2, diffs


# ---------------------------------------------------------------------- QK-Clip
def _mla_setup(scale_q: float):
  from k3jax.layers.mla import MLA
  cfg = preset("tiny", num_heads=3)
  layer = MLA(cfg)
  x = jax.random.normal(jax.random.PRNGKey(6), (2, 12, cfg.text.d_model))
  params = jax.tree.map(lambda a: a, __import__("flax").linen.unbox(
      layer.init(jax.random.PRNGKey(7), x)["params"]))
  # Blow up head 0 and 2 (not 1) so their logits exceed τ.
  q = params["q_b_proj"]["kernel"]
  params["q_b_proj"]["kernel"] = q.at[:, 0].multiply(scale_q).at[:, 2].multiply(scale_q / 3)
  kv = params["kv_b_proj"]["kernel"]
  params["kv_b_proj"]["kernel"] = kv.at[:, 0].multiply(scale_q).at[:, 2].multiply(scale_q / 3)
  params["kv_a_proj_with_mqa"]["kernel"] = params["kv_a_proj_with_mqa"]["kernel"] * scale_q / 4

  def max_logit(p):
    _, st = layer.apply({"params": p}, x, mutable=["stats"])
    return np.asarray(st["stats"]["max_logit"])

  return cfg, params, max_logit


def test_qk_clip_brings_max_logit_to_tau():
  tau = 20.0
  cfg, params, max_logit = _mla_setup(scale_q=12.0)
  before = max_logit(params)
  assert before[0] > tau and before[2] > tau and before[1] < tau, before
  clipped = optim.qk_clip({"layers_3": {"self_attn": params}},
                          {"layers_3/self_attn": jnp.asarray(before)}, tau,
                          cfg.text.qk_nope_head_dim)["layers_3"]["self_attn"]
  after = max_logit(clipped)
  np.testing.assert_allclose(after[[0, 2]], tau, rtol=1e-4)   # every logit scaled by exactly γ
  assert after[1] == pytest.approx(before[1], rel=1e-6)        # head under τ untouched
  # The shared key part (kv_a_proj_with_mqa) and values are never clipped.
  np.testing.assert_array_equal(clipped["kv_a_proj_with_mqa"]["kernel"],
                                params["kv_a_proj_with_mqa"]["kernel"])
  nope = cfg.text.qk_nope_head_dim
  np.testing.assert_array_equal(clipped["kv_b_proj"]["kernel"][..., nope:],
                                params["kv_b_proj"]["kernel"][..., nope:])
  # Nope parts scaled by √γ, rope part of q by γ.
  gamma = tau / before[0]
  np.testing.assert_allclose(clipped["q_b_proj"]["kernel"][:, 0, :nope],
                             params["q_b_proj"]["kernel"][:, 0, :nope] * gamma ** 0.5, rtol=1e-5)
  np.testing.assert_allclose(clipped["q_b_proj"]["kernel"][:, 0, nope:],
                             params["q_b_proj"]["kernel"][:, 0, nope:] * gamma, rtol=1e-5)


def test_qk_clip_scanned_layers_each_own_gamma():
  """Under the scanned body a [G, H] max-logit clips each layer with its own factors."""
  nope, g, h = 4, 2, 3
  q = jnp.ones((g, 5, h, nope + 2))
  kv = jnp.ones((g, 5, h, nope + 3))
  params = {"body": {"layers_3": {"self_attn": {"q_b_proj": {"kernel": q},
                                                "kv_b_proj": {"kernel": kv}}}}}
  ml = jnp.array([[200.0, 50.0, 100.0], [50.0, 400.0, 10.0]])
  out = optim.qk_clip(params, {"body/layers_3/self_attn": ml}, 100.0, nope)
  oq = out["body"]["layers_3"]["self_attn"]["q_b_proj"]["kernel"]
  okv = out["body"]["layers_3"]["self_attn"]["kv_b_proj"]["kernel"]
  gam = np.minimum(1.0, 100.0 / np.asarray(ml))
  np.testing.assert_allclose(oq[:, 0, :, 0], np.sqrt(gam), rtol=1e-6)
  np.testing.assert_allclose(oq[:, 0, :, -1], gam, rtol=1e-6)
  np.testing.assert_allclose(okv[:, 0, :, 0], np.sqrt(gam), rtol=1e-6)
  np.testing.assert_allclose(okv[:, 0, :, -1], 1.0)


def test_vision_tower_wqkv_and_wo_are_orthogonalised_per_head():
  """MoonViT's fused wqkv [in, 3, H, hd] is one [in, hd] block per (q|k|v, head) and wo
  [H, hd, out] one [hd, out] block per head, like the decoder's attention projections; the
  whole multimodal tree gets an update (no 4-D kernel is refused)."""
  path = "params/vision_tower/encoder/blocks_0/wqkv/kernel"
  g = jax.random.normal(jax.random.PRNGKey(5), (32, 3, 2, 16))
  assert optim.muon_blocks(path, g.shape) == ((1, 2), 0, 3)
  out = optim.orthogonalize_blocks(g, path)
  for j in range(3):
    for h in range(2):
      np.testing.assert_allclose(out[:, j, h], optim.newton_schulz(g[:, j, h]) * 0.2 * 32 ** 0.5,
                                 atol=1e-5)
  # Scaling one head's key block leaves every other block's update unchanged.
  out2 = optim.orthogonalize_blocks(g.at[:, 1, 0].multiply(5.0).at[:, 1, 0, 0].add(1.0), path)
  np.testing.assert_array_equal(np.asarray(out2[:, 0]), np.asarray(out[:, 0]))
  np.testing.assert_array_equal(np.asarray(out2[:, 1, 1]), np.asarray(out[:, 1, 1]))
  assert not np.allclose(out2[:, 1, 0], out[:, 1, 0])
  wo = "params/vision_tower/encoder/blocks_0/wo/kernel"
  assert optim.muon_blocks(wo, (2, 16, 32)) == ((0,), 1, 2)
  assert optim.param_label(path, g.shape) == "muon"
  assert optim.param_label("params/vision_tower/patch_embed/pos_emb/weight", (8, 8, 32)) == "adam"

  from k3jax.train.state import init_variables
  v = init_variables(preset("tiny_multimodal", num_layers=2, num_mtp_layers=0),
                     jax.random.PRNGKey(0))
  tx = optim.make_optimizer(1e-2)
  # Jitted: one compile instead of eager dispatch (a compile per op shape) over every leaf.
  upd, _ = jax.jit(tx.update)({"params": v["params"], "balance": v["balance"]}, tx.init(v), v)
  u = upd["params"]["vision_tower"]["encoder"]["blocks_1"]["wqkv"]["kernel"]
  assert u.shape == (32, 3, 2, 16) and float(jnp.abs(u).max()) > 0


# ---------------------------------------------------------------------- packed / frozen experts
def _moe_params(expert_format):
  import flax.linen as nn
  from k3jax.layers.moe import StableLatentMoE
  cfg = preset("tiny", expert_format=expert_format)
  x = jax.random.normal(jax.random.PRNGKey(3), (2, 4, cfg.text.d_model))
  v = nn.unbox(StableLatentMoE(cfg).init(jax.random.PRNGKey(0), x))
  loss = lambda p: jnp.sum(StableLatentMoE(cfg).apply({**v, "params": p}, x) ** 2)
  return v, loss


def test_optimizer_refuses_packed_experts_naming_them():
  v, _ = _moe_params("mxfp4")
  tx = optim.make_optimizer(1e-2)
  with pytest.raises(ValueError, match=r"params/experts/w1/weight_packed: uint8 parameter "
                     r"cannot be trained.*freeze_experts=True.*expert_format='bf16'"):
    tx.init({"params": v["params"], "balance": v["balance"]})


@pytest.mark.parametrize("expert_format", ["mxfp4", "bf16"])
def test_freeze_experts_masks_them_and_trains_the_rest(expert_format):
  """A train step (grad with allow_int, float0 → zeros, update, apply): experts bit-identical,
  the router and latent projections move, and the frozen experts hold no optimizer state."""
  v, loss = _moe_params(expert_format)
  tx = optim.make_optimizer(1e-2, freeze_experts=True)
  params = {"params": v["params"], "balance": v["balance"]}
  state = tx.init(params)
  n_state = sum(x.size for x in jax.tree.leaves(state))
  n_experts = sum(x.size for x in jax.tree.leaves(v["params"]["experts"]))
  n_rest = sum(x.size for x in jax.tree.leaves(v["params"])) - n_experts
  assert n_state < 3 * n_rest + 100       # (Adam: 2 moments; Muon: 1) — nothing for experts
  g = jax.grad(loss, allow_int=True)(v["params"])
  g = optim.integer_grads_to_zeros(g)
  assert all(x.dtype != jax.dtypes.float0 for x in jax.tree.leaves(g))
  updates, _ = tx.update({"params": g, "balance": jax.tree.map(jnp.zeros_like, v["balance"])},
                         state, params)
  new = optax.apply_updates(params, updates)
  jax.tree.map(np.testing.assert_array_equal, new["params"]["experts"], v["params"]["experts"])
  for a, b in zip(jax.tree.leaves(new["params"]["experts"]),
                  jax.tree.leaves(v["params"]["experts"])):
    assert a.dtype == b.dtype
  moved = np.abs(np.asarray(new["params"]["gate"]["kernel"] - v["params"]["gate"]["kernel"]))
  assert moved.max() > 1e-4
  assert np.abs(np.asarray(new["params"]["routed_expert_down_proj"]["kernel"]
                           - v["params"]["routed_expert_down_proj"]["kernel"])).max() > 1e-4


def test_param_label_frozen_and_integer():
  assert optim.param_label("params/layers_1/mlp/experts/w1", (4, 8, 8), jnp.float32,
                           freeze_experts=True) == "frozen"
  assert optim.param_label("params/layers_1/mlp/shared_experts/gate_proj/kernel", (8, 8),
                           jnp.float32, freeze_experts=True) == "muon"
  with pytest.raises(ValueError, match="layers_1/mlp/experts/w2/weight_scale: uint8"):
    optim.param_label("params/layers_1/mlp/experts/w2/weight_scale", (4, 8, 1), jnp.uint8)
