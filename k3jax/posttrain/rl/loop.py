"""The RL loop behind experiments/rl.py: partial rollouts → rewards → one policy update per
round, with per-round metrics.

Round r (policy version v = optimizer steps taken):
  1. `PartialRollout.round` generates until λ of the active trajectories finished and hands
     out the groups whose K completions have all finished (k3jax/posttrain/rl/partial.py).
  2. Task reward (exact checker on the reply's response channel), effort budget on
     T(y) = the reply's thinking tokens (`rl_tasks.read_reply`; K3 §13: general tasks count
     thinking) with b₀(x) = mean T of `budget.b0_samples` completions of the initial policy
     on x (sampled once per prompt, when its group is first trained) and τ = the domain's
     schedule at round r, group baseline (k3jax/posttrain/rl/losses.py).
  3. MOPD: each row's teacher (by the prompt's (domain, effort)) scores its tokens, on the
     prompt without the effort option (`rewards.Teachers`).
  4. One optimizer step (k3jax/posttrain/rl/update.py) on all handed-out groups (rows padded to a
     multiple of N·K: few compiled shapes).
Metrics per round (DIR/metrics.jsonl, one JSON object a line): reward (final, after budget),
accuracy (task reward before budget), length (reply tokens), thinking (T(y)),
budget_violations, mopd (mean clipped r_t), mismatch (max |rollout − trainer| log-prob over the
tokens sampled by the current policy from a cache it computed — with rl.retain_cache a resumed
trajectory's cache holds older policies' states), prefill_tokens (rollout tokens run through
prefill),
rollout_tokens_per_s, train_tokens_per_s, and bookkeeping counts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import time
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from k3jax import sharding
from k3jax.config import ModelConfig
from k3jax.data import tool_tasks, visual_tasks
from k3jax.data.rl_tasks import DOMAINS as RL_DOMAINS
from k3jax.data.rl_tasks import STOP_TOKEN, Task, TaskSampler, read_reply
from k3jax.posttrain.rl import logprobs as lp_lib
from k3jax.posttrain.rl import rollout as rollout_lib
from k3jax.posttrain.rl.losses import LossConfig, group_advantages
from k3jax.posttrain.rl.partial import PartialRollout
from k3jax.posttrain.rl.rewards import (Teachers, TauSchedule, apply_budget, budget_violations,
                                        task_rewards)
from k3jax.posttrain.rl.update import make_rl_step
from k3jax.quant import qat
from k3jax.train.optim import optimizer
from k3jax.train.run import RunConfig, base_config, run_config
from k3jax.train.sharded import PRETRAIN, run_rules
from k3jax.train.state import TrainState, init_state


def _need(cond, field, msg):
  if not cond:
    raise ValueError(f"config.{field}: {msg}")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """The `rl` group: rounds of N prompts × K completions, partial rollouts at λ."""
  rounds: int = 20
  n_prompts: int = 4
  k: int = 4
  lam: float = 0.75
  max_new_tokens: int = 32       # thinking, then `[close][open]response[sep]` answer …
  max_prompt_len: int = 112
  temperature: float = 1.0
  domains: tuple[str, ...] = ("arith", "sort", "puzzle")
  efforts: tuple[str, ...] = ("low", "high", "max")
  # None: the policy's own config; "mxfp4_mxfp8": QAT of the routed experts in rollouts and
  # updates alike (`policy_config`).
  expert_qat: str | None = None
  # True: rounds run through the serving engine, unfinished trajectories paused with their
  # caches and resumed without prefill (k3jax/posttrain/rl/partial.py); False: resumed
  # prefixes are recomputed (the reference). Either works at any temperature: the engine
  # reports log-probs of the distribution it samples from.
  retain_cache: bool = True
  # False: prompts without the effort option (the task's effort still picks τ and the
  # teacher): how a (domain × effort) teacher is trained (experiments/rl_pipeline.py).
  effort_option: bool = True

  def __post_init__(self):
    for f in ("rounds", "n_prompts", "k", "max_new_tokens", "max_prompt_len"):
      v = getattr(self, f)
      _need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"rl.{f}",
            f"expected a positive int, found {v!r}")
    _need(0 < self.lam <= 1, "rl.lam", f"expected a value in (0, 1], found {self.lam}")
    _need(self.temperature > 0, "rl.temperature",
          f"expected > 0 (sampling), found {self.temperature}")
    qat.check_mode(self.expert_qat, "config.rl.expert_qat")


@dataclasses.dataclass(frozen=True)
class BudgetConfig:
  """The `budget` group: the effort budget's τ per domain (a number: every domain), annealed
  from tau_start to tau_end over anneal_rounds; b₀ from b0_samples completions per prompt."""
  enabled: bool = True
  b0_samples: int = 2
  tau_start: float | Mapping[str, float] = 1.5
  tau_end: float | Mapping[str, float] = 0.8
  anneal_rounds: int | Mapping[str, int] = 10

  def __post_init__(self):
    _need(self.b0_samples > 0, "budget.b0_samples", f"expected > 0, found {self.b0_samples}")


@dataclasses.dataclass(frozen=True)
class AgentConfig:
  """The `agent` group: with `enabled`, rounds of multi-turn tool tasks through the serving
  engine (k3jax/posttrain/rl/agentic.py; rl.domains then name tool-task domains). Per
  trajectory: at most max_turns replies of max_reply_tokens, max_tokens in all; each tool
  call's sandbox limits; num_slots: the rollout engine's slots."""
  enabled: bool = False
  max_turns: int = 3
  max_tokens: int = 768
  max_reply_tokens: int = 96
  tool_cpu_seconds: int = 2
  tool_wall_seconds: float = 5.0
  num_slots: int = 8

  def __post_init__(self):
    for f in ("max_turns", "max_tokens", "max_reply_tokens", "num_slots", "tool_cpu_seconds"):
      v = getattr(self, f)
      _need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"agent.{f}",
            f"expected a positive int, found {v!r}")
    _need(self.tool_wall_seconds > 0, "agent.tool_wall_seconds",
          f"expected > 0, found {self.tool_wall_seconds}")


@dataclasses.dataclass(frozen=True)
class RLRun:
  """An RL run: the run config (optimizer, model, seed, mesh) and the RL groups."""
  run: RunConfig
  rl: RolloutConfig = RolloutConfig()
  loss: LossConfig = LossConfig()
  budget: BudgetConfig = BudgetConfig()
  agent: AgentConfig = AgentConfig()

  def __post_init__(self):
    known = (tool_tasks.DOMAINS + visual_tasks.DOMAINS) if self.agent.enabled else RL_DOMAINS
    unknown = [d for d in self.rl.domains if d not in known]
    _need(not unknown, "rl.domains", f"unknown domain(s) {unknown} for "
          f"{'agentic' if self.agent.enabled else 'single-turn'} rounds (domains: {known})")
    _need(self.run.train.steps == self.rl.rounds, "train.steps",
          f"the learning-rate schedule spans rl.rounds={self.rl.rounds}, found "
          f"{self.run.train.steps}")
    tau_schedule(self)   # domains and values checked


RL_GROUPS = {"rl": RolloutConfig, "loss": LossConfig, "budget": BudgetConfig,
             "agent": AgentConfig}


def rl_config(cfg) -> RLRun:
  """The typed RL run of a ConfigDict (configs/rl_*.py): `run_config` of its run groups and
  the RL groups (unknown fields are ValueErrors naming them)."""
  d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
  groups = {}
  for name, cls in RL_GROUPS.items():
    values = dict(d.get(name, {}))
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
    _need(not unknown, name, f"unknown field(s) {unknown}")
    groups[name] = cls(**{k: tuple(v) if isinstance(v, list) else v
                          for k, v in values.items()})
  return RLRun(run_config(cfg, extra=tuple(RL_GROUPS)), **groups)


def rl_base_config(preset_name: str = "tiny"):
  """`base_config(preset)` with the RL groups at their defaults (configs/rl_*.py start here);
  train.steps follows rl.rounds."""
  c = base_config(preset_name)
  for name, cls in RL_GROUPS.items():
    c[name] = ml_collections.ConfigDict(dataclasses.asdict(cls()))
  c.rl.expert_qat = ml_collections.FieldReference(None, field_type=str)
  c.train.steps = c.rl.get_ref("rounds")
  return c


def tau_schedule(r: RLRun) -> TauSchedule:
  b = r.budget

  def per_domain(v):
    # The visual domain has no effort budget (its T(y) is not wired: budget.enabled False).
    return dict(v) if hasattr(v, "keys") else {d: v for d in r.rl.domains
                                               if d not in visual_tasks.DOMAINS}

  return TauSchedule(per_domain(b.tau_start), per_domain(b.tau_end),
                     per_domain(b.anneal_rounds))


def policy_config(rl: RolloutConfig, config: ModelConfig) -> ModelConfig:
  """The policy's model config for RL: `config`, with `rl.expert_qat` (when set) turning on
  QAT of the routed experts (docs/k3.md §13: QAT from SFT through RL). Rollouts, b₀, the trainer's
  log-probs and the update all run this one config, so the same quantiser samples the tokens
  and scores them (the mismatch metric covers it)."""
  mode = rl.expert_qat
  return config if mode is None else config.replace(expert_qat=mode)


class B0:
  """b₀(x): mean T(y) (thinking tokens, `rl_tasks.read_reply`) of the initial policy's
  completions of prompt x, sampled once per prompt."""

  def __init__(self, config, variables, *, batch: int, samples: int, max_new_tokens: int,
               width: int, temperature: float, seed: int):
    self.config, self.variables, self.batch, self.samples = config, variables, batch, samples
    self.max_new, self.width, self.temperature = max_new_tokens, width, temperature
    self.key = jax.random.PRNGKey(seed)
    self.values: dict[int, float] = {}

  def __call__(self, tasks: list[Task]) -> np.ndarray:
    new = list({t.uid: t for t in tasks if t.uid not in self.values}.values())
    rows = [t for t in new for _ in range(self.samples)]
    lengths = []
    for s in range(0, len(rows), self.batch):   # fixed batch: one compiled shape
      part = rows[s:s + self.batch]
      prefixes = [t.tokens for t in part] + [[0]] * (self.batch - len(part))
      limits = [self.max_new] * len(part) + [0] * (self.batch - len(part))
      self.key, sub = jax.random.split(self.key)
      out = rollout_lib.sample(self.config, self.variables, prefixes, limits, width=self.width,
                               key=sub, stop_tokens=[STOP_TOKEN], temperature=self.temperature)
      lengths += [read_reply(out.row(b)[0]).thinking_tokens for b in range(len(part))]
    for i, t in enumerate(new):
      self.values[t.uid] = float(np.mean(lengths[i * self.samples:(i + 1) * self.samples]))
    return np.array([self.values[t.uid] for t in tasks], np.float64)


def record_round(m: dict, out: pathlib.Path | None, log: Callable[[str], None] | None) -> None:
  """One round's metrics: a line of out/metrics.jsonl, and one line to `log`."""
  if out is not None:
    with open(out / "metrics.jsonl", "a") as f:
      f.write(json.dumps(m) + "\n")
  if log is not None:
    log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()))


