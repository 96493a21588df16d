"""The teacher pipeline of K3 §13 at CPU size: (domain × effort) teachers trained from the
project's own cold start and RL, then MOPD into one student conditioned on the effort option.

python -m experiments.rl_pipeline --out=runs/rl_pipeline [--results=docs/results/rl_pipeline]

Stages (each resumes from its output when that exists):
  1. cold start   supervised warm-up on thinking-mode replies (0–8 filler dots in `think`,
                  then the answer; experiments/rl_figures.py `train_cold_start`; by
                  default the length follows the prompt's effort option, low 0–2, high
                  3–5, max 6–8; --nocold_start_by_effort: 0–8 at every level) →
                  OUT/cold_start.
  2. teachers     for every (domain, effort): RL from the cold start on that domain, on
                  prompts WITHOUT the effort option (the prompt the teacher later scores), with
                  the effort level's own budget regime on T(y) = thinking tokens:
                    low   τ annealed 1.0 → 0.5 over the first half of the rounds, then 0.5
                    high  τ = 1.0 throughout (no longer than the cold start's b₀)
                    max   no budget
                  → OUT/teachers/<domain>_<effort> (checkpoint) and .../run (metrics).
  3. student      MOPD from the cold start on prompts WITH the effort option (every effort
                  level), each row scored by the teacher of its (domain, effort) on the prompt
                  without the option (`rewards.Teachers`), plus the task reward; no budget →
                  OUT/student_mopd.
  4. baseline     the same rounds from the same start without teachers → OUT/student_rl.
  5. evaluation   per effort level, sampled replies (temperature 1) on fresh prompts: mean
                  thinking tokens, accuracy, reply length, for the cold start, the students
                  and each teacher (on its own effort, prompted without the option).
Outputs are written to a temporary name, then renamed: checkpoints, OUT/<run>/summary.json,
OUT/summary.json (and with --results, RESULTS/summary.json).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import shutil
import time

from absl import app, flags

REGIMES = {
    "low": {"enabled": True, "tau_start": 1.0, "tau_end": 0.5, "anneal": 0.5},
    "high": {"enabled": True, "tau_start": 1.0, "tau_end": 1.0, "anneal": 0.0},
    "max": {"enabled": False, "tau_start": 1.0, "tau_end": 1.0, "anneal": 0.0},
}


def define_flags() -> None:
  """Flags, defined only when run as a script (pytest imports several entry points).
  experiments.rl_figures (imported for its cold start) defines --out, --domains, --layers,
  --sft_steps, --lr and --k at import; they are shared, with this command's defaults."""
  from experiments import rl_figures  # noqa: F401  (its flags: see above)
  for name, value in (("out", "runs/rl_pipeline"), ("domains", "arith"), ("layers", 2),
                      ("sft_steps", 300), ("lr", 3e-4), ("k", 8)):
    flags.FLAGS.set_default(name, value)
  flags.DEFINE_string("results", "", "Also write the summary JSON into this directory.")
  flags.DEFINE_string("efforts", "low,high,max", "Comma-separated effort levels.")
  flags.DEFINE_integer("sft_batch", 32, "Cold-start batch.")
  flags.DEFINE_integer("teacher_rounds", 200, "RL rounds per teacher.")
  flags.DEFINE_integer("student_rounds", 200, "RL rounds of the student (and the baseline).")
  flags.DEFINE_integer("n_prompts", 8, "Prompts per round.")
  flags.DEFINE_integer("max_new_tokens", 32, "Reply tokens at most.")
  flags.DEFINE_float("mopd_coef", 1.0, "β: weight of the MOPD per-token reward.")
  flags.DEFINE_integer("eval_n", 128, "Evaluation prompts per effort level.")
  flags.DEFINE_string("qat", "mxfp4_mxfp8", "rl.expert_qat of every RL run (empty: off).")
  flags.DEFINE_bool("cold_start_by_effort", True, "Cold-start thinking lengths by the "
                    "prompt's effort option (low 0-2, high 3-5, max 6-8 dots); false: 0-8 at "
                    "every level (the student then does not learn to read the option).")


def settings_from_flags() -> dict:
  f = flags.FLAGS
  return {k: f[k].value for k in (
      "out", "results", "domains", "efforts", "layers", "sft_steps", "sft_batch",
      "teacher_rounds", "student_rounds", "n_prompts", "k", "max_new_tokens", "lr", "mopd_coef",
      "eval_n", "qat", "cold_start_by_effort")}


