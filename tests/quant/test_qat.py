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


# Every path of ops.moe, the Pallas grouped matmul interpreted on CPU: each returns
# (y, dropped) and must drop nothing here.
CAP = 16


def _pallas(*a, **kw):
  from pallas_kernels.moe_gmm import gmm
  return moe_ops.expert_mlp(*a, gmm=gmm, **kw)


PATHS = {
    "reference": lambda *a: moe_ops.expert_mlp_reference(*a, input_quant="mxfp8"),
    "sort_tiled": lambda *a: moe_ops.expert_mlp(*a, input_quant="mxfp8"),
    "sort_buffer": lambda *a: moe_ops.expert_mlp(*a, capacity=CAP, input_quant="mxfp8"),
    "grouped_xla": lambda *a: moe_ops.expert_mlp(*a, gmm=moe_ops.ragged_gmm,
                                                 input_quant="mxfp8"),
    "grouped_pallas": lambda *a: _pallas(*a, input_quant="mxfp8"),
}


def test_qat_expert_mlp_every_path_equals_quantised_reference(problem):
  x, weights, indices, w1, w3, w2 = problem
  assert moe_ops.sort_layout(N, K, E, None)[0] == "tiled"
  assert moe_ops.sort_layout(N, K, E, CAP)[0] == "buffer"
  want, _ = _qat_reference(*problem)

  @jax.jit
  def run(x, weights, indices, w1, w3, w2):   # one compile for every path
    ws = [qat.fake_mxfp4_expert(w) for w in (w1, w3, w2)]
    out = {name: fn(x, weights, indices, *ws) for name, fn in PATHS.items()}
    # The packed form of the same weights (what serving holds).
    packed = [moe_ops.MXFP4Weight(*mx.pack_expert(w)) for w in (w1, w3, w2)]
    out["packed"] = moe_ops.expert_mlp(x, weights, indices, *packed, input_quant="mxfp8")
    out["plain"] = moe_ops.expert_mlp_reference(x, weights, indices, w1, w3, w2)
    return out

  out = run(*problem)
  plain = out.pop("plain")[0]
  for name, (got, dropped) in out.items():
    assert int(dropped) == 0, name
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=name)
  # The quantisation is real: without it the result differs by far more than the tolerance.
  assert float(jnp.max(jnp.abs(plain - want))) > 1e-2


