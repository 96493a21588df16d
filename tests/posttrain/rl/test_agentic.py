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
from k3jax.posttrain.rl.loop import policy_config, rl_base_config, rl_config
from k3jax.posttrain.rl.rewards import Teachers
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
  # MOPD: the initial policy as the teacher of every strops row, reading the same prompt
  # (strip_effort=False): its per-token reward is 0 while the student is the initial policy
  # (round 0) — were the teacher's tokens misaligned or a tool token scored, it would not be —
  # and not once the student has moved (round 1); bigmul rows have no teacher.
  teachers = Teachers({("strops", e): (policy_config(r.rl, CONFIG), variables)
                       for e in r.rl.efforts}, CONFIG.text.vocab_size, strip_effort=False)
  # One rewarded trajectory in each group of two: nonzero advantages, so the update moves.
  history, state = agentic.run(r, CONFIG, variables, log=None, teachers=teachers,
                               reward_fn=lambda trajs: [1.0, 0.0] * (len(trajs) // 2))
  assert [h["round"] for h in history] == [0, 1]
  sampler = T.ToolTaskSampler(r.rl.domains, r.rl.efforts, seed=r.run.seed)   # the run's tasks
  rows = [r.rl.k * sum(t.domain == "strops" for t in sampler.sample(r.rl.n_prompts))
          for _ in history]
  assert [h["teacher_rows"] for h in history] == rows == [4, 2]
  assert abs(history[0]["mopd"]) <= 1e-5 and abs(history[1]["mopd"]) > 1e-3
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


def test_budget_on_agentic_effort_boundary():
  """T(y) = thinking + tool-call argument tokens; T = τ·b₀ is within budget, T = τ·b₀ + 1 is
  rewarded −1, whatever the task reward."""
  from k3jax.posttrain.rl.env import Trajectory
  task = T.ToolTaskSampler(domains=("bigmul",), seed=1).sample(1)[0]

  def traj(think, args):
    return Trajectory(task, list(task.tokens), len(task.tokens), thinking_tokens=think,
                      argument_tokens=args)

  # b₀ = 8, τ = 1.5: budget 12.
  trajs = [traj(12, 0), traj(5, 7), traj(6, 7), traj(13, 0), traj(0, 0)]
  rewards, violations, effort = agentic.budget_rewards([1.0, 1.0, 1.0, 0.0, 0.0], trajs, 8.0,
                                                       1.5)
  np.testing.assert_array_equal(effort, [12, 12, 13, 13, 0])
  np.testing.assert_array_equal(violations, [False, False, True, True, False])
  np.testing.assert_array_equal(rewards, [1.0, 1.0, -1.0, -1.0, 0.0])
  assert trajs[1].effort_tokens(agentic=False) == 5       # general tasks: thinking alone


def test_rounds_with_the_budget_on_agentic_effort():
  """budget.enabled in agentic rounds: b₀ from the initial policy's trajectories (a second
  engine), τ annealed per domain, every trajectory's reward = −1 iff T > τ·b₀. At
  temperature 0.7: the engine's log-probs are the tempered distribution's, = the update's."""
  c = rl_base_config("tiny")
  c.rl.update(dict(rounds=2, n_prompts=2, k=2, domains=("bigmul", "strops"),
                   max_prompt_len=544, temperature=0.7))
  c.agent.update(dict(enabled=True, max_tokens=608, max_reply_tokens=8, max_turns=2,
                      num_slots=4, tool_cpu_seconds=1, tool_wall_seconds=4.0))
  c.budget.update(dict(enabled=True, b0_samples=1, tau_start=1.0, tau_end=0.5,
                       anneal_rounds=1))
  r = rl_config(c)
  variables = init_variables(CONFIG, jax.random.PRNGKey(0))
  history, _ = agentic.run(r, CONFIG, variables, log=None,
                           reward_fn=lambda trajs: [1.0] * len(trajs))
  assert [h["tau"] for h in history] == [1.0, 0.5]

  for h in history:
    assert h["mismatch"] <= 1e-5, h
    p = h["per_trajectory"]
    assert len(p["effort"]) == 4 and h["b0"] > 0
    for e, b, tau, acc, rew in zip(p["effort"], p["b0"], p["tau"], p["accuracy"], p["reward"]):
      assert rew == (-1.0 if e > tau * b else acc)
    # b₀ is one value per task (its group of K shares it).
    assert p["b0"][0] == p["b0"][1] and p["b0"][2] == p["b0"][3]
    assert h["budget_violations"] == np.mean([e > t * b for e, b, t in
                                              zip(p["effort"], p["b0"], p["tau"])])
  assert h["effort_tokens"] == np.mean(p["effort"])


def test_bad_settings_are_named():
  variables = {"params": {}}
  with pytest.raises(ValueError, match="rl.temperature"):
    _run(temperature=0.0)
  with pytest.raises(ValueError, match="rl.domains"):
    _run(domains=("arith",))
  c = rl_base_config("tiny")
  with pytest.raises(ValueError, match="agent.enabled"):
    agentic.run(rl_config(c), CONFIG, variables, log=None)
  c.agent.max_turns = 0
  with pytest.raises(ValueError, match="agent.max_turns"):
    rl_config(c)
