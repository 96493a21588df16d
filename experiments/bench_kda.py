"""Benchmark of the KDA ops: kda_chunked vs kda_recurrent (and PyTorch references in-process).

For each size (T, H, K=V; B=1 unless --batch) and implementation it measures forward tokens/s,
forward+backward tokens/s (gradient of a random projection of o and of the final state w.r.t.
q, k, v, g, beta) and, for the JAX functions, the compiled temporary memory
(`jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes`). Every implementation's
output is compared with kda_chunked's (max abs error), so the figures are for matching maths.

PyTorch references (run when torch imports): `chunk_kimi_delta_attention` from transformers'
kimi_linear (its CPU fallback), and flash-linear-attention's `naive_chunk_kda` / `chunk_kda`
when the `fla` package is installed. Torch autograd gives their backward.

Usage:
  .venv/bin/python experiments/bench_kda.py --quick
  .venv/bin/python experiments/bench_kda.py --json --out /tmp/bench_kda.json
  .venv/bin/python experiments/bench_kda.py --sizes 4096x4x64,16384x8x128 --impls chunked
  .venv/bin/python experiments/bench_kda.py --impls chunked,chunked_packed   # packing's cost
  .venv/bin/python experiments/bench_kda.py --gpu_suite --json        # on an accelerator
  .venv/bin/python experiments/bench_kda.py --gpu_suite --roofline    # + shares of the ceilings
  --backend=pallas swaps kda_chunked for pallas_kernels.kda_chunk.kda_chunked_pallas.

The last line printed with --json is one JSON object with every row and the goal ratios.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys

import numpy as np
from absl import app, flags

SIZES_CPU = ("1024x4x64", "4096x4x64", "16384x4x64", "1024x8x128", "4096x8x128", "16384x8x128")
SIZES_QUICK = ("1024x4x64",)
SIZES_GPU = ("8192x96x128", "32768x96x128")


DEFAULT_IMPLS = "chunked,recurrent,torch_chunk,fla_naive"


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Registers the benchmark's flags on `flag_values`.

  Called when the file runs as a script (tests call it with their own FlagValues): importing
  the module registers nothing, so it can share a process with other entry points that also
  define --json, --out or --dtype.
  """
  fv = dict(flag_values=flag_values)
  flags.DEFINE_string("sizes", None, "comma-separated TxHxK (K=V), e.g. 1024x4x64,16384x8x128 "
                      "(default: the CPU set)", **fv)
  flags.DEFINE_bool("quick", False, "smallest size only (< 1 min)", **fv)
  flags.DEFINE_bool("gpu_suite", False, "B=1,H=96,K=V=128,T in {8K,32K}, bf16 inputs: xla vs "
                    "pallas vs fla chunk_kda", **fv)
  flags.DEFINE_enum("backend", "xla", ["xla", "pallas"],
                    "implementation behind the 'chunked' rows", **fv)
  flags.DEFINE_string("impls", DEFAULT_IMPLS, "subset of chunked,recurrent,torch_chunk,"
                      "fla_naive,fla_chunk,pallas,chunked_packed", **fv)
  flags.DEFINE_integer("batch", 1, "batch size B", **fv)
  flags.DEFINE_integer("doc_len", 1000, "document length of the chunked_packed impl (T cut "
                       "into documents of this many tokens, boundaries mid-tile)", **fv)
  flags.DEFINE_integer("chunk_size", 64, "chunk size of the chunked forms", **fv)
  flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                    "input dtype (default float32; bfloat16 in --gpu_suite)", **fv)
  flags.DEFINE_integer("repeats", 3, "timed runs (the median is reported)", **fv)
  flags.DEFINE_float("max_run_gib", 4.0, "only report memory (do not run) when a JAX program "
                     "needs more temp memory", **fv)
  flags.DEFINE_integer("max_torch_tokens", 16384,
                       "skip the PyTorch references above this T (they are slow)", **fv)
  flags.DEFINE_bool("roofline", False, "also measure the device's matmul rate (in --dtype) and "
                    "memory bandwidth, and report each JAX row's forward FLOPs and bytes over "
                    "its time as fractions of them", **fv)
  flags.DEFINE_bool("json", False, "print one JSON object as the last line", **fv)
  flags.DEFINE_string("out", None, "also write the JSON object to this path", **fv)
  flags.DEFINE_enum("malloc", "keep", ["keep", "default"],
                    "keep: one glibc malloc arena that keeps its pages "
                    "(k3jax.runtime.keep_cpu_allocations; applies to the torch references in "
                    "the same process too); default: glibc's defaults", **fv)