def base_config(s: dict, rounds: int):
  """configs/rl_tiny.py at the pipeline's size (the tiny model of experiments/rl_figures.py)."""
  from configs.rl_tiny import get_config
  c = get_config()
  layers = s["layers"]
  c.model.update(dict(num_layers=layers, mla_every=max(2, min(4, layers)),
                      attn_res_block_size=None if layers < 4 else 2))
  c.rl.domains = tuple(s["domains"].split(","))
  c.rl.efforts = tuple(s["efforts"].split(","))
  c.rl.update(dict(rounds=rounds, n_prompts=s["n_prompts"], k=s["k"],
                   max_new_tokens=s["max_new_tokens"]))
  c.train.steps = rounds
  c.optim.lr = s["lr"]
  c.budget.enabled = False
  c.rl.expert_qat = s.get("qat") or None
  return c


def write_json(path: pathlib.Path, obj) -> None:
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(obj, indent=1))
  os.replace(tmp, path)


def save_checkpoint(path: pathlib.Path, config, variables) -> None:
  """The checkpoint under a temporary name, then renamed: a path that exists is whole."""
  from k3jax.convert.checkpoint import save_pretrained
  tmp = path.with_name(path.name + ".tmp")
  if tmp.exists():
    shutil.rmtree(tmp)
  save_pretrained(tmp, config, variables)
  os.replace(tmp, path)


