"""MXFP4-packed experts (ops.moe.MXFP4Weight) against the dequantise-everything reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import moe
from k3jax.quant import mx


def _problem(seed, n, d, f, e, k, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(ks[0], (n, d), dtype)
  scores = jax.nn.sigmoid(jax.random.normal(ks[1], (n, e)))
  weights, indices, _ = moe.route(scores, jnp.zeros((e,)), k)
  w = lambda key, s: jax.random.normal(key, s, jnp.float32) * s[-2] ** -0.5
  packed = [moe.MXFP4Weight(*mx.pack_expert(w(ks[2 + i], s)))
            for i, s in enumerate([(e, d, f), (e, d, f), (e, f, d)])]
  return x, weights, indices, packed


def _dense(ws, dtype=jnp.float32):
  return [w.dequantize(dtype) for w in ws]


@pytest.mark.parametrize("n,e,k,cap,chunk", [
    (24, 8, 2, None, None),      # dropless → tiled layout, one expert dequantised per tile
    (24, 8, 2, 8, None),         # capacity buffer, all experts in one chunk
    (24, 8, 2, 8, 3 * 32 * 64 * 2),   # capacity buffer, scanned in chunks of 2 experts
    (16, 4, 3, 4, 1),            # chunks of 1 expert, drops
    (3, 16, 2, None, None),      # 6 pairs < 16 experts (a decode step): pairs, 6 dequantised
    (3, 16, 2, None, 3 * 32 * 64 * 2),   # the same in chunks of 2 pairs
])
def test_packed_equals_dequantised_reference(monkeypatch, n, e, k, cap, chunk):
  if chunk is not None:
    monkeypatch.setattr(moe, "DEQUANT_CHUNK_ELEMENTS", chunk)
  x, weights, indices, packed = _problem(0, n, 32, 64, e, k)
  fast = jax.jit(functools.partial(moe.expert_mlp, capacity=cap))
  y, dropped = fast(x, weights, indices, *packed)
  y_ref, d_ref = moe.expert_mlp_reference(x, weights, indices, *packed, capacity=cap)
  y_dense, d_dense = moe.expert_mlp(x, weights, indices, *_dense(packed), capacity=cap)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y, y_dense, rtol=1e-5, atol=1e-5)
  assert int(dropped) == int(d_ref) == int(d_dense)
  assert float(jnp.abs(y).max()) > 0.1


def test_packed_gradient_wrt_tokens(monkeypatch):
  """Frozen packed experts still pass gradients to their inputs (chunked scan, remat'd dequant)."""
  monkeypatch.setattr(moe, "DEQUANT_CHUNK_ELEMENTS", 3 * 32 * 64 * 2)
  x, weights, indices, packed = _problem(1, 24, 32, 64, 8, 2)
  loss = lambda fn, ws: lambda x_: jnp.sum(fn(x_, weights, indices, *ws, capacity=8)[0] ** 2)
  g = jax.jit(jax.grad(loss(moe.expert_mlp, packed)))(x)
  g_ref = jax.grad(loss(moe.expert_mlp_reference, _dense(packed)))(x)
  np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-4)


def test_packed_decode_step_gradient_wrt_tokens():
  """The pairs path (fewer pairs than experts) passes gradients to its tokens too."""
  x, weights, indices, packed = _problem(3, 2, 32, 64, 16, 2)
  loss = lambda fn, ws: lambda x_: jnp.sum(fn(x_, weights, indices, *ws)[0] ** 2)
  g = jax.jit(jax.grad(loss(moe.expert_mlp, packed)))(x)
  g_ref = jax.grad(loss(moe.expert_mlp_reference, _dense(packed)))(x)
  np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-4)
  assert float(jnp.abs(g).max()) > 1e-3


def test_packed_bf16_compute_matches_dequantised_bf16():
  x, weights, indices, packed = _problem(2, 16, 32, 64, 4, 2)
  xb = x.astype(jnp.bfloat16)
  y, _ = jax.jit(moe.expert_mlp)(xb, weights, indices, *packed)
  y_ref, _ = jax.jit(moe.expert_mlp)(xb, weights, indices, *_dense(packed, jnp.bfloat16))
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32),
                             rtol=2e-2, atol=2e-2)


def test_packed_errors():
  x, weights, indices, packed = _problem(3, 8, 32, 64, 4, 2)
  with pytest.raises(ValueError, match="gmm"):
    moe.expert_mlp(x, weights, indices, *packed, gmm=moe.ragged_gmm)
  bad = moe.MXFP4Weight(packed[0].packed, packed[0].scale[:, :1])
  with pytest.raises(ValueError, match="w1 MXFP4Weight must be uint8"):
    moe.expert_mlp(x, weights, indices, bad, *packed[1:])


@pytest.mark.parametrize("grad", [False, True])
def test_packed_temporaries_stay_below_one_bf16_copy(grad):
  """Mid-size layer: the compiled packed path's temporaries are far below the bf16 experts, in
  the forward and in the gradient with respect to the inputs (frozen experts, as under LoRA):
  the backward recomputes each chunk's dequantised weights rather than keeping them, or
  anything made of them (w1‖w3 concatenated), for every chunk of the layer. (On this CPU: 24
  and 30 MiB whatever the number of experts, one chunk's worth; 298 MiB for 64 experts when
  the backward kept every chunk's w1‖w3.)"""
  n, d, f, e, k = 256, 512, 512, 128, 4
  x = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((n, k), jnp.float32)
  i = jax.ShapeDtypeStruct((n, k), jnp.int32)
  ps = lambda din, dout: moe.MXFP4Weight(
      jax.ShapeDtypeStruct((e, dout, din // 2), jnp.uint8),
      jax.ShapeDtypeStruct((e, dout, din // 32), jnp.uint8))
  mlp = functools.partial(moe.expert_mlp, capacity=moe.capacity(n, k, e, 1.25))
  fn = mlp if not grad else jax.grad(
      lambda x, *a: jnp.sum(mlp(x, *a)[0].astype(jnp.float32)), argnums=(0, 1))
  mem = jax.jit(fn).lower(x, w, i, ps(d, f), ps(d, f), ps(f, d)).compile().memory_analysis()
  bf16_experts = 3 * e * d * f * 2
  assert mem.temp_size_in_bytes < bf16_experts / 4, (mem.temp_size_in_bytes, bf16_experts)