def _sizes(args):
  if args.sizes:
    names = [s for s in args.sizes.split(",") if s]
  elif args.gpu_suite:
    names = list(SIZES_GPU)
  elif args.quick:
    names = list(SIZES_QUICK)
  else:
    names = list(SIZES_CPU)
  out = []
  for name in names:
    try:
      t, h, d = (int(x) for x in name.lower().split("x"))
    except ValueError:
      raise SystemExit(f"--sizes: expected entries like 4096x4x64 (TxHxK), found {name!r}")
    out.append((t, h, d))
  return out


# ----------------------------------------------------------------------------- inputs


def _inputs(b, t, h, d, seed=0):
  """Random KDA inputs (numpy fp32): L2-normalised q,k, bounded-gate g, sigmoid beta."""
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
  q = unit(rng.standard_normal((b, t, h, d))).astype(np.float32)
  k = unit(rng.standard_normal((b, t, h, d))).astype(np.float32)
  v = rng.standard_normal((b, t, h, d)).astype(np.float32)
  x = rng.standard_normal((b, t, h, d)) - 3.0
  g = (-5.0 / (1.0 + np.exp(-x))).astype(np.float32)  # bounded gate, g in (-5, 0)
  beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h))))).astype(np.float32)
  do = rng.standard_normal((b, t, h, d)).astype(np.float32)
  ds = rng.standard_normal((b, h, d, d)).astype(np.float32)
  return dict(q=q, k=k, v=v, g=g, beta=beta, do=do, ds=ds)


# ----------------------------------------------------------------------------- JAX


def _jax_impl(name, backend, chunk_size, doc_len=None):
  from k3jax.ops import kda
  if name == "recurrent":
    return kda.kda_recurrent
  if name == "pallas" or (name == "chunked" and backend == "pallas"):
    try:
      mod = importlib.import_module("pallas_kernels.kda_chunk")
      fn = mod.kda_chunked_pallas
    except (ImportError, AttributeError) as e:
      raise SystemExit(
          "--backend=pallas: pallas_kernels.kda_chunk.kda_chunked_pallas is not available "
          f"({type(e).__name__}: {e}); use --backend=xla")
    return lambda *a, **kw: fn(*a, chunk_size=chunk_size, **kw)
  # The inputs come from the bounded gate (g > −5), and the K3 layer passes that bound too.
  if name == "chunked_packed":   # documents of doc_len tokens, as packed training rows hold
    import jax.numpy as jnp

    def packed(q, *a, **kw):
      seg = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32) // doc_len, q.shape[:2])
      return kda.kda_chunked(q, *a, chunk_size=chunk_size, lower_bound=-5.0, segment_ids=seg,
                             **kw)
    return packed
  return lambda *a, **kw: kda.kda_chunked(*a, chunk_size=chunk_size, lower_bound=-5.0, **kw)


def _bench_jax(fn, data, dtype, args):
  import jax
  import jax.numpy as jnp
  from experiments import timing

  cast = lambda x: jnp.asarray(x, dtype)
  xs = tuple(cast(data[n]) for n in ("q", "k", "v")) + (
      jnp.asarray(data["g"]), cast(data["beta"]))
  do, ds = jnp.asarray(data["do"]), jnp.asarray(data["ds"])

  def fwd(q, k, v, g, beta):
    return fn(q, k, v, g, beta)

  def loss(q, k, v, g, beta):
    o, s = fn(q, k, v, g, beta)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(s * ds)

  fwdbwd = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
  row = {}
  compiled = {}
  for key, f in (("fwd", fwd), ("fwdbwd", fwdbwd)):
    c = jax.jit(f).lower(*xs).compile()
    mem = c.memory_analysis()
    row[f"{key}_temp_bytes"] = int(mem.temp_size_in_bytes) if mem is not None else None
    compiled[key] = c
  limit = args.max_run_gib * 2**30
  for key in ("fwd", "fwdbwd"):
    temp = row[f"{key}_temp_bytes"]
    if temp is not None and temp > limit:
      row[f"{key}_s"] = None
      row[f"{key}_skipped"] = f"temp {temp / 2**30:.1f} GiB > --max_run_gib"
      continue
    row[f"{key}_s"] = timing.median_seconds(lambda: compiled[key](*xs), args.repeats)
  out = None
  if row.get("fwd_s") is not None:
    o, _ = compiled["fwd"](*xs)
    out = np.asarray(o, np.float32)
  return row, out


