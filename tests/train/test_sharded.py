"""k3jax/train/sharded.py: the optimizer state's shardings (like the params they mirror; Muon's
momentum in host memory), and `build_step` on a mesh: the trainer's step sharded equals it on
one device, takes the expert-parallel path, and leaves no mesh behind (8 simulated CPU devices).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import k3jax.parallel.context
import k3jax.parallel.expert
from k3jax import sharding
from k3jax.data import corpus as data_lib
from k3jax.train import sharded
from k3jax.train.run import base_config, run_config
from k3jax.train.state import init_state, init_variables


class _Toy(nn.Module):
  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp")),
                   (16, 8))
    e = self.param("experts", nn.with_logical_partitioning(
        nn.initializers.ones, ("experts", "moe_latent", "expert_mlp")), (8, 4, 6))
    return x @ w + e.sum()


def test_opt_state_shardings_follow_the_params():
  mesh = sharding.make_mesh(dict(data=1, fsdp=2, expert=2, tensor=2))
  abstract = jax.eval_shape(_Toy().init, jax.random.key(0), jnp.zeros((1, 16)))
  sh = sharding.param_shardings(mesh, abstract)
  # Optimizer state mirrors the params it belongs to; the step count is replicated.
  params = nn.unbox(abstract)
  tx = optax.adamw(1e-3)
  opt_abstract = jax.eval_shape(tx.init, params)
  osh = sharded.opt_state_shardings(mesh, opt_abstract, params, sh)
  adam = osh[0]
  assert adam.mu["params"]["w"].spec == P("fsdp", "tensor")
  assert adam.nu["params"]["experts"].spec == P("expert", "fsdp", "tensor")
  assert adam.count.spec == P()


def test_offloaded_muon_momentum_lives_in_host_memory():
  """offload_momentum: Muon's momentum is sharded to "pinned_host" (Adam's moments stay on the
  device), two jitted updates on 2 devices (fsdp) equal the on-device optimizer's, and the new
  momentum comes back in host memory."""
  from k3jax.train.optim import MuonState, make_optimizer
  mesh = sharding.make_mesh(sharding.MeshConfig(data=4, fsdp=2))
  names = {"params": {
      "body": {"layers_0": {"mlp": {"up_proj": {"kernel": nn.LogicallyPartitioned(
          jax.ShapeDtypeStruct((3, 8, 6), jnp.float32), ("layers", "embed", "mlp"))}}}},
      "head": {"kernel": nn.LogicallyPartitioned(
          jax.ShapeDtypeStruct((8, 4), jnp.float32), ("embed", "vocab"))},
      "embed_tokens": {"embedding": nn.LogicallyPartitioned(
          jax.ShapeDtypeStruct((16, 8), jnp.float32), ("vocab", "embed"))}}, "balance": {}}
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 9))
  params = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape), nn.unbox(names))
  grads = [jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape), params)
           for _ in range(2)]
  p_sh = sharding.param_shardings(mesh, names)
  results = {}
  for offload in (False, True):
    tx = make_optimizer(lambda s: 0.1, offload_momentum=offload)
    o_sh = sharded.opt_state_shardings(mesh, jax.eval_shape(tx.init, params), params, p_sh,
                                       offload_momentum=offload)
    is_muon = lambda x: isinstance(x, MuonState)  # noqa: E731
    (muon_sh,) = [x for x in jax.tree.leaves(o_sh, is_leaf=is_muon) if is_muon(x)]
    assert {s.memory_kind for s in jax.tree.leaves(muon_sh.mu)} == (
        {"pinned_host"} if offload else {"device"})
    assert {s.memory_kind for s in jax.tree.leaves(o_sh)} == (
        {"pinned_host", "device"} if offload else {"device"})
    update = jax.jit(tx.update, in_shardings=(p_sh, o_sh, p_sh), out_shardings=(p_sh, o_sh))
    state = jax.device_put(tx.init(params), o_sh)
    ups = []
    for g in grads:
      u, state = update(jax.device_put(g, p_sh), state, jax.device_put(params, p_sh))
      ups.append(u)
    results[offload] = (ups, state)
  (ups0, st0), (ups1, st1) = results[False], results[True]
  for a, b in zip(jax.tree.leaves(ups0), jax.tree.leaves(ups1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  for a, b in zip(jax.tree.leaves(st0), jax.tree.leaves(st1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  (muon,) = [x for x in jax.tree.leaves(st1, is_leaf=is_muon) if is_muon(x)]
  assert {x.sharding.memory_kind for x in jax.tree.leaves(muon.mu)} == {"pinned_host"}
  with pytest.raises(ValueError, match="no MuonState"):
    tx = make_optimizer(lambda s: 0.1, muon=False)
    sharded.opt_state_shardings(mesh, jax.eval_shape(tx.init, params), params, p_sh,
                                offload_momentum=True)


def _holds_a_mesh(x, depth=0) -> bool:
  """Whether `x` is or contains (lists, tuples, dicts, sets) a Mesh or an AbstractMesh."""
  if isinstance(x, (Mesh, jax.sharding.AbstractMesh)):
    return True
  if depth > 4:
    return False
  if isinstance(x, dict):
    return any(_holds_a_mesh(v, depth + 1) for v in x.values())
  if isinstance(x, (list, tuple, set, frozenset)):
    return any(_holds_a_mesh(v, depth + 1) for v in x)
  return False


def test_build_step_on_a_mesh_equals_one_device_and_keeps_no_mesh():
  """The trainer's step (Muon + QB) from `build_step` on (data=2, expert=4) runs expert-parallel
  and gives the one-device step's loss and gradient norm; its state comes back laid out by
  the step's shardings. Afterwards no mesh is in JAX's context and no module of k3jax that
  reads one (sharding, parallel/*) holds one."""
  cfg = base_config("tiny")
  cfg.model.num_layers = 2                      # one dense layer, one MoE layer
  cfg.train.update(dict(batch_size=8, seq_len=16, mtp_weight=0.0))
  run = run_config(cfg)
  config = run.model
  batch = data_lib.pack_windows(np.random.default_rng(0).integers(0, 256, size=(8, 18)))
  mesh = sharding.make_mesh(dict(data=2, expert=4))

  one = sharded.build_step(run, config)
  many = sharded.build_step(run, config, mesh)
  assert isinstance(many.train, sharded.ShardedStep)
  losses = {}
  for name, step in (("one", one), ("many", many)):
    state = init_state(init_variables(config, jax.random.PRNGKey(0)), sharded.PRETRAIN, step.tx)
    ms = []
    for _ in range(2):
      state, m = step.train(state, batch)
      ms.append(jax.device_get(m))
    losses[name] = ms
    if name == "many":
      want = jax.tree.leaves(step.train.state_shardings)
      assert all(x.sharding.is_equivalent_to(s, x.ndim)
                 for x, s in zip(jax.tree.leaves(state), want))
      w1 = state.params["params"]["layers_1"]["block_sparse_moe"]["experts"]["w1"]
      assert "expert" in str(w1.sharding.spec)
  for a, b in zip(losses["one"], losses["many"]):
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
    np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=1e-4)
  # The expert-parallel path was taken (the mesh reached the layers through JAX's context).
  hlo = many.train.lower(many.train.abstract_state, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)).as_text()
  assert "all_to_all" in hlo
  assert jax.sharding.get_abstract_mesh().empty
  for module in (sharding, k3jax.parallel.expert, k3jax.parallel.context):
    held = [k for k, v in vars(module).items() if not k.startswith("__") and _holds_a_mesh(v)]
    assert not held, (module.__name__, held)


def test_offload_without_a_mesh_is_refused():
  cfg = base_config("tiny")
  cfg.optim.offload_momentum = True
  run = run_config(cfg)
  with pytest.raises(ValueError, match="offload_momentum: host memory needs a jit"):
    sharded.build_step(run, run.model)
