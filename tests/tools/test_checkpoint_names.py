"""tools/checkpoint_names: the names, shapes and dtypes export writes, from the config alone
(497,220 entries for the k3 release, docs/k3.md §12)."""

import json
import pathlib
import subprocess
import sys

import numpy as np

from convert_helpers import random_variables
from k3jax.config import preset
from k3jax.convert import export
from k3jax.convert import names as N
from k3jax.convert.safetensors_io import DTYPE_NAMES, Source
from tools.checkpoint_names import format_line, names_for

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_checkpoint_names_equal_what_export_writes(tmp_path):
  config = preset("tiny_multimodal")
  variables = random_variables(config, seed=5)
  back = export(None, tmp_path / "mm", loaded=(config, variables), progress=False,
                log=lambda s: None)
  infos = Source(back).infos
  listed = names_for(config)
  assert [n for n, _, _ in listed] == sorted(infos, key=N._natural_key)
  for n, dt, shape in listed:
    assert (infos[n].dtype, infos[n].shape) == (dt, shape), n
  assert listed[0][0].startswith("language_model.")     # vision tower → multimodal spelling
  r = subprocess.run([sys.executable, "-m", "tools.checkpoint_names", "--preset",
                      "tiny_multimodal"], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.splitlines() == [f"{n}\t{list(s)}\t{DTYPE_NAMES[d]}" for n, d, s in listed]


def test_checkpoint_names_k3_count():
  """The release: 497,220 entries (§12), 1.561 TB; listing the names allocates nothing."""
  lines = [format_line(*e) for e in names_for(preset("k3"))]
  assert len(lines) == 497_220
  assert sum(l.endswith("\tU8") for l in lines) == 92 * 896 * 3 * 2
  assert sum(l.startswith(("vision_tower.", "mm_projector.")) for l in lines) == 168
  assert not [l for l in lines if "mtp" in l]
  assert "language_model.model.layers.0.self_attn.A_log\t[128]\tF32" in lines
  assert ("language_model.model.layers.91.block_sparse_moe.experts.895.w2.weight_scale\t"
          "[3584, 96]\tU8") in lines
  assert "language_model.model.layers.1.block_sparse_moe.gate.weight\t[896, 7168]\tBF16" in lines
  total = sum(int(np.prod(json.loads(l.split("\t")[1]))) * {"BF16": 2, "F32": 4, "U8": 1}[
      l.split("\t")[2]] for l in lines)
  assert total == 1_560_860_324_864      # 1.561 TB published (k3jax/convert/dtypes.py)
