"""Tests for pallas_kernels.moe_gmm: interpret mode on CPU against per-group references, and
lowering for TPU (Mosaic) and CUDA (Triton) through jax.export."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.pallas_smem import capture
from k3jax.ops import moe
from k3jax.quant import mx
from pallas_kernels import moe_gmm

TILE = (16, 16, 16)  # small tiles: several row tiles, groups straddling tile boundaries


def _np_gmm(lhs, rhs, sizes):
  """Per-group loop: rows [o_g, o_g + size_g) times rhs[g]; rows past Σ sizes stay zero."""
  lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  o = 0
  for g, s in enumerate(np.asarray(sizes)):
    out[o:o + s] = lhs[o:o + s] @ rhs[g]
    o += s
  return out


def _np_tgmm(lhs, grad, sizes):
  lhs, grad = np.asarray(lhs, np.float64), np.asarray(grad, np.float64)
  out = np.zeros((len(sizes), lhs.shape[1], grad.shape[1]))
  o = 0
  for g, s in enumerate(np.asarray(sizes)):
    out[g] = lhs[o:o + s].T @ grad[o:o + s]
    o += s
  return out


def _jnp_gmm_masked(lhs, rhs, sizes):
  """Differentiable per-group einsum reference (a one-hot row→group mask)."""
  ends = jnp.cumsum(sizes)
  row_group = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")
  mask = jax.nn.one_hot(row_group, rhs.shape[0], dtype=lhs.dtype)   # rows past Σ: all zero
  return jnp.einsum("mk,gkn,mg->mn", lhs, rhs, mask)


SIZES = {
    "mixed_with_empty": [7, 0, 18, 0, 3, 22],            # Σ = 50 = M
    "all_in_one": [0, 0, 50, 0, 0, 0],
    "tail_rows_unused": [5, 9, 0, 0, 11, 2],              # Σ = 27 < M: rows 27.. are zero
    "all_empty": [0, 0, 0, 0, 0, 0],
}


def _data(seed, m=50, k=20, n=24, g=6):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(m, k)), jnp.float32),
          jnp.asarray(rng.normal(size=(g, k, n)), jnp.float32))


@pytest.mark.parametrize("case", sorted(SIZES))
def test_gmm_and_tgmm_match_per_group_reference(case):
  lhs, rhs = _data(0)
  sizes = jnp.asarray(SIZES[case], jnp.int32)

  @jax.jit
  def run(lhs, rhs, sizes, grad):
    return (moe_gmm.gmm(lhs, rhs, sizes, tiling=TILE),
            moe_gmm.tgmm(lhs, grad, sizes, tiling=TILE))

  grad = jnp.asarray(np.random.default_rng(1).normal(size=(50, 24)), jnp.float32)
  out, tout = run(lhs, rhs, sizes, grad)
  np.testing.assert_allclose(out, _np_gmm(lhs, rhs, sizes), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(tout, _np_tgmm(lhs, grad, sizes), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["mixed_with_empty", "all_in_one", "tail_rows_unused"])
def test_gmm_gradients_match_einsum_reference(case):
  lhs, rhs = _data(2)
  sizes = jnp.asarray(SIZES[case], jnp.int32)
  probe = jnp.asarray(np.random.default_rng(3).normal(size=(50, 24)), jnp.float32)

  def loss(fn):
    return jax.jit(jax.grad(lambda a, b: jnp.sum(fn(a, b, sizes) * probe), argnums=(0, 1)))

  got = loss(lambda a, b, s: moe_gmm.gmm(a, b, s, tiling=TILE))(lhs, rhs)
  want = loss(_jnp_gmm_masked)(lhs, rhs)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_gmm_default_tiling_bf16_and_odd_shapes():
  rng = np.random.default_rng(4)
  lhs = jnp.asarray(rng.normal(size=(37, 9)), jnp.bfloat16)
  rhs = jnp.asarray(rng.normal(size=(3, 9, 5)), jnp.bfloat16)
  sizes = jnp.array([20, 0, 17], jnp.int32)
  out = jax.jit(moe_gmm.gmm)(lhs, rhs, sizes)
  assert out.dtype == jnp.bfloat16 and out.shape == (37, 5)
  np.testing.assert_allclose(np.float32(out), _np_gmm(np.float32(lhs), np.float32(rhs), sizes),
                             rtol=3e-2, atol=1e-1)


# --------------------------------------------------------------------------- MXFP4 experts
def _packed(seed, k=64, n=24, g=6):
  """Experts [G, K, N] quantised by the exporter's quantiser, as an MXFP4Weight."""
  w = np.random.default_rng(seed).normal(size=(g, k, n)).astype(np.float32)
  return moe.MXFP4Weight(*(jnp.asarray(a) for a in mx.pack_expert(w)))


