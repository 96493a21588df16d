"""Benchmark: `convert --check_only` on the full K3 release layout, headers only.

  python -m experiments.bench_check_only                  # table
  python -m experiments.bench_check_only --json --out /tmp/check_only.json

The layout is the released one as published — tests/tools/release_facts.py, typed by hand from
docs/k3.md §9/§11/§12, never k3jax's own tensor map (which is what the check tests): 497,220
entries in 96 safetensors shards, 1.561 TB, synthesised as header-only files made the right
size with `os.truncate` — sparse, so under 200 MB on disk. The check reads config.json, the
index and every shard's header (no tensor data). Reported: wall and CPU seconds of the
in-process `convert(src, None, check_only=True)` (the goal is ≤ 10 s) and of the CLI with its
interpreter start and imports. `tests/tools/test_check_only.py` uses the same synthesiser.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from experiments import results

SHARDS = 96
ROOT = pathlib.Path(__file__).resolve().parents[1]


def write_shard(path: pathlib.Path, entries) -> None:
  """A valid safetensors file of `entries` [(name, dtype, shape)] whose data is a hole."""
  from k3jax.convert.safetensors_io import header_bytes
  header = header_bytes(entries, {"format": "pt"})
  data = sum(math.prod(s) * d.itemsize for _, d, s in entries)
  with open(path, "wb") as f:
    f.write(header)
  os.truncate(path, len(header) + data)


def split_shards(plan, shards: int = SHARDS) -> dict[str, list]:
  """{file: entries} of `plan` [(name, dtype, shape)] split into `shards` files by bytes."""
  total = sum(math.prod(s) * dt.itemsize for _, dt, s in plan)
  out: dict[str, list] = {}
  done = 0
  for name, dt, shape in plan:
    k = done * shards // total
    out.setdefault(f"model-{k + 1:05d}-of-{shards:05d}.safetensors", []).append(
        (name, dt, shape))
    done += math.prod(shape) * dt.itemsize
  assert len(out) == shards
  return out


def write_layout(d: pathlib.Path, shards: dict[str, list], link_from=None) -> None:
  """Shards + index + k3 config.json in `d`; a shard whose entries equal those of
  `link_from` = (directory, {file: entries}) is a symlink to the file there."""
  from k3jax import hf_config
  from k3jax.config import preset
  from k3jax.convert.safetensors_io import INDEX_NAME
  d.mkdir(parents=True, exist_ok=True)
  for f, entries in shards.items():
    if link_from and link_from[1].get(f) == entries:
      os.symlink(link_from[0] / f, d / f)
    else:
      write_shard(d / f, entries)
  total = sum(math.prod(s) * dt.itemsize for e in shards.values() for _, dt, s in e)
  (d / INDEX_NAME).write_text(json.dumps({
      "metadata": {"total_size": total},
      "weight_map": {n: f for f, entries in shards.items() for n, _, _ in entries}}))
  (d / "config.json").write_text(json.dumps(hf_config.to_hf_config(preset("k3"), "kimi_k3",
                                                                    "mxfp4")))


def published_entries() -> list:
  """[(name, numpy dtype, shape)] of the release as published: the hand-typed facts of
  tests/tools/release_facts.py (loaded from its file: tests/ is not a package)."""
  from k3jax.convert.safetensors_io import DTYPES
  spec = importlib.util.spec_from_file_location(
      "release_facts", ROOT / "tests" / "tools" / "release_facts.py")
  facts = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(facts)
  return [(name, DTYPES[dtype], tuple(shape)) for name, shape, dtype in facts.entries()]


def release_layout(d: pathlib.Path) -> dict[str, list]:
  """Write the clean k3 release layout (`published_entries`) into `d`; returns its
  {file: entries}."""
  shards = split_shards(published_entries())
  write_layout(d, shards)
  return shards


def _cpu() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def main(argv):
  del argv
  from k3jax.convert import convert
  with tempfile.TemporaryDirectory() as tmp:
    d = pathlib.Path(tmp) / "k3"
    t0 = time.perf_counter()
    shards = release_layout(d)
    synth = time.perf_counter() - t0
    lines = []
    t0, c0 = time.perf_counter(), _cpu()
    convert(d, None, check_only=True, progress=False, log=lines.append)
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "tools.convert_from_pytorch", "--src", str(d),
                        "--check_only"], cwd=ROOT, capture_output=True, text=True)
    cli = time.perf_counter() - t0
    if r.returncode:
      raise SystemExit(f"check_only CLI failed on the clean layout:\n{r.stderr[-3000:]}")
  result = {
      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
      "load_average": os.getloadavg()[0],
      "entries": sum(len(e) for e in shards.values()), "shards": len(shards),
      "synthesise_s": round(synth, 2), "check_only_wall_s": round(wall, 2),
      "check_only_cpu_s": round(cpu, 2), "cli_wall_s": round(cli, 2), "goal_s": 10.0,
      "verdict": lines[-1]}
  print(f"{result['entries']} entries in {result['shards']} shards: check_only "
        f"{wall:.1f} s wall, {cpu:.1f} s CPU in-process; CLI {cli:.1f} s wall "
        f"(load {result['load_average']:.1f}; goal ≤ 10 s)")
  if flags.FLAGS.out:
    results.write_json(flags.FLAGS.out, result)
  if flags.FLAGS.json:
    print(json.dumps(result))


if __name__ == "__main__":
  flags.DEFINE_bool("json", False, "print one JSON object as the last line")
  flags.DEFINE_string("out", None, "also write the JSON object to this file")
  app.run(main)
