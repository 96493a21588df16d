"""LoRA math (k3jax/ops/lora.py) and per-expert adapters through every expert path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import lora as L
from k3jax.ops import moe as moe_ops
from k3jax.quant import mx



@pytest.fixture(autouse=True, scope="module")
def _highest_precision():
  """fp32 products in full precision for this module's comparisons, and for it alone (a global
  update would leak into the modules a test worker runs after this one)."""
  with jax.default_matmul_precision("highest"):
    yield


def _rand(key, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


@pytest.mark.parametrize("x_shape,k_shape,n_in,r", [
    ((2, 3, 8), (8, 2, 5), 1, 3),       # q_proj-like: [d] → [H, K]
    ((2, 3, 2, 4), (2, 4, 6), 2, 2),    # o_proj-like: [H, V] → [d]
])
def test_lora_dense_is_slow_reference(x_shape, k_shape, n_in, r):
  x, w = np.asarray(_rand(0, x_shape)), np.asarray(_rand(1, k_shape))
  a = np.asarray(_rand(2, (*k_shape[:n_in], r)))
  b = np.asarray(_rand(3, (r, *k_shape[n_in:])))
  s = 0.75
  # Slow reference: flatten to matrices, x W + s (x A) B with numpy in float64.
  din, dout = int(np.prod(k_shape[:n_in])), int(np.prod(k_shape[n_in:]))
  xm = x.reshape(-1, din).astype(np.float64)
  ref = xm @ w.reshape(din, dout) + s * (xm @ a.reshape(din, r)) @ b.reshape(r, dout)
  ref = ref.reshape(*x_shape[:x.ndim - n_in], *k_shape[n_in:])
  got = L.lora_dense(jnp.asarray(x), jnp.asarray(w), jnp.asarray(a), jnp.asarray(b), s, n_in)
  np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)
  # The merged kernel applies the same map.
  merged = np.asarray(L.merge(jnp.asarray(w), jnp.asarray(a), jnp.asarray(b), s, n_in))
  np.testing.assert_allclose(xm @ merged.reshape(din, dout),
                             ref.reshape(-1, dout), rtol=1e-5, atol=1e-5)
  # B = 0: exactly the base projection.
  base = L.lora_dense(jnp.asarray(x), jnp.asarray(w), jnp.asarray(a), jnp.zeros_like(b), s, n_in)
  y0 = jax.lax.dot_general(jnp.asarray(x), jnp.asarray(w),
                           ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ())))
  np.testing.assert_array_equal(np.asarray(base), np.asarray(y0))


def test_merge_batch_axes_and_errors():
  w, a, b = _rand(0, (3, 4, 8, 5)), _rand(1, (3, 4, 8, 2)), _rand(2, (3, 4, 2, 5))
  got = np.asarray(L.merge(w, a, b, 2.0, n_in=1))
  # Leading [layers, experts] axes are batch axes: one [in, r]·[r, out] product each.
  ref = np.asarray(w) + 2.0 * np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))
  np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="merge"):
    L.merge(w, a, b[..., :4], 1.0)
  with pytest.raises(ValueError, match="lora A must be"):
    L.lora_dense(jnp.ones((2, 8)), jnp.ones((8, 5)), jnp.ones((7, 2)), jnp.ones((2, 5)), 1.0)
  with pytest.raises(ValueError, match="lora B must be"):
    L.lora_dense(jnp.ones((2, 8)), jnp.ones((8, 5)), jnp.ones((8, 2)), jnp.ones((3, 5)), 1.0)


# --------------------------------------------------------------------------- experts
E, D, F, R, N, K = 4, 32, 32, 3, 12, 2


def _experts(packed: bool):
  ws = [_rand(10, (E, D, F), 0.2), _rand(11, (E, D, F), 0.2), _rand(12, (E, F, D), 0.2)]
  adapters = [(_rand(20 + i, (E, w.shape[1], R), 0.3), _rand(30 + i, (E, R, w.shape[2]), 0.3))
              for i, w in enumerate(ws)]
  if packed:   # QLoRA: the base as the release's MXFP4 bytes
    ws = [moe_ops.MXFP4Weight(*mx.pack_expert(w)) for w in ws]
  return [L.LoRAExperts(w, a, b) for w, (a, b) in zip(ws, adapters)]


def _routing():
  x = _rand(1, (N, D))
  logits = _rand(2, (N, E))
  w, idx, _ = moe_ops.route(jax.nn.sigmoid(logits), jnp.zeros((E,)), K)
  return x, w, idx


def _token_loop(x, w, idx, lws):
  """Slowest reading: each (token, slot) through its expert's W + A·B, float64."""
  x, w, idx = (np.asarray(v, np.float64) for v in (x, w, idx))
  dense = []
  for lw in lws:
    base = lw.base.dequantize(jnp.float32) if moe_ops.is_packed(lw) else lw.base
    dense.append(np.asarray(base, np.float64) + np.matmul(np.asarray(lw.a, np.float64),
                                                          np.asarray(lw.b, np.float64)))
  def situ(a, b, b1=4.0, b2=25.0):   # docs/k3.md §6, in float64
    return b1 * np.tanh(a / b1) / (1 + np.exp(-a)) * b2 * np.tanh(b / b2)

  y = np.zeros_like(x)
  for n in range(N):
    for j in range(K):
      e = int(idx[n, j])
      h = situ(x[n] @ dense[0][e], x[n] @ dense[1][e])
      y[n] += w[n, j] * (h @ dense[2][e])
  return y