def kda_forward_cost(b, t, h, dk, dv, chunk, dtype):
  """(FLOPs, bytes) of one chunked KDA forward. FLOPs: the model of `k3jax.train.metrics`
  (per token and head 2·dk·dv multiply-adds for the state read q·S and update kᵀv, and
  C·(dk + dv)/2 for the intra-chunk products), ×2 per multiply-add. Bytes: the least any
  implementation moves: q, k, v, beta in `dtype` and g in fp32 read once, o in `dtype` and the
  fp32 final state written once."""
  import jax.numpy as jnp
  isz = jnp.dtype(dtype).itemsize
  flops = 2.0 * b * t * h * (2 * dk * dv + chunk * (dk + dv) / 2)
  per_token = h * (isz * (2 * dk + dv + 1) + 4 * dk + isz * dv)
  return flops, float(b * t * per_token + b * h * dk * dv * 4)


def device_ceilings(dtype, repeats=5):
  """{matmul_flops_per_s, memory_bytes_per_s} of the default device, measured now: the best
  jitted square matmul in `dtype` (1024² on a CPU, 8192² elsewhere: `metrics.matmul_peak`) and
  the best jitted `x + 1` over a 1 GiB fp32 array (64 MiB on a CPU), which reads and writes
  every byte once."""
  import jax
  import jax.numpy as jnp
  from experiments import timing
  from k3jax.train import metrics
  cpu = jax.default_backend() == "cpu"
  peak = metrics.matmul_peak(repeats=repeats, dtype=jnp.dtype(dtype))
  x = jnp.zeros(((16 if cpu else 256) * 2**20,), jnp.float32)
  f = jax.jit(lambda a: a + 1.0)
  best = min(timing.round_robin({"add": lambda: f(x)}, repeats)["add"])
  return dict(matmul_flops_per_s=peak, memory_bytes_per_s=2.0 * x.nbytes / best)


# ----------------------------------------------------------------------------- PyTorch


def _torch_impl(name):
  """Returns (callable(q,k,v,g,beta) -> (o, state), why-unavailable)."""
  try:
    import torch  # noqa: F401
  except ImportError as e:
    return None, f"torch not importable ({e})"
  if name == "torch_chunk":
    try:
      from transformers.models.kimi_linear import modeling_kimi_linear as mkl
    except Exception as e:  # pylint: disable=broad-except
      return None, f"transformers kimi_linear not importable ({type(e).__name__}: {e})"
    fn = mkl.chunk_kimi_delta_attention
    return (lambda q, k, v, g, beta: fn(q, k, v, g, beta, chunk_size=64,
                                        output_final_state=True)), None
  if name in ("fla_naive", "fla_chunk"):
    try:
      if name == "fla_naive":
        fn = _load_fla_naive().naive_chunk_kda
      else:
        mod = importlib.import_module("fla.ops.kda")
        fn = mod.chunk_kda
    except Exception as e:  # pylint: disable=broad-except
      return None, f"flash-linear-attention (fla) not installed ({type(e).__name__})"
    return (lambda q, k, v, g, beta: fn(q, k, v, g, beta, output_final_state=True)), None
  return None, f"unknown torch implementation {name!r}"


def _load_fla_naive():
  """fla.ops.kda.naive, by path when the package's __init__ needs triton (CPU-only machines).

  naive.py imports only torch and einops; fla's __init__ imports every Triton kernel.
  """
  try:
    return importlib.import_module("fla.ops.kda.naive")
  except ImportError:
    spec = importlib.util.find_spec("fla")  # locates the package without running __init__
    if spec is None or not spec.submodule_search_locations:
      raise
    path = os.path.join(spec.submodule_search_locations[0], "ops", "kda", "naive.py")
    file_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    mod = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(mod)
    return mod