def test_in_kernel_decoders_equal_the_codecs():
  """E2M1 codes and E8M0 scales decoded by selects in the kernel = the MX codec's values."""
  codes = jnp.arange(16, dtype=jnp.int32)
  np.testing.assert_array_equal(np.asarray(moe_gmm._e2m1(codes)), mx._E2M1_TABLE)
  got = np.asarray(moe_gmm._e8m0(jnp.arange(256, dtype=jnp.int32)), np.float64)
  want = np.ldexp(1.0, np.arange(256) - 127)
  np.testing.assert_array_equal(got[1:255], want[1:255])
  assert got[0] in (0.0, want[0]) and np.isnan(got[255])    # 2^-127 is subnormal: may flush


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", ["mixed_with_empty", "tail_rows_unused"])
def test_gmm_on_mxfp4_equals_gmm_on_the_dequantised_experts(case, dtype):
  """The packed experts, dequantised in the kernel, give the dense gmm's product of
  `MXFP4Weight.dequantize` (fp32: to summation order; bf16: the same bf16 weights, fp32
  sums), and the same gradient in lhs."""
  sizes = jnp.asarray(SIZES[case], jnp.int32)
  w = _packed(5)
  lhs = jnp.asarray(np.random.default_rng(6).normal(size=(50, 64)), dtype)
  probe = jnp.asarray(np.random.default_rng(7).normal(size=(50, 24)), jnp.float32)
  dense = w.dequantize(dtype)

  def run(rhs):
    f = lambda a: jnp.sum(moe_gmm.gmm(a, rhs, sizes, tiling=TILE).astype(jnp.float32) * probe)
    return jax.jit(lambda a: (moe_gmm.gmm(a, rhs, sizes, tiling=TILE), jax.grad(f)(a)))(lhs)

  (out, d_lhs), (out_d, d_lhs_d) = run(w), run(dense)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  assert out.dtype == dtype
  np.testing.assert_allclose(np.float32(out), np.float32(out_d), rtol=tol, atol=tol)
  np.testing.assert_allclose(np.float32(d_lhs), np.float32(d_lhs_d), rtol=tol, atol=tol)
  if dtype == jnp.float32:    # and both are the per-group product
    np.testing.assert_allclose(out, _np_gmm(lhs, dense, sizes), rtol=1e-4, atol=1e-4)


def test_mxfp4_rhs_bad_input_names_the_problem():
  lhs = jnp.zeros((8, 64), jnp.float32)
  w = _packed(0)
  with pytest.raises(ValueError, match=r"MXFP4Weight rhs must be uint8 packed \[G, N, K/2 = 16\]"):
    moe_gmm.gmm(jnp.zeros((8, 32), jnp.float32), w, jnp.zeros(6, jnp.int32))
  with pytest.raises(ValueError, match="MXFP4Weight rhs"):
    moe_gmm.gmm(lhs, moe.MXFP4Weight(w.packed, w.scale[..., :1]), jnp.zeros(6, jnp.int32))
  with pytest.raises(ValueError, match="group_sizes"):
    moe_gmm.gmm(lhs, w, jnp.zeros(5, jnp.int32))


def test_permute_unpermute_roundtrip():
  x = jnp.arange(12.0).reshape(4, 3)
  indices = jnp.array([[2, 0], [0, 1], [2, 1], [0, 2]], jnp.int32)
  weights = jnp.full((4, 2), 0.5, jnp.float32)
  rows, info = moe_gmm.permute(x, indices, 3)
  np.testing.assert_array_equal(info["group_sizes"], [3, 2, 3])
  np.testing.assert_array_equal(info["token"], [0, 1, 3, 1, 2, 0, 2, 3])
  np.testing.assert_array_equal(rows, np.asarray(x)[[0, 1, 3, 1, 2, 0, 2, 3]])
  y, dropped = moe_gmm.unpermute(rows, weights, info, 4)
  np.testing.assert_allclose(y, x)              # two copies, weight 0.5 each
  assert int(dropped) == 0
  y2, dropped2 = moe_gmm.unpermute(rows, weights, info, 4, capacity=2)
  assert int(dropped2) == 2                     # third row of experts 0 and 2 (token 3 twice)
  np.testing.assert_allclose(y2[3], 0.0)
  np.testing.assert_allclose(y2[:3], x[:3])


