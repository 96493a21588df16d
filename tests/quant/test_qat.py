"""Quantisation-aware training of the routed experts (k3jax/quant/qat.py, docs/k3.md §13): the
quantisers against ml_dtypes' E2M1/E4M3/E8M0 types; the QAT expert MLP in every path (reference,
sorted buffer/tiled, grouped XLA/Pallas, packed, expert-parallel) against a per-pair reference on
quantised weights and inputs (tests/quant/qat_reference.py); straight-through gradients against
the unquantised op's gradient at the quantised point. The model: tests/quant/test_qat_model.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import preset
from k3jax.ops import moe as moe_ops
from k3jax.quant import mx, qat
from qat_reference import qat_reference, ref_mxfp4_kernel, ref_mxfp8, stage1, stage2


def _values(key, shape, spread=20):
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, shape) * 2.0 ** jax.random.randint(k2, shape[:-1] + (1,), -spread,
                                                               spread)
  return x.at[(0,) * (len(shape) - 1) + (slice(0, 32),)].set(0.0)   # an all-zero block


def test_quantizers_are_the_ml_dtypes_roundings():
  x = _values(jax.random.key(0), (3, 5, 96))
  fake8 = jax.jit(qat.fake_mxfp8)
  np.testing.assert_array_equal(fake8(x), ref_mxfp8(x))
  # bf16 activations: quantised from their float32 value, returned in bf16 (exactly).
  xb = x.astype(jnp.bfloat16)
  yb = fake8(xb)
  assert yb.dtype == jnp.bfloat16
  np.testing.assert_array_equal(yb.astype(jnp.float32), ref_mxfp8(xb.astype(jnp.float32)))
  # Weights [E, in, out]: MXFP4 along `in`, the exporter's codes (numpy mxfp4_pack of [out, in]).
  w = jnp.swapaxes(_values(jax.random.key(1), (2, 48, 64), spread=6), -1, -2)   # scales per out
  fq = np.asarray(jax.jit(qat.fake_mxfp4_expert)(w))
  np.testing.assert_array_equal(fq, ref_mxfp4_kernel(w))
  w_out_in = np.ascontiguousarray(np.swapaxes(np.asarray(w), -1, -2))   # the exporter's [out, in]
  export = mx.mxfp4_unpack(*mx.mxfp4_pack(w_out_in))
  np.testing.assert_array_equal(fq, np.swapaxes(export, -1, -2))
  # Quantised values are fixed points.
  np.testing.assert_array_equal(jax.jit(qat.fake_mxfp4_expert)(jnp.asarray(fq)), fq)
  with pytest.raises(ValueError, match=r"x: MXFP8 blocks need .* \(2, 48\)"):
    qat.fake_mxfp8(jnp.zeros((2, 48)))
  with pytest.raises(ValueError, match=r"w: expected an expert kernel .* \(2, 40, 64\)"):
    qat.fake_mxfp4_expert(jnp.zeros((2, 40, 64)))
  with pytest.raises(ValueError, match="input_quant: expected None or 'mxfp8'"):
    moe_ops.quantized_inputs(x, None, "mxfp4")
  with pytest.raises(ValueError, match="ModelConfig.modes.expert_qat: expected None or 'mxfp4_mxfp8'"):
    preset("tiny", expert_qat="mxfp4")
  with pytest.raises(ValueError, match="ModelConfig.modes.expert_qat: 'mxfp4_mxfp8' needs"):
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
  want, _ = qat_reference(*problem)

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
  want, _ = qat_reference(*problem)
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
  _, (xq, w1q, w3q, w2q, hq) = qat_reference(*problem)
  _, vjp2 = jax.vjp(lambda h, a2, p_: stage2(h, a2, p_, indices), hq, w2q, weights)
  d_hq, d_w2, d_p = vjp2(c)
  _, vjp1 = jax.vjp(lambda x_, a1, a3: stage1(x_, a1, a3, indices), xq, w1q, w3q)
  d_x, d_w1, d_w3 = vjp1(d_hq)
  for name, g, r in zip(("x", "weights", "w1", "w3", "w2"), got, (d_x, d_p, d_w1, d_w3, d_w2)):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=name)
  np.testing.assert_allclose(g_qat, g_plain, rtol=1e-6, atol=1e-7)

