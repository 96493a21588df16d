"""The typed run config (k3jax/train/run.py): one read of the ConfigDict, the defaults in one
place, errors naming `config.<group>.<field>`."""

import dataclasses

import pytest

from k3jax.posttrain.rl import loop
from k3jax.train import run as R


def test_base_config_is_the_dataclasses_defaults():
  c = R.base_config("tiny")
  run = R.run_config(c)
  assert run == R.RunConfig(model=run.model)          # nothing but defaults
  for group, cls in R.GROUPS.items():
    fields = {f.name for f in dataclasses.fields(cls)}
    assert set(c[group]) == fields, group
  assert run.model.name == "tiny" and run.model.text.num_layers == 13
  assert run.train.lora == R.LoRARun()


def test_the_model_group_is_flat_and_routed():
  c = R.base_config("tiny")
  c.model.num_layers = 4
  c.model.dtype = "bfloat16"
  c.model.moe_capacity_factor = None
  c.train.lora.rank = 2
  c.train.lora.targets = "q,o"
  c.balance.num_bins = 64
  m = R.run_config(c).model
  assert (m.text.num_layers, m.modes.dtype, m.modes.moe_capacity_factor) == (4, "bfloat16", None)
  assert (m.modes.lora_rank, m.modes.lora_targets, m.modes.qb_num_bins) == (2, ("q", "o"), 64)


@pytest.mark.parametrize("group,field,value,message", [
    ("train", "steps", 0, "config.train.steps: expected a positive int"),
    ("train", "grad_accum", 3, "config.train.batch_size: must be divisible by train.grad_accum=3"),
    ("train", "curriculum", "10:x", "curriculum"),
    ("optim", "mu_dtype", "int8", "config.optim.mu_dtype"),
    ("balance", "method", "median", "config.balance.method"),
    ("data", "text_fraction", 2.0, "config.data.text_fraction"),
    ("model", "d_model", -1, "config.model: ModelConfig.text.d_model"),
    ("model", "kernel_backend", "cuda", "config.model: ModelConfig.modes.kernel_backend"),
])
def test_errors_name_the_field(group, field, value, message):
  c = R.base_config("tiny")
  c[group][field] = value
  with pytest.raises(ValueError, match=message):
    R.run_config(c)


def test_unknown_fields_and_groups_are_errors():
  d = R.base_config("tiny").to_dict()
  d["train"]["stepz"] = 3
  with pytest.raises(ValueError, match=r"config.train: unknown field\(s\) \['stepz'\]"):
    R.run_config(d)
  d = R.base_config("tiny").to_dict()
  d["rl"] = {}
  with pytest.raises(ValueError, match=r"unknown group\(s\) \['rl'\]"):
    R.run_config(d)
  assert R.run_config(d, extra=("rl",)).train.steps == 300


def test_rl_config_reads_its_groups_and_ties_the_schedule_to_the_rounds():
  c = loop.rl_base_config("tiny")
  c.rl.rounds = 7                     # train.steps follows (the schedule spans the rounds)
  r = loop.rl_config(c)
  assert r.rl.rounds == r.run.train.steps == 7
  assert r.loss == loop.LossConfig() and r.budget == loop.BudgetConfig()
  c.rl.lam = 1.5
  with pytest.raises(ValueError, match=r"config.rl.lam: expected a value in \(0, 1\]"):
    loop.rl_config(c)


def test_to_dict_is_json_and_signature_follows_the_optimizer():
  import json
  run = R.run_config(R.base_config("small"))
  d = json.loads(json.dumps(run.to_dict()))
  assert d["model"]["text"]["d_model"] == 512 and d["train"]["lora"]["targets"] == list("qkvo")
  assert run.signature() == {"muon": True, "balance": "qb", "clip": False}
  lora = run.replace(train=dataclasses.replace(run.train, lora=R.LoRARun(rank=4)))
  assert lora.signature()["lora"] == 4
