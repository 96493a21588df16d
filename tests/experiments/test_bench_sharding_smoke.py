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
