"""One RL round end to end on a 1-layer (MLA + MoE) model: rollout, rewards with the budget, MOPD with a
teacher, KL to the initial policy, one Per-Head Muon + QB step, metrics on disk."""

import json

import jax
import numpy as np

from configs.rl_tiny import get_config
from k3jax.posttrain.rl import loop
from k3jax.posttrain.rl.rewards import Teachers
from k3jax.train.state import init_variables


def test_one_round(tmp_path):
  c = get_config()
  c.model.update(dict(num_layers=1, first_dense_layers=0, attn_res_block_size=None))
  c.rl.update(dict(rounds=1, n_prompts=2, k=2, lam=1.0, max_new_tokens=8))
  c.train.steps = 1
  c.loss.kl_coef = 0.1
  r = loop.rl_config(c)
  config = r.run.model
  v = init_variables(config, jax.random.PRNGKey(0))
  before = jax.tree.map(np.array, v["params"])
  # The teacher: the same weights but a different head, so the MOPD reward is not zero.
  tv = jax.tree.map(np.array, v)
  tv["params"]["lm_head"]["kernel"] = tv["params"]["lm_head"]["kernel"] * 3.0
  teachers = Teachers({(d, e): (config, tv) for d in c.rl.domains for e in c.rl.efforts},
                      config.text.vocab_size)
  history, state = loop.run(r, config, v, teachers=teachers, out_dir=tmp_path, log=None)
  (m,) = history
  assert m["groups"] == 2 and m["trained"] == 4 and m["queued"] == 0
  assert m["mismatch"] <= 1e-5
  assert m["teacher_rows"] == 4 and 0 < abs(m["mopd"]) <= c.loss.r_max
  assert -1 <= m["reward"] <= 1 and 1 <= m["length"] <= 8 and 0 <= m["thinking"] <= m["length"]
  assert m["tau"] == c.budget.tau_start
  assert m["kl"] >= 0 and np.isfinite(m["loss"]) and m["grad_norm"] > 0
  assert m["rollout_tokens_per_s"] > 0 and m["train_tokens_per_s"] > 0
  assert int(state.step) == 1
  # The caller's arrays were not donated to the step (they are still readable and unchanged).
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, v["params"]), before)
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()),
                       state.params["params"], before)
  assert max(jax.tree.leaves(moved)) > 0
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(x)["round"] for x in lines] == [0]
  assert json.loads((tmp_path / "summary.json").read_text())["rounds"][0]["reward"] == m["reward"]


def test_rounds_on_a_mesh_match_one_device(monkeypatch):
  """cfg.mesh shards the update as pre-training does (params over fsdp/expert, batch over the
  batch axes); the rollouts then run on the sharded policy: the retained-cache engine is
  given the weights as the mesh holds them (no copy gathered on one device). Same rounds as
  one device."""
  from k3jax import sharding
  from k3jax.posttrain.rl import partial
  served = []

  class Spy(partial.Engine):
    def __init__(self, config, variables, *args, **kwargs):
      served.append(variables)
      super().__init__(config, variables, *args, **kwargs)

    def set_variables(self, variables):
      served.append(variables)
      super().set_variables(variables)

  monkeypatch.setattr(partial, "Engine", Spy)
  c = get_config()
  c.model.update(dict(num_layers=1, first_dense_layers=0, attn_res_block_size=None))
  c.rl.update(dict(rounds=2, n_prompts=2, k=2, lam=1.0, max_new_tokens=8))
  c.budget.enabled = False
  c.train.steps = 2
  c.mesh.update(dict(data=1, fsdp=2, expert=2))
  r = loop.rl_config(c)
  config = r.run.model
  v = init_variables(config, jax.random.PRNGKey(0))
  one, s1 = loop.run(r, config, v, log=None)
  mesh = sharding.make_mesh(r.run.mesh, jax.devices()[:4])
  many, s2 = loop.run(r, config, v, log=None, mesh=mesh)
  # Each run serves the policy twice (its start, then round 0's update); the mesh run's
  # update is sharded, and so are the weights its engine then runs.
  assert len(served) == 4 and r.rl.retain_cache
  leaves = jax.tree.leaves(served[3])
  assert sum(not x.sharding.is_fully_replicated for x in leaves) >= len(leaves) // 2
  assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(served[1]))
  for a, b in zip(one, many):
    assert a["length"] == b["length"] and a["reward"] == b["reward"]   # same rollouts
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-4, atol=1e-6)
    assert b["mismatch"] <= 1e-5
  p1, p2 = s1.params["params"], s2.params["params"]
  split = [x for x in jax.tree.leaves(p2) if not x.sharding.is_fully_replicated]
  assert len(split) >= len(jax.tree.leaves(p2)) // 2
  delta = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), p1, p2)
  step = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
                      p1, v["params"])
  assert max(jax.tree.leaves(delta)) <= 1e-2 * max(jax.tree.leaves(step))


def test_shipped_config_learns_with_qat():
  """configs/rl_tiny.py ships the setting the reward rises with (K = 8, std-normalised
  advantages) and QAT of the routed experts on (the model has experts)."""
  r = loop.rl_config(get_config())
  assert r.rl.k == 8 and r.loss.adv_std_norm and r.rl.expert_qat == "mxfp4_mxfp8"
  assert r.run.model.text.num_experts > 0
  assert loop.policy_config(r.rl, r.run.model).modes.expert_qat == "mxfp4_mxfp8"
