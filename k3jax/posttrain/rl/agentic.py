"""Agentic RL rounds (K3 §13): tool tasks rolled out through the serving engine, then the RL
update of the one training engine.

A round: N tool tasks (k3jax/data/tool_tasks.py), each K times, run to their ends by
`env.rollout` (multi-turn, the python tool in the sandbox, every turn a request to one
`Engine` whose prefix cache resumes each later turn at the earlier prompt's last boundary);
reward 1 for an exact final answer (the hidden verifier); group advantages over the K
trajectories of a task; one step of `make_rl_step` on the policy's own tokens
(`env.training_rows`: tool outputs, prompts and the environment's closings masked), with the
engine's log-probs as the behaviour log-probs. The engine then serves the updated weights
(`Engine.set_variables`, which also drops the cache: its states were the old weights').

Effort budget (`budget.enabled`; K3 §13): T(y) = `Trajectory.effort_tokens(agentic=True)` —
the thinking tokens plus every tool call's argument tokens; b₀(x) = the mean T of
`budget.b0_samples` trajectories of the *initial* policy on task x (`EffortB0`: rolled out
through a second engine that keeps serving the initial weights, once per task, in the round
the task is first trained); τ_d(r) per domain, annealed as in the single-turn loop
(`loop.tau_schedule`); the reward becomes −1 when T(y) > τ·b₀(x) (`budget_rewards`).

MOPD (`teachers`, K3 §13): each trajectory whose (domain, effort) has a teacher gets the dense
per-token reward r_t = clip(log π_teacher(y_t | x', y<t) − log π_θ(y_t | x, y<t), ±R_max) on
its policy tokens, as in the single-turn loop: the teacher reads the whole multi-turn row
(tool messages included, the prompt without its effort option) and only the policy's own
tokens carry the reward (the row's loss mask).

Visual tasks (rl.domains = ("crop",), k3jax/data/visual_tasks.py; a multimodal policy): the
environment offers the `crop` tool instead of python, each request carries the trajectory's
images (the overview, then every crop) as a media stream, and so does each training row
(`ToolEnv.batch_media`): the update sees the images the rollout saw.

Sampling is at `rl.temperature`: the engine reports each token's log-prob under the
distribution it was drawn from (`EngineConfig(logprobs="sampling")`), the update scores the
same tokens at the same temperature, so behaviour = trainer log-probs up to rounding (the
`mismatch` metric).
"""

from __future__ import annotations

import os
import pathlib
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.data.tokenizers import CHAT_END
from k3jax.data import visual_tasks
from k3jax.data.tool_tasks import ToolTaskSampler, is_correct
from k3jax.posttrain.rl import logprobs as lp_lib
from k3jax.posttrain.rl import sandbox
from k3jax.posttrain.rl.env import FINISHES, ToolEnv, Trajectory, rollout, training_rows
from k3jax.posttrain.rl.loop import RLRun, policy_config, record_round, tau_schedule, write_json
from k3jax.posttrain.rl.losses import group_advantages
from k3jax.posttrain.rl.rewards import Teachers, apply_budget, budget_violations
from k3jax.posttrain.rl.update import make_rl_step
from k3jax.serve.engine import Engine, EngineConfig
from k3jax.train.optim import optimizer
from k3jax.train.sharded import PRETRAIN
from k3jax.train.state import TrainState, init_state


