"""Measurements of the RL stage on a tiny model (docs/notes/rl.md), each written as JSON.

python -m experiments.rl_figures --figure=all --out=runs/rl_figures

  cold_start  a short supervised warm-up of the policy on correct thinking-mode replies: 0–8
              filler dots inside `think`, then the answer in the response channel
              (k3jax/data/rl_tasks.py `sft_reply`), through the pre-training step; saved as
              OUT/cold_start (a checkpoint experiments/rl.py takes as --policy).
  mismatch    max |rollout − trainer| log-prob of sampled tokens, model in fp32 and in bf16.
  partial     wall time per round of partial rollouts (λ < 1) vs waiting for all (λ = 1) on
              trajectories whose lengths follow a long-tailed (Pareto) distribution, fixed
              parameters, same number of rounds.
  partial_cache  the same partial rollouts at λ = 1, 0.75, 0.5 with resumed prefixes
              recomputed by prefill vs kept in the serving engine's caches (pause / resume,
              rl.retain_cache): rollout tokens/s, prefill tokens and decode steps per round;
              the two modes' rounds alternate, so both see the same machine load.
  reward      RL rounds from the cold start without budget: mean reward per round.
  budget      the same with the effort budget (τ annealed): length and reward per round.
  mopd        a weaker student distilled from a better and from a worse teacher (MOPD only):
              teachers' and student's accuracy before/after.
Every figure writes OUT/<figure>.json with its settings and the command's date.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import time

from absl import app, flags

_FIGURE = flags.DEFINE_enum("figure", "all",
                            ["all", "cold_start", "mismatch", "partial", "partial_cache", "reward",
                             "budget", "mopd", "plot"],
                            "Which measurement.")
_OUT = flags.DEFINE_string("out", "runs/rl_figures", "Output directory.")
_ROUNDS = flags.DEFINE_integer("rounds", 30, "RL rounds of the reward/budget figures.")
_SFT_STEPS = flags.DEFINE_integer("sft_steps", 300, "Cold-start supervised steps.")
_LAYERS = flags.DEFINE_integer("layers", 2, "Model layers (2: one KDA, one MLA).")
_DOMAINS = flags.DEFINE_string("domains", "arith", "Comma-separated task domains.")
_LR = flags.DEFINE_float("lr", 2e-3, "RL learning rate (reward/budget figures).")
_MUON = flags.DEFINE_bool("muon", True, "RL updates with Per-Head Muon (else AdamW alone).")
_K = flags.DEFINE_integer("k", 4, "Completions per prompt (the GRPO group).")
_ADV_STD = flags.DEFINE_bool("adv_std_norm", False, "Divide advantages by the group's std.")


def _write(out: pathlib.Path, name: str, obj: dict) -> None:
  obj = {"figure": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"), "command": "python -m experiments.rl_figures " + " ".join(
          f"--{k}={v}" for k, v in _flags().items()), **obj}
  tmp = out / f"{name}.json.tmp"
  tmp.write_text(json.dumps(obj, indent=1))
  os.replace(tmp, out / f"{name}.json")
  print(f"wrote {out / name}.json")


def _flags() -> dict:
  return {"figure": _FIGURE.value, "out": _OUT.value, "rounds": _ROUNDS.value,
          "sft_steps": _SFT_STEPS.value, "layers": _LAYERS.value, "domains": _DOMAINS.value,
          "lr": _LR.value, "muon": _MUON.value, "k": _K.value,
          "adv_std_norm": _ADV_STD.value}


def _cfg():
  from configs.rl_tiny import get_config
  c = get_config()
  c.model.update(dict(num_layers=_LAYERS.value, mla_every=max(2, min(4, _LAYERS.value)),
                      attn_res_block_size=None if _LAYERS.value < 4 else 2))
  c.rl.domains = tuple(_DOMAINS.value.split(","))
  c.rl.update(dict(rounds=_ROUNDS.value, n_prompts=8, k=_K.value, max_new_tokens=32))
  c.loss.adv_std_norm = _ADV_STD.value
  c.train.steps = _ROUNDS.value
  c.optim.lr = _LR.value
  c.optim.muon = _MUON.value
  return c


def train_cold_start(c, steps: int, path: pathlib.Path, *, batch: int = 32,
                     max_filler: int = 8, by_effort: bool = False, log=print):
  """Supervised warm-up of `c`'s model (an RL config dict: its model, rl.domains / efforts /
  widths) on `sft_reply` rows — the prompt with its effort option, a reply that thinks 0..
  max_filler dots and answers — for `steps` steps (lr 3e-3, Per-Head Muon); loss on the reply's
  tokens only; `by_effort`: each reply's length from its effort level's third of that range
  (`rl_tasks.filler_range`). Saves the checkpoint at `path`; returns ((config, variables),
  losses, seconds)."""
  import jax
  import numpy as np
  from k3jax.data import rl_tasks
  from k3jax.convert.checkpoint import load_pretrained, save_pretrained
  from k3jax.posttrain.rl.loop import RL_GROUPS
  from k3jax.train.run import run_config
  from k3jax.train.sharded import PRETRAIN, build_step
  from k3jax.train.state import init_state, init_variables

  c = c.copy_and_resolve_references() if hasattr(c, "copy_and_resolve_references") else c
  c.train.steps = steps
  c.optim.update(dict(lr=3e-3, warmup_frac=0.05, final_lr_frac=0.1, muon=True))
  run = run_config(c, extra=tuple(RL_GROUPS))     # supervised steps: the RL groups unused
  config = run.model
  step = build_step(run, config)
  state = init_state(init_variables(config, jax.random.PRNGKey(run.seed)), PRETRAIN, step.tx)
  sampler = rl_tasks.TaskSampler(c.rl.domains, c.rl.efforts, seed=1234)
  rng = np.random.default_rng(0)
  width = c.rl.max_prompt_len + c.rl.max_new_tokens
  losses, t0 = [], time.perf_counter()
  for s in range(steps):
    rows = np.zeros((batch, width + 1), np.int32)
    mask = np.zeros((batch, width), np.float32)
    for i, t in enumerate(sampler.sample(batch)):
      seq = list(t.tokens) + list(rl_tasks.sft_reply(t, rng, max_filler, by_effort))
      rows[i, :len(seq)] = seq
      mask[i, len(t.tokens) - 1:len(seq) - 1] = 1     # predict the reply's tokens only
    b = {"inputs": rows[:, :-1], "targets": rows[:, 1:], "loss_mask": mask,
         "segment_ids": np.zeros((batch, width), np.int32)}
    state, m = step.train(state, b)
    if s % 50 == 0 or s == steps - 1:
      losses.append((s, float(m["loss"])))
      if log is not None:
        log(f"cold start step {s}: loss {float(m['loss']):.3f}")
  save_pretrained(path, config, state.variables)
  return load_pretrained(path), losses, time.perf_counter() - t0


def cold_start(out: pathlib.Path, steps: int | None = None, name: str = "cold_start"):
  """(config, variables) after `steps` supervised warm-up steps (trained once, then
  reloaded from OUT/<name>)."""
  from k3jax.convert.checkpoint import load_pretrained
  steps = steps or _SFT_STEPS.value
  path = out / name
  if path.exists():
    return load_pretrained(path)
  (config, variables), losses, seconds = train_cold_start(_cfg(), steps, path)
  _write(out, name, {"steps": steps, "batch": 32, "loss": losses, "seconds": seconds,
                     "format": "thinking mode: 0-8 dots in think, then the answer"})
  return config, variables


def mismatch(out: pathlib.Path, config, variables):
  import jax
  from k3jax.posttrain.rl import logprobs as L
  from k3jax.posttrain.rl import rollout as R
  from k3jax.data import rl_tasks
  c = _cfg()
  width = c.rl.max_prompt_len + c.rl.max_new_tokens
  prompts = [t.tokens for t in rl_tasks.TaskSampler(c.rl.domains, seed=7).sample(32)]
  res = {}
  for dtype in ("float32", "bfloat16"):
    cfg = config.replace(dtype=dtype)
    o = R.rollout(cfg, variables, prompts, c.rl.max_new_tokens, key=jax.random.PRNGKey(3),
                  width=width, stop_tokens=[rl_tasks.STOP_TOKEN])
    seqs, plens = R.sequences(prompts, [o.row(b)[0] for b in range(len(prompts))], width)
    lp = L.token_logprobs(cfg, variables, seqs, plens, o.tokens.shape[1])
    res[dtype] = {"max_abs": L.mismatch(o.logprobs, lp, o.lengths),
                  "tokens": int(o.lengths.sum())}
    print(dtype, res[dtype])
  _write(out, "mismatch", {"prompts": len(prompts), "params": "fp32 masters", **res})


def partial(out: pathlib.Path, config, variables):
  import jax
  import numpy as np
  from k3jax.data import rl_tasks
  from k3jax.posttrain.rl.partial import PartialRollout
  c = _cfg()
  max_new = 64
  width = c.rl.max_prompt_len + max_new

  def pareto(task, rng):   # long tail: most short, a few at the cap
    return int(min(max_new, 4 + np.floor(rng.pareto(1.2) * 4)))

  res = {}
  for lam in (1.0, 0.75, 0.5):
    pool = PartialRollout(rl_tasks.TaskSampler(c.rl.domains, seed=11), n_prompts=8, k=4, lam=lam,
                          max_new_tokens=max_new, width=width, stop_tokens=(),
                          temperature=1.0, limit_fn=pareto, seed=0)
    pool.round(config, variables, 0, jax.random.PRNGKey(0))   # compile
    secs, steps, done, toks = [], [], 0, 0
    for r in range(30):
      groups, st = pool.round(config, variables, 0, jax.random.PRNGKey(r + 1))
      secs.append(st.seconds)
      steps.append(st.steps)
      done += st.finished
      toks += st.new_tokens
    res[f"lam={lam}"] = {"round_seconds_mean": float(np.mean(secs)),
                         "round_seconds": secs, "decode_steps": steps,
                         "finished_per_s": done / sum(secs), "tokens_per_s": toks / sum(secs)}
    print(lam, res[f"lam={lam}"]["round_seconds_mean"], res[f"lam={lam}"]["finished_per_s"])
  _write(out, "partial", {"n_prompts": 8, "k": 4, "rounds": 30, "max_new_tokens": max_new,
                          "lengths": "min(64, 4 + floor(4·Pareto(1.2)))", **res})


def partial_cache(out: pathlib.Path, config, variables, warmup: int = 3):
  """`partial`'s setup (8 prompts × 4, Pareto caps up to 64, no stop token, fixed parameters),
  recompute vs retained caches over --rounds rounds, the two pools' rounds alternating. Both
  pools draw the same tasks and caps, so round r does the same decode steps in both: the
  median of the per-round time ratios (`speedup_p50`) is robust to a loaded machine."""
  rounds = _ROUNDS.value
  import jax
  import numpy as np
  from k3jax.data import rl_tasks
  from k3jax.posttrain.rl.partial import PartialRollout
  c = _cfg()
  max_new = 64
  width = c.rl.max_prompt_len + max_new

  def pareto(task, rng):
    return int(min(max_new, 4 + np.floor(rng.pareto(1.2) * 4)))

  res = {}
  for lam in (1.0, 0.75, 0.5):
    pools = {mode: PartialRollout(rl_tasks.TaskSampler(c.rl.domains, seed=11), n_prompts=8, k=4,
                                  lam=lam, max_new_tokens=max_new, width=width, stop_tokens=(),
                                  temperature=1.0, limit_fn=pareto, seed=0,
                                  retain_cache=mode == "retain")
             for mode in ("recompute", "retain")}
    rec = {m: dict(secs=[], steps=[], prefill=[], done=0, toks=0, resumed=0) for m in pools}
    for r in range(warmup + rounds):
      for mode, pool in pools.items():
        groups, st = pool.round(config, variables, 0, jax.random.PRNGKey(r + 1))
        pool.check()
        if r < warmup:                       # compiles (pause / resume first run in round 2)
          continue
        x = rec[mode]
        x["secs"].append(st.seconds)
        x["steps"].append(st.steps)
        x["prefill"].append(st.prefill_tokens)
        x["done"] += st.finished
        x["toks"] += st.new_tokens
        x["resumed"] += st.resumed
    for mode, x in rec.items():
      secs = np.array(x["secs"])
      res[f"lam={lam}/{mode}"] = {
          "round_seconds_mean": float(secs.mean()), "round_seconds_p50": float(np.median(secs)),
          "round_seconds_p90": float(np.percentile(secs, 90)), "round_seconds": x["secs"],
          "decode_steps": x["steps"], "prefill_tokens_per_round": float(np.mean(x["prefill"])),
          "resumed_per_round": x["resumed"] / rounds, "new_tokens": x["toks"],
          "finished_per_s": float(x["done"] / secs.sum()),
          "tokens_per_s": float(x["toks"] / secs.sum())}
      print(lam, mode, {k: v for k, v in res[f"lam={lam}/{mode}"].items()
                        if not isinstance(v, list)}, flush=True)
    ratio = np.array(rec["recompute"]["secs"]) / np.array(rec["retain"]["secs"])
    res[f"lam={lam}/speedup_p50"] = float(np.median(ratio))
    res[f"lam={lam}/tokens_per_s_ratio"] = (res[f"lam={lam}/retain"]["tokens_per_s"]
                                            / res[f"lam={lam}/recompute"]["tokens_per_s"])
    print(lam, "per-round speedup (median)", res[f"lam={lam}/speedup_p50"], flush=True)
    pools["retain"].close()
    pools["retain"].check()
    eng = pools["retain"].engine
    assert eng.allocator.num_used == 0, "pages left after close"
  _write(out, "partial_cache", {"n_prompts": 8, "k": 4, "rounds": rounds, "warmup_rounds": warmup,
                                "max_new_tokens": max_new,
                                "lengths": "min(64, 4 + floor(4·Pareto(1.2)))", **res})


def rl_run(out: pathlib.Path, name: str, config, variables, budget: bool):
  from k3jax.posttrain.rl import loop
  c = _cfg()
  c.budget.enabled = budget
  c.budget.update(dict(tau_start=1.2, tau_end=0.6, anneal_rounds=max(1, _ROUNDS.value // 2)))
  t0 = time.perf_counter()
  hist, _ = loop.run(loop.rl_config(c), config, variables, out_dir=out / name)
  _write(out, name, {"budget": dict(c.budget), "rl": dict(c.rl), "loss": dict(c.loss),
                     "lr": c.optim.lr, "muon": c.optim.muon,
                     "seconds": time.perf_counter() - t0, "rounds": hist})


def sample_replies(config, variables, c, n: int, seed: int, efforts=None,
                   effort_option: bool = True):
  """(tasks, replies): n fresh prompts of `c`'s domains (and `efforts`, default c.rl.efforts),
  each answered once by sampling at temperature 1."""
  import jax
  from k3jax.posttrain.rl import rollout as R
  from k3jax.data import rl_tasks
  ts = rl_tasks.TaskSampler(c.rl.domains, efforts or c.rl.efforts, seed=seed,
                            effort_option=effort_option).sample(n)
  o = R.rollout(config, variables, [t.tokens for t in ts], c.rl.max_new_tokens,
                key=jax.random.PRNGKey(seed), width=c.rl.max_prompt_len + c.rl.max_new_tokens,
                stop_tokens=[rl_tasks.STOP_TOKEN])
  return ts, [rl_tasks.read_reply(o.row(b)[0]) for b in range(n)]


def accuracy(config, variables, n: int = 64, seed: int = 99) -> float:
  """Mean exact-answer rate of sampled (temperature 1) replies on n fresh prompts."""
  from k3jax.posttrain.rl import rewards
  ts, replies = sample_replies(config, variables, _cfg(), n, seed)
  return float(rewards.task_rewards(ts, [r.response for r in replies]).mean())


def mopd(out: pathlib.Path, config, variables):
  """A weaker student (100 cold-start steps) distilled on-policy from a better teacher (the
  300-step cold start) or a worse one (the untrained initial model): the loop's loss (task
  reward with group baseline + MOPD, mopd_coef 1), no budget."""
  import jax
  from k3jax.posttrain.rl import loop
  from k3jax.posttrain.rl.rewards import Teachers
  from k3jax.train.state import init_variables
  s_cfg, student = cold_start(out, 100, "cold_start_100")
  weak = init_variables(config, jax.random.PRNGKey(0))
  res = {"student_start_accuracy": accuracy(s_cfg, student)}
  c = _cfg()
  for name, tv in (("better", variables), ("worse", weak)):
    res[f"teacher_{name}_accuracy"] = accuracy(config, tv)
    c = _cfg()
    c.budget.enabled = False
    c.loss.update(dict(mopd_coef=1.0, r_max=1.0))
    teachers = Teachers({(d, e): (config, tv) for d in c.rl.domains for e in c.rl.efforts},
                        config.text.vocab_size)
    hist, state = loop.run(loop.rl_config(c), s_cfg, student, teachers=teachers,
                           out_dir=out / f"mopd_{name}")
    res[f"student_with_{name}_teacher"] = {"accuracy_after": accuracy(s_cfg, state.variables),
                                           "rounds": hist}
    print(name, res[f"teacher_{name}_accuracy"], res[f"student_with_{name}_teacher"]["accuracy_after"])
  _write(out, "mopd", {"rl": dict(c.rl), "loss": dict(c.loss), "lr": c.optim.lr, **res})


def plot(out: pathlib.Path, block: int = 60) -> None:
  """OUT/reward.png: the in-round task accuracy of every OUT/reward*.json, as means over
  blocks of `block` rounds with ± one standard error (binomial, over the block's trajectories)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  runs = sorted(out.glob("reward*.json"))
  if not runs:
    raise ValueError(f"--figure=plot: no reward*.json in {out}")
  fig, ax = plt.subplots(figsize=(7, 4))
  for path in runs:
    r = json.loads(path.read_text())
    # A round that finished no group trains nothing (no accuracy): weight 0.
    acc = np.array([h.get("accuracy", 0.0) for h in r["rounds"]])
    n = np.array([h.get("trained", 0) for h in r["rounds"]])
    x, mean, err = [], [], []
    for i in range(0, len(acc) - block + 1, block):
      hits, total = float((acc[i:i + block] * n[i:i + block]).sum()), float(n[i:i + block].sum())
      p = hits / max(total, 1.0)
      x.append(i + block / 2)
      mean.append(p)
      err.append(np.sqrt(p * (1 - p) / max(total, 1.0)))
    opt = "Per-Head Muon" if r.get("muon", True) else "AdamW"
    label = f"{opt} lr {r['lr']:g}, K {r['rl']['k']}" + (
        ", adv/std" if r["loss"].get("adv_std_norm") else "")
    ax.errorbar(x, mean, yerr=err, marker="o", capsize=3, label=label)
  ax.set_xlabel("RL round")
  ax.set_ylabel(f"task accuracy (mean over {block} rounds)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  tmp = out / "reward.png.tmp"
  fig.savefig(tmp, format="png", dpi=120)
  os.replace(tmp, out / "reward.png")
  print(f"wrote {out / 'reward.png'}")


def main(argv):
  del argv
  out = pathlib.Path(_OUT.value)
  out.mkdir(parents=True, exist_ok=True)
  fig = _FIGURE.value
  if fig == "plot":
    plot(out)
    return
  config, variables = cold_start(out)
  if fig in ("all", "mismatch"):
    mismatch(out, config, variables)
  if fig in ("all", "partial"):
    partial(out, config, variables)
  if fig in ("all", "partial_cache"):
    partial_cache(out, config, variables)
  if fig in ("all", "reward"):
    rl_run(out, "reward", config, variables, budget=False)
  if fig in ("all", "budget"):
    rl_run(out, "budget", config, variables, budget=True)
  if fig in ("all", "mopd"):
    mopd(out, config, variables)


if __name__ == "__main__":
  app.run(main)