def write_json(path: pathlib.Path, obj) -> None:
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(obj, indent=1))
  os.replace(tmp, path)


def run(r: RLRun, config: ModelConfig, variables: dict, *, teachers: Teachers | None = None,
        out_dir: str | os.PathLike | None = None, log: Callable[[str], None] | None = print,
        limit_fn: Callable | None = None, mesh=None) -> tuple[list[dict], TrainState]:
  """Run rl.rounds rounds from `variables` (module doc). Returns (per-round metrics, the
  final state). `limit_fn(task, rng)` caps each trajectory's length (default max_new_tokens).
  `mesh`: the policy update runs sharded over it as pre-training does (`make_rl_step`; the
  rules of `run.mesh`), and rollouts run on the sharded policy; None: one device."""
  if r.agent.enabled:
    raise ValueError("agent.enabled: agentic rounds run through k3jax.posttrain.rl.agentic.run")
  config = policy_config(r.rl, config)
  cfg, lcfg, taus = r.run, r.loss, tau_schedule(r)
  width = r.rl.max_prompt_len + r.rl.max_new_tokens
  variables = {"params": variables["params"], "balance": variables.get("balance", {})}
  # Copies: the step donates the state's buffers, and neither the caller's arrays nor the
  # initial policy (b₀, the KL reference) may be among them.
  initial = jax.tree.map(jnp.array, variables)
  variables = jax.tree.map(jnp.array, variables)
  tx, _ = optimizer(cfg, config)
  state = init_state(variables, PRETRAIN, tx)
  ro = r.rl
  if mesh is not None:   # every update batch is a multiple of the N·K rollout slots
    sharding.check_shapes(config, mesh, batch_size=ro.n_prompts * ro.k, seq_len=width)
  step_fn = make_rl_step(config, tx, lcfg, temperature=float(ro.temperature),
                         qk_clip_tau=cfg.optim.qk_clip_tau, mesh=mesh,
                         rules=run_rules(cfg) if mesh is not None else None)
  sampler = TaskSampler(tuple(ro.domains), tuple(ro.efforts), seed=cfg.seed,
                        effort_option=ro.effort_option)
  pool = PartialRollout(sampler, n_prompts=ro.n_prompts, k=ro.k, lam=float(ro.lam),
                        max_new_tokens=ro.max_new_tokens, width=width, stop_tokens=[STOP_TOKEN],
                        temperature=float(ro.temperature), limit_fn=limit_fn, seed=cfg.seed,
                        retain_cache=ro.retain_cache)
  b0 = B0(config, initial, batch=pool.slots, samples=r.budget.b0_samples,
          max_new_tokens=ro.max_new_tokens, width=width, temperature=float(ro.temperature),
          seed=cfg.seed + 1) if r.budget.enabled else None
  out = pathlib.Path(out_dir) if out_dir is not None else None
  if out is not None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("")
  key = jax.random.PRNGKey(cfg.seed)
  history = []
  for rnd in range(ro.rounds):
    for t in pool.queue:
      if len(t.task.tokens) > ro.max_prompt_len:
        raise ValueError(f"rl.max_prompt_len={ro.max_prompt_len}: a prompt has "
                         f"{len(t.task.tokens)} tokens")
    key, sub = jax.random.split(key)
    version = int(state.step)
    groups, st = pool.round(config, state.variables, version, sub)
    pool.check()
    m = {"round": rnd, "version": version, "active": st.active, "resumed": st.resumed,
         "finished": st.finished, "queued": len(pool.queue), "groups": len(groups),
         "rollout_seconds": st.seconds, "prefill_tokens": st.prefill_tokens,
         "rollout_tokens_per_s": st.new_tokens / max(st.seconds, 1e-9)}
    if groups:
      upd, state = _update(ro, config, groups, rnd, version, taus, b0, teachers, lcfg, width,
                           pool.slots, initial, state, step_fn)
      m.update(upd)
    history.append(m)
    record_round(m, out, log)
  pool.close()
  if out is not None:
    write_json(out / "summary.json", {"rounds": history})
  return history, state


