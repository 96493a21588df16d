"""Benchmark: convert a synthetic ~4.4 GiB Kimi-K3-layout checkpoint; throughput and peak memory.

  python -m experiments.bench_convert                 # table
  python -m experiments.bench_convert --json          # table, then ONE JSON object last
  python -m experiments.bench_convert --expert_format mxfp4   # experts kept packed
  python -m experiments.bench_convert --workers 1     # one converting process

The checkpoint has K3's structure (AttnRes, KDA with full-rank gates and bounded decay, gated
MLA, latent MoE with MXFP4 experts, fp32 vectors, A_log padded to 128, `language_model.` prefix,
sharded safetensors + index) at a reduced size: d=2048, 13 layers (4 unrolled, 2 scanned groups,
1 suffix), 160 experts of width 1024, vocab 65536 — about 4.4 GiB in bf16/MXFP4 (2/3 of it
MXFP4 experts). Tensor values
are slices of 64 MiB random pools at random offsets (values do not matter; generation must be
cheap; repeats are longer than a compressor's window).

The conversion runs in a child process (what `tools/convert_from_pytorch.py` does, with its
worker processes); the parent samples /proc for the child and its workers (RSS summed over the
process tree, split into anonymous and file-backed pages) and reads the largest single
process's peak RSS (ru_maxrss) at exit. Goal: peak RSS ≤ 2 × largest tensor + 1 GiB. Before converting it
reads every source file once (`read_rate`) as the reference throughput of the same run.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

import ml_dtypes
import numpy as np

FLAGS = flags.FLAGS
flags.DEFINE_bool("json", False, "print one JSON object as the last line")
flags.DEFINE_string("workdir", None, "where to write the synthetic checkpoint (default: a temp dir)")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "converter --dtype")
flags.DEFINE_integer("d_model", 2048, "hidden size of the synthetic config")
flags.DEFINE_integer("num_experts", 160, "routed experts per MoE layer")
flags.DEFINE_integer("workers", 2, "converter --workers (processes converting at once)")
flags.DEFINE_bool("keep", False, "keep the synthetic checkpoint and the output")
flags.DEFINE_enum("expert_format", "bf16", ["bf16", "mxfp4"],
                  "converter target for routed experts (mxfp4: kept packed; needs a model that "
                  "builds ModelConfig.modes.expert_format='mxfp4')")

GiB = 1 << 30


def bench_config(d: int, experts: int):
  from k3jax.config import preset
  return preset(
      "k3", d_model=d, num_layers=13, kda_num_heads=d // 128,
      num_heads=d // 128, q_lora_rank=d // 4, kv_lora_rank=256, dense_intermediate_size=4 * d,
      num_experts=experts, experts_per_token=8, num_shared_experts=2, moe_intermediate_size=d // 2,
      latent_moe_dim=d // 2, attn_res_block_size=4, vocab_size=65536, num_mtp_layers=0,
      vision=None, media_placeholder_token_id=None)


def write_synthetic(directory: pathlib.Path, config) -> dict:
  """Write the K3-layout checkpoint of `config` with tiled random values. Returns sizes."""
  from k3jax import hf_config
  from k3jax.convert import names as N
  from k3jax.convert.safetensors_io import ShardedWriter
  rng = np.random.default_rng(0)
  # 64 MiB pools read at random offsets: cheap to produce, and no shorter repeats than a
  # compressor's window, so the output is not unrealistically compressible.
  pool_f = (rng.normal(size=16 << 20) * 0.02).astype(np.float32)
  pool_u8 = rng.integers(0, 256, size=64 << 20, dtype=np.uint8)

  def take(pool, n):
    if n >= pool.size:
      return np.resize(pool, n)
    o = int(rng.integers(0, pool.size - n))
    return pool[o:o + n]

  plan, kinds = [], {}
  for leaf in N.leaves(config, "kimi_k3"):
    for slot in leaf.slots:
      for k, (name, shape, kind) in enumerate(zip(slot.names, slot.shapes, slot.dtypes)):
        dt = np.uint8 if kind == "uint8" else (np.float32 if leaf.fp32 else ml_dtypes.bfloat16)
        plan.append((name, dt, shape))
        kinds[name] = (leaf.kind, k)
  plan.sort(key=lambda e: [int(t) if t.isdigit() else t for t in
                           __import__("re").split(r"(\d+)", e[0])])
  directory.mkdir(parents=True)
  w = ShardedWriter(directory, plan, max_shard_bytes=GiB)
  largest = 0
  for name, dt, shape in plan:
    n = math.prod(shape)
    if np.dtype(dt) == np.uint8:
      if kinds[name][1] == 1:   # E8M0 scales: 2^(120..123-127), values of a sane magnitude
        a = (120 + take(pool_u8, n) % 4).astype(np.uint8)
      else:
        a = take(pool_u8, n)
    elif kinds[name][0] == "a_log_pad":
      a = np.zeros(n, np.float32)
      a[:config.text.kda_num_heads] = np.log(np.linspace(1, 16, config.text.kda_num_heads))
    else:
      a = take(pool_f, n).astype(dt)
    a = a.reshape(shape)
    largest = max(largest, a.nbytes)
    w.write(name, a)
    del a
  w.close()
  (directory / "config.json").write_text(
      json.dumps(hf_config.to_hf_config(config, "kimi_k3"), indent=2))
  return {"bytes": w.total_bytes, "tensors": len(plan), "largest_tensor_bytes": largest,
          "shards": len(w.files)}


def _status(pid: int) -> dict:
  out = {}
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon", "RssFile"):
          out[k] = int(v.split()[0]) * 1024
  except OSError:
    pass
  return out


def _tree(pid: int) -> list[int]:
  """`pid` and all its descendants (from /proc/*/task/*/children)."""
  out, todo = [], [pid]
  while todo:
    p = todo.pop()
    out.append(p)
    try:
      for t in os.listdir(f"/proc/{p}/task"):
        with open(f"/proc/{p}/task/{t}/children") as f:
          todo.extend(int(c) for c in f.read().split())
    except OSError:
      pass
  return out


def _tree_status(pid: int) -> dict:
  """RSS of `pid` and its descendants, summed."""
  total = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
  for p in _tree(pid):
    for k, v in _status(p).items():
      total[k] += v
  return total


_CHILD = """
import sys
from k3jax.convert import convert
def log(msg):
  print(msg, file=sys.stderr)