def _bench_torch(fn, data, dtype, args, device="cpu"):
  import torch
  from experiments import timing

  tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
  mk = lambda n, dt=tdt: torch.tensor(data[n], device=device, dtype=dt)
  do, ds = mk("do", torch.float32), mk("ds", torch.float32)
  sync = (lambda: torch.cuda.synchronize()) if device == "cuda" else (lambda: None)

  def fwd():
    with torch.no_grad():
      out = fn(mk("q"), mk("k"), mk("v"), mk("g", torch.float32), mk("beta"))
    sync()
    return out

  def fwdbwd():
    leaves = [mk("q"), mk("k"), mk("v"), mk("g", torch.float32), mk("beta")]
    for x in leaves:
      x.requires_grad_(True)
    o, s = fn(*leaves)
    loss = (o.float() * do).sum() + (s.float() * ds).sum()
    loss.backward()
    sync()

  row = {"fwd_temp_bytes": None, "fwdbwd_temp_bytes": None}
  row["fwd_s"] = timing.median_seconds(fwd, args.repeats)
  row["fwdbwd_s"] = timing.median_seconds(fwdbwd, args.repeats)
  o, _ = fwd()
  return row, o.float().cpu().numpy()


# ----------------------------------------------------------------------------- driver


def _fmt_rate(tokens, secs):
  return "-" if secs is None else f"{tokens / secs:,.0f}"


def _fmt_mib(b):
  return "-" if b is None else f"{b / 2**20:,.1f}"


def run(args):
  import jax

  dtype = args.dtype or ("bfloat16" if args.gpu_suite else "float32")
  impls = [s for s in args.impls.split(",") if s]
  if args.gpu_suite and args.impls == DEFAULT_IMPLS:
    impls = ["chunked", "pallas", "fla_chunk"]
  device = jax.default_backend()
  rows, unavailable = [], {}
  ceilings = device_ceilings(dtype) if args.roofline else None
  if ceilings:
    print(f"  ceilings: matmul {ceilings['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({dtype}), "
          f"memory {ceilings['memory_bytes_per_s'] / 1e9:.0f} GB/s", flush=True)
  for t, h, d in _sizes(args):
    data = _inputs(args.batch, t, h, d)
    ref_out = None
    for name in impls:
      row = dict(impl=name, T=t, H=h, K=d, V=d, B=args.batch, dtype=dtype,
                 backend=(args.backend if name == "chunked" else None))
      if name in ("chunked", "recurrent", "pallas", "chunked_packed"):
        try:
          fn = _jax_impl(name, args.backend, args.chunk_size, args.doc_len)
        except SystemExit as e:
          if name == "chunked":
            raise
          unavailable[name] = str(e)
          continue
        r, out = _bench_jax(fn, data, dtype, args)
      else:
        if t > args.max_torch_tokens:
          continue
        fn, why = _torch_impl(name)
        if fn is None:
          unavailable[name] = why
          continue
        r, out = _bench_torch(fn, data, dtype, args, "cuda" if device == "gpu" else "cpu")
      row.update(r)
      tokens = args.batch * t
      for key in ("fwd", "fwdbwd"):
        s = row.get(f"{key}_s")
        row[f"{key}_tokens_per_s"] = None if s is None else tokens / s
      if ceilings and row.get("fwd_s") and name in ("chunked", "pallas", "recurrent"):
        flops, nbytes = kda_forward_cost(args.batch, t, h, d, d, args.chunk_size, dtype)
        row["fwd_flops_fraction"] = flops / row["fwd_s"] / ceilings["matmul_flops_per_s"]
        row["fwd_bytes_fraction"] = nbytes / row["fwd_s"] / ceilings["memory_bytes_per_s"]
      if name == "chunked" and out is not None:
        ref_out = out
      if out is not None and ref_out is not None and name != "chunked_packed":
        row["max_abs_err_vs_chunked"] = float(np.max(np.abs(out - ref_out)))
      rows.append(row)
      print(f"  {name:12s} T={t:6d} H={h:3d} K={d:4d}  fwd {_fmt_rate(tokens, row.get('fwd_s')):>12s}"
            f" tok/s  fwd+bwd {_fmt_rate(tokens, row.get('fwdbwd_s')):>12s} tok/s", flush=True)
  return dict(device=device, dtype=dtype, chunk_size=args.chunk_size, backend=args.backend,
              jax_version=jax.__version__, cpu_count=os.cpu_count(), rows=rows,
              unavailable=unavailable, goals=_goals(rows), ceilings=ceilings)


