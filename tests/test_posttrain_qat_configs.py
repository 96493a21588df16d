"""The shipped post-training configs (configs/sft_*.py, configs/rl_*.py) train with QAT on
(K3 §13: MXFP4 experts, MXFP8 expert inputs from SFT through RL), and an agentic RL run hands
the one quantised policy config to both the rollout engine and the update."""

import importlib
import pathlib

import pytest

from cli_env import ROOT
from k3jax.config import preset
from k3jax.posttrain.rl import agentic
from k3jax.posttrain.rl.loop import policy_config, rl_config
from k3jax.train.run import run_config

POSTTRAIN = sorted(p.stem for p in (pathlib.Path(ROOT) / "configs").glob("*.py")
                   if p.stem.startswith(("sft_", "rl_")))


def test_there_are_sft_and_rl_configs():
  assert {"sft_tiny", "sft_small", "rl_tiny", "rl_agentic_tiny"} <= set(POSTTRAIN)


@pytest.mark.parametrize("name", POSTTRAIN)
def test_shipped_posttraining_config_has_qat_on(name):
  cfg = importlib.import_module(f"configs.{name}").get_config()
  if "rl" in cfg:
    r = rl_config(cfg)
    assert r.rl.expert_qat == "mxfp4_mxfp8"
    # The policy every rollout, log-prob and update of the loop runs (loop.policy_config).
    assert policy_config(r.rl, r.run.model).modes.expert_qat == "mxfp4_mxfp8"
  else:
    assert run_config(cfg).model.modes.expert_qat == "mxfp4_mxfp8"
  off = importlib.import_module(f"configs.{name}").get_config()
  (off.rl if "rl" in off else off.model).expert_qat = None
  model = rl_config(off).run.model if "rl" in off else run_config(off).model
  assert model.modes.expert_qat is None


class _Stop(Exception):
  pass


def test_agentic_engine_and_update_quantise_alike(monkeypatch):
  """configs/rl_agentic_tiny.py: the engine that samples the rollouts and the RL step that
  scores and updates them are built from one model config, with QAT on."""
  seen = {}

  def fake_step(config, *a, **k):
    seen["update"] = config
    return lambda *a, **k: None

  def fake_engine(config, variables, ec):
    seen["engine"] = config
    raise _Stop

  monkeypatch.setattr(agentic, "make_rl_step", fake_step)
  monkeypatch.setattr(agentic, "Engine", fake_engine)
  monkeypatch.setattr(agentic, "init_state", lambda v, t, tx: type("S", (), {"variables": v}))
  r = rl_config(importlib.import_module("configs.rl_agentic_tiny").get_config())
  config = preset("tiny", num_layers=2, mla_every=2, first_dense_layers=1,
                  attn_res_block_size=None, num_mtp_layers=0)
  assert config.modes.expert_qat is None
  with pytest.raises(_Stop):
    agentic.run(r, config, {"params": {}}, log=None)
  assert seen["engine"] is seen["update"]
  assert seen["engine"].modes.expert_qat == "mxfp4_mxfp8"