def test_qat_expert_parallel_equals_quantised_reference(problem):
  """The expert-parallel path (8 CPU devices: data 2 × expert 4, all_to_all dispatch) runs the
  same QAT function."""
  from k3jax import sharding
  from k3jax.parallel import expert as ep_lib
  x, weights, indices, w1, w3, w2 = problem
  want, _ = _qat_reference(*problem)
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, expert=4))
  with jax.set_mesh(mesh):
    fn = ep_lib.maybe_expert_parallel(moe_ops.expert_mlp)
    fq = qat.fake_mxfp4_expert
    got, dropped = jax.jit(lambda x_, p_, i_, a1, a3, a2: fn(
        x_, p_, i_, fq(a1), fq(a3), fq(a2), input_quant="mxfp8"))(x, weights, indices, w1, w3, w2)
  assert int(dropped) == 0
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_qat_gradients_pass_straight_through(problem):
  """d/d(x, weights, w1, w3, w2) of the QAT expert MLP = the unquantised stages' vector-Jacobian
  products evaluated at the quantised point (x_q, W_q, h_q), the quantisers skipped."""
  x, weights, indices, w1, w3, w2 = problem
  c = jax.random.normal(jax.random.key(6), (N, D))
  fq = qat.fake_mxfp4_expert

  def loss(x_, p_, a1, a3, a2):
    y = moe_ops.expert_mlp(x_, p_, indices, fq(a1), fq(a3), fq(a2), input_quant="mxfp8")[0]
    return jnp.sum(c * y)

  # Weights alone as well: the gradient at w is the unquantised op's gradient at q(w).
  plain = lambda a1: jnp.sum(c * moe_ops.expert_mlp(x, weights, indices, a1, w3, w2)[0])

  @jax.jit
  def grads(x_, p_, a1, a3, a2):   # one compile
    return (jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x_, p_, a1, a3, a2),
            jax.grad(lambda a: plain(fq(a)))(a1), jax.grad(plain)(fq(a1)))

  got, g_qat, g_plain = grads(x, weights, w1, w3, w2)
  _, (xq, w1q, w3q, w2q, hq) = _qat_reference(*problem)
  _, vjp2 = jax.vjp(lambda h, a2, p_: _stage2(h, a2, p_, indices), hq, w2q, weights)
  d_hq, d_w2, d_p = vjp2(c)
  _, vjp1 = jax.vjp(lambda x_, a1, a3: _stage1(x_, a1, a3, indices), xq, w1q, w3q)
  d_x, d_w1, d_w3 = vjp1(d_hq)
  for name, g, r in zip(("x", "weights", "w1", "w3", "w2"), got, (d_x, d_p, d_w1, d_w3, d_w2)):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=name)
  np.testing.assert_allclose(g_qat, g_plain, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ the model
TOKENS = [[5, 9, 11, 3, 7, 1, 2, 8], [7, 1, 4, 4, 200, 13, 5, 6]]


def _flat(tree, prefix=""):
  """{"a/b/c": leaf-tuple} of a captured-intermediates dict."""
  out = {}
  for k, x in tree.items():
    if isinstance(x, dict):
      out.update(_flat(x, f"{prefix}{k}/"))
    else:
      out[prefix + k] = x
  return out


@pytest.fixture(scope="module")
def tiny_model():
  """2 layers (compile time: layer 0 KDA + dense MLP, layer 1 MLA + MoE), expert_qat on; the
  params, and the logits and every module's output with and without the flag (one compile)."""
  from k3jax.model import K3Model
  cfg = preset("tiny", num_layers=2, moe_capacity_factor=None, expert_qat="mxfp4_mxfp8")
  toks = jnp.asarray(TOKENS)
  v = nn.unbox(jax.jit(K3Model(cfg).init)(jax.random.key(0), toks[:, :4]))

  @jax.jit
  def forward(v_, t):
    out = []
    for c in (cfg, cfg.replace(expert_qat=None)):
      logits, state = K3Model(c).apply(v_, t, capture_intermediates=True)   # [B, T, vocab]
      out.append((logits, _flat(state["intermediates"])))
    return out

  return cfg, v, forward(v, toks)


# Modules whose inputs do not depend on the routed experts in the 2-layer model: their outputs
# must be bit-identical with and without the flag (a module that read expert_qat would differ).
_BEFORE_EXPERTS = ("embed", "layers_0/", "layers_1/self_attn", "layers_1/input_layernorm",
                   "layers_1/self_attention_res", "layers_1/post_attention_layernorm",
                   "layers_1/block_sparse_moe/gate/", "layers_1/block_sparse_moe/shared_experts",
                   "layers_1/block_sparse_moe/routed_expert_down_proj/",
                   "layers_1/block_sparse_moe/experts/")


def test_modules_outside_the_experts_are_untouched_by_the_flag(tiny_model):
  """Attention (KDA, MLA), dense MLP, norms, AttnRes, embedding, router, latent down projection
  and shared experts give the same outputs with the flag; the latent up projection and the head
  apply their unquantised kernels; the routed experts do change."""
  _, v, ((lq, iq), (lp, ip)) = tiny_model
  assert set(iq) == set(ip)
  compared = [k for k in iq if k.startswith(_BEFORE_EXPERTS)]
  assert len(compared) > 20 and any(k.startswith("layers_0/mlp") for k in compared)
  for k in compared:
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b, err_msg=k), iq[k], ip[k])
  p = v["params"]
  moe = "layers_1/block_sparse_moe/"
  np.testing.assert_allclose(iq[moe + "routed_expert_up_proj/__call__"][0],
                             iq[moe + "routed_expert_norm/__call__"][0]
                             @ p["layers_1"]["block_sparse_moe"]["routed_expert_up_proj"]["kernel"],
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(iq["lm_head/__call__"][0],
                             iq["norm/__call__"][0] @ p["lm_head"]["kernel"], rtol=1e-5,
                             atol=1e-5)
  assert float(jnp.max(jnp.abs(iq[moe + "__call__"][0] - ip[moe + "__call__"][0]))) > 1e-4
  assert float(jnp.max(jnp.abs(lq - lp))) > 1e-4


def test_qat_moe_layer_equals_quantised_reference(tiny_model):
  """Inside the model, the routed path = the reference QAT expert MLP (ml_dtypes-quantised
  weights and inputs) on the layer's z and routing, then the unquantised RMSNorm."""
  cfg, v, ((_, iq), _) = tiny_model
  p = v["params"]["layers_1"]["block_sparse_moe"]
  moe = "layers_1/block_sparse_moe/"
  z = iq[moe + "routed_expert_down_proj/__call__"][0]
  scores, bias = iq[moe + "gate/__call__"][0]
  w, idx, _ = moe_ops.route(scores, bias, cfg.experts_per_token)
  u = _qat_reference(z, w * cfg.routed_scaling_factor, idx,
                     *(p["experts"][n] for n in ("w1", "w3", "w2")))[0]
  normed = u * jax.lax.rsqrt(jnp.mean(u * u, -1, keepdims=True) + cfg.rms_norm_eps)
  normed = normed * p["routed_expert_norm"]["weight"]
  np.testing.assert_allclose(iq[moe + "routed_expert_norm/__call__"][0], normed, rtol=1e-4,
                             atol=1e-5)


def test_served_packed_model_is_the_qat_model(tiny_model):
  """Packed MXFP4 experts + the config's MXFP8 inputs, through the serving forward
  (`generate.prefill`, with caches; decode steps run the same forward), give the QAT model's
  logits."""
  from k3jax import generate as G
  cfg, v, ((lq, _), _) = tiny_model
  served_cfg = cfg.replace(expert_format="mxfp4")
  served_v = {**v, "params": jax.jit(mx.pack_expert_params)(v["params"])}
  toks, lengths = G.padded_prompts(TOKENS)
  served = np.asarray(G.prefill(served_cfg, served_v, toks, lengths)[0])
  want = np.asarray(lq[:, -1])
  np.testing.assert_allclose(served, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