def test_bad_input():
  lhs, rhs = _data(0)
  with pytest.raises(ValueError, match="rhs"):
    moe_gmm.gmm(lhs, rhs[:, :3], jnp.zeros(6, jnp.int32))
  with pytest.raises(ValueError, match="group_sizes"):
    moe_gmm.gmm(lhs, rhs, jnp.zeros(5, jnp.int32))
  with pytest.raises(ValueError, match="group_sizes"):
    moe_gmm.gmm(lhs, rhs, jnp.zeros(6, jnp.float32))


def _fwd_and_grad(lhs, rhs, sizes):
  out = moe_gmm.gmm(lhs, rhs, sizes, interpret=False)
  grads = jax.grad(lambda a, b: jnp.sum(moe_gmm.gmm(a, b, sizes, interpret=False) ** 2),
                   argnums=(0, 1))(lhs, rhs)
  return out, grads


SPECS = (jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
         jax.ShapeDtypeStruct((4, 128, 256), jnp.bfloat16),
         jax.ShapeDtypeStruct((4,), jnp.int32))


CUSTOM_CALL = {"tpu": "tpu_custom_call", "cuda": capture.TRITON_CALL}


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_lowers_for_tpu_mosaic_and_cuda_triton(platform):
  text = capture.export_text(_fwd_and_grad, SPECS, platform)
  assert text.count(CUSTOM_CALL[platform]) >= 3      # gmm fwd, gmm for d lhs, tgmm for d rhs


def _mxfp4_fwd_and_grad(lhs, packed, scale, sizes):
  w = moe.MXFP4Weight(packed, scale)
  out = moe_gmm.gmm(lhs, w, sizes, interpret=False)
  d_lhs = jax.grad(lambda a: jnp.sum(
      moe_gmm.gmm(a, w, sizes, interpret=False).astype(jnp.float32) ** 2))(lhs)
  return out, d_lhs


MXFP4_SPECS = (jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
               jax.ShapeDtypeStruct((4, 256, 64), jnp.uint8),     # packed [G, N, K/2]
               jax.ShapeDtypeStruct((4, 256, 4), jnp.uint8),      # scale [G, N, K/32]
               jax.ShapeDtypeStruct((4,), jnp.int32))


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_mxfp4_gmm_lowers(platform):
  """The in-kernel MXFP4 gmm (uint8 loads, nibble and scale decoding by integer ops and
  selects) lowers for Mosaic TPU and Triton; its backward is the dense gmm (two kernels)."""
  text = capture.export_text(_mxfp4_fwd_and_grad, MXFP4_SPECS, platform)
  # forward twice (value, and inside grad), d lhs once
  assert text.count(CUSTOM_CALL[platform]) == 3 and "_gmm_mxfp4_kernel" in text


def test_expert_mlp_through_the_mxfp4_kernel_equals_the_sorted_path():
  """`expert_mlp(..., gmm=moe_gmm.gmm)` with MXFP4 experts (the "pallas" backend's path for
  expert_format="mxfp4") = the sorted path that dequantises a chunk at a time: values and the
  gradients of x and the combine weights."""
  rng = np.random.default_rng(8)
  n, d, f, e, k = 40, 64, 32, 6, 2
  x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  scores = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(n, e)), jnp.float32))
  weights, indices, _ = moe.route(scores, jnp.zeros(e), k)
  w1, w3 = (_packed(s, k=d, n=f, g=e) for s in (9, 10))
  w2 = _packed(11, k=f, n=d, g=e)
  probe = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)

  def run(gmm):
    def loss(x, weights):
      y, _ = moe.expert_mlp(x, weights, indices, w1, w3, w2, gmm=gmm)
      return jnp.sum(y * probe), y
    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, weights)
    return y, grads

  y, (dx, dw) = run(moe_gmm.gmm)
  y_s, (dx_s, dw_s) = run(None)
  for name, a, b in (("y", y, y_s), ("dx", dx, dx_s), ("d weights", dw, dw_s)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)    # fp32: summation order only
    assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b)), name
  with pytest.raises(ValueError, match="takes dense weights"):
    moe.expert_mlp(x, weights, indices, w1, w3, w2, gmm=moe.ragged_gmm)
