"""RL from a k3jax checkpoint: partial rollouts, task rewards with effort budgets, MOPD from
per-(domain, effort) teachers, Per-Head Muon + QB updates (docs/notes/rl.md).

python -m experiments.rl --config=configs/rl_tiny.py --policy=CKPT \
    --teachers=arith:low=CKPT_A,sort:high=CKPT_B --out=runs/rl

Teachers are k3jax checkpoints of any config sharing the policy's vocabulary; prompts without
a teacher get no MOPD term. Agentic configs (`agent.enabled`) take teachers of tool-task
domains (`bigmul:high=CKPT`): MOPD on the policy's tokens of multi-turn rows.
--config.mesh.{data,fsdp,expert,...} shard the policy update over a device mesh as in
pre-training (experiments/train.py). Writes OUT/metrics.jsonl (one line per round),
OUT/summary.json and, with --save, the final policy as a checkpoint under OUT/policy.
"""

from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags


def parse_teachers(spec: str) -> dict[tuple[str, str], str]:
  """"d1:e1=PATH,d2:e2=PATH" → {(d1, e1): PATH, ...}, domains of the single-turn tasks or
  the text tool tasks; a malformed entry names itself."""
  from k3jax.data import rl_tasks, tool_tasks
  DOMAINS, EFFORTS = rl_tasks.DOMAINS + tool_tasks.DOMAINS, rl_tasks.EFFORTS
  out = {}
  for item in filter(None, (s.strip() for s in spec.split(","))):
    key, sep, path = item.partition("=")
    d, colon, e = key.partition(":")
    if not sep or not colon or not path:
      raise ValueError(f"--teachers: expected domain:effort=CKPT, found {item!r}")
    if d not in DOMAINS or e not in EFFORTS:
      raise ValueError(f"--teachers: {item!r}: domain must be one of {DOMAINS} and effort one "
                       f"of {EFFORTS}")
    if (d, e) in out:
      raise ValueError(f"--teachers: {d}:{e} given twice")
    out[d, e] = path
  return out


def define_flags() -> None:
  """The command line's flags, defined only when run as a script: pytest workers import several
  entry points into one process, whose flags would share (and collide in) absl's FLAGS."""
  global _CONFIG, _POLICY, _TEACHERS, _OUT, _SAVE
  _CONFIG = config_flags.DEFINE_config_file("config", None, "RL config (configs/rl_tiny.py).",
                                            lock_config=True)
  _POLICY = flags.DEFINE_string("policy", None, "Initial policy checkpoint (load_pretrained).")
  _TEACHERS = flags.DEFINE_string("teachers", "",
                                  "domain:effort=CKPT,... (MOPD teachers; empty: none).")
  _OUT = flags.DEFINE_string("out", "runs/rl", "Output directory.")
  _SAVE = flags.DEFINE_bool("save", True, "Save the final policy under OUT/policy.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import pathlib

  from k3jax.posttrain.rl import agentic, loop
  from k3jax.posttrain.rl.rewards import Teachers
  from k3jax.convert.checkpoint import load_pretrained, save_pretrained
  from k3jax.train.sharded import run_mesh

  r = loop.rl_config(_CONFIG.value)     # the one read of the command line's config
  config, variables = load_pretrained(_POLICY.value)
  teachers = None
  spec = parse_teachers(_TEACHERS.value)
  if spec:
    teachers = Teachers({k: load_pretrained(p) for k, p in spec.items()}, config.text.vocab_size)
  if r.agent.enabled:       # multi-turn tool tasks through the serving engine
    history, state = agentic.run(r, config, variables, out_dir=_OUT.value, teachers=teachers)
  else:
    history, state = loop.run(r, config, variables, teachers=teachers, out_dir=_OUT.value,
                              mesh=run_mesh(r.run))
  if _SAVE.value:
    save_pretrained(pathlib.Path(_OUT.value) / "policy", loop.policy_config(r.rl, config),
                    state.variables,
                    step=int(state.step))
  trained = [h for h in history if "reward" in h]
  if trained:
    last = trained[-1]
    size = (f"length {last['length']:.1f}" if "length" in last
            else f"turns {last['turns']:.2f}, tool calls {last['tool_calls']}")
    print(f"rounds {len(history)}: last reward {last['reward']:.3f}, {size}, mismatch "
          f"{last['mismatch']:.2e}")


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["config", "policy"])
  app.run(main)
