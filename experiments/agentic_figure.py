"""Tool-task accuracy before and after agentic RL, with the python tool and with it withheld
(docs/notes/rl.md, K3 §13): the tool must matter.

python -m experiments.agentic_figure --out=docs/results/agentic

  cold start  SFT of a tiny policy (configs/rl_agentic_tiny.py's model, 2 layers) on
              demonstration trajectories of `bigmul` tool tasks through the project's chat/SFT
              data path (k3jax/data/sft.py: `assistant_mask`, `pack`, `SFTIterator`) and the
              pre-training/SFT step (`build_step`): the question, an assistant turn whose
              `tools` channel calls python with `tool_tasks.reference_code(task)`, the tool
              message with the sandbox's real output (`ToolEnv.run_call`), and the final
              answer. Few steps: the policy is not already perfect.
  evaluate    `--eval_n` held-out tasks (another seed) rolled out to their ends through the
              serving engine (k3jax/posttrain/rl/env.py) at temperature 1, once with the tool
              (the sandbox) and once withheld (`ToolEnv(withheld="all")`: every call is
              answered "error: tool unavailable"); accuracy = exact final answer, with its
              standard error sqrt(p(1−p)/n).
  RL          `--rounds` agentic rounds (k3jax/posttrain/rl/agentic.py, configs/rl_agentic_tiny.py:
              QAT on, rollouts through the engine, reward 1 for an exact answer) from the cold
              start, on training tasks (a third seed), then evaluate again both ways.

The multiplications have `--digits` digits per factor (default 1–2: beyond the tiny model's
mental arithmetic — without the tool it answers none — and short enough that 500 SFT steps
teach the copying a tool call and its answer need; at 2–3 and 6–9 digits the cold start
called the tool but copied the numbers wrongly, docs/notes/rl.md).
Writes OUT/agentic_figure.json (settings, the four accuracies, per-round RL metrics, times).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import time

from absl import app, flags

# The script's own flag set: importing it (its test does) registers nothing in absl's global
# FLAGS, so it shares a process with other entry points defining --seed, --out, --k, ...
FLAGS = flags.FlagValues()
_OUT = flags.DEFINE_string("out", "docs/results/agentic", "Output directory (JSON).", flag_values=FLAGS)
_SFT_STEPS = flags.DEFINE_integer("sft_steps", 500, "Cold-start SFT steps.", flag_values=FLAGS)
_SFT_BATCH = flags.DEFINE_integer("sft_batch", 8, "Cold-start SFT rows per step.", flag_values=FLAGS)
_DEMOS = flags.DEFINE_integer("demos", 4000, "Demonstration trajectories (distinct tasks).", flag_values=FLAGS)
_SFT_LR = flags.DEFINE_float("sft_lr", 3e-3, "Cold-start SFT peak learning rate (AdamW).", flag_values=FLAGS)
_ROUNDS = flags.DEFINE_integer("rounds", 20, "Agentic RL rounds.", flag_values=FLAGS)
_N_PROMPTS = flags.DEFINE_integer("n_prompts", 2, "Tasks per RL round.", flag_values=FLAGS)
_K = flags.DEFINE_integer("k", 8, "Trajectories per task (the group).", flag_values=FLAGS)
_LR = flags.DEFINE_float("lr", 3e-4, "RL learning rate (AdamW).", flag_values=FLAGS)
_EVAL_N = flags.DEFINE_integer("eval_n", 64, "Held-out tasks per evaluation.", flag_values=FLAGS)
_DIGITS = flags.DEFINE_list("digits", ["1", "2"], "Digits per factor: lo,hi (inclusive).", flag_values=FLAGS)
_LAYERS = flags.DEFINE_integer("layers", 2, "Model layers (2: one KDA, one MLA with the MoE).", flag_values=FLAGS)
_MAX_REPLY = flags.DEFINE_integer("max_reply_tokens", 80, "One reply's token cap.", flag_values=FLAGS)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 480, "A trajectory's token cap (prompt too).", flag_values=FLAGS)
_SEED = flags.DEFINE_integer("seed", 0, "Model init / SFT seed.", flag_values=FLAGS)
_BUDGET = flags.DEFINE_bool("budget", True, "The config's effort budget on T(y) during RL "
                            "(τ 1.5 → 1.0 of the initial policy's b₀); --nobudget: reward = "
                            "accuracy only.", flag_values=FLAGS)

EFFORT = "high"
_TRAIN_SEED, _RL_SEED, _EVAL_SEED = 101, 202, 303


def _flags() -> dict:
  return {"out": _OUT.value, "sft_steps": _SFT_STEPS.value, "sft_batch": _SFT_BATCH.value,
          "demos": _DEMOS.value, "sft_lr": _SFT_LR.value, "rounds": _ROUNDS.value,
          "n_prompts": _N_PROMPTS.value, "k": _K.value, "lr": _LR.value,
          "eval_n": _EVAL_N.value, "digits": ",".join(_DIGITS.value), "layers": _LAYERS.value,
          "max_reply_tokens": _MAX_REPLY.value, "max_tokens": _MAX_TOKENS.value,
          "seed": _SEED.value}


def _digits() -> tuple[int, int]:
  try:
    lo, hi = (int(d) for d in _DIGITS.value)
  except ValueError:
    raise ValueError(f"--digits: expected lo,hi (two ints), found {_DIGITS.value}") from None
  if not 1 <= lo <= hi:
    raise ValueError(f"--digits: expected 1 <= lo <= hi, found {lo},{hi}")
  return lo, hi


class BigmulSampler:
  """`bigmul` tool tasks (k3jax/data/tool_tasks.py's prompt, verifier and reference program)
  with lo–hi-digit factors; `sample(n)` draws reproducibly from `seed` (distinct seeds give
  the demonstration, RL and evaluation sets)."""

  def __init__(self, digits: tuple[int, int], seed: int):
    import numpy as np
    self.lo, self.hi = digits
    self.rng = np.random.default_rng(seed)
    self.uid = seed * 1_000_000

  def _number(self) -> int:
    n = int(self.rng.integers(self.lo, self.hi + 1))
    return int(self.rng.integers(10 ** (n - 1), 10 ** n))

  def sample(self, n: int) -> list:
    from k3jax.data import tool_tasks as T
    out = []
    for _ in range(n):
      a, b = self._number(), self._number()
      q = f"Compute {a}*{b} exactly."
      conv = T.conversation(q, EFFORT)
      out.append(T.ToolTask(self.uid, "bigmul", EFFORT, q, str(a * b), (a, b), conv,
                            T.prompt_tokens(conv)))
      self.uid += 1
    return out


def rl_run_config():
  """configs/rl_agentic_tiny.py at this figure's sizes (its QAT, K and advantages kept)."""
  from configs.rl_agentic_tiny import get_config
  from k3jax.posttrain.rl.loop import rl_config
  c = get_config()
  layers = _LAYERS.value
  c.model.update(dict(num_layers=layers, mla_every=max(2, min(4, layers)),
                      first_dense_layers=1, attn_res_block_size=None if layers < 4 else 2,
                      num_mtp_layers=0))
  c.rl.update(dict(rounds=_ROUNDS.value, n_prompts=_N_PROMPTS.value, k=_K.value,
                   domains=("bigmul",), efforts=(EFFORT,), max_prompt_len=320))
  c.agent.update(dict(max_tokens=_MAX_TOKENS.value, max_reply_tokens=_MAX_REPLY.value,
                      max_turns=3, num_slots=_N_PROMPTS.value * _K.value))
  c.optim.update(dict(lr=_LR.value, muon=False, warmup_frac=0.0, final_lr_frac=1.0))
  c.budget.enabled = _BUDGET.value
  c.seed = _SEED.value
  return c, rl_config(c)


def demonstration(task, tool_text: str):
  """The demonstration trajectory of a task: call python with the reference program, read
  the tool's output, answer."""
  from k3jax.data import chat, tool_tasks as T
  call = chat.ToolCall("python", {"code": T.reference_code(task)})
  msgs = task.conversation.messages + (
      chat.Message("assistant", None, "", (call,)),
      chat.Message("tool", tool_text),
      chat.Message("assistant", f"= {task.answer}", ""))
  return chat.Conversation(msgs, task.conversation.options)


def cold_start(r, config, log=print):
  """(variables, record) after the supervised warm-up on demonstrations (module doc)."""
  import jax
  import numpy as np
  from k3jax.data import chat, sft, tool_tasks as T
  from k3jax.data.chat_tokens import ChatEncoder
  from k3jax.data.tokenizers import ByteTokenizer
  from k3jax.posttrain.rl import sandbox
  from k3jax.posttrain.rl.env import ToolEnv
  from k3jax.train.run import run_config
  from k3jax.train.sharded import PRETRAIN, build_step
  from k3jax.train.state import init_state, init_variables

  t0 = time.perf_counter()
  tasks = BigmulSampler(_digits(), _TRAIN_SEED).sample(_DEMOS.value)
  env = ToolEnv(limits=sandbox.Limits(cpu_seconds=r.agent.tool_cpu_seconds,
                                      wall_seconds=r.agent.tool_wall_seconds))
  # The sandbox's real output for a sample of the programs; every program here prints its
  # product, so the rest is that text (checked equal on the sample).
  checked = 0
  for t in tasks[:16]:
    got = env.run_call(chat.ToolCall("python", {"code": T.reference_code(t)}))
    if got != f"{t.answer}\n":
      raise RuntimeError(f"sandbox output {got!r} != {t.answer!r}")
    checked += 1
  encoder = ChatEncoder(ByteTokenizer())
  examples = []
  for t in tasks:
    ids = encoder.encode(demonstration(t, f"{t.answer}\n"), bos=False).ids
    if tuple(int(i) for i in ids[:len(t.tokens)]) != t.tokens:
      raise RuntimeError("demonstration does not extend the rollout prompt")
    examples.append((ids, sft.assistant_mask(ids)))
  longest = max(len(e[0]) for e in examples)
  seq_len = -(-longest // 32) * 32
  packed = sft.pack(examples, seq_len, _SEED.value)
  it = sft.SFTIterator(packed, _SFT_BATCH.value, _SEED.value)

  c, _ = rl_run_config()
  c.train.steps = _SFT_STEPS.value
  c.train.mtp_weight = 0.0
  c.optim.update(dict(lr=_SFT_LR.value, muon=False, warmup_frac=0.05, final_lr_frac=0.1))
  from k3jax.posttrain.rl.loop import RL_GROUPS
  run = run_config(c, extra=tuple(RL_GROUPS))
  step = build_step(run, config)
  state = init_state(init_variables(config, jax.random.PRNGKey(_SEED.value)), PRETRAIN, step.tx)
  losses = []
  for s in range(_SFT_STEPS.value):
    b = it.batch(s)
    state, m = step.train(state, b)
    if s % 25 == 0 or s == _SFT_STEPS.value - 1:
      losses.append((s, float(m["loss"])))
      log(f"cold start step {s}: loss {float(m['loss']):.4f} ({time.perf_counter() - t0:.0f} s)")
  rec = {"steps": _SFT_STEPS.value, "batch": _SFT_BATCH.value, "demos": len(tasks),
         "seq_len": seq_len, "rows": packed.num_rows, "longest": longest,
         "sandbox_checked": checked, "loss": losses, "seconds": time.perf_counter() - t0}
  return jax.tree.map(np.asarray, state.variables), rec


def evaluate(r, config, variables, tasks, tool: bool, seed: int = 7) -> dict:
  """Accuracy of temperature-1 rollouts of `tasks` through the engine (module doc)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from k3jax.data.tool_tasks import is_correct
  from k3jax.posttrain.rl import sandbox
  from k3jax.posttrain.rl.agentic import engine_config
  from k3jax.posttrain.rl.env import ToolEnv, rollout
  from k3jax.serve.engine import Engine

  t0 = time.perf_counter()
  a = r.agent
  env = ToolEnv(limits=sandbox.Limits(cpu_seconds=a.tool_cpu_seconds,
                                      wall_seconds=a.tool_wall_seconds),
                max_turns=a.max_turns, max_tokens=a.max_tokens,
                max_reply_tokens=a.max_reply_tokens, withheld=() if tool else "all")
  variables = {"params": variables["params"], "balance": variables.get("balance", {})}
  engine = Engine(config, jax.tree.map(jnp.asarray, variables), engine_config(r))
  trajs = rollout(engine, tasks, env, temperature=1.0, seed=seed)
  correct = np.array([is_correct(t.task, t.response) for t in trajs], np.float64)
  n = len(trajs)
  p = float(correct.mean())
  return {"tool": tool, "n": n, "accuracy": p, "stderr": float(np.sqrt(p * (1 - p) / n)),
          "called_tool": float(np.mean([len(t.turns) > 1 for t in trajs])),
          "ok_tool_runs": int(sum(res.ok for t in trajs for res in t.results)),
          "finish": {f: int(sum(t.finish == f for t in trajs))
                     for f in ("answer", "turn_limit", "token_limit")},
          "mean_turns": float(np.mean([len(t.turns) for t in trajs])),
          "example": env.tokenizer.decode(trajs[0].tokens[trajs[0].prompt_len:], specials=True),
          "seconds": time.perf_counter() - t0}


def _write(out: pathlib.Path, obj: dict) -> None:
  obj = {"figure": "agentic", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"), "command": "python -m experiments.agentic_figure " + " ".join(
          f"--{k}={v}" for k, v in _flags().items()), **obj}
  out.mkdir(parents=True, exist_ok=True)
  tmp = out / "agentic_figure.json.tmp"
  tmp.write_text(json.dumps(obj, indent=1))
  os.replace(tmp, out / "agentic_figure.json")
  print(f"wrote {out / 'agentic_figure.json'}")


def main(argv):
  del argv
  from k3jax.posttrain.rl import agentic
  from k3jax.posttrain.rl.loop import policy_config
  from k3jax.train.run import run_config
  from k3jax.posttrain.rl.loop import RL_GROUPS

  t_all = time.perf_counter()
  out = pathlib.Path(_OUT.value)
  c, r = rl_run_config()
  config = policy_config(r.rl, run_config(c, extra=tuple(RL_GROUPS)).model)
  variables, sft_rec = cold_start(r, config)
  held = BigmulSampler(_digits(), _EVAL_SEED).sample(_EVAL_N.value)
  res = {"settings": {"rl": {k: getattr(r.rl, k) for k in ("rounds", "n_prompts", "k",
                                                            "expert_qat")},
                      "agent": {k: getattr(r.agent, k) for k in ("max_turns", "max_tokens",
                                                                 "max_reply_tokens")},
                      "adv_std_norm": r.loss.adv_std_norm, "lr": c.optim.lr,
                      "budget": r.budget.enabled, "model_layers": _LAYERS.value},
         "cold_start": sft_rec}
  res["before"] = {arm: evaluate(r, config, variables, held, tool)
                   for arm, tool in (("tool", True), ("withheld", False))}
  for arm, e in res["before"].items():
    print(f"before RL, {arm}: accuracy {e['accuracy']:.3f} ± {e['stderr']:.3f}")
  _write(out, res)
  t0 = time.perf_counter()
  hist, state = agentic.run(r, config, variables, sampler=BigmulSampler(_digits(), _RL_SEED),
                            log=print)
  res["rl_rounds"] = hist
  res["rl_seconds"] = time.perf_counter() - t0
  import jax
  import numpy as np
  after = jax.tree.map(np.asarray, state.variables)
  res["after"] = {arm: evaluate(r, config, after, held, tool)
                  for arm, tool in (("tool", True), ("withheld", False))}
  for arm, e in res["after"].items():
    print(f"after RL, {arm}: accuracy {e['accuracy']:.3f} ± {e['stderr']:.3f}")
  res["seconds"] = time.perf_counter() - t_all
  _write(out, res)


if __name__ == "__main__":
  app.run(main, flags_parser=lambda argv: (flags.FLAGS(argv[:1]), FLAGS(argv))[1])
