"""Expert parallelism (k3jax/parallel/expert.py) against the unsharded `ops.moe.expert_mlp`
on 8 simulated CPU devices."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import sharding
from k3jax.config import preset
from k3jax.layers.moe import StableLatentMoE
from k3jax.ops import moe as moe_ops
from k3jax.parallel import expert as ep_lib
from pallas_kernels import moe_gmm

E, K, D, F = 8, 2, 6, 5
B, T = 8, 4


def _inputs(seed=0, skew=0.0):
  ks = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(ks[0], (B, T, D))
  logits = jax.random.normal(ks[1], (B * T, E)) + skew * jnp.arange(E)  # skew: crowd experts
  w, idx, _ = moe_ops.route(jax.nn.sigmoid(logits), jnp.zeros(E), K)
  w1 = jax.random.normal(ks[2], (E, D, F)) / 3
  w3 = jax.random.normal(ks[3], (E, D, F)) / 3
  w2 = jax.random.normal(ks[4], (E, F, D)) / 3
  return x, w.reshape(B, T, K), idx.reshape(B, T, K), w1, w3, w2


MESHES = [dict(expert=8, data=1), dict(data=2, expert=4), dict(data=2, context=2, expert=2)]


@pytest.mark.parametrize("mesh_cfg", MESHES,
                         ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()))
def test_ep_equals_unsharded_when_dropless(mesh_cfg):
  x, w, idx, w1, w3, w2 = _inputs()
  mesh = sharding.make_mesh(sharding.MeshConfig(**mesh_cfg))
  y_ref, d_ref = moe_ops.expert_mlp_reference(x.reshape(-1, D), w.reshape(-1, K),
                                              idx.reshape(-1, K), w1, w3, w2)
  y, dropped = jax.jit(lambda *a: ep_lib.expert_mlp_ep(mesh, *a))(x, w, idx, w1, w3, w2)
  np.testing.assert_allclose(y.reshape(-1, D), y_ref, rtol=1e-5, atol=1e-6)
  assert int(dropped) == int(d_ref) == 0


@pytest.mark.parametrize("seed,mesh_cfg,kernel", [
    (1, dict(data=2, expert=4), "xla"),
    (6, dict(data=2, context=2, expert=2), "pallas gmm")])
def test_ep_gradients_equal_unsharded(seed, mesh_cfg, kernel):
  """Through the XLA expert einsums, and through the Pallas grouped matmul (interpreted)."""
  x, w, idx, w1, w3, w2 = _inputs(seed)
  mesh = sharding.make_mesh(sharding.MeshConfig(**mesh_cfg))
  gmm = moe_gmm.gmm if kernel == "pallas gmm" else None

  def loss_ep(x, w, w1, w3, w2):
    y, _ = ep_lib.expert_mlp_ep(mesh, x, w, idx, w1, w3, w2, gmm=gmm)
    return jnp.sum(jnp.sin(y))

  def loss_ref(x, w, w1, w3, w2):
    y, _ = moe_ops.expert_mlp_reference(x.reshape(-1, D), w.reshape(-1, K),
                                        idx.reshape(-1, K), w1, w3, w2)
    return jnp.sum(jnp.sin(y))

  g = jax.jit(jax.grad(loss_ep, argnums=(0, 1, 2, 3, 4)))(x, w, w1, w3, w2)
  g_ref = jax.grad(loss_ref, argnums=(0, 1, 2, 3, 4))(x, w, w1, w3, w2)
  for a, b_ in zip(g, g_ref):
    np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-5)


def test_ep_counts_drops_per_source_device():
  # Skewed routing with capacity factor 1: some experts overflow. Ranks are counted per source
  # device, so the EP result is exactly the unsharded op applied to each device's tokens.
  x, w, idx, w1, w3, w2 = _inputs(2, skew=1.5)
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, expert=4))
  y, dropped = jax.jit(lambda *a: ep_lib.expert_mlp_ep(mesh, *a, capacity_factor=1.0))(
      x, w, idx, w1, w3, w2)
  per = B // 8   # batch rows per device (batch over data·expert = 8)
  n_local = per * T
  cap = moe_ops.capacity(n_local, K, E, 1.0)
  ys, total = [], 0
  for dev in range(8):
    sl = slice(dev * per, (dev + 1) * per) if per else slice(0, 0)
    yi, di = moe_ops.expert_mlp_reference(x[sl].reshape(-1, D), w[sl].reshape(-1, K),
                                          idx[sl].reshape(-1, K), w1, w3, w2, capacity=cap)
    ys.append(yi)
    total += int(di)
  assert total > 0
  assert int(dropped) == total
  np.testing.assert_allclose(y.reshape(-1, D), jnp.concatenate(ys), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("capacity", [None, 8])
def test_maybe_expert_parallel_pads_a_token_count_the_shards_do_not_divide(capacity):
  # 30 tokens over 8 token shards (data·context·expert, the MTP layer's B·(T−1) case): padded
  # to 32 inside. Dropless, it equals the unsharded op; with a capacity (global 8 → 1 row per
  # expert and source device), each device's real tokens are served as by the unsharded op on
  # them alone, and the padding (2 rows, both routed to experts 0 and 1, so the second one
  # overflows them) is never counted dropped.
  n = 30
  x, w, idx, w1, w3, w2 = _inputs(4, skew=1.5 if capacity else 0.0)
  x, w, idx = x.reshape(-1, D)[:n], w.reshape(-1, K)[:n], idx.reshape(-1, K)[:n]
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, context=2, expert=2))
  with jax.set_mesh(mesh):   # chosen and run under the mesh (JAX's context)
    fn = ep_lib.maybe_expert_parallel(moe_ops.expert_mlp)
    y, dropped = jax.jit(lambda *a: fn(*a, capacity=capacity))(x, w, idx, w1, w3, w2)
  assert y.shape == (n, D)
  if capacity is None:
    y_ref, d_ref = moe_ops.expert_mlp_reference(x, w, idx, w1, w3, w2)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    assert int(dropped) == int(d_ref) == 0
    return
  n_local = 4   # 32 rows / 8 shards; the last shard holds 2 real rows and the 2 padding rows
  ys, total = [], 0
  for dev in range(8):
    sl = slice(dev * n_local, min((dev + 1) * n_local, n))
    yi, di = moe_ops.expert_mlp_reference(x[sl], w[sl], idx[sl], w1, w3, w2, capacity=1)
    ys.append(yi)
    total += int(di)
  assert total > 0
  assert int(dropped) == total
  np.testing.assert_allclose(y, jnp.concatenate(ys), rtol=1e-5, atol=1e-6)


def test_histogram_summed_over_token_axes():
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, context=2, expert=2))
  vals = jax.random.randint(jax.random.key(3), (B, T, E), 0, 10)

  def hist(v):  # [b, t, E] → [E, 10] counts
    return jax.vmap(lambda col: jnp.bincount(col, length=10), in_axes=1)(v.reshape(-1, E))

  got = ep_lib.sharded_histogram(mesh, hist, vals)
  np.testing.assert_array_equal(got, hist(vals))
  assert got.dtype == jnp.int32


def test_experts_not_divisible_by_expert_axis():
  x, w, idx, w1, w3, w2 = _inputs()
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, expert=4))
  with pytest.raises(ValueError, match="not divisible by the expert axis"):
    ep_lib.expert_mlp_ep(mesh, x, w, idx, w1[:6], w3[:6], w2[:6])


def _spy(calls):
  """The Pallas grouped matmul (interpreted on CPU), recording the lhs shape of every call."""
  def gmm(lhs, rhs, group_sizes):
    calls.append(lhs.shape)
    return moe_gmm.gmm(lhs, rhs, group_sizes)
  return gmm


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_ep_runs_the_chosen_grouped_matmul(capacity_factor):
  # The local experts go through the kernel passed in (three calls, each over E/ep groups of
  # ep·C rows) and the result is the unsharded op's: dropless, on all tokens at once; with a
  # capacity, on each device's tokens (ranks counted per source device).
  x, w, idx, w1, w3, w2 = _inputs(5, skew=1.5 if capacity_factor else 0.0)
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, expert=4))
  calls = []
  y, dropped = jax.jit(lambda *a: ep_lib.expert_mlp_ep(
      mesh, *a, capacity_factor=capacity_factor, gmm=_spy(calls)))(x, w, idx, w1, w3, w2)
  n_local = B * T // 8
  cap = moe_ops.capacity(n_local, K, E, capacity_factor)
  rows = (E // 4) * (4 * cap)   # E/ep local experts × ep·C rows each
  assert calls == [(rows, D), (rows, D), (rows, F)]
  ys, total = [], 0
  for dev in range(8):
    sl = slice(dev * n_local, (dev + 1) * n_local)
    yi, di = moe_ops.expert_mlp_reference(x.reshape(-1, D)[sl], w.reshape(-1, K)[sl],
                                          idx.reshape(-1, K)[sl], w1, w3, w2,
                                          capacity=None if capacity_factor is None else cap)
    ys.append(yi)
    total += int(di)
  assert (total > 0) == (capacity_factor is not None)
  assert int(dropped) == total
  np.testing.assert_allclose(y.reshape(-1, D), jnp.concatenate(ys), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh_cfg", [dict(data=2, expert=4), dict(data=2, context=2, expert=2)],
                         ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()))
def test_pallas_backend_on_an_expert_mesh_equals_single_device_xla(mesh_cfg):
  """kernel_backend="pallas" with mesh.expert > 1: the layer runs expert-parallel *and* through
  the Pallas grouped matmul (a pallas_call inside the shard_map), with the outputs and stats of
  the single-device XLA layer (dropless, so per-device capacity cannot differ)."""
  cfg = preset("tiny", moe_capacity_factor=None)
  x = jax.random.normal(jax.random.key(7), (B, T, cfg.text.d_model), jnp.float32)
  v = nn.unbox(StableLatentMoE(cfg).init(jax.random.key(0), x))

  def apply(c):
    return jax.jit(lambda v, x: StableLatentMoE(c).apply(v, x, mutable=["stats"]))

  y_ref, st_ref = apply(cfg)(v, x)
  pallas = cfg.replace(kernel_backend="pallas")
  mesh = sharding.make_mesh(sharding.MeshConfig(**mesh_cfg))
  with sharding.activate(mesh):
    jaxpr = str(jax.make_jaxpr(lambda v, x: StableLatentMoE(pallas).apply(
        v, x, mutable=["stats"]))(v, x))
    y, st = apply(pallas)(v, x)
  assert "shard_map" in jaxpr and "pallas_call" in jaxpr
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  jax.tree.map(np.testing.assert_array_equal, st, st_ref)


@pytest.mark.parametrize("mesh_cfg", [dict(expert=8, data=1), dict(data=2, context=2, expert=2)],
                         ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()))
def test_ep_with_packed_mxfp4_experts_equals_dequantised_reference(mesh_cfg):
  """MXFP4Weight experts sharded over `expert` (both uint8 leaves): each device dequantises its
  own experts; equals the dequantise-everything reference, values and gradient in x."""
  from k3jax.quant import mx
  e, d, f = 8, 32, 64
  ks = jax.random.split(jax.random.key(11), 5)
  x = jax.random.normal(ks[0], (B, T, d))
  logits = jax.random.normal(ks[1], (B * T, e))
  w, idx, _ = moe_ops.route(jax.nn.sigmoid(logits), jnp.zeros(e), K)
  w, idx = w.reshape(B, T, K), idx.reshape(B, T, K)
  packed = [moe_ops.MXFP4Weight(*mx.pack_expert(jax.random.normal(k_, s) / 4))
            for k_, s in zip(ks[2:], [(e, d, f), (e, d, f), (e, f, d)])]
  mesh = sharding.make_mesh(sharding.MeshConfig(**mesh_cfg))

  def loss(fn, x):
    y, dropped = fn(x)
    return jnp.sum(jnp.sin(y)), (y, dropped)

  ep = lambda x: ep_lib.expert_mlp_ep(mesh, x, w, idx, *packed)
  ref = lambda x: moe_ops.expert_mlp_reference(x.reshape(-1, d), w.reshape(-1, K),
                                               idx.reshape(-1, K), *packed)
  (_, (y, dropped)), g = jax.jit(jax.value_and_grad(lambda x: loss(ep, x), has_aux=True))(x)
  (_, (y_ref, _)), g_ref = jax.value_and_grad(lambda x: loss(ref, x), has_aux=True)(x)
  np.testing.assert_allclose(y.reshape(-1, d), y_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5)
  assert int(dropped) == 0


def test_packed_layer_on_an_expert_mesh_equals_single_device():
  """expert_format="mxfp4" layer under an expert mesh (shard_map over the packed params)."""
  cfg = preset("tiny", moe_capacity_factor=None, expert_format="mxfp4")
  x = jax.random.normal(jax.random.key(8), (B, T, cfg.text.d_model), jnp.float32)
  v = nn.unbox(StableLatentMoE(cfg).init(jax.random.key(0), x))
  fn = jax.jit(lambda v, x: StableLatentMoE(cfg).apply(v, x, mutable=["stats"]))
  y_ref, st_ref = fn(v, x)
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, expert=4))
  with sharding.activate(mesh):
    jaxpr = str(jax.make_jaxpr(lambda v, x: StableLatentMoE(cfg).apply(
        v, x, mutable=["stats"]))(v, x))
    y, st = jax.jit(lambda v, x: StableLatentMoE(cfg).apply(v, x, mutable=["stats"]))(v, x)
  assert "shard_map" in jaxpr
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  jax.tree.map(np.testing.assert_array_equal, st, st_ref)
