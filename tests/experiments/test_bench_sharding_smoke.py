"""experiments/bench_sharding.py: flag parsing (the documented command lines), the layout
table, the message when the optional libtpu is missing, the per-device state of each recipe,
and the memory part's compile path (the trainer's step from `k3jax.train.sharded.build_step`,
lowered from abstract values) for a 2-layer tiny model on the 8 simulated CPU devices. The
deviceless TPU compile itself needs the `tpu_aot` extra; docs/notes/sharding.md has the manual
check."""

import importlib.util
import math
import re
import shlex

import pytest
from absl import app, flags

from experiments import bench_sharding as bench


def _flags(args):
  """The benchmark's flags parsed from `args` (a fresh FlagValues: nothing global)."""
  fv = flags.FlagValues()
  bench.define_flags(fv)
  rest = fv(["bench_sharding.py", *args])
  assert rest == ["bench_sharding.py"], rest
  return fv


def _run(*args):
  bench.run(_flags(args))


# Command lines of the module docstring, README.md, docs/results.md and docs/notes.
DOCUMENTED = [
    "",
    "--part memory --devices 256",
    "--part memory --devices 256 --offload_momentum false",
    "--part memory --devices 2048 --num_layers 9",
    "--part memory --preset tiny --devices 4 --layout fsdp=2,expert=2 --topology v5p:2x2x1 "
    "--seq_len 64",
    "--part ep --ep_devices 4 --steps 5",
    "--part ep --ep_devices 4 --steps 5 --ep_batch 8 --ep_seq_len 64 --ep_num_layers 2",
    "--part state",
    "--part memory --devices 2048 --out /tmp/x.json",
    "--part memory --devices 2048 --layout fsdp=16,expert=64,tensor=2 --out docs/results/b.json",
    "--part memory --devices 256 --optimizer adamw",
    "--part memory --devices 2048",
    "--part qlora --out qlora.json",
    "--part qlora --devices 64 --qlora_compile",
    "--part inference",
    "--part memory --stage 1M",
    "--part state --stage 1M --out docs/results/long_context/state_1M.json",
    "--part memory --stage 8K --out docs/results/long_context/stage_8K.json",
    "--part memory --stage 256K --stage_modes remat_offload=false,mla_key_block=2048 "
    "--fsdp_over_context false",
    "--part memory --stage 1M --num_layers 9 --stage_modes num_mtp_layers=0",
    "--part memory --stage 1M --stage_modes mtp_full_length=false",
    "--part memory --stage 1M --peak_buffers 40 --stage_modes ce_chunks=8,mla_key_block=2048,"
    "mla_query_block=2048,moe_capacity_factor=1.0,expert_grad_barrier=true",
    "--part memory --target cpu --devices 8 --preset tiny --num_layers 2 --seq_len 8192 "
    "--per_device_batch 1 --layout data=1,fsdp=1,expert=1,context=8 --stage_modes "
    "mtp_full_length=true,mla_key_block=1024,mla_query_block=1024",
    "--part inference --devices 64 --inf_batch 64 --inf_max_len 1048576",
    "--part cache --inf_max_len 1048576 --out docs/results/long_context/decode_cache_1m.json",
]


@pytest.mark.parametrize("line", DOCUMENTED)
def test_documented_command_lines_parse(line):
  _flags(shlex.split(line))


def test_flag_values_and_defaults():
  f = _flags([])
  assert (f.part, f.devices, f.target, f.topology, f.preset, f.num_layers, f.layout) == (
      "all", 0, "tpu", None, "k3", 0, None)
  assert (f.optimizer, f.seq_len, f.param_dtype, f.offload_momentum, f.mu_dtype) == (
      "muon", 0, None, None, None)
  assert (f.per_device_batch, f.steps, f.ep_batch, f.ep_seq_len, f.ep_devices,
          f.ep_num_layers, f.ep_layout, f.out, f.child) == (1, 5, 8, 64, 8, 2, None, None, False)
  # the parent passes these to its --child processes, "" included (the parameters' dtype)
  f = _flags(["--mu_dtype", "", "--offload_momentum", "true", "--out=r.json", "--child",
              "--ep_layout", "expert"])
  assert (f.mu_dtype, f.offload_momentum, f.out, f.child, f.ep_layout) == (
      "", "true", "r.json", True, "expert")
  for bad in (["--part", "bogus"], ["--mu_dtype", "float16"], ["--offload_momentum", "yes"]):
    with pytest.raises(flags.IllegalFlagValueError):
      _flags(bad)