def engine_config(r: RLRun) -> EngineConfig:
  """The rollout engine of a run: `agent.num_slots` slots, a context of the trajectory's
  token limit, the grid and KDA checkpoints every 64 tokens plus every turn boundary;
  log-probs of the sampling distribution (the behaviour policy at rl.temperature)."""
  a = r.agent
  page = 16
  return EngineConfig(num_slots=a.num_slots, tile_rows=min(a.num_slots, 4),
                      max_len=-(-a.max_tokens // page) * page, page_size=page, prefill_chunk=64,
                      checkpoint_interval=64, boundary_token=CHAT_END, step_tokens=256,
                      num_checkpoints=4 * a.num_slots, logprobs="sampling")


class EffortB0:
  """b₀(x) on agentic T(y) (module doc): the mean `effort_tokens(agentic=True)` of `samples`
  trajectories of the engine's (initial) policy on task x at `temperature`, rolled out once
  per task uid."""

  def __init__(self, engine: Engine, env: ToolEnv, samples: int, seed: int = 0,
               temperature: float = 1.0):
    self.engine, self.env, self.samples, self.seed = engine, env, samples, seed
    self.temperature = temperature
    self.values: dict[int, float] = {}
    self.calls = 0

  def __call__(self, tasks: Sequence) -> np.ndarray:
    new = list({t.uid: t for t in tasks if t.uid not in self.values}.values())
    if new:
      rows = [t for t in new for _ in range(self.samples)]
      trajs = rollout(self.engine, rows, self.env, temperature=self.temperature,
                      seed=self.seed * 7919 + 104_729 + self.calls)
      self.calls += 1
      for i, t in enumerate(new):
        part = trajs[i * self.samples:(i + 1) * self.samples]
        self.values[t.uid] = float(np.mean([x.effort_tokens(agentic=True) for x in part]))
    return np.array([self.values[t.uid] for t in tasks], np.float64)


def budget_rewards(rewards, trajs: Sequence[Trajectory], b0, tau
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(rewards with −1 where T(y) > τ·b₀(x), violations [n] bool, T(y) [n]) on agentic T(y) =
  thinking + tool-call argument tokens (T = τ·b₀ is within budget)."""
  effort = np.array([t.effort_tokens(agentic=True) for t in trajs], np.float64)
  return (apply_budget(rewards, effort, b0, tau), budget_violations(effort, b0, tau), effort)


def run(r: RLRun, config: ModelConfig, variables: dict, *,
        out_dir: str | os.PathLike | None = None,
        log: Callable[[str], None] | None = print,
        reward_fn: Callable[[Sequence[Trajectory]], np.ndarray] | None = None,
        sampler=None, teachers: Teachers | None = None) -> tuple[list[dict], TrainState]:
  """Run rl.rounds agentic rounds from `variables` (module doc) on one device. Returns (per
  round metrics, the final state); with `out_dir`, metrics.jsonl and summary.json there.
  reward_fn: trajectories → rewards [n] (default: 1 for an exact final answer).
  sampler: an object whose `sample(n)` gives n tool tasks (default: `ToolTaskSampler` over
  rl.domains × rl.efforts, seeded by run.seed). teachers: MOPD teachers by (domain, effort)
  (module doc; text tool tasks only), weighted by loss.mopd_coef.

  Training rows are rl.max_prompt_len + agent.max_tokens tokens wide and read
  agent.max_tokens tokens after each prompt (a bound on any trajectory's continuation)."""
  if not r.agent.enabled:
    raise ValueError("agent.enabled: False (single-turn rounds: k3jax.posttrain.rl.loop.run)")
  config = policy_config(r.rl, config)
  ro, a, lcfg = r.rl, r.agent, r.loss
  variables = {"params": variables["params"], "balance": variables.get("balance", {})}
  # Copies: the step donates the state's buffers; the KL reference must not be among them.
  initial = jax.tree.map(jnp.array, variables)
  tx, _ = optimizer(r.run, config)
  state = init_state(jax.tree.map(jnp.array, variables), PRETRAIN, tx)
  step_fn = make_rl_step(config, tx, lcfg, temperature=ro.temperature,
                         qk_clip_tau=r.run.optim.qk_clip_tau)
  visual = any(d in visual_tasks.DOMAINS for d in ro.domains)
  if visual and (not all(d in visual_tasks.DOMAINS for d in ro.domains)
                 or config.vision is None):
    raise ValueError(f"rl.domains={tuple(ro.domains)}: visual tasks need a multimodal policy "
                     f"(model.vision) and no text-tool domain beside them")
  if teachers is not None and visual:
    raise ValueError(f"teachers: MOPD teachers score text rows; rl.domains={tuple(ro.domains)} "
                     f"are visual")
  media = (dict(tools=("crop",), vision_config=config.vision,
                media_id=config.media_placeholder_token_id) if visual else {})
  env = ToolEnv(limits=sandbox.Limits(cpu_seconds=a.tool_cpu_seconds,
                                      wall_seconds=a.tool_wall_seconds),
                max_turns=a.max_turns, max_tokens=a.max_tokens,
                max_reply_tokens=a.max_reply_tokens, **media)
  engine = Engine(config, jax.tree.map(jnp.array, state.variables), engine_config(r))
  b0 = (EffortB0(Engine(config, initial, engine_config(r)), env, r.budget.b0_samples,
                 seed=r.run.seed + 1, temperature=ro.temperature)
        if r.budget.enabled else None)
  taus = tau_schedule(r)
  if sampler is None:
    sampler = (visual_tasks.VisualTaskSampler if visual else ToolTaskSampler)(
        ro.domains, ro.efforts, seed=r.run.seed)
  verify = visual_tasks.is_correct if visual else is_correct
  width, resp = ro.max_prompt_len + a.max_tokens, a.max_tokens
  out = pathlib.Path(out_dir) if out_dir is not None else None
  if out is not None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("")
  history = []
  for rnd in range(ro.rounds):
    tasks = [t for t in sampler.sample(ro.n_prompts) for _ in range(ro.k)]
    for t in tasks:
      if len(t.tokens) > ro.max_prompt_len:
        raise ValueError(f"rl.max_prompt_len={ro.max_prompt_len}: a prompt has "
                         f"{len(t.tokens)} tokens")
    t0 = time.perf_counter()
    trajs = rollout(engine, tasks, env, temperature=ro.temperature,
                    seed=r.run.seed * 7919 + rnd)
    rollout_s = time.perf_counter() - t0
    rewards = (np.array([float(verify(t.task, t.response)) for t in trajs], np.float32)
               if reward_fn is None else np.asarray(reward_fn(trajs), np.float32))
    accuracy = rewards
    effort = np.array([t.effort_tokens(agentic=True) for t in trajs], np.float64)
    budget = {}
    if b0 is not None:
      base = b0([t.task for t in trajs])
      taus_row = np.array([taus(t.task.domain, rnd) for t in trajs])
      rewards, violations, effort = budget_rewards(accuracy, trajs, base, taus_row)
      budget = {"tau": float(taus_row.mean()), "b0": float(base.mean()),
                "budget_violations": float(violations.mean()),
                "per_trajectory": {"effort": effort.tolist(), "b0": base.tolist(),
                                   "tau": taus_row.tolist(), "accuracy": accuracy.tolist(),
                                   "reward": rewards.tolist()}}
    adv = group_advantages(rewards, ro.k, lcfg.adv_std_norm, lcfg.adv_eps)
    seqs, plens, mask, blp = training_rows(trajs, width, resp)
    rows = len(trajs)
    media = env.batch_media(trajs) if visual else None
    # The KL reference reads the same rows as the update: with their images.
    ref = (lp_lib.token_logprobs(config, initial, seqs, plens, resp, float(ro.temperature),
                                 media=media)
           if lcfg.kl_coef > 0 else np.zeros((rows, resp), np.float32))
    if teachers is not None:
      tlp, has = teachers.score([(t.task.domain, t.task.effort) for t in trajs], seqs, plens,
                                resp, float(ro.temperature))
    else:
      tlp, has = np.zeros((rows, resp), np.float32), np.zeros(rows, bool)
    batch = {"seqs": seqs, "prompt_lens": plens, "mask": mask, "behaviour_lp": blp,
             "adv": adv, "teacher_lp": tlp, "has_teacher": has, "ref_lp": ref}
    if visual:
      batch["media"] = media
    t0 = time.perf_counter()
    state, met = step_fn(state, jax.tree.map(jnp.asarray, batch))
    lp = np.asarray(met["rows"]["lp"])
    train_s = time.perf_counter() - t0
    engine.set_variables(jax.tree.map(jnp.array, state.variables))
    later = [turn for t in trajs for turn in t.turns[1:]]
    m = {"round": rnd, "trajectories": rows, "reward": float(rewards.mean()),
         "accuracy": float(accuracy.mean()),
         "turns": float(np.mean([len(t.turns) for t in trajs])),
         "tool_calls": int(sum(t.tool_calls for t in trajs)),
         "finish": {f: sum(t.finish == f for t in trajs) for f in FINISHES
                    if f != "media_token" or visual},
         "policy_tokens": int(mask.sum()),
         "effort_tokens": float(effort.mean()), **budget,
         "cached_fraction_later_turns": (sum(t.cached for t in later)
                                         / max(sum(t.prompt_len for t in later), 1)),
         "mismatch": float(np.abs(lp - blp)[mask > 0].max()) if mask.any() else 0.0,
         "loss": float(met["loss"]), "grad_norm": float(met["grad_norm"]),
         "clip_frac": float(met["clip_frac"]), "kl": float(met["kl"]),
         "mopd": float(met["mopd"]) if has.any() else 0.0, "teacher_rows": int(has.sum()),
         "rollout_seconds": rollout_s,
         "train_seconds": train_s}
    history.append(m)
    record_round(m, out, log)
  if out is not None:
    write_json(out / "summary.json", {"rounds": history})
  return history, state


__all__ = ["EffortB0", "budget_rewards", "engine_config", "run"]
