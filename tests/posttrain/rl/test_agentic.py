"""Agentic RL rounds (k3jax/posttrain/rl/agentic.py): tool tasks rolled out through the serving
engine, the RL update on the policy's own tokens, and the engine serving the updated weights
(a 2-layer KDA + MLA model, two rounds)."""

import jax
import numpy as np
import pytest

from k3jax.config import preset
from k3jax.data import tool_tasks as T
from k3jax.posttrain.rl import agentic
from k3jax.posttrain.rl import logprobs as L
from k3jax.posttrain.rl.loop import rl_base_config, rl_config
from k3jax.train.state import init_variables

CONFIG = preset("tiny", num_layers=2, mla_every=2, first_dense_layers=1,
                attn_res_block_size=None, num_mtp_layers=0)


def _run(**rl):
  c = rl_base_config("tiny")
  c.rl.update({**dict(rounds=2, n_prompts=2, k=2, domains=("bigmul", "strops"),
                      max_prompt_len=544), **rl})
  c.agent.update(dict(enabled=True, max_tokens=608, max_reply_tokens=8, max_turns=2,
                      num_slots=4, tool_cpu_seconds=1, tool_wall_seconds=4.0))
  c.optim.update(dict(lr=1e-2, warmup_frac=0.0, final_lr_frac=1.0))
  c.budget.enabled = False
  return rl_config(c)


def test_rounds_train_on_engine_rollouts_and_the_engine_serves_the_update():
  r = _run()
  variables = init_variables(CONFIG, jax.random.PRNGKey(0))
  # One rewarded trajectory in each group of two: nonzero advantages, so the update moves.
  history, state = agentic.run(r, CONFIG, variables, log=None,
                               reward_fn=lambda trajs: [1.0, 0.0] * (len(trajs) // 2))
  assert [h["round"] for h in history] == [0, 1]
  for h in history:
    assert h["trajectories"] == 4 and h["policy_tokens"] > 0 and np.isfinite(h["loss"])
    assert sum(h["finish"].values()) == 4 and h["turns"] >= 1
    assert h["cached_fraction_later_turns"] > 0        # later turns resumed from the cache
    # Behaviour log-probs (the engine's) = the trainer's: in round 1 this holds only if the
    # engine serves the weights after round 0's update.
    assert h["mismatch"] <= 1e-5, h
  # The update is large enough that stale weights would break that bound.
  task = T.ToolTaskSampler(domains=("bigmul",), seed=5).sample(1)[0]
  seqs = np.array([list(task.tokens) + [97] * 8], np.int32)
  plens = np.array([len(task.tokens)], np.int32)
  before = L.token_logprobs(CONFIG, variables, seqs, plens, 8)
  after = L.token_logprobs(CONFIG, state.variables, seqs, plens, 8)
  assert np.abs(after - before).max() > 1e-3


def test_bad_settings_are_named():
  variables = {"params": {}}
  with pytest.raises(ValueError, match="rl.temperature"):
    agentic.run(_run(temperature=0.7), CONFIG, variables, log=None)
  with pytest.raises(ValueError, match="rl.domains"):
    _run(domains=("arith",))
  c = rl_base_config("tiny")
  with pytest.raises(ValueError, match="agent.enabled"):
    agentic.run(rl_config(c), CONFIG, variables, log=None)
  c.agent.max_turns = 0
  with pytest.raises(ValueError, match="agent.max_turns"):
    rl_config(c)
