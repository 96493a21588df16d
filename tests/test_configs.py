"""Every file under configs/ builds a valid model and training config; `gpu_1b` is the ~1B
K3-shaped model the GPU check trains (its shape is what makes its MFU figure meaningful)."""

import importlib
import pathlib

import pytest

from cli_env import ROOT
from k3jax.posttrain.rl.loop import RL_GROUPS, rl_config
from k3jax.train.run import run_config
from tools.param_count import count_params

CONFIGS = sorted(p.stem for p in (pathlib.Path(ROOT) / "configs").glob("*.py")
                 if p.stem != "__init__")


@pytest.mark.parametrize("name", CONFIGS)
def test_config_builds_a_valid_model(name):
  cfg = importlib.import_module(f"configs.{name}").get_config()
  # The typed run config validates every field (and ModelConfig its own).
  run = rl_config(cfg).run if "rl" in cfg else run_config(cfg)
  assert run.model.text.num_layers >= 1 and run.train.steps >= 1
  assert set(cfg) <= {"seed", "model", "train", "optim", "balance", "data", "mesh", *RL_GROUPS}


def test_gpu_1b_is_k3_shaped_at_one_billion():
  cfg = importlib.import_module("configs.gpu_1b").get_config()
  model = run_config(cfg).model
  counts = count_params(model)
  total, active = counts["total"], counts["activated"]
  assert 0.95e9 < total < 1.15e9 and 0.25e9 < active < 0.4e9, (total, active)
  # K3's kernel shapes: KDA K = V = 128 with the bounded gate, 8 of 64 experts, bf16 compute.
  assert model.text.kda_head_dim == 128 and model.text.kda_lower_bound is not None
  assert (model.text.num_experts, model.text.experts_per_token) == (64, 8)
  assert model.modes.dtype == "bfloat16" and cfg.train.seq_len * cfg.train.batch_size >= 16384
