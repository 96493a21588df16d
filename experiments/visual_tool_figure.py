r"""The visual tool task's accuracy with and without the crop tool (K3 §13 vision-in-the-loop
RL at CPU scale; docs/notes/rl.md "Multimodal post-training").

  python -m experiments.visual_tool_figure --out=runs/visual_tool \
      --json=docs/results/visual_tool/visual_tool.json [--sft_steps=300 --rounds=4]

1. Cold start: the policy of configs/rl_visual_tiny.py (tiny_multimodal, 4 layers, the 2-layer
   tower, QAT of the routed experts as in RL) trained from a random init by SFT on
   demonstrations (k3jax/data/visual_tasks.py `demonstration`): the crop call on the
   question's cell, the tool's message with the crop as a media block, the colour. A
   fraction `--withheld_frac` of them show the tool withheld (the tool error, then the answer
   anyway), so that the policy has seen that case too. Loss on the assistant tokens only.
2. Held-out accuracy (tasks of another seed, greedy, through the serving engine and the
   environment of the RL rollouts): with the crop tool, and with it withheld (the environment
   answers every crop call with "error: the crop tool is unavailable": only the 56 px
   overview is seen). Also: the fraction of trajectories that call crop on the right cell.
3. `--rounds` > 0: that many agentic RL rounds (k3jax/posttrain/rl/agentic.py on the visual
   task), then the same two accuracies again.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import time

from absl import app, flags

_OUT = flags.DEFINE_string("out", "runs/visual_tool", "Working directory.")
_JSON = flags.DEFINE_string("json", "docs/results/visual_tool/visual_tool.json", "Result JSON.")
_SFT_STEPS = flags.DEFINE_integer("sft_steps", 300, "Cold-start SFT steps.")
_BATCH = flags.DEFINE_integer("batch", 4, "SFT batch size (rows of one demonstration).")
_LR = flags.DEFINE_float("lr", 3e-3, "SFT learning rate (peak of warmup-cosine).")
_WITHHELD = flags.DEFINE_float("withheld_frac", 0.2, "Demonstrations with the tool withheld.")
_EVAL = flags.DEFINE_integer("eval_tasks", 32, "Held-out tasks per condition.")
_ROUNDS = flags.DEFINE_integer("rounds", 0, "Agentic RL rounds after the cold start.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed.")
_REUSE = flags.DEFINE_bool("reuse", False, "Reuse --out's saved cold start (same flags).")

SEQ_LEN, MEDIA_LENGTH = 352, 64


def policy_setup(rounds: int, seed: int):
  """(RLRun of configs/rl_visual_tiny.py, the policy's model config)."""
  from configs import rl_visual_tiny
  from k3jax.posttrain.rl.loop import policy_config, rl_config
  c = rl_visual_tiny.get_config()
  c.seed = seed
  c.rl.rounds = max(rounds, 1)
  r = rl_config(c)
  return r, policy_config(r.rl, r.run.model)


def sft(config, steps: int, batch: int, lr: float, withheld_frac: float, seed: int, log=print):
  """Cold-start SFT on demonstrations (module doc); (variables, per-step losses)."""
  import jax
  import numpy as np
  from k3jax.data import sft as sft_lib
  from k3jax.data import visual_tasks as V
  from k3jax.train.optim import optimizer
  from k3jax.train.run import base_config, run_config
  from k3jax.train.sharded import PRETRAIN, jit_step
  from k3jax.train.state import init_state, init_variables
  from k3jax.train.step import lm_loss

  def make(rng):
    task = V.make_task(rng, 0)
    return V.demonstration(task, withheld=bool(rng.random() < withheld_frac))

  c = base_config("tiny_multimodal")
  c.train.steps, c.train.batch_size, c.train.seq_len = steps, batch, SEQ_LEN
  c.optim.lr = lr
  run = run_config(c)
  tx, _ = optimizer(run, config)
  variables = init_variables(config, jax.random.PRNGKey(seed))
  state = init_state(variables, PRETRAIN, tx)
  step = jit_step(lm_loss(config, 0.0), tx, PRETRAIN, config)
  it = sft_lib.MediaSFTIterator(config.vision, make, batch, SEQ_LEN, MEDIA_LENGTH, seed,
                                name="visual_demos", bos=False)
  losses = []
  t0 = time.perf_counter()
  for s in range(steps):
    state, met = step(state, jax.tree.map(jax.numpy.asarray, next(it)))
    losses.append(float(met["loss"]))
    if log and (s % 25 == 0 or s == steps - 1):
      log(f"sft step {s}: loss {np.mean(losses[-25:]):.4f} ({time.perf_counter() - t0:.0f} s)")
  return state.variables, losses


def evaluate(config, variables, tasks, withheld: bool, max_turns: int = 3):
  """Greedy held-out accuracy through the engine and the environment (module doc)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from k3jax.data import visual_tasks as V
  from k3jax.posttrain.rl.env import ToolEnv, rollout
  from k3jax.serve.engine import Engine, EngineConfig
  from k3jax.data.tokenizers import CHAT_END
  env = ToolEnv(max_turns=max_turns, max_tokens=384, max_reply_tokens=64, tools=("crop",),
                withheld=("crop",) if withheld else (), vision_config=config.vision,
                media_id=config.media_placeholder_token_id, media_length=MEDIA_LENGTH)
  ec = EngineConfig(num_slots=8, tile_rows=4, max_len=384, page_size=16, prefill_chunk=64,
                    checkpoint_interval=64, boundary_token=CHAT_END, step_tokens=256,
                    num_checkpoints=32)
  engine = Engine(config, jax.tree.map(jnp.array, {k: variables[k] for k in ("params",
                                                                          "balance")}), ec)
  trajs = rollout(engine, tasks, env, temperature=0.0, seed=0)
  correct = [V.is_correct(t.task, t.response) for t in trajs]
  called = [any(c.name == "crop" and c.arguments.get("cell") == t.task.cell
                for turn in t.turns for c in _calls(env, turn.reply)) for t in trajs]
  return {"accuracy": float(np.mean(correct)), "correct": int(np.sum(correct)),
          "tasks": len(trajs), "crop_right_cell": float(np.mean(called)),
          "answered": float(np.mean([t.finish == "answer" for t in trajs])),
          "turns": float(np.mean([len(t.turns) for t in trajs]))}


def _calls(env, reply):
  msg = env.read_reply(reply).message
  return () if msg is None or not msg.tool_calls else msg.tool_calls


def main(argv):
  del argv
  import jax
  from k3jax.data import visual_tasks as V
  from k3jax.posttrain.rl import agentic
  from k3jax.posttrain.rl.loop import write_json
  t_start = time.perf_counter()
  r, config = policy_setup(_ROUNDS.value, _SEED.value)
  os.makedirs(_OUT.value, exist_ok=True)
  saved = os.path.join(_OUT.value, "cold_start.pkl")
  if _REUSE.value and os.path.exists(saved):
    with open(saved, "rb") as f:
      variables, losses = pickle.load(f)
  else:
    variables, losses = sft(config, _SFT_STEPS.value, _BATCH.value, _LR.value,
                            _WITHHELD.value, _SEED.value)
    variables = jax.device_get(variables)
    with open(saved + ".tmp", "wb") as f:
      pickle.dump((variables, losses), f)
    os.replace(saved + ".tmp", saved)
  sft_s = time.perf_counter() - t_start
  tasks = V.VisualTaskSampler(seed=10_000 + _SEED.value).sample(_EVAL.value)
  result = {"date": "2026-12-04", "sft_steps": _SFT_STEPS.value, "batch": _BATCH.value,
            "lr": _LR.value, "withheld_frac": _WITHHELD.value, "eval_tasks": _EVAL.value,
            "seq_len": SEQ_LEN, "model": config.name, "expert_qat": config.modes.expert_qat,
            "sft_loss_first25": sum(losses[:25]) / max(len(losses[:25]), 1),
            "sft_loss_last25": sum(losses[-25:]) / max(len(losses[-25:]), 1),
            "sft_seconds": round(sft_s, 1), "chance": 1 / len(V.captions.COLOURS)}
  result["cold_start"] = {"with_crop": evaluate(config, variables, tasks, False),
                          "crop_withheld": evaluate(config, variables, tasks, True)}
  print(json.dumps(result["cold_start"]))
  if _ROUNDS.value:
    history, state = agentic.run(r, config, {"params": variables["params"],
                                             "balance": variables.get("balance", {})},
                                 out_dir=os.path.join(_OUT.value, "rl"))
    result["rl_rounds"] = _ROUNDS.value
    result["rl_reward"] = [h["reward"] for h in history]
    v = jax.device_get(state.variables)
    result["after_rl"] = {"with_crop": evaluate(config, v, tasks, False),
                          "crop_withheld": evaluate(config, v, tasks, True)}
    print(json.dumps(result["after_rl"]))
  result["wall_seconds"] = round(time.perf_counter() - t_start, 1)
  os.makedirs(os.path.dirname(_JSON.value) or ".", exist_ok=True)
  write_json(pathlib.Path(_JSON.value), result)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  app.run(main)
