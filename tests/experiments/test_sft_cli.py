"""experiments/sft.py and experiments/eval_sft.py from the command line: a 2-step fine-tuning
on a JSONL file, then the held-out evaluation of its checkpoint; bad data and configs."""

import json
import os
import subprocess
import sys

from cli_env import ROOT, cli_env
from k3jax.data import sft
from k3jax.data import sft_tasks

FLAGS = ["--config.model.num_layers=1", "--config.train.steps=2", "--config.train.batch_size=2",
         "--config.train.seq_len=96", "--config.train.log_every=1",
         "--config.train.eval_every=2", "--config.train.eval_batches=1",
         "--config.train.checkpoint_every=2", "--config.train.progress=False",
         "--config.train.peak_flops=1e11", "--config.train.mtp_weight=0",
         "--config.optim.muon=False", "--config.data.eval_percent=30"]


def _run(*args):
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=cli_env(),
                        capture_output=True, text=True, timeout=900)


def test_sft_then_eval(tmp_path):
  data = tmp_path / "convs.jsonl"
  sft.write_jsonl(str(data), [s.conversation for s in sft_tasks.samples(0, 40, sft_tasks.TRAIN)])
  work = tmp_path / "run"
  out = _run("experiments.sft", "--config=configs/sft_tiny.py", f"--workdir={work}",
             f"--data={data}", *FLAGS)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "step 2: loss" in out.stdout and "held-out loss" in out.stdout
  assert "longer than a row" in out.stderr          # the calculator conversations, reported
  recs = [json.loads(line) for line in open(work / "metrics.jsonl")]
  assert [r["step"] for r in recs] == [1, 2] and recs[-1]["eval_loss"] > 0
  assert json.load(open(work / "config.json"))["data"]["sft_file"] == str(data)
  assert os.path.isdir(work / "checkpoints" / "2")

  res = tmp_path / "eval.json"
  out = _run("experiments.eval_sft", f"--checkpoint={work}", "--num_samples=3",
             "--max_new_tokens=4", "--batch_size=2", f"--json={res}")
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.load(open(res))
  assert got["step"] == 2 and got["num_samples"] == 3
  assert got["replies"] == 3 and 0 <= got["parse_rate"] <= 1 and 0 <= got["exact_match"] <= 1
  assert sum(v["n"] for v in got["by_task"].values()) == 3
  assert "held-out exact match" in out.stdout


def test_bad_data_and_config_are_named(tmp_path):
  data = tmp_path / "bad.jsonl"
  data.write_text('{"messages": [{"role": "assistant", "response": "x"}]}\n'
                  '{"messages": [{"role": "robot", "content": "x"}]}\n')
  out = _run("experiments.sft", "--config=configs/sft_tiny.py", f"--workdir={tmp_path / 'w'}",
             f"--data={data}", *FLAGS)
  assert out.returncode != 0
  assert f"{data}:2: messages[0].role: expected one of" in out.stderr
  assert not os.path.exists(tmp_path / "w" / "metrics.jsonl")
  out = _run("experiments.sft", "--config=configs/tiny.py", f"--workdir={tmp_path / 'w'}")
  assert out.returncode != 0 and "data.source must be 'sft'" in out.stderr