def _update(r: RolloutConfig, config, groups, rnd, version, taus, b0, teachers, lcfg, width,
            slots, initial, state, step_fn) -> tuple[dict, TrainState]:
  """Rewards, advantages, teacher scores and one optimizer step on the handed-out groups."""
  trajs = [t for g in groups for t in g]
  tasks = [t.task for t in trajs]
  lengths = np.array([len(t.tokens) for t in trajs])
  replies = [read_reply(t.tokens) for t in trajs]
  effort = np.array([rp.thinking_tokens for rp in replies])     # T(y)
  accuracy = task_rewards(tasks, [rp.response for rp in replies])   # the response channel
  rewards, violations, tau = accuracy, np.zeros(len(trajs), bool), np.nan
  if b0 is not None:
    base = b0(tasks)
    taus_row = np.array([taus(t.domain, rnd) for t in tasks])
    violations = budget_violations(effort, base, taus_row)
    rewards = apply_budget(accuracy, effort, base, taus_row)
    tau = float(taus_row.mean())
  adv = group_advantages(rewards, r.k, lcfg.adv_std_norm, lcfg.adv_eps)
  rows = math.ceil(len(trajs) / slots) * slots
  pad = rows - len(trajs)
  L = r.max_new_tokens
  seqs, plens = rollout_lib.sequences([t.task.tokens for t in trajs] + [trajs[0].task.tokens] * pad,
                                      [t.tokens for t in trajs] + [[]] * pad, width)
  mask = np.zeros((rows, L), np.float32)
  blp = np.zeros((rows, L), np.float32)
  fresh = np.zeros((rows, L), bool)
  for i, t in enumerate(trajs):
    mask[i, :len(t.tokens)] = 1
    blp[i, :len(t.tokens)] = t.logprobs
    # Sampled by the current policy alone: its version, from a cache it computed.
    fresh[i, :len(t.tokens)] = (np.array(t.versions) == version) & (
        np.array(t.cache_versions) == version)
  keys = [(t.domain, t.effort) for t in tasks] + [("", "")] * pad
  if teachers is not None:
    tlp, has = teachers.score(keys, seqs, plens, L, float(r.temperature))
  else:
    tlp, has = np.zeros((rows, L), np.float32), np.zeros(rows, bool)
  ref = (lp_lib.token_logprobs(config, initial, seqs, plens, L, float(r.temperature))
         if lcfg.kl_coef > 0 else np.zeros((rows, L), np.float32))
  batch = {"seqs": seqs, "prompt_lens": plens, "mask": mask, "behaviour_lp": blp,
           "adv": np.pad(adv, (0, pad)), "teacher_lp": tlp, "has_teacher": has, "ref_lp": ref}
  t0 = time.perf_counter()
  state, met = step_fn(state, jax.tree.map(jnp.asarray, batch))
  lp = np.asarray(met["rows"]["lp"])
  seconds = time.perf_counter() - t0
  train_tokens = int(sum(len(t.task.tokens) + len(t.tokens) for t in trajs))
  stale = mask.astype(bool) & ~fresh
  return {
      "trained": len(trajs), "reward": float(rewards.mean()), "accuracy": float(accuracy.mean()),
      "length": float(lengths.mean()), "thinking": float(effort.mean()),
      "budget_violations": float(violations.mean()),
      "tau": tau, "mopd": float(met["mopd"]) if has.any() else 0.0,
      "teacher_rows": int(has.sum()),
      "mismatch": float(np.abs(lp - blp)[fresh].max()) if fresh.any() else 0.0,
      "stale_tokens": int(stale.sum()), "loss": float(met["loss"]),
      "clip_frac": float(met["clip_frac"]), "kl": float(met["kl"]),
      "grad_norm": float(met["grad_norm"]), "train_seconds": seconds,
      "train_tokens_per_s": train_tokens / max(seconds, 1e-9)}, state
