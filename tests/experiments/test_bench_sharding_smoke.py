"""experiments/bench_sharding.py: flag parsing (the documented command lines), the layout
table, the message when the optional libtpu is missing, the per-device state of each recipe,
and the memory part's compile path (the trainer's step from `k3jax.train.sharded.build_step`,
lowered from abstract values) for a 2-layer tiny model on the 8 simulated CPU devices. The
deviceless TPU compile itself needs the `tpu_aot` extra; docs/notes/sharding.md has the manual
check."""

import importlib.util
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
                        layout=dict(data=1, fsdp=2, expert=4))
  assert len(calls) == 1 and dict(calls[0].shape)["expert"] == 4
  assert r["layout"] == dict(data=1, fsdp=2, expert=4, context=1, tensor=1)
  assert r["global_batch"] == 8 and r["num_layers"] == 2
  assert r["state_gib_total"] / 8 <= r["state_gib_per_device"] < r["state_gib_total"]
  assert r["argument_bytes"] > 0 and r["temp_bytes"] > 0 and r["peak_gib"] > 0

