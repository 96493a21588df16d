"""FSDP over context: parameters and optimizer state sharded over the `context` mesh axis too
(`MeshConfig.fsdp_over_context`, `sharding.axis_rules(fsdp_over_context=True)`), on 8 simulated
CPU devices (fsdp=2, context=4).

The parameters' shardings include `context` (the dense weights over fsdp × context, the
expert matrices' latent dimension too; not the token embedding table) and the trainer's state
shardings follow the run's mesh option. The step with the parameters laid out that way — loss,
logits, MTP logits and every updated parameter, in that layout — equals one device's in
tests/parallel/test_model_parallel.py (its fsdp × context mesh).
"""

import jax
import jax.numpy as jnp

from k3jax import sharding
from k3jax.config import preset
from k3jax.model import K3Model
from k3jax.train import sharded
from k3jax.train.run import RunConfig, TrainConfig

B, T = 2, 32
MESH = sharding.MeshConfig(data=1, fsdp=2, context=4, fsdp_over_context=True)


def _config():
  return preset("tiny", num_layers=2, num_mtp_layers=1)


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
