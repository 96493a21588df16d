"""Multimodal training from the command line (configs/tiny_multimodal.py, data.source=shapes): a
run stopped at step 2 resumes through `experiments.train` to step 4 with the same losses as an
uninterrupted run (the shapes iterator's state restores), logs the true and shuffled-image eval
losses, and trains the vision tower. One compile: every run shares the process's step cache."""

import json
import os

import jax
import numpy as np
from absl import flags

from experiments import train as cli
from k3jax.train import trainer
from k3jax.train.run import run_config

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OVERRIDES = {"model.num_layers": 2, "model.mla_every": 2, "train.steps": 4, "train.batch_size": 2,
             "train.seq_len": 64, "data.media_length": 64, "train.log_every": 1,
             "train.eval_every": 2, "train.eval_batches": 1, "train.checkpoint_every": 2,
             "train.progress": False, "train.tensorboard": False,
             "train.async_checkpoint": False, "train.peak_flops": 1e11,
             "data.text_fraction": 0.25, "data.text_source": os.path.join(ROOT, "README.md")}


def _parse(workdir):
  """The CLI's flags for `workdir`; the overrides are set on the parsed (locked) config, as
  --config.<group>.<field>=value would."""
  FLAGS.unparse_flags()
  FLAGS(["train", f"--config={os.path.join(ROOT, 'configs/tiny_multimodal.py')}",
         f"--workdir={workdir}"])
  cfg = FLAGS.config
  for key, value in OVERRIDES.items():
    group, field = key.split(".")
    cfg[group][field] = value
  return cfg


def _records(workdir):
  return [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]


def test_multimodal_run_resumes_through_the_cli(tmp_path, capsys):
  stopped, whole = str(tmp_path / "stopped"), str(tmp_path / "whole")
  try:
    cfg = _parse(stopped)
    first = trainer.train(run_config(cfg), stopped, until=2)
    assert [r["step"] for r in first] == [1, 2]
    cli.main(["train"])                 # the same command again: resumes at step 2
    assert "step 4: loss" in capsys.readouterr().out
    ref = trainer.train(run_config(_parse(whole)), whole)
  finally:
    FLAGS.unparse_flags()
  recs = {r["step"]: r for r in _records(stopped)}
  assert sorted(recs) == [1, 2, 3, 4]
  for s in (3, 4):    # bit-exact: the same batches (iterator state) and optimizer state
    assert recs[s]["loss"] == ref[s - 1]["loss"], (s, recs[s]["loss"], ref[s - 1]["loss"])
  for s in (2, 4):
    assert np.isfinite(recs[s]["eval_loss"]) and np.isfinite(recs[s]["eval_loss_shuffled"])
    assert recs[s]["eval_loss"] != recs[s]["eval_loss_shuffled"]

  # The vision tower and projector trained with the language model.
  import k3jax
  from k3jax.train.state import init_variables
  config, variables = k3jax.load_pretrained(stopped)
  init = init_variables(config, jax.random.PRNGKey(cfg.seed))
  for path in (("vision_tower", "encoder", "blocks_0", "wqkv", "kernel"),
               ("vision_tower", "patch_embed", "proj", "kernel"),
               ("mm_projector", "proj_2", "kernel")):
    a, b = variables["params"], init["params"]
    for k in path:
      a, b = a[k], b[k]
    assert not np.allclose(np.asarray(a), np.asarray(b)), path