def test_parse_layout():
  assert bench.parse_layout("fsdp=4, expert=64") == {"fsdp": 4, "expert": 64}
  assert bench.parse_layout("data=-1") == {"data": -1}
  with pytest.raises(ValueError, match="axis=size"):
    bench.parse_layout("fsdp:4")
  with pytest.raises(ValueError, match="axis=size"):
    bench.parse_layout("fsdp=four")


def test_recommended_layouts_fill_the_device_counts():
  for n, layout in bench.LAYOUTS.items():
    assert layout["data"] * layout["fsdp"] * layout["expert"] * layout["context"] \
        * layout["tensor"] == n
    dims = [int(x) for x in bench.TOPOLOGIES[n].split(":")[1].split("x")]
    assert dims[0] * dims[1] * dims[2] == n


def test_missing_libtpu_is_a_clear_error(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "libtpu" else real(name, *a))
  with pytest.raises(app.UsageError) as e:
    _run("--part", "memory", "--devices", "256")
  err = str(e.value)
  assert "libtpu" in err and "[tpu_aot]" in err and "--target cpu" in err
  with pytest.raises(SystemExit, match=r"tpu_aot"):
    bench.tpu_devices("v5p:2x2x1", 4)


def test_layout_needs_devices():
  with pytest.raises(app.UsageError, match="need --devices"):
    _run("--part", "memory", "--target", "cpu", "--layout", "fsdp=2")


def test_state_part_follows_each_recipe(capsys):
  """`--part state` (shardings only, no compile) applies each device count's recipe: 256 devices
  store kernels and first moments in bf16 and Muon's momentum in host memory, 2048 keep fp32
  on the device."""
  import json
  _run("--part", "state", "--devices", "256")
  _run("--part", "state", "--devices", "2048")
  r256, r2048 = [json.loads(l)["results"][0] for l in capsys.readouterr().out.splitlines()
                 if l.startswith("{")]
  gib = 2.0 ** 30
  for r, n in ((r256, 256), (r2048, 2048)):
    recipe = bench.RECIPES[n]
    assert r["layout"] == recipe["layout"] and r["param_dtype"] == recipe["param_dtype"]
    # Momentum or Adam's (mu, nu) per parameter: about the parameters' bytes again; at 256
    # Muon's momentum is in host memory, only Adam's moments (embeddings, vectors) stay.
    opt = r["opt_gib_per_device"] + r["opt_host_gib_per_device"]
    assert 0.99 < opt / r["params_gib_per_device"] < 1.03, r
    assert r["offload_momentum"] == recipe["offload_momentum"]
    if recipe["offload_momentum"]:
      assert r["opt_gib_per_device"] < 0.02 * opt, r
    else:
      assert r["opt_host_gib_per_device"] == 0, r
  # 256 = fsdp 4 x expert 64, the axes parameters are sharded over: almost every parameter is a
  # bf16 kernel split 256 ways; vectors, norms, convs and the router stay fp32 and a few small
  # kernels are replicated (KDA's f_b_proj [22,128,96,128] has no axis divisible by 256:
  # +0.2 GiB per device). Within 2%.
  assert abs(r256["params_gib_per_device"] / (r256["params"] * 2 / 256 / gib) - 1) < 0.02, r256
  # 2048 = fsdp 16 x expert 64 x tensor 2: fp32, split 1024 ways, and most kernels also over
  # `tensor` (heads), so between 1/2048 and 1/1024 of the fp32 bytes.
  full = r2048["params"] * 4 / gib
  assert full / 2048 < r2048["params_gib_per_device"] < full / 1024 * 0.6, r2048


