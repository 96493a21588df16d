"""Every file under configs/ builds a valid model and training config; `gpu_1b` is the ~1B
K3-shaped model the GPU check trains (its shape is what makes its MFU figure meaningful)."""

import importlib
import pathlib

import pytest

from cli_env import ROOT
from k3jax import sharding
from k3jax.posttrain.rl.loop import RL_GROUPS, rl_config
from k3jax.train import stages as S
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


def test_k3_curriculum_is_the_reports_with_a_layout_per_stage():
  """configs/k3.py: 8K → 64K in pre-training, 256K → 1M in the cool-down (docs/k3.md §8) as
  train.stages covering every step; the cool-down on long-document rows with evidence tasks;
  each stage's layout uses the same 4096 chips with 4K tokens of a sequence per chip, passes
  the shape checks (experts, batch, context) and keeps whole KDA chunks and MLA key blocks on
  each context shard; the longer rows run with remat, latent MLA and host offload."""
  run = run_config(importlib.import_module("configs.k3").get_config())
  plan = run.train.stage_plan()
  assert [st.seq_len for st in plan] == [8192, 65536, 262144, 1048576]
  assert sum(st.steps for st in plan) == run.train.steps
  assert [st.data for st in plan] == ["", "", "long", "long"]
  assert all(st.evidence_fraction > 0 for st in plan[2:])
  assert {st.batch_size * st.seq_len for st in plan} == {1 << 24}
  contexts = []
  for st in plan:
    stage = S.stage_run(run, st)
    modes, shape = stage.model.modes, sharding.mesh_shape(stage.mesh, 4096)
    mesh = sharding.abstract_mesh(stage.mesh, 4096)
    sharding.check_shapes(stage.model, mesh, batch_size=st.batch_size, seq_len=st.seq_len)
    shard = st.seq_len // shape["context"]
    assert shard == 4096 and shard % modes.kda_chunk_size == 0
    assert modes.remat and (modes.mla_key_block is None or shard % modes.mla_key_block == 0)
    contexts.append(shape["context"])
    assert (st.seq_len > 65536) == modes.remat_offload == bool(stage.optim.offload_momentum)
    assert modes.mla_key_block is not None    # MLA from the latents in every stage
    # FSDP over context wherever a row spans chips: the state is then sharded over every
    # chip's share (dense weights over fsdp × context × expert where d divides, the expert
    # matrices' latent dim over fsdp × context).
    assert stage.mesh.fsdp_over_context == (shape["context"] > 1)
    rules = sharding.params_over(stage.mesh, param_axes=("fsdp", "expert"))
    embed = [axes for name, axes in rules if name == "embed"][0]
    assert ("context" in embed) == (shape["context"] > 1)
  assert contexts == [2, 16, 64, 256]
  # The run's own mesh is the first stage's.
  assert sharding.mesh_shape(run.mesh, 4096) == sharding.mesh_shape(S.stage_run(run, plan[0]).mesh, 4096)
