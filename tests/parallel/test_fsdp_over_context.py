"""FSDP over context: parameters and optimizer state sharded over the `context` mesh axis too
(`MeshConfig.fsdp_over_context`, `sharding.axis_rules(fsdp_over_context=True)`), on 8 simulated
CPU devices (fsdp=2, context=4).

The parameters' shardings include `context` (the dense weights over fsdp × context, the
expert matrices' latent dimension too; not the token embedding table), the trainer's state shardings follow the run's mesh
option, and the step — loss, logits, MTP logits and every gradient, computed with the
parameters laid out that way and the gradients returned in that layout — equals one device's
(fp32, ≤ 1e-5 relative). A 2-layer `tiny` (KDA + dense, MLA + MoE, the MTP layer) keeps the
compile short.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax import sharding
from k3jax.config import preset
from k3jax.data import corpus as data_lib
from k3jax.data import tokenizers
from k3jax.model import K3Model
from k3jax.train import sharded
from k3jax.train.run import RunConfig, TrainConfig

from parallel.mtp_loss import loss_and_grads

B, T = 2, 32
MESH = sharding.MeshConfig(data=1, fsdp=2, context=4, fsdp_over_context=True)


def _config():
  return preset("tiny", num_layers=2, num_mtp_layers=1)


def _batch():
  rng = np.random.default_rng(0)
  w = rng.integers(0, 256, size=(B, T + 2))
  w[:, 0] = tokenizers.BOS
  w[0, 11] = tokenizers.BOS            # a second document inside the second context shard
  return {k: jnp.asarray(v) for k, v in data_lib.pack_windows(w).items()}


def _close(a, b, what):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  scale = max(float(np.max(np.abs(b))), 1e-6)
  err = float(np.max(np.abs(a - b))) / scale
  assert err <= 1e-5, f"{what}: max error / max |ref| = {err:.2e}"


def _specs(shardings):
  return {jax.tree_util.keystr(p): s.spec for p, s in
          jax.tree_util.tree_flatten_with_path(
              shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]}


def test_rules_put_params_over_context_and_the_trainer_follows_the_mesh_option():
  config = _config()
  boxed = jax.eval_shape(K3Model(config).init, jax.random.PRNGKey(0),
                         jnp.zeros((1, 8), jnp.int32))
  mesh = sharding.make_mesh(MESH)
  plain = _specs(sharding.param_shardings(mesh, boxed, sharding.axis_rules()))
  over = _specs(sharding.param_shardings(mesh, boxed, sharding.params_over(MESH)))
  with_context = [k for k, s in over.items() if "context" in str(s)]
  assert not any("context" in str(s) for s in plain.values())
  assert "['params']['lm_head']['kernel']" in with_context
  # Every weight that plain FSDP shards is now sharded over context as well — except the
  # token embedding table, read by a gather (sharding.GATHERED_TABLE) — and the expert
  # matrices (experts over `expert`, latent over fsdp) keep fsdp and add context.
  table = "['params']['embed_tokens']['embedding']"
  assert "fsdp" in str(plain[table]) and over[table] == plain[table]
  for k, s in plain.items():
    if "fsdp" in str(s) and k != table:
      assert "context" in str(over[k]), (k, s, over[k])
  w1 = [k for k in over if "experts" in k and k.endswith("['w1']")]
  assert w1 and all("context" in str(over[k]) and "fsdp" in str(over[k]) for k in w1)
  # The trainer: the run's mesh group carries the option into the state's shardings
  # (parameters and the optimizer state that mirrors them); no compile.
  amesh = sharding.abstract_mesh(MESH, 8)
  for option in (False, True):
    mesh_cfg = sharding.MeshConfig(data=1, fsdp=2, context=4, fsdp_over_context=option)
    run = RunConfig(model=config, train=TrainConfig(batch_size=B, seq_len=T), mesh=mesh_cfg)
    st = sharded.build_step(run, config, amesh).train.state_shardings
    p = _specs(st.params)
    o = [str(s.spec) for s in jax.tree.leaves(
        st.opt_state, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))]
    assert ("context" in str(p["['params']['lm_head']['kernel']"])) == option
    assert any("context" in s for s in o) == option


def test_step_with_params_over_context_equals_one_device():
  config = _config()
  batch = _batch()
  boxed = jax.eval_shape(K3Model(config).init, jax.random.PRNGKey(0),
                         jnp.zeros((1, 8), jnp.int32))
  variables = nn.unbox(jax.jit(K3Model(config).init)(jax.random.PRNGKey(0),
                                                      jnp.zeros((1, 8), jnp.int32)))
  variables = {"params": variables["params"], "balance": variables["balance"]}
  step = functools.partial(loss_and_grads, config, t=T)
  ref = jax.device_get(jax.jit(step)(variables, batch))

  mesh = sharding.make_mesh(MESH)
  sharding.check_shapes(config, mesh, batch_size=B, seq_len=T)
  var_sh = sharding.param_shardings(mesh, {c: boxed[c] for c in ("params", "balance")},
                                    sharding.params_over(MESH))
  fn = jax.jit(step, in_shardings=(var_sh, sharding.batch_shardings(mesh, batch)),
               out_shardings=(None, sharding.batch_sharding(mesh, 3), None, var_sh["params"]))
  with jax.set_mesh(mesh):
    loss, logits, mtp_logits, grads = fn(sharding.put_batch(variables, var_sh), batch)
  assert "context" in str(grads["lm_head"]["kernel"].sharding.spec)
  _close(loss, ref[0], "loss")
  _close(logits, ref[1], "logits")
  _close(mtp_logits, ref[2], "mtp_logits")
  flat = jax.tree_util.tree_flatten_with_path(jax.device_get(grads))[0]
  ref_flat = jax.tree_util.tree_leaves(ref[3])
  assert len(flat) == len(ref_flat)
  for (path, a), b in zip(flat, ref_flat):
    _close(a, b, f"grads{jax.tree_util.keystr(path)}")