def test_memory_part_compiles_the_trainer_step_from_build_step(monkeypatch):
  """`memory_part` lowers the step `build_step` returns (the trainer's, not a copy) from
  abstract values and compiles it: a 2-layer tiny model on (fsdp=2, expert=4) CPU devices,
  state sharded 8 ways or less per device, XLA's memory plan read back."""
  from k3jax.train import sharded
  calls = []
  real = sharded.build_step

  def spy(*args, **kwargs):
    calls.append(args[2] if len(args) > 2 else kwargs.get("mesh"))
    return real(*args, **kwargs)

  monkeypatch.setattr(sharded, "build_step", spy)
  r = bench.memory_part(8, 16, 1, target="cpu", preset_name="tiny", num_layers=2,
                        layout=dict(data=1, fsdp=2, expert=4), peak_buffers=6)
  assert len(calls) == 1 and dict(calls[0].shape)["expert"] == 4
  assert r["layout"] == dict(data=1, fsdp=2, expert=4, context=1, tensor=1)
  assert r["global_batch"] == 8 and r["num_layers"] == 2
  assert r["state_gib_total"] / 8 <= r["state_gib_per_device"] < r["state_gib_total"]
  assert r["argument_bytes"] > 0 and r["temp_bytes"] > 0 and r["peak_gib"] > 0
  # The compiler's cost analysis, per chip and per token of the chip's share (16 tokens).
  assert r["flops_per_chip"] > 0 and r["bytes_accessed_per_chip"] > 0
  assert r["tokens_per_chip_per_step"] == 16
  assert r["flops_per_token"] == pytest.approx(r["flops_per_chip"] / 16)
  # XLA's own account of the peak (its dump): the bytes live there are within what
  # memory_analysis counts, the largest buffers come first, and each one's bytes are its
  # shape's (f32[64,272] → 69,632).
  pk = r["peak_live_buffers"]
  total = r["argument_bytes"] + r["output_bytes"] + r["temp_bytes"]
  assert r["temp_bytes"] < pk["bytes"] <= total and pk["position"] > 0
  assert (pk["device_bytes"], pk["host_bytes"], pk["top_host"]) == (pk["bytes"], 0, [])
  # The heap of the one (CPU) memory space holds the parameters and the temporaries.
  (heap,) = pk["heap_bytes_by_memory_space"].values()
  assert 1.0 <= heap / (r["argument_bytes"] + r["temp_bytes"]) < 1.05
  sizes = [b["bytes"] for b in pk["top"]]
  assert len(sizes) == 6 and sizes == sorted(sizes, reverse=True)
  width = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1}
  for b in pk["top"]:
    m = re.match(r"(\w+)\[([\d,]*)\]", b["shape"])
    assert m, b
    assert b["bytes"] == width[m.group(1)] * math.prod(int(x) for x in m.group(2).split(",")
                                                        if x), b


def test_a_refused_stage_records_the_stage(monkeypatch, capsys):
  """XLA:TPU's refusal (RESOURCE_EXHAUSTED) is a result: for --stage it is recorded with what
  the child compiled — the stage's layout, length, sequences per chip and optimizer offload —
  and the temporaries XLA asked for (the compile itself is replaced by the refusal)."""
  import json
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: object() if name == "libtpu" else real(name, *a))

  def refuse(args, devices):
    raise RuntimeError("jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory on "
                       "HBM, the total memory required for HLO temporaries (371.15G) exceeds "
                       "available HBM (95.74G).")

  monkeypatch.setattr(bench, "_subprocess", refuse)
  _run("--part", "memory", "--stage", "1M", "--num_layers", "9", "--stage_modes",
       "mtp_full_length=false")
  (r,) = [json.loads(l) for l in capsys.readouterr().out.splitlines()
          if l.startswith("{")][-1]["results"]
  _, layout, per_chip = bench.stage_config("1M", 9)
  assert r["layout"] == layout and layout["context"] == 256 and r["devices"] == 4096
  assert (r["seq_len"], r["per_device_batch"]) == (1048576, per_chip)
  assert r["offload_momentum"] is True and r["fits"] is False
  assert r["refused_temp_gib"] == 371.15 and r["stage_modes"] == {"mtp_full_length": False}


