"""Tests for pallas_kernels.moe_gmm: interpret mode on CPU against per-group references, and
lowering for TPU (Mosaic) and CUDA (Triton) through jax.export."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_lowers_for_tpu_mosaic():
  exp = jax.export.export(jax.jit(_fwd_and_grad), platforms=["tpu"])(*SPECS)
  text = exp.mlir_module()
  assert exp.platforms == ("tpu",)
  assert text.count("tpu_custom_call") >= 3      # gmm fwd, gmm for d lhs, tgmm for d rhs


def test_lowers_for_cuda_triton():
  # Triton lowering; its custom call has no stability guarantee, so export needs that one safety
  # check disabled. On a GPU backend the kernels pass Triton CompilerParams themselves. Exported
  # from a CPU host they pass none: jax 0.10 then picks the lowering by the config flag
  # `jax_pallas_use_mosaic_gpu` (default Mosaic GPU, which rejects a plain dot), so the test sets
  # it to False; jax >= 0.11 dropped that flag (Triton is the pallas_call default on GPU there).
  has_flag = hasattr(jax.config, "jax_pallas_use_mosaic_gpu")
  if has_flag:
    prev = jax.config.jax_pallas_use_mosaic_gpu
    jax.config.update("jax_pallas_use_mosaic_gpu", False)
  try:
    exp = jax.export.export(
        jax.jit(_fwd_and_grad), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*SPECS)
  finally:
    if has_flag:
      jax.config.update("jax_pallas_use_mosaic_gpu", prev)
  assert exp.platforms == ("cuda",)
  assert exp.mlir_module().count("__gpu$xla.gpu.triton") >= 3
