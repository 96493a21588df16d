"""experiments/qat_gap.py: its documented command line parses, and a tiny run (one MoE layer,
two steps per arm) goes end to end through the CLI (a subprocess) and writes its JSON."""

import json
import subprocess
import sys

from absl import flags

from cli_env import ROOT, cli_env
from experiments import qat_gap



def test_documented_command_parses():
  fv = flags.FlagValues()
  qat_gap.define_flags(fv)
  rest = fv(["qat_gap.py", "--config=configs/small.py", "--workdir=runs/qat_gap",
             "--out=/tmp/x.json", "--data=stdlib", "--eval_batches=4"])
  assert rest == ["qat_gap.py"]
  assert fv.config.model.latent_moe_dim == 256 and fv.workdir == "runs/qat_gap"
  assert (fv.data, fv.eval_batches, fv.out) == ("stdlib", 4, "/tmp/x.json")


def test_tiny_run_end_to_end(tmp_path):
  out = tmp_path / "gap.json"
  cmd = [sys.executable, "-m", "experiments.qat_gap", "--config=configs/tiny.py",
         f"--workdir={tmp_path / 'runs'}", f"--out={out}", "--eval_batches=1",
         # One layer (MLA + MoE), Adam, two steps: the smallest run with routed experts.
         "--config.model.num_layers=1", "--config.model.first_dense_layers=0",
         "--config.model.num_mtp_layers=0", "--config.train.mtp_weight=0",
         "--config.optim.muon=False", "--config.train.steps=2", "--config.train.batch_size=2",
         "--config.train.seq_len=32", "--config.train.peak_flops=1e12"]
  res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=cli_env())   # one device, as a user's run
  assert res.returncode == 0, res.stderr[-3000:]
  r = json.loads(out.read_text())
  assert set(r["arms"]) == {"plain", "qat"} and r["eval_tokens"] == 64
  plain, q = r["arms"]["plain"], r["arms"]["qat"]
  # The QAT forward is the served forward: no gap; the plain run's training forward is the
  # unquantised one; both arms start from the same init and see the same batches.
  assert abs(q["gap"]) < 1e-5 and q["served_loss"] > 0
  assert plain["train_loss"] == plain["float_loss"] and abs(plain["gap"]) > 1e-4
  assert abs(plain["gap"]) == abs(plain["served_loss"] - plain["train_loss"])
  for a in (plain, q):
    assert 0.01 < a["mxfp4_rel_err"] < 0.3   # E2M1 with a shared scale: ~0.1 on Gaussians
  assert json.loads(res.stdout.strip().splitlines()[-1])["arms"] == r["arms"]