def test_stage_config_is_the_config_s_stage():
  """--stage takes configs/k3.py's stage as it is: sequence length, sequences per chip, layout
  (FSDP over context where a row spans chips), run modes and Muon offload; --stage_modes
  overrides RunModes or the model's own fields; bad names are clear errors."""
  import importlib
  from k3jax.train.run import run_config
  plan = run_config(importlib.import_module("configs.k3").get_config()).train.stages
  assert [bench.STAGES[n] for n in ("8K", "64K", "256K", "1M")] == [st.seq_len for st in plan]
  for name, st in zip(("8K", "64K", "256K", "1M"), plan):
    run, layout, per_chip = bench.stage_config(name)
    mesh = dict(st.mesh)
    assert {a: layout[a] for a in ("data", "fsdp", "expert", "context", "tensor")} == {
        a: mesh.get(a, 1) for a in ("data", "fsdp", "expert", "context", "tensor")}
    assert layout["fsdp_over_context"] == (mesh["context"] > 1)
    chips = layout["data"] * layout["fsdp"] * layout["expert"] * layout["context"]
    assert chips == 4096 and per_chip * chips // mesh["context"] == st.batch_size
    assert bench.TOPOLOGIES[chips] == "v5p:16x16x16"
    assert run.train.seq_len == st.seq_len
    modes = dict(st.modes)
    assert run.model.modes.mla_key_block == modes["mla_key_block"]
    assert run.model.modes.remat_offload == modes.get("remat_offload", False)
    assert run.optim.offload_momentum == bool(st.offload_momentum)
    # A stage's capacity factor as configured; a dropless stage's the bench's 1.25.
    assert run.model.modes.moe_capacity_factor == modes.get("moe_capacity_factor", 1.25)
    assert run.model.modes.scan_layers
    for field, default in (("ce_chunks", None), ("expert_grad_barrier", False)):
      assert getattr(run.model.modes, field) == modes.get(field, default), field
    assert run.model.modes.mla_query_block == modes["mla_query_block"]
  run, layout, _ = bench.stage_config("1M", 5, modes=dict(remat_offload=False,
                                                          num_mtp_layers=0),
                                      fsdp_over_context=False)
  assert (run.model.text.num_layers, run.model.text.num_mtp_layers) == (5, 0)
  assert not run.model.modes.remat_offload and not layout["fsdp_over_context"]
  with pytest.raises(ValueError, match="--stage"):
    bench.stage_config("2M")
  with pytest.raises(ValueError, match="unknown model field 'bogus'"):
    bench.stage_config("8K", modes=dict(bogus=1))
  assert bench.parse_modes("remat_offload=false, mla_key_block=2048,x=none") == dict(
      remat_offload=False, mla_key_block=2048, x=None)
  assert bench.parse_modes("moe_capacity_factor=1.0,dtype=bfloat16") == dict(
      moe_capacity_factor=1.0, dtype="bfloat16")
  assert bench._hbm_required("RESOURCE_EXHAUSTED: ... HLO temporaries (215.86G) exceeds "
                             "available HBM (94.75G).") == {"refused_temp_gib": 215.86}
  assert bench._hbm_required("RESOURCE_EXHAUSTED: Ran out of memory") == {}


def test_cache_bytes_per_request_from_the_shapes():
  """One request's decode cache: (kv_lora_rank + rope) numbers a token for every MLA layer
  (the MTP layer's included), KDA states and conv tails independent of the length."""
  from k3jax.config import preset
  cfg = preset("tiny", num_layers=4, mla_every=2)    # KDA, MLA, KDA, MLA + the MTP's MLA
  t = cfg.text
  a, b = (bench._cache_bytes_per_request(cfg, n) for n in (1000, 3000))
  width = (t.kv_lora_rank + t.qk_rope_head_dim) * 4           # fp32 cache
  assert a["mla_numbers_per_token_per_layer"] == t.kv_lora_rank + t.qk_rope_head_dim
  assert a["mla_cache_bytes_per_request"] == 3 * 1000 * width
  assert b["mla_cache_bytes_per_request"] == 3 * 3000 * width
  kda = t.kda_num_heads * t.kda_head_dim * t.kda_head_dim * 4
  assert a["kda_cache_bytes_per_request"] == b["kda_cache_bytes_per_request"] >= 2 * kda
  assert a["cache_bytes_per_request"] == sum(
      a[k] for k in ("mla_cache_bytes_per_request", "kda_cache_bytes_per_request",
                     "other_cache_bytes_per_request"))

