"""experiments/train.py from the command line: a run killed with SIGKILL resumes; bad flags.

The killed run and its resume share a JAX persistent compilation cache (a tmp dir), so the
resume does not compile again. The killed run keeps Muon's momentum in host memory
(`optim.offload_momentum`: a one-device mesh with explicit shardings), so its checkpoint
restores host-memory arrays too; the plain single-device step resumes bit-exactly in
tests/train/test_trainer.py.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cli_env import ROOT, cli_env

FLAGS = ["--config.model.num_layers=2", "--config.model.num_mtp_layers=0", "--config.train.batch_size=4",
         "--config.train.seq_len=32", "--config.train.log_every=1",
         "--config.train.eval_every=0", "--config.train.checkpoint_every=3",
         "--config.train.progress=False", "--config.train.peak_flops=1e11",
         "--config.optim.lr=0.01"]


def _cmd(workdir, steps, *extra):
  return [sys.executable, "-m", "experiments.train", "--config=configs/tiny.py",
          f"--workdir={workdir}", f"--config.train.steps={steps}", *FLAGS, *extra]


def _env(cache):
  # One device, as a user's run; the same HLO in both processes: the cache hits.
  return cli_env(JAX_COMPILATION_CACHE_DIR=str(cache),
                 JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONHASHSEED="0")


def _records(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  out = []
  for line in open(path):
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError:
      pass    # a line torn by the kill
  return out


def test_sigkill_mid_run_then_resume(tmp_path):
  work, steps = tmp_path / "run", 14
  env = _env(tmp_path / "jax_cache")
  offload = "--config.optim.offload_momentum=True"
  proc = subprocess.Popen(_cmd(work, steps, offload), cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.time() + 900
  try:
    # Kill once a checkpoint exists and the run has gone past it (mid-interval).
    while time.time() < deadline:
      recs = _records(work)
      if recs and recs[-1]["step"] >= 7:
        break
      if proc.poll() is not None:
        pytest.fail(f"training exited early: {proc.stderr.read().decode()[-2000:]}")
      time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
  finally:
    proc.wait()
  first_run = _records(work)
  before = {r["step"]: r["loss"] for r in first_run}
  killed_at = max(before)
  assert killed_at < steps
  out = subprocess.run(_cmd(work, steps, offload), cwd=ROOT, env=env, capture_output=True,
                       timeout=900)
  assert out.returncode == 0, out.stderr.decode()[-3000:]
  recs = _records(work)
  after = recs[len(first_run):]
  resumed = after[0]["step"] - 1
  assert 3 <= resumed <= killed_at and resumed % 3 == 0         # from a complete checkpoint
  assert after[-1]["step"] == steps
  for r in after:                         # steps redone after the kill: the same losses
    if r["step"] in before:
      assert r["loss"] == before[r["step"]], r["step"]


def test_unknown_config_key_is_an_error(tmp_path):
  out = subprocess.run(_cmd(tmp_path, 2, "--config.train.no_such_field=3"), cwd=ROOT,
                       env=_env(tmp_path / "c"), capture_output=True, timeout=300)
  assert out.returncode != 0
  assert b"no_such_field" in out.stderr
  assert not os.path.exists(tmp_path / "metrics.jsonl")