def evaluate(c, config, variables, efforts, n: int, seed: int, effort_option: bool = True):
  """{effort: {thinking, accuracy, length, complete}} over n sampled replies per level."""
  import numpy as np
  from experiments.rl_figures import sample_replies
  from k3jax.posttrain.rl import rewards
  out = {}
  for j, e in enumerate(efforts):
    ts, replies = sample_replies(config, variables, c, n, seed + j, efforts=(e,),
                                 effort_option=effort_option)
    acc = rewards.task_rewards(ts, [r.response for r in replies])
    think = np.array([r.thinking_tokens for r in replies], np.float64)
    out[e] = {"thinking": float(think.mean()),
              "thinking_se": float(think.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0,
              "accuracy": float(acc.mean()),
              "accuracy_se": float(np.sqrt(acc.mean() * (1 - acc.mean()) / n)),
              "complete": float(np.mean([r.complete for r in replies])), "n": n}
  return out


def _rl(c, config, variables, out: pathlib.Path, name: str, teachers=None, log=print):
  """One RL run (k3jax/posttrain/rl/loop.py) into out/name; returns (history, state, secs)."""
  from k3jax.posttrain.rl import loop
  t0 = time.perf_counter()
  r = loop.rl_config(c)
  every = max(1, r.rl.rounds // 10)

  def progress(line: str) -> None:
    rnd = int(line.split()[0].split("=")[1])
    if log is not None and (rnd % every == 0 or rnd == r.rl.rounds - 1):
      log(f"[{name}] {line}")

  hist, state = loop.run(r, config, variables, teachers=teachers, out_dir=out / name,
                         log=progress)
  return hist, state, time.perf_counter() - t0


def _blocks(hist, key: str, n_blocks: int = 5) -> list:
  """Trajectory-weighted means of `key` over n_blocks equal blocks of rounds."""
  import numpy as np
  rows = [h for h in hist if key in h]
  if not rows:
    return []
  size = max(1, len(rows) // n_blocks)
  out = []
  for i in range(0, len(rows) - size + 1, size):
    part = rows[i:i + size]
    w = np.array([h["trained"] for h in part], np.float64)
    out.append(float((np.array([h[key] for h in part]) * w).sum() / max(w.sum(), 1)))
  return out[:n_blocks]


def run_pipeline(s: dict, log=print) -> dict:
  """The whole pipeline (module doc) with settings `s` (settings_from_flags' keys)."""
  from experiments.rl_figures import train_cold_start
  from k3jax.convert.checkpoint import load_pretrained
  from k3jax.posttrain.rl import loop
  from k3jax.posttrain.rl.loop import policy_config
  from k3jax.posttrain.rl.rewards import Teachers

  out = pathlib.Path(s["out"])
  out.mkdir(parents=True, exist_ok=True)
  t_all = time.perf_counter()
  domains, efforts = s["domains"].split(","), s["efforts"].split(",")
  for e in efforts:
    if e not in REGIMES:
      raise ValueError(f"--efforts: {e!r} is not one of {tuple(REGIMES)}")
  summary = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "command": "python -m experiments.rl_pipeline " + " ".join(
                 f"--{k}={v}" for k, v in s.items() if v != ""),
             "settings": s, "regimes": {e: REGIMES[e] for e in efforts}}

  # 1. Cold start.
  path = out / "cold_start"
  if path.exists():
    config, start = load_pretrained(path)
    summary["cold_start"] = {"resumed": True}
  else:
    log(f"[cold_start] {s['sft_steps']} supervised steps")
    tmp = out / "cold_start.tmp"
    if tmp.exists():
      shutil.rmtree(tmp)
    if s["sft_steps"] > 0:
      (config, start), losses, secs = train_cold_start(
          base_config(s, 1), s["sft_steps"], tmp, batch=s["sft_batch"],
          by_effort=bool(s.get("cold_start_by_effort")), log=log)
    else:      # no supervised steps: the initial model stands in (smoke tests)
      import jax
      from k3jax.convert.checkpoint import save_pretrained
      from k3jax.train.run import run_config
      from k3jax.train.state import init_variables
      run = run_config(base_config(s, 1), extra=tuple(loop.RL_GROUPS))
      save_pretrained(tmp, run.model, init_variables(run.model, jax.random.PRNGKey(run.seed)))
      losses, secs = [], 0.0
    os.replace(tmp, path)
    config, start = load_pretrained(path)
    summary["cold_start"] = {"steps": s["sft_steps"], "loss": losses, "seconds": secs}
  c_eval = base_config(s, 1)
  summary["cold_start"]["eval"] = evaluate(c_eval, config, start, efforts, s["eval_n"], 101)
  log(f"[cold_start] eval {summary['cold_start']['eval']}")

  # 2. Teachers, one per (domain, effort), each under its effort's budget regime.
  teachers, summary["teachers"] = {}, {}
  for d in domains:
    for e in efforts:
      name = f"{d}_{e}"
      tpath = out / "teachers" / name
      tpath.parent.mkdir(parents=True, exist_ok=True)
      c = base_config(s, s["teacher_rounds"])
      c.rl.domains, c.rl.efforts = (d,), (e,)
      c.rl.effort_option = False
      reg = REGIMES[e]
      c.budget.update(dict(enabled=reg["enabled"], tau_start=reg["tau_start"],
                           tau_end=reg["tau_end"],
                           anneal_rounds=int(reg["anneal"] * s["teacher_rounds"])))
      info = {"regime": reg}
      if tpath.exists():
        tcfg, tvars = load_pretrained(tpath)
        info["resumed"] = True
      else:
        log(f"[teacher {name}] {s['teacher_rounds']} rounds, regime {reg}")
        hist, state, secs = _rl(c, config, start, out / "teachers", name + "_run", log=log)
        save_checkpoint(tpath, policy_config(loop.rl_config(c).rl, config), state.variables)
        tcfg, tvars = load_pretrained(tpath)
        info.update({"seconds": secs, "accuracy_blocks": _blocks(hist, "accuracy"),
                     "thinking_blocks": _blocks(hist, "thinking"),
                     "violation_blocks": _blocks(hist, "budget_violations")})
      c1 = base_config(s, 1)
      c1.rl.domains = (d,)
      info["eval"] = evaluate(c1, tcfg, tvars, (e,), s["eval_n"], 202, effort_option=False)[e]
      log(f"[teacher {name}] eval {info['eval']}")
      teachers[d, e] = (tcfg, tvars)
      summary["teachers"][name] = info
      write_json(out / "summary.json", summary)

  # 3-4. The student with MOPD from the teachers, and without, same rounds, same start.
  for name, tch in (("student_mopd", Teachers(teachers, config.text.vocab_size)),
                    ("student_rl", None)):
    c = base_config(s, s["student_rounds"])
    c.loss.update(dict(mopd_coef=s["mopd_coef"] if tch is not None else 0.0, r_max=1.0))
    log(f"[{name}] {s['student_rounds']} rounds" + (
        f", teachers {sorted(teachers)}" if tch is not None else ", no teachers"))
    hist, state, secs = _rl(c, config, start, out, name, teachers=tch, log=log)
    save_checkpoint(out / name / "policy", policy_config(loop.rl_config(c).rl, config),
                    state.variables)
    info = {"seconds": secs, "accuracy_blocks": _blocks(hist, "accuracy"),
            "thinking_blocks": _blocks(hist, "thinking"),
            "mopd_blocks": _blocks(hist, "mopd") if tch is not None else [],
            "eval": evaluate(c_eval, config, state.variables, efforts, s["eval_n"], 303)}
    log(f"[{name}] eval {info['eval']}")
    summary[name] = info
    write_json(out / "summary.json", summary)

  summary["seconds"] = time.perf_counter() - t_all
  write_json(out / "summary.json", summary)
  if s.get("results"):
    res = pathlib.Path(s["results"])
    res.mkdir(parents=True, exist_ok=True)
    write_json(res / "summary.json", summary)
  log(f"wrote {out / 'summary.json'} ({summary['seconds']:.0f} s)")
  return summary


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  t0 = time.time()
  run_pipeline(settings_from_flags(),
               log=lambda line: print(f"{time.time() - t0:7.1f}s {line}", flush=True))


if __name__ == "__main__":
  define_flags()
  app.run(main)
