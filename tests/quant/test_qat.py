"""Quantisation-aware training of the routed experts (k3jax/quant/qat.py, spec §13).

The quantisers against ml_dtypes' E2M1/E4M3/E8M0 types; the QAT expert MLP in every path
against a per-token reference on quantised weights and inputs; straight-through gradients
against the unquantised op's gradient at the quantised point; modules outside the experts
untouched; the served packed (MXFP4) model = the QAT model.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k3jax.config import preset
from k3jax.layers.moe import StableLatentMoE
from k3jax.ops import moe as moe_ops
from k3jax.quant import mx, qat

F4 = ml_dtypes.float4_e2m1fn
F8 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu


def _mx_reference(x: np.ndarray, elem, emax: int, max_value: float) -> np.ndarray:
  """MX fake quantisation along the last axis, block by block, with ml_dtypes casts: shared
  scale 2^(floor(log2 amax) − emax) as an E8M0 value, elements rounded by the element type."""
  x = np.ascontiguousarray(x, np.float64)
  out = np.zeros(x.shape)
  flat, oflat = x.reshape(-1, x.shape[-1]), out.reshape(-1, x.shape[-1])
  for r in range(flat.shape[0]):
    for b in range(flat.shape[1] // 32):
      blk = flat[r, 32 * b:32 * (b + 1)]
      amax = np.abs(blk).max()
      if amax == 0:
        continue
      scale = float(np.array([2.0 ** (np.floor(np.log2(amax)) - emax)], np.float32)
                    .astype(E8M0).astype(np.float64)[0])
      y = np.clip(blk / scale, -max_value, max_value).astype(np.float32).astype(elem)
      oflat[r, 32 * b:32 * (b + 1)] = y.astype(np.float64) * scale
  return out.astype(np.float32)


def _ref_mxfp8(x):
  return _mx_reference(x, F8, 8, 448.0)


def _ref_mxfp4_kernel(w):
  """MXFP4 of an [..., in, out] kernel: blocks along `in`."""
  return np.swapaxes(_mx_reference(np.swapaxes(np.asarray(w), -1, -2), F4, 2, 6.0), -1, -2)


def _values(key, shape, spread=20):
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, shape) * 2.0 ** jax.random.randint(k2, shape[:-1] + (1,), -spread,
                                                               spread)
  return x.at[(0,) * (len(shape) - 1) + (slice(0, 32),)].set(0.0)   # an all-zero block


def test_quantizers_are_the_ml_dtypes_roundings():
  x = _values(jax.random.key(0), (3, 5, 96))
  fake8 = jax.jit(qat.fake_mxfp8)
  np.testing.assert_array_equal(fake8(x), _ref_mxfp8(x))
  # bf16 activations: quantised from their float32 value, returned in bf16 (exactly).
  xb = x.astype(jnp.bfloat16)
  yb = fake8(xb)
  assert yb.dtype == jnp.bfloat16
  np.testing.assert_array_equal(yb.astype(jnp.float32), _ref_mxfp8(xb.astype(jnp.float32)))
  # Weights [E, in, out]: MXFP4 along `in`, the exporter's codes (numpy mxfp4_pack of [out, in]).
  w = jnp.swapaxes(_values(jax.random.key(1), (2, 48, 64), spread=6), -1, -2)   # scales per out
  fq = np.asarray(jax.jit(qat.fake_mxfp4_expert)(w))
  np.testing.assert_array_equal(fq, _ref_mxfp4_kernel(w))
  export = mx.mxfp4_unpack(*mx.mxfp4_pack(np.ascontiguousarray(np.swapaxes(np.asarray(w), -1, -2))))
  np.testing.assert_array_equal(fq, np.swapaxes(export, -1, -2))
  # Quantised values are fixed points.
  np.testing.assert_array_equal(jax.jit(qat.fake_mxfp4_expert)(jnp.asarray(fq)), fq)
  with pytest.raises(ValueError, match=r"x: MXFP8 blocks need .* \(2, 48\)"):
    qat.fake_mxfp8(jnp.zeros((2, 48)))
  with pytest.raises(ValueError, match=r"w: expected an expert kernel .* \(2, 40, 64\)"):
    qat.fake_mxfp4_expert(jnp.zeros((2, 40, 64)))
  with pytest.raises(ValueError, match="input_quant: expected None or 'mxfp8'"):
    moe_ops.quantized_inputs(x, None, "mxfp4")
  with pytest.raises(ValueError, match="ModelConfig.expert_qat: expected None or 'mxfp4_mxfp8'"):
    preset("tiny", expert_qat="mxfp4")
  with pytest.raises(ValueError, match="ModelConfig.expert_qat: 'mxfp4_mxfp8' needs"):
    preset("tiny", expert_qat="mxfp4_mxfp8", moe_intermediate_size=48)


def test_straight_through_gradient_is_the_identity():
  x = _values(jax.random.key(2), (64, 64), spread=4)
  c = jax.random.normal(jax.random.key(3), x.shape)
  for fq in (qat.fake_mxfp8, qat.fake_mxfp4_expert):
    g = jax.jit(jax.grad(lambda x_: jnp.sum(c * fq(x_))))(x)
    np.testing.assert_array_equal(g, c)
    # Forward mode: the tangent passes unchanged too.
    _, t = jax.jit(lambda x_, c_: jax.jvp(fq, (x_,), (c_,)))(x, c)
    np.testing.assert_array_equal(t, c)


# ------------------------------------------------------------------ the QAT expert MLP
N, D, F, E, K = 32, 64, 32, 8, 2


@pytest.fixture(scope="module")
def problem():
  ks = jax.random.split(jax.random.key(4), 6)
  x = jax.random.normal(ks[0], (N, D))
  scores = jax.nn.sigmoid(jax.random.normal(ks[1], (N, E)))
  weights, indices, _ = moe_ops.route(scores, jnp.zeros(E), K)
  w1 = jax.random.normal(ks[2], (E, D, F)) * D ** -0.5
  w3 = jax.random.normal(ks[3], (E, D, F)) * D ** -0.5
  w2 = jax.random.normal(ks[4], (E, F, D)) * F ** -0.5
  return x, weights, indices, w1, w3, w2


def _act(a, b):
  return moe_ops.situ_glu(a, b)


def _stage1(xq, w1, w3, indices):
  """h [N, k, F]: the gated activation of each (token, slot) pair, unquantised op."""
  hi = jax.lax.Precision.HIGHEST
  a = jnp.einsum("nd,nkdf->nkf", xq, w1[indices], precision=hi)
  b = jnp.einsum("nd,nkdf->nkf", xq, w3[indices], precision=hi)
  return _act(a, b)


def _stage2(hq, w2, weights, indices):
  """y [N, D] = Σ_k weights · hq w2[e], unquantised op."""
  return jnp.einsum("nk,nkf,nkfd->nd", weights, hq, w2[indices],
                    precision=jax.lax.Precision.HIGHEST)


def _qat_reference(x, weights, indices, w1, w3, w2):
  """Per-pair QAT expert MLP on ml_dtypes-quantised weights and inputs (numpy quantisers)."""
  q4 = lambda w: jnp.asarray(_ref_mxfp4_kernel(w))
  q8 = lambda a: jnp.asarray(_ref_mxfp8(a))
  xq, w1q, w3q, w2q = q8(x), q4(w1), q4(w3), q4(w2)
  hq = q8(_stage1(xq, w1q, w3q, indices))
  return _stage2(hq, w2q, weights, indices), (xq, w1q, w3q, w2q, hq)


# Every path of ops.moe (the Pallas grouped matmul is checked on the layer below): each
# returns (y, dropped) and must drop nothing here.
CAP = 16
PATHS = {
    "reference": lambda *a: moe_ops.expert_mlp_reference(*a, input_quant="mxfp8"),
    "sort_tiled": lambda *a: moe_ops.expert_mlp(*a, input_quant="mxfp8"),
    "sort_buffer": lambda *a: moe_ops.expert_mlp(*a, capacity=CAP, input_quant="mxfp8"),
    "grouped_xla": lambda *a: moe_ops.expert_mlp(*a, gmm=moe_ops.ragged_gmm,
                                                 input_quant="mxfp8"),
}


def test_qat_expert_mlp_every_path_equals_quantised_reference(problem):
  x, weights, indices, w1, w3, w2 = problem
  assert moe_ops.sort_layout(N, K, E, None)[0] == "tiled"
  assert moe_ops.sort_layout(N, K, E, CAP)[0] == "buffer"
  want, _ = _qat_reference(*problem)
  fq = qat.fake_mxfp4_expert
  for name, fn in PATHS.items():
    got, dropped = jax.jit(fn)(x, weights, indices, fq(w1), fq(w3), fq(w2))
    assert int(dropped) == 0, name
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=name)
  # The packed form of the same weights (what serving holds) gives the same result.
  packed = [moe_ops.MXFP4Weight(*mx.pack_expert(w)) for w in (w1, w3, w2)]
  got = jax.jit(lambda *a: moe_ops.expert_mlp(*a, input_quant="mxfp8")[0])(
      x, weights, indices, *packed)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg="packed")
  # The quantisation is real: without it the result differs by far more than the tolerance.
  plain = moe_ops.expert_mlp_reference(x, weights, indices, w1, w3, w2)[0]
  assert float(jnp.max(jnp.abs(plain - want))) > 1e-2


def test_qat_gradients_pass_straight_through(problem):
  """d/d(x, weights, w1, w3, w2) of the QAT expert MLP = the unquantised stages' vector-Jacobian
  products evaluated at the quantised point (x_q, W_q, h_q), the quantisers skipped."""
  x, weights, indices, w1, w3, w2 = problem
  c = jax.random.normal(jax.random.key(6), (N, D))
  fq = qat.fake_mxfp4_expert

  def loss(x_, p_, a1, a3, a2):
    y = moe_ops.expert_mlp(x_, p_, indices, fq(a1), fq(a3), fq(a2), input_quant="mxfp8")[0]
    return jnp.sum(c * y)

  got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(x, weights, w1, w3, w2)
  _, (xq, w1q, w3q, w2q, hq) = _qat_reference(*problem)
  _, vjp2 = jax.vjp(lambda h, a2, p_: _stage2(h, a2, p_, indices), hq, w2q, weights)
  d_hq, d_w2, d_p = vjp2(c)
  _, vjp1 = jax.vjp(lambda x_, a1, a3: _stage1(x_, a1, a3, indices), xq, w1q, w3q)
  d_x, d_w1, d_w3 = vjp1(d_hq)
  for name, g, r in zip(("x", "weights", "w1", "w3", "w2"), got, (d_x, d_p, d_w1, d_w3, d_w2)):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=name)
  # Weights alone: the gradient at w is the unquantised op's gradient at q(w).
  plain = lambda a1: jnp.sum(c * moe_ops.expert_mlp(x, weights, indices, a1, w3, w2)[0])
  g_qat = jax.jit(jax.grad(lambda a1: plain(fq(a1))))(w1)
  np.testing.assert_allclose(g_qat, jax.jit(jax.grad(plain))(fq(w1)), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ the layer and the model
def _captured(cfg, v, x):
  y, state = jax.jit(lambda v_, x_: StableLatentMoE(cfg).apply(
      v_, x_, capture_intermediates=True))(v, x)
  return y, state["intermediates"]


def test_layer_quantises_only_the_routed_experts():
  cfg = preset("tiny")
  qcfg = cfg.replace(expert_qat="mxfp4_mxfp8")
  x = jax.random.normal(jax.random.key(7), (2, 8, cfg.d_model))
  v = nn.unbox(StableLatentMoE(cfg).init(jax.random.key(8), x))
  y0, it0 = _captured(cfg, v, x)
  y1, it1 = _captured(qcfg, v, x)
  # Router, latent down projection and shared experts: same outputs with the flag.
  for name in ("gate", "routed_expert_down_proj", "shared_experts"):
    jax.tree.map(np.testing.assert_array_equal, it1[name], it0[name])
  assert float(jnp.max(jnp.abs(y1 - y0))) > 1e-4   # the routed experts did change
  # The routed path = the reference QAT expert MLP on the same z and routing, then the
  # unquantised RMSNorm and W_up.
  p = v["params"]
  z = it1["routed_expert_down_proj"]["__call__"][0]
  scores, bias = it1["gate"]["__call__"][0]
  w, idx, _ = moe_ops.route(scores, bias, cfg.experts_per_token)
  u = _qat_reference(z, w * cfg.routed_scaling_factor, idx,
                     *(p["experts"][n] for n in ("w1", "w3", "w2")))[0]
  norm = p["routed_expert_norm"]
  u32 = u.astype(jnp.float32)
  normed = u32 * jax.lax.rsqrt(jnp.mean(u32 * u32, -1, keepdims=True) + cfg.rms_norm_eps)
  normed = normed * jax.tree.leaves(norm)[0]
  np.testing.assert_allclose(it1["routed_expert_norm"]["__call__"][0], normed, rtol=1e-4,
                             atol=1e-5)
  up = jax.tree.leaves(p["routed_expert_up_proj"])[0]
  np.testing.assert_allclose(it1["routed_expert_up_proj"]["__call__"][0],
                             it1["routed_expert_norm"]["__call__"][0] @ up, rtol=1e-5, atol=1e-6)
  # Every backend runs the same QAT layer.
  y_pallas = jax.jit(StableLatentMoE(qcfg.replace(kernel_backend="pallas")).apply)(v, x)
  np.testing.assert_allclose(y_pallas, y1, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_model():
  from k3jax.model import K3Model
  # 2 layers (compile time): layer 0 KDA + dense MLP, layer 1 MLA + MoE.
  cfg = preset("tiny", num_layers=2, moe_capacity_factor=None, expert_qat="mxfp4_mxfp8")
  v = nn.unbox(jax.jit(K3Model(cfg).init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
  return cfg, v


def test_modules_outside_the_experts_are_untouched_by_the_flag(tiny_model):
  """A model without MoE layers (attention, dense MLP, AttnRes, embedding, head) computes the
  same logits with and without `expert_qat`."""
  from k3jax.model import K3Model
  cfg, _ = tiny_model
  dense = cfg.replace(first_dense_layers=cfg.num_layers)
  toks = jnp.asarray([[5, 9, 11, 3, 7, 1, 2, 8]])
  v = nn.unbox(jax.jit(K3Model(dense).init)(jax.random.key(1), toks))
  fwd = lambda c: jax.jit(lambda v_, t: K3Model(c).apply(v_, t))(v, toks)
  a, b = fwd(dense), fwd(dense.replace(expert_qat=None))
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_served_packed_model_is_the_qat_model(tiny_model):
  """Packed MXFP4 experts + the config's MXFP8 inputs reproduce the QAT model's logits through
  the serving forward (`generate.prefill`, with caches; decode steps are the same forward)."""
  from k3jax import generate as G
  cfg, v = tiny_model
  served_cfg = cfg.replace(expert_format="mxfp4")
  served_v = {**v, "params": mx.pack_expert_params(v["params"])}
  toks, lengths = G.padded_prompts([[5, 9, 11, 3], [7, 1]])
  logits = np.asarray(G.prefill(cfg, v, toks, lengths, max_len=16)[0])
  served = np.asarray(G.prefill(served_cfg, served_v, toks, lengths, max_len=16)[0])
  np.testing.assert_allclose(served, logits, rtol=1e-5, atol=1e-5 * np.abs(logits).max())