def _goals(rows):
  """The three goal ratios per size (None where a figure is missing): fwd+bwd tokens/s vs the
  fastest PyTorch reference (goal ≥ 10), fwd+bwd temp memory vs the scan (≤ 1/8 at 16K) and
  forward tokens/s vs the scan (≥ 0.5)."""
  by = {}
  for r in rows:
    by.setdefault((r["T"], r["H"], r["K"]), {})[r["impl"]] = r
  goals = []
  for (t, h, d), impls in sorted(by.items()):
    c, rec = impls.get("chunked"), impls.get("recurrent")
    torch_rates = [impls[n]["fwdbwd_tokens_per_s"] for n in ("torch_chunk", "fla_naive")
                   if n in impls and impls[n].get("fwdbwd_tokens_per_s")]
    ratio = lambda a, b: (a / b) if (a is not None and b) else None
    goal = dict(T=t, H=h, K=d)
    if c is not None:
      goal["fwdbwd_vs_fastest_torch"] = ratio(
          c.get("fwdbwd_tokens_per_s"), max(torch_rates) if torch_rates else None)
      if rec is not None:
        goal["fwdbwd_mem_vs_recurrent"] = ratio(c.get("fwdbwd_temp_bytes"),
                                                rec.get("fwdbwd_temp_bytes"))
        goal["fwd_speed_vs_recurrent"] = ratio(c.get("fwd_tokens_per_s"),
                                               rec.get("fwd_tokens_per_s"))
    goals.append(goal)
  return goals


def _print_table(result):
  print(f"\ndevice={result['device']} dtype={result['dtype']} chunk_size={result['chunk_size']} "
        f"backend={result['backend']} jax={result['jax_version']}")
  head = (f"{'impl':12s} {'T':>6s} {'H':>3s} {'K':>4s} {'fwd tok/s':>12s} {'f+b tok/s':>12s} "
          f"{'fwd MiB':>9s} {'f+b MiB':>9s} {'err':>8s}")
  print(head)
  print("-" * len(head))
  for r in result["rows"]:
    tokens = r["B"] * r["T"]
    err = r.get("max_abs_err_vs_chunked")
    print(f"{r['impl']:12s} {r['T']:6d} {r['H']:3d} {r['K']:4d} "
          f"{_fmt_rate(tokens, r.get('fwd_s')):>12s} {_fmt_rate(tokens, r.get('fwdbwd_s')):>12s} "
          f"{_fmt_mib(r.get('fwd_temp_bytes')):>9s} {_fmt_mib(r.get('fwdbwd_temp_bytes')):>9s} "
          f"{'-' if err is None else f'{err:.1e}':>8s}")
  for name, why in result["unavailable"].items():
    print(f"unavailable: {name}: {why}")
  for r in result["rows"]:
    if "fwd_flops_fraction" in r:
      print(f"roofline {r['impl']} T={r['T']} H={r['H']} K={r['K']}: forward at "
            f"{100 * r['fwd_flops_fraction']:.1f}% of the matmul rate, "
            f"{100 * r['fwd_bytes_fraction']:.1f}% of the memory bandwidth")
  print("\ngoals (chunked): fwd+bwd speed / fastest torch (>= 10), fwd+bwd memory / recurrent "
        "(<= 1/8 at 16K), fwd speed / recurrent (>= 0.5)")
  f = lambda x: "-" if x is None else f"{x:.3g}"
  for g in result["goals"]:
    print(f"  T={g['T']:6d} H={g['H']:3d} K={g['K']:4d}: "
          f"{f(g.get('fwdbwd_vs_fastest_torch')):>7s}  {f(g.get('fwdbwd_mem_vs_recurrent')):>7s}  "
          f"{f(g.get('fwd_speed_vs_recurrent')):>7s}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  args = flags.FLAGS
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  malloc = "default"
  if args.malloc == "keep":
    from k3jax.runtime import keep_cpu_allocations
    malloc = "keep" if keep_cpu_allocations() else "default (mallopt unavailable)"
  result = run(args)
  result["malloc"] = malloc
  _print_table(result)
  print(f"malloc: {malloc}")
  if args.out:
    from experiments import results
    results.write_json(args.out, result)
  if args.json:
    print(json.dumps(result))


if __name__ == "__main__":
  define_flags()
  app.run(main)
