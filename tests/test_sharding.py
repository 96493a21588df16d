"""k3jax/sharding.py: meshes from config, the logical-axis table, shardings of params,
batches and caches, the constraints applied under JAX's mesh, and the early errors (8 simulated
CPU devices). The optimizer state's shardings are tested in tests/train/test_sharded.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import sharding
from k3jax.config import preset


def test_mesh_fill_and_order():
  assert sharding.mesh_shape(dict(expert=4), 8) == dict(data=2, fsdp=1, expert=4, context=1,
                                                        tensor=1)
  assert sharding.mesh_shape(dict(data=1, fsdp=-1, context=4), 8)["fsdp"] == 2
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, context=2, expert=2))
  assert mesh.axis_names == sharding.MESH_AXES
  assert dict(mesh.shape) == dict(data=2, fsdp=1, expert=2, context=2, tensor=1)
  # tensor fastest, data slowest: device ids in jax.devices() order
  ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(-1)
  np.testing.assert_array_equal(ids, [d.id for d in jax.devices()])


@pytest.mark.parametrize("cfg, msg", [
    (dict(data=3), "product of axis sizes must equal the device count 8, found 3"),
    (dict(data=2, expert=2), "must equal the device count 8, found 4"),
    (dict(data=-1, fsdp=-1), "at most one axis may be -1"),
    (dict(data=-1, expert=3), r"mesh.data=-1: the other axes' product 3 does not divide"),
    (dict(expert=0), r"mesh.expert: expected a positive int or -1, found 0"),
])
def test_bad_mesh_errors(cfg, msg):
  with pytest.raises(ValueError, match=msg):
    sharding.make_mesh(cfg)


def test_mesh_from_config_dict():
  import ml_collections
  c = ml_collections.ConfigDict(dict(data=-1, fsdp=2, expert=1, context=2, tensor=1))
  assert sharding.mesh_shape(c, 8) == dict(data=2, fsdp=2, expert=1, context=2, tensor=1)


def test_check_shapes_errors_before_compiling():
  mesh = sharding.make_mesh(dict(data=1, context=2, expert=4))
  cfg = preset("tiny")                     # 8 experts
  sharding.check_shapes(cfg, mesh, batch_size=8, seq_len=16)
  with pytest.raises(ValueError, match="6 experts are not divisible by the expert axis size 4"):
    sharding.check_shapes(cfg.replace(num_experts=6), mesh)
  with pytest.raises(ValueError, match="sequence length 15 is not divisible by the context "
                     "axis size 2"):
    sharding.check_shapes(cfg, mesh, seq_len=15)
  with pytest.raises(ValueError, match="batch_size: 6 is not divisible by the batch axes"):
    sharding.check_shapes(cfg, mesh, batch_size=6)
  # Works on abstract meshes too (pod-scale planning without devices).
  big = sharding.abstract_mesh(dict(data=-1, fsdp=16, expert=64), 2048)
  sharding.check_shapes(preset("k3"), big, batch_size=2048, seq_len=4096)
  with pytest.raises(ValueError, match="896 experts are not divisible by the expert axis size 256"):
    sharding.check_shapes(preset("k3"), sharding.abstract_mesh(dict(expert=256), 256))


class _Toy(nn.Module):
  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp")),
                   (16, 8))
    e = self.param("experts", nn.with_logical_partitioning(
        nn.initializers.ones, ("experts", "moe_latent", "expert_mlp")), (8, 4, 6))
    odd = self.param("odd", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)), (3,))
    b = self.variable("balance", "bias", nn.with_logical_partitioning(
        lambda: jnp.zeros(8), ("experts",)))
    plain = self.param("plain", nn.initializers.zeros, (5,))
    return x @ w + e.sum() + odd.sum() + b.value.sum() + plain.sum()


def test_param_shardings_follow_the_table():
  mesh = sharding.make_mesh(dict(data=1, fsdp=2, expert=2, tensor=2))
  abstract = jax.eval_shape(_Toy().init, jax.random.key(0), jnp.zeros((1, 16)))
  sh = sharding.param_shardings(mesh, abstract)
  assert sh["params"]["w"].spec == P("fsdp", "tensor")                 # embed→fsdp, mlp→tensor
  assert sh["params"]["experts"].spec == P("expert", "fsdp", "tensor")
  assert sh["params"]["odd"].spec == P()                   # 3 not divisible by fsdp=2: replicated
  assert sh["params"]["plain"].spec == P()                 # no logical names: replicated
  assert sh["balance"]["bias"].spec == P("expert")
  # Real arrays placed with these shardings hold the right slices.
  real = jax.device_put(nn.unbox(_Toy().init(jax.random.key(0), jnp.zeros((1, 16)))), sh)
  assert real["params"]["w"].addressable_shards[0].data.shape == (8, 4)
  assert real["params"]["experts"].addressable_shards[0].data.shape == (4, 2, 3)


def test_experts_not_divisible_in_param_shardings():
  mesh = sharding.make_mesh(dict(data=1, expert=8))
  abstract = jax.eval_shape(_Toy().init, jax.random.key(0), jnp.zeros((1, 16)))
  sh = sharding.param_shardings(mesh, abstract)
  assert sh["params"]["experts"].spec == P("expert")
  mesh3 = sharding.make_mesh(dict(data=2, expert=4), jax.devices()[:8])

  class Bad(nn.Module):
    @nn.compact
    def __call__(self):
      return self.param("e", nn.with_logical_partitioning(nn.initializers.ones, ("experts",)),
                        (6,))

  with pytest.raises(ValueError, match=r"dimension 0 of size 6 \(experts\) is not divisible"):
    sharding.param_shardings(mesh3, jax.eval_shape(Bad().init, jax.random.key(0)))


def test_batch_and_cache_shardings():
  mesh = sharding.make_mesh(dict(data=2, context=2, expert=2))
  batch = {"inputs": np.zeros((8, 16), np.int32), "weights": np.zeros((8,), np.float32)}
  sh = sharding.batch_shardings(mesh, batch)
  assert sh["inputs"].spec == P(sharding.BATCH_AXES, "context")
  assert sh["weights"].spec == P(sharding.BATCH_AXES)
  x = jax.device_put(batch["inputs"] + np.arange(16), sh["inputs"])
  assert x.addressable_shards[0].data.shape == (2, 8)        # 8/(2·2) rows, 16/2 tokens
  cache = {"state": jnp.zeros((3, 8, 2, 4, 4)), "latent": jnp.zeros((8, 32, 6)),
           "pos": jnp.zeros((), jnp.int32)}
  csh = sharding.cache_shardings(mesh, cache, batch_size=8)
  assert csh["state"].spec == P(None, sharding.BATCH_AXES)   # [groups, B, ...]
  assert csh["latent"].spec == P(sharding.BATCH_AXES)
  assert csh["pos"].spec == P()


def test_fsdp_over_data_rules():
  rules = sharding.axis_rules(fsdp_over_data=True)
  # widened rule first, plain fsdp as its fallback; activations untouched
  assert rules.index(("embed", ("data", "fsdp"))) < rules.index(("embed", "fsdp"))
  assert ("batch", sharding.BATCH_AXES) in rules
  mesh = sharding.make_mesh(dict(data=4, fsdp=2))
  abstract = jax.eval_shape(_Toy().init, jax.random.key(0), jnp.zeros((1, 16)))
  sh = sharding.param_shardings(mesh, abstract, sharding.axis_rules(fsdp_over_data=True))
  assert sh["params"]["w"].spec == P(("data", "fsdp"))
  assert isinstance(sh["params"]["w"], NamedSharding)
  # param_axes=(fsdp, expert): dense weights over both; expert matrices fall back to fsdp.
  mesh2 = sharding.make_mesh(dict(data=1, fsdp=2, expert=4))
  sh2 = sharding.param_shardings(mesh2, abstract, sharding.axis_rules(
      param_axes=("fsdp", "expert")))
  assert sh2["params"]["w"].spec == P(("fsdp", "expert"))
  assert sh2["params"]["experts"].spec == P("expert", "fsdp")


def test_the_mesh_is_jax_s_own():
  """Traced code sees the mesh of `jax.set_mesh` around the call (nothing in k3jax.sharding
  holds one); the logical-axis rules act only through explicit shardings."""
  mesh = sharding.make_mesh(dict(expert=8, data=1))
  seen = []

  def f(x):
    seen.append(jax.sharding.get_abstract_mesh())
    return x

  jax.jit(f)(jnp.ones(8))
  with jax.set_mesh(mesh):
    jax.jit(f)(jnp.ones(8))                    # retraced: JAX's jit cache keys on the mesh
  assert seen[0].empty and dict(seen[1].shape) == dict(mesh.shape)
  assert jax.sharding.get_abstract_mesh().empty
  assert not [k for k, v in vars(sharding).items()
              if isinstance(v, (list, dict)) and not k.startswith("__")]
  assert nn.logical_to_mesh_axes(("batch", "length"), sharding.LOGICAL_AXIS_RULES) == P(
      sharding.BATCH_AXES, "context")


def test_constrain_activations_shards_batch_and_sequence():
  mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=2, context=4))
  x = jnp.arange(2 * 8 * 3, dtype=jnp.float32).reshape(2, 8, 3)      # [B, T, d]
  blocks = jnp.ones((5, 2, 8, 3))                                     # [n, B, T, d]
  odd = jnp.ones((2, 7, 3))                                           # T=7: context dropped

  def f(x, blocks, odd):
    a, b = sharding.constrain_activations((x, blocks))
    c = sharding.constrain_activations(odd)
    d = sharding.constrain_activations(x, context=False)
    return a, b, c, d

  with jax.set_mesh(mesh):
    a, b, c, d = jax.jit(f)(x, blocks, odd)
  np.testing.assert_array_equal(a, x)                 # values untouched
  assert a.sharding.spec == P("fsdp", "context")
  assert b.sharding.spec == P(None, "fsdp", "context")
  assert c.sharding.spec == P("fsdp")
  assert d.sharding.spec == P("fsdp")
  assert sharding.constrain_activations(x) is x       # no mesh: unchanged


def test_constrain_like_params_pins_gradients():
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=8))
  params = {"w": jnp.arange(16 * 4, dtype=jnp.float32).reshape(16, 4) / 64.0}
  param_sh = {"w": NamedSharding(mesh, P("fsdp", None))}
  x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("fsdp", None)))  # batch-sharded
  grad = jax.grad(lambda p, x: jnp.sum((x @ p["w"]) ** 2))

  def f(p, x):
    g = grad(p, x)
    pinned = sharding.constrain_like_params(g, param_sh)
    assert sharding.constrain_like_params(g, None) is g   # no param shardings given: unchanged
    return pinned

  out = jax.jit(f)(params, x)
  assert out["w"].sharding.spec == P("fsdp")
  np.testing.assert_allclose(out["w"], grad(params, jnp.ones((8, 16)))["w"], rtol=1e-6)
  assert sharding.constrain_like_params(params, None) is params
