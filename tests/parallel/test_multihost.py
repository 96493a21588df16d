"""Multi-host training on loopback: two `experiments/train.py --multihost` processes (4 CPU
devices each, jax.distributed with a local coordinator, gloo collectives) train 3 steps of the
trainer's real step (Muon + Quantile Balancing) on a (data=2, expert=4) mesh, write one
collective orbax checkpoint, and log the same losses as one process with 8 devices."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

from cli_env import ROOT, cli_env

ARGS = ["--config=configs/tiny.py", "--config.train.steps=3", "--config.train.batch_size=8",
        "--config.train.seq_len=16", "--config.train.log_every=1",
        "--config.train.eval_every=0", "--config.train.checkpoint_every=3",
        "--config.train.progress=False", "--config.train.tensorboard=False",
        "--config.train.async_checkpoint=False", "--config.train.mtp_weight=0.0",
        "--config.model.num_layers=2", "--config.model.mla_every=2",
        "--config.model.attn_res_block_size=2", "--config.model.num_mtp_layers=0",
        "--config.mesh.data=2", "--config.mesh.expert=4"]


def _losses(workdir):
  by_step = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      if line.strip():
        r = json.loads(line)
        by_step.setdefault(r["step"], []).append(r["loss"])
  return by_step


def test_two_processes_match_one_process_with_eight_devices(tmp_path):
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  cmd = [sys.executable, "-m", "experiments.train"]
  multi_dir = str(tmp_path / "multi")
  procs = [subprocess.Popen(
      cmd + ARGS + [f"--workdir={multi_dir}", "--multihost",
                    f"--coordinator_address=localhost:{port}", "--num_processes=2",
                    f"--process_id={i}"], cwd=ROOT, env=cli_env(4), stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for i in range(2)]
  single_dir = str(tmp_path / "single")
  single = subprocess.run(cmd + ARGS + [f"--workdir={single_dir}"], cwd=ROOT, env=cli_env(8),
                          capture_output=True, text=True, timeout=1500)
  outs = [p.communicate(timeout=1500)[0] for p in procs]
  assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  ref = _losses(single_dir)
  got = _losses(multi_dir)
  assert sorted(ref) == sorted(got) == [1, 2, 3]
  for step in ref:
    for loss in got[step]:            # every process logged the same loss
      np.testing.assert_allclose(loss, ref[step][0], rtol=1e-5)
  # The collective checkpoint of step 3 is complete (orbax finalised it).
  assert os.path.isdir(os.path.join(multi_dir, "checkpoints", "3"))