kw = {"expert_format": "mxfp4"} if sys.argv[4] == "mxfp4" else {}
convert(sys.argv[1], sys.argv[2], dtype=sys.argv[3], progress=False, log=log,
        workers=int(sys.argv[5]), **kw)
"""


def read_rate(src: pathlib.Path) -> float:
  """Bytes per second of reading every source file once with 64 MiB reads, measured in the
  same run just before the conversion (the files were just written, so mostly from the page
  cache: the ceiling for a converter that reads each byte once)."""
  buf = bytearray(64 << 20)
  total, t0 = 0, time.perf_counter()
  for p in sorted(src.glob("*.safetensors")):
    with open(p, "rb", buffering=0) as f:
      while n := f.readinto(buf):
        total += n
  return total / (time.perf_counter() - t0)


def run_convert(src: pathlib.Path, dst: pathlib.Path, dtype: str,
                expert_format: str = "bf16", workers: int = 1) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  t0 = time.perf_counter()
  with tempfile.TemporaryFile("w+") as err:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(src), str(dst), dtype,
                             expert_format, str(workers)], env=env, stderr=err)
    peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    while True:
      pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
      if pid:
        break
      for k, v in _tree_status(proc.pid).items():
        peak[k] = max(peak[k], v)
      time.sleep(0.05)
    seconds = time.perf_counter() - t0
    err.seek(0)
    log = err.read()
  if os.waitstatus_to_exitcode(status) != 0:
    print(log[-4000:], file=sys.stderr)
    raise RuntimeError(f"conversion failed with exit status {os.waitstatus_to_exitcode(status)}")
  return {"seconds": seconds, "peak_rss_bytes": usage.ru_maxrss * 1024,
          "peak_rss_tree_bytes_sampled": peak["VmRSS"],
          "peak_rss_anon_bytes_sampled": peak["RssAnon"],
          "peak_rss_file_bytes_sampled": peak["RssFile"],
          "cpu_seconds": usage.ru_utime + usage.ru_stime}


def _du(p: pathlib.Path) -> int:
  return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def main(argv):
  del argv
  config = bench_config(FLAGS.d_model, FLAGS.num_experts)
  root = pathlib.Path(FLAGS.workdir or tempfile.mkdtemp(prefix="bench_convert_"))
  src, dst = root / "src", root / "dst"
  try:
    t0 = time.perf_counter()
    info = write_synthetic(src, config)
    gen_s = time.perf_counter() - t0
    read_bps = read_rate(src)
    res = run_convert(src, dst, FLAGS.dtype, FLAGS.expert_format, FLAGS.workers)
    out_bytes = _du(dst)
  finally:
    if not FLAGS.keep:
      shutil.rmtree(root, ignore_errors=True)
  largest = info["largest_tensor_bytes"]
  goal = 2 * largest + GiB
  peak = max(res["peak_rss_bytes"], res["peak_rss_tree_bytes_sampled"])
  mbps = info["bytes"] / res["seconds"] / 1e6
  load = os.getloadavg()[0]
  rows = [
      ("source checkpoint", f"{info['bytes'] / GiB:.2f} GiB, {info['tensors']} tensors, "
                            f"{info['shards']} shards (generated in {gen_s:.1f} s)"),
      ("largest tensor", f"{largest / 2**20:.0f} MiB"),
      ("output (orbax)", f"{out_bytes / GiB:.2f} GiB ({FLAGS.dtype} matmul weights)"),
      ("conversion time", f"{res['seconds']:.1f} s wall, {res['cpu_seconds']:.1f} s CPU "
                          f"({FLAGS.workers} worker(s))"),
      ("throughput", f"{mbps:.1f} MB/s of source (experts: {FLAGS.expert_format})"),
      ("source read rate", f"{read_bps / 1e6:.0f} MB/s (64 MiB reads, same run)"),
      ("peak RSS, one process", f"{res['peak_rss_bytes'] / GiB:.2f} GiB (ru_maxrss)"),
      ("peak RSS, all processes", f"{res['peak_rss_tree_bytes_sampled'] / GiB:.2f} GiB "
                                  "(sampled every 50 ms, summed)"),
      ("  sampled anon / file, all", f"{res['peak_rss_anon_bytes_sampled'] / GiB:.2f} / "
                                f"{res['peak_rss_file_bytes_sampled'] / GiB:.2f} GiB"),
      ("goal 2×largest + 1 GiB", f"{goal / GiB:.2f} GiB -> "
                                 f"{'met' if peak <= goal else 'NOT met'}"),
      ("load average (1 min)", f"{load:.1f}"),
  ]
  w = max(len(r[0]) for r in rows)
  for k, v in rows:
    print(f"{k:<{w}}  {v}")
  if FLAGS.json:
    print(json.dumps({"source_bytes": info["bytes"], "tensors": info["tensors"],
                      "largest_tensor_bytes": largest, "output_bytes": out_bytes,
                      "dtype": FLAGS.dtype, "expert_format": FLAGS.expert_format,
                      "workers": FLAGS.workers, **res, "mb_per_s": mbps,
                      "read_mb_per_s": read_bps / 1e6, "goal_bytes": goal,
                      "goal_met": peak <= goal, "loadavg_1min": load, "date": time.strftime(
                          "%Y-%m-%d %H:%M UTC", time.gmtime())}))


if __name__ == "__main__":
  app.run(main)