@pytest.mark.parametrize("packed", [False, True])
def test_expert_paths_with_adapters(packed):
  x, w, idx = _routing()
  lws = _experts(packed)
  ref = _token_loop(x, w, idx, lws)
  outs = {"reference": moe_ops.expert_mlp_reference(x, w, idx, *lws)[0],
          "sorted": moe_ops.expert_mlp(x, w, idx, *lws)[0],
          "capacity": moe_ops.expert_mlp(x, w, idx, *lws, capacity=N)[0]}
  if not packed:   # a grouped matmul takes dense weights
    outs["grouped"] = moe_ops.expert_mlp(x, w, idx, *lws, gmm=moe_ops.ragged_gmm)[0]
  for name, y in outs.items():
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-4, atol=2e-4, err_msg=name)


def test_tiled_layout_with_adapters():
  # Dropless with many experts: the tiled layout (one expert's tile per scan step).
  e, n = 16, 40
  ws = [_rand(10, (e, D, F), 0.2), _rand(11, (e, D, F), 0.2), _rand(12, (e, F, D), 0.2)]
  lws = [L.LoRAExperts(mw, _rand(20 + i, (e, mw.shape[1], R), 0.3),
                       _rand(30 + i, (e, R, mw.shape[2]), 0.3)) for i, mw in enumerate(ws)]
  assert moe_ops.sort_layout(n, K, e, None)[0] == "tiled"
  x = _rand(1, (n, D))
  w, idx, _ = moe_ops.route(jax.nn.sigmoid(_rand(2, (n, e))), jnp.zeros((e,)), K)
  got = moe_ops.expert_mlp(x, w, idx, *lws)[0]
  ref = moe_ops.expert_mlp_reference(x, w, idx, *lws)[0]
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-4, atol=2e-4)


def test_qlora_is_lora_on_dequantised_base_with_gradients():
  x, w, idx = _routing()
  packed = _experts(True)
  dense = [L.LoRAExperts(lw.base.dequantize(jnp.float32), lw.a, lw.b) for lw in packed]

  def loss(ab, base):
    lws = [L.LoRAExperts(bw, a, b) for bw, (a, b) in zip(base, ab)]
    return jnp.sum(moe_ops.expert_mlp(x, w, idx, *lws)[0] ** 2)

  ab = [(lw.a, lw.b) for lw in packed]
  lq, gq = jax.value_and_grad(loss)(ab, [lw.base for lw in packed])
  ld, gd = jax.value_and_grad(loss)(ab, [lw.base for lw in dense])
  np.testing.assert_allclose(float(lq), float(ld), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(gq), jax.tree.leaves(gd)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  # And the factored gradients equal the merged reference's.
  def ref_loss(ab):
    lws = [L.LoRAExperts(lw.base, a, b) for lw, (a, b) in zip(dense, ab)]
    return jnp.sum(moe_ops.expert_mlp_reference(x, w, idx, *lws)[0] ** 2)
  for a, b in zip(jax.tree.leaves(jax.grad(ref_loss)(ab)), jax.tree.leaves(gd)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_expert_adapter_shape_errors():
  x, w, idx = _routing()
  lws = _experts(False)
  bad = L.LoRAExperts(lws[0].base, lws[0].a, lws[0].b[:, :, :5])
  with pytest.raises(ValueError, match="w1 LoRA adapters must be"):
    moe_ops.expert_mlp(x, w, idx, bad, lws[1], lws[2])
  packed = _experts(True)
  with pytest.raises(ValueError, match="grouped matmul"):
    moe_ops.expert_mlp(x, w, idx, *packed, gmm=moe_ops.ragged_gmm)


def test_expert_parallel_with_adapters():
  # QLoRA experts (packed base + adapters) shard over `expert` (all_to_all dispatch, 4 CPU
  # devices); each device dequantises its own experts.
  from k3jax import sharding
  from k3jax.parallel import expert as ep_lib
  x, w, idx = _routing()
  lws = _experts(True)
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, expert=4), devices=jax.devices()[:4])
  y, dropped = ep_lib.expert_mlp_ep(mesh, x, w, idx, *lws)
  ref = moe_ops.expert_mlp_reference(x, w, idx, *lws)[0]
  assert int(dropped) == 0
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=2e-4, atol=2e-4)
