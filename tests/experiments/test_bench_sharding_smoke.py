"""experiments/bench_sharding.py: argument parsing, the layout table and the message when the
optional libtpu is missing. Cheap: nothing here compiles a model (the deviceless TPU compile
itself needs the `tpu_aot` extra; docs/notes/sharding.md has the manual check)."""

import importlib.util

import pytest

from experiments import bench_sharding as bench


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


def test_missing_libtpu_is_a_clear_error(monkeypatch, capsys):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "libtpu" else real(name, *a))
  with pytest.raises(SystemExit) as e:
    bench.main(["--part", "memory", "--devices", "256"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "libtpu" in err and "[tpu_aot]" in err and "--target cpu" in err
  with pytest.raises(SystemExit, match=r"tpu_aot"):
    bench.tpu_devices("v5p:2x2x1", 4)


def test_layout_needs_devices():
  with pytest.raises(SystemExit):
    bench.main(["--part", "memory", "--target", "cpu", "--layout", "fsdp=2"])


def test_state_part_follows_each_recipe(capsys):
  """`--part state` (shardings only, no compile) applies each device count's recipe: 256 devices
  store kernels and first moments in bf16 and Muon's momentum in host memory, 2048 keep fp32
  on the device."""
  import json
  bench.main(["--part", "state", "--devices", "256"])
  bench.main(["--part", "state", "--devices", "2048"])
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
