"""LoRA end to end: a run with `train.lora.*` (the fields `experiments.train --config.train.lora.*`
sets) trains adapters on a saved base, the `tools.merge_lora --export_dir` command folds them in
and exports the release layout, and that export converts back to exactly the merged checkpoint.
The merge's numerics: tests/posttrain/test_lora.py."""

import subprocess
import sys

import jax
import numpy as np

from cli_env import ROOT, cli_env
from convert_helpers import flat
from k3jax.convert import convert
from k3jax.posttrain import lora as L
from k3jax.convert.checkpoint import load_pretrained, save_pretrained
from k3jax.train import trainer
from k3jax.train.run import base_config, run_config
from k3jax.train.state import init_variables


def _run(*args: str) -> str:
  r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                     timeout=600, env=cli_env())
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  return r.stdout + r.stderr


def test_train_lora_merge_and_export(tmp_path):
  cfg = base_config("tiny")
  cfg.model.update(num_layers=3, mla_every=2, attn_res_block_size=2,   # KDA, MLA; MoE
                   num_mtp_layers=0)
  base = run_config(cfg).model
  save_pretrained(tmp_path / "base", base, init_variables(base, jax.random.PRNGKey(1)))
  text = tmp_path / "corpus.txt"
  text.write_text("".join(f"line {i}: the adapters learn, the base stays.\n" for i in range(400)))
  run = cfg.copy_and_resolve_references()
  run.train.lora.update(rank=2, targets="q,o,experts", base=str(tmp_path / "base"))
  run.train.update(steps=2, batch_size=2, seq_len=32, eval_every=0, progress=False,
                   tensorboard=False, async_checkpoint=False, peak_flops=1e12)
  run.data.source = str(text)
  trainer.train(run_config(run), str(tmp_path / "run"), recipe=L.RECIPE)
  config, adapters = L.load_adapters(tmp_path / "run" / "adapters")
  assert config.modes.lora_rank == 2 and set(config.modes.lora_targets) == {"q", "o", "experts"}
  assert any(np.abs(np.asarray(b)).max() > 0 for b in jax.tree.leaves(adapters))   # trained
  log = _run("tools.merge_lora", f"--base={tmp_path / 'base'}",
             f"--adapters={tmp_path / 'run' / 'adapters'}", f"--dst={tmp_path / 'merged'}",
             f"--export_dir={tmp_path / 'export'}", "--expert_format=bf16", "--dtype=float32")
  assert "exported" in log
  merged_config, merged = load_pretrained(tmp_path / "merged")
  assert merged_config.modes.lora_rank == 0
  base = dict(flat(load_pretrained(tmp_path / "base")[1]))
  changed = {"/".join(k) for k, v in flat(merged) if not np.array_equal(v, base[k])}
  assert changed and not [k for k in changed if "embed" in k or "lm_head" in k], changed
  assert any("experts" in k for k in changed) and any("o_proj" in k for k in changed)
  # The export is the merged model: converting it back gives every tensor bit for bit.
  convert(tmp_path / "export", tmp_path / "back", progress=False, log=lambda s: None)
  _, back = load_pretrained(tmp_path / "back")
  want = dict(flat(merged))
  got = dict(flat(back))
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg="/".join(k))
