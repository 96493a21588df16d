"""experiments/bench_kda.py: its absl flags parse every documented command line with the same
meanings and defaults, and one tiny run goes end to end through `app.run` (a subprocess)."""

import json
import shlex
import subprocess
import sys

import pytest
from absl import flags

from cli_env import ROOT, cli_env
from experiments import bench_kda as bench



def _flags(args):
  """The benchmark's flags parsed from `args` (a fresh FlagValues: nothing global)."""
  fv = flags.FlagValues()
  bench.define_flags(fv)
  rest = fv(["bench_kda.py", *args])
  assert rest == ["bench_kda.py"], rest
  return fv


# Command lines of the module docstring, docs/results.md, docs/notes and experiments/gpu*_check.sh.
DOCUMENTED = [
    "--quick",
    "--json --out /tmp/bench_kda.json",
    "--sizes 4096x4x64,16384x8x128 --impls chunked",
    "--gpu_suite --json",
    "--sizes 4096x4x64 --impls chunked,recurrent --chunk_size 32",
    "--backend=pallas",
    "--gpu_suite --json --out /tmp/kda_gpu.json",
    "--json --out /tmp/bench_kda_full.json --repeats 1 --max_torch_tokens 4096",
    "--sizes 1024x4x64,1024x8x128,4096x4x64,16384x4x64 --impls "
    "chunked,recurrent,torch_chunk,fla_naive --max_torch_tokens 4096 --repeats 7 --json "
    "--out docs/results/bench_kda_cpu.json",
    "--sizes 1024x4x64,1024x8x128,4096x4x64 --impls chunked,torch_chunk,fla_naive "
    "--max_torch_tokens 4096 --repeats 7 --json --out docs/results/bench_kda_cpu_rerun.json",
    "--sizes 1024x4x64,4096x4x64,1024x8x128,16384x4x64 --impls chunked,recurrent --repeats 15 "
    "--json --out docs/results/bench_kda_fwd_cpu.json",
    "--sizes 1024x4x64 --impls chunked,pallas,recurrent --repeats 3 --json",
    "--gpu_suite --sizes 8192x96x128 --max_run_gib 60 --max_torch_tokens 40000 --json "
    "--out /tmp/bench_kda_8k.json",
    "--gpu_suite --sizes 32768x96x128 --max_run_gib 60 --max_torch_tokens 40000 --repeats 2",
    "--sizes 16384x4x64,16384x8x128 --impls chunked,recurrent,fla_naive --repeats 5",
    "--sizes 8192x16x128 --impls chunked,pallas --repeats 2",
    "--gpu_suite --roofline --sizes 8192x96x128 --max_run_gib 60 --max_torch_tokens 40000 "
    "--json --out /tmp/bench_kda_8k.json",
    "--malloc keep",
    "--malloc default --batch 2 --dtype bfloat16",
]


@pytest.mark.parametrize("line", DOCUMENTED)
def test_documented_command_lines_parse(line):
  _flags(shlex.split(line))


def test_flag_values_and_defaults():
  f = _flags([])
  assert (f.sizes, f.quick, f.gpu_suite, f.backend, f.impls, f.batch, f.chunk_size) == (
      None, False, False, "xla", "chunked,recurrent,torch_chunk,fla_naive", 1, 64)
  assert (f.dtype, f.repeats, f.max_run_gib, f.max_torch_tokens, f.json, f.out, f.malloc) == (
      None, 3, 4.0, 16384, False, None, "keep")
  f = _flags(shlex.split("--gpu_suite --sizes 8192x96x128 --max_run_gib 60 --out o.json"))
  assert (f.gpu_suite, bench._sizes(f), f.max_run_gib, f.out) == (
      True, [(8192, 96, 128)], 60.0, "o.json")
  for bad in (["--backend", "cuda"], ["--dtype", "float16"], ["--malloc", "off"],
              ["--repeats", "two"]):
    with pytest.raises(flags.IllegalFlagValueError):
      _flags(bad)


def test_forward_cost_model():
  """K3's shape, bf16: FLOPs 2·H·(2·K·V + C·(K+V)/2) per token; bytes q, k, v, beta, o in
  bf16 and g fp32 per token, plus the fp32 final state."""
  flops, nbytes = bench.kda_forward_cost(1, 8192, 96, 128, 128, 64, "bfloat16")
  assert flops == 2 * 8192 * 96 * (2 * 128 * 128 + 64 * 128)
  assert nbytes == 8192 * 96 * (2 * (3 * 128 + 1) + 4 * 128 + 2 * 128) + 96 * 128 * 128 * 4
  assert bench.kda_forward_cost(2, 8192, 96, 128, 128, 64, "float32")[0] == 2 * flops


def test_tiny_run_as_a_script(tmp_path):
  out = tmp_path / "r.json"
  r = subprocess.run(
      [sys.executable, "-m", "experiments.bench_kda", "--sizes", "128x2x16", "--impls",
       "chunked,recurrent", "--repeats", "1", "--roofline", "--json", "--out", str(out)],
      cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  result = json.loads(r.stdout.strip().splitlines()[-1])
  assert result == json.loads(out.read_text())
  assert [(row["impl"], row["T"], row["H"], row["K"]) for row in result["rows"]] == [
      ("chunked", 128, 2, 16), ("recurrent", 128, 2, 16)]
  assert result["rows"][1]["max_abs_err_vs_chunked"] < 1e-4
  # --roofline: the measured ceilings and each row's forward as a fraction of them (a fraction
  # of a measured ceiling is below 1 unless the cost model overcounts).
  ceil = result["ceilings"]
  assert ceil["matmul_flops_per_s"] > 1e8 and ceil["memory_bytes_per_s"] > 1e8
  for row in result["rows"]:
    assert 0 < row["fwd_flops_fraction"] < 1 and 0 < row["fwd_bytes_fraction"] < 1, row
