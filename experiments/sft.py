r"""Supervised fine-tuning on chat conversations (the XTML format, k3jax/data/chat.py).

  python -m experiments.sft --config=configs/sft_tiny.py --workdir=runs/sft_tiny \
      [--init=runs/tiny] [--data=convs.jsonl] [--config.train.steps=500 ...]

--init: a checkpoint (run directory or any directory `load_pretrained` reads) whose params and
router biases start the run, with a fresh optimizer (sets train.init; its model config must
equal the run config's). Without it the model starts from a random init of cfg.seed.
--data: a JSONL file of conversations (schema in k3jax/data/sft.py; sets data.sft_file);
without it, the embedded procedural tasks (k3jax/data/sft_tasks.py). The loss is on the
assistant tokens only; metrics, checkpoints and resume are those of experiments/train.py (the
same loop: rerunning the command resumes from the newest checkpoint in --workdir, and then
--init is not read again). Held-out accuracy: experiments/eval_sft.py.
"""

from __future__ import annotations

import logging

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (configs/sft_*.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (metrics, checkpoints).")
_INIT = flags.DEFINE_string("init", None, "Checkpoint to start from (sets train.init).")
_DATA = flags.DEFINE_string("data", None, "JSONL conversations (sets data.sft_file).")


def sft_config(cfg, init: str | None, data: str | None):
  """The run config with --init / --data applied; ValueError when it is not an SFT config."""
  if cfg.data.source != "sft":
    raise ValueError(f"--config: data.source must be 'sft' for experiments.sft, found "
                     f"{cfg.data.source!r} (use configs/sft_tiny.py or configs/sft_small.py)")
  if init is not None:
    cfg.train.init = init
  if data is not None:
    cfg.data.sft_file = data
  return cfg


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("k3jax.train").setLevel(logging.INFO)
  from k3jax.train.run import run_config
  from k3jax.train.trainer import train
  records = train(run_config(sft_config(_CONFIG.value, _INIT.value, _DATA.value)),
                  _WORKDIR.value)
  if records:
    last = records[-1]
    ev = f", held-out loss {last['eval_loss']:.4f}" if "eval_loss" in last else ""
    print(f"step {last['step']}: loss {last['loss']:.4f} (assistant tokens){ev}, "
          f"{last['tokens_per_s'] or 0:.0f} tokens/s")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)
