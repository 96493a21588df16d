"""Benchmark: MoE experts forward+backward vs a dense SiTU MLP with the same active FLOPs.

  python -m experiments.bench_moe            # table
  python -m experiments.bench_moe --json     # table, then ONE JSON object as the last line

Shapes default to the `small` preset's routed path: tokens N = batch·seq = 8·512, expert input
D = ℓ = 256 (d = 512), expert hidden F = 256, E = 64 experts, k = 8. The dense reference is a
SiTU MLP D → k·F → D on the same N tokens (the active FLOPs of the routed experts). Methods of
`k3jax.ops.moe.expert_mlp`: sort (dropless tiles), sort@CF (capacity buffer, factor CF),
ragged (`jax.lax.ragged_dot`), reference (all experts on all tokens: E/k times the FLOPs),
gmm (Pallas; skipped in interpret mode on CPU); and "gather" (here only: each token's k expert
matrices gathered, w[indices] [N, k, D, F], and contracted per token — the naive gather-based
layout, checked against the reference before timing).
Also: `jax.lax.ragged_dot` vs a dense matmul of the same FLOPs; QAT's cost (`bench_qat`: the
sorted path with MXFP4 weights and MXFP8 inputs fake-quantised, and the quantisers alone,
direct `mx.fake_round` vs the codec round trip it equals); and the whole StableLatentMoE
layer (`small` config, router + shared experts + latent projections) when it exists.
In fp32 unless `--dtype=bfloat16` (inputs and weights of the expert and dense MLPs; the
ragged_dot and QAT rows stay fp32); `--noextras` skips the ragged_dot and QAT rows (the GPU
check's shape: `--tokens 16384 --dim 2048 --ffn 2048 --dtype bfloat16`). One
process; time = min over repeats (the machine may be shared: the load average is printed and
stored, and ratios are the figures to compare).
"""

from __future__ import annotations

import functools
import json
import os

from absl import app, flags

import jax
import jax.numpy as jnp
import numpy as np

from experiments import results, timing
from k3jax.ops import moe

FLAGS = flags.FLAGS
flags.DEFINE_bool("json", False, "print one JSON object as the last line")
flags.DEFINE_integer("tokens", 8 * 512, "N tokens (batch × sequence)")
flags.DEFINE_integer("dim", 256, "expert input width D (the latent ℓ)")
flags.DEFINE_integer("ffn", 256, "expert hidden width F")
flags.DEFINE_integer("experts", 64, "E")
flags.DEFINE_integer("k", 8, "experts per token")
flags.DEFINE_integer("repeats", 5, "timed repeats (min is reported)")
flags.DEFINE_list("methods", ["sort", "sort@1.0", "sort@1.1", "sort@1.25", "gmm"],
                  "methods timed at --tokens; sort@CF = the capacity-padded buffer with "
                  "capacity factor CF (plain sort = dropless)")
flags.DEFINE_string("headline", "sort@1.1",
                    "the row reported as moe_ms / ratio in the JSON (the layout `small` "
                    "trains with: configs/small.py sets model.moe_capacity_factor)")
flags.DEFINE_list("small_methods", ["ragged", "reference", "gather"],
                  "methods timed at --small_tokens (on CPU ragged_dot materialises a masked "
                  "[E, rows, D] operand: ~18 GB temp for fwd+bwd at 4096 tokens)")
flags.DEFINE_integer("small_tokens", 512, "N for --small_methods (with their own dense row)")
flags.DEFINE_bool("layer", True, "also time the StableLatentMoE layer (small preset)")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                  "dtype of the expert and dense MLPs' inputs and weights")
flags.DEFINE_bool("extras", True, "also time ragged_dot vs a dense matmul and QAT's cost")
flags.DEFINE_string("out", None, "also write the JSON object to this path")


def _ms(seconds):
  """(min_ms, median_ms) of a list of run times."""
  return 1e3 * min(seconds), 1e3 * float(np.median(seconds))


def _time(fn, *args, repeats):
  return _ms(timing.round_robin({"fn": lambda: fn(*args)}, repeats)["fn"])


def _problem(n, d, f, e, k, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(n, d)), dtype)
  logits = rng.normal(size=(n, e))
  scores = jnp.asarray(1 / (1 + np.exp(-logits)), jnp.float32)
  weights, indices, _ = moe.route(scores, jnp.zeros(e), k)
  w1 = jnp.asarray(rng.normal(size=(e, d, f)) / np.sqrt(d), dtype)
  w3 = jnp.asarray(rng.normal(size=(e, d, f)) / np.sqrt(d), dtype)
  w2 = jnp.asarray(rng.normal(size=(e, f, d)) / np.sqrt(f), dtype)
  return x, weights, indices, w1, w3, w2


def _expert_fn(method):
  """The routed-experts function a method name stands for: `expert_mlp`'s sorted path, the
  dense reference, or expert-sorted rows through a grouped matmul passed as its `gmm`."""
  if method == "sort":
    return moe.expert_mlp
  if method == "reference":
    return moe.expert_mlp_reference
  if method == "ragged":
    return functools.partial(moe.expert_mlp, gmm=moe.ragged_gmm)
  if method == "gmm":
    from pallas_kernels.moe_gmm import gmm
    return functools.partial(moe.expert_mlp, gmm=gmm)
  raise ValueError(f"--methods: expected sort[@CF], reference, ragged, gmm or gather, "
                   f"found {method!r}")


def _method(name, n, k, e):
  """'sort@1.25' → ('sort', capacity for cf 1.25); other names → (name, None = dropless)."""
  if "@" not in name:
    return name, None
  method, cf = name.split("@")
  return method, moe.capacity(n, k, e, float(cf))


def drop_fractions(n, d, f, e, k, names, seed=0):
  """Fraction of (token, expert) pairs over capacity for each `sort@CF` name, under two
  routings: the benchmark's own (the indices `bench_experts` times: sigmoid of N(0,1) logits)
  and a skewed router (per-expert logit offsets N(0, 0.5²)) after one Quantile Balancing step
  fitted on another batch."""
  from k3jax.ops import balance
  rng = np.random.default_rng(seed)
  skew = rng.normal(size=e) * 0.5
  def scores(logits):
    return jnp.asarray(1 / (1 + np.exp(-logits)), jnp.float32)
  fit = scores(rng.normal(size=(n, e)) + skew)
  _, _, cutoff = moe.route(fit, jnp.zeros(e), k)
  qb = balance.qb_bias_exact(fit, cutoff, k)
  routings = {"bench": _problem(n, d, f, e, k)[2],   # same arguments as bench_experts
              "skewed_qb": moe.route(scores(rng.normal(size=(n, e)) + skew), qb, k)[1]}
  out = {}
  for name in names:
    _, cap = _method(name, n, k, e)
    if cap is None:
      continue
    out[name] = {}
    for rname, idx in routings.items():
      load = np.bincount(np.asarray(idx).ravel(), minlength=e)
      out[name][rname] = float(np.maximum(load - cap, 0).sum() / (n * k))
  return out


def _time_round_robin(calls, failed=None):
  """{name: (min_ms, median_ms)} of calls {name: (fn, args, repeats)} (`timing.round_robin`)."""
  ts = timing.round_robin({name: (lambda fn=fn, args=args: fn(*args))
                           for name, (fn, args, _) in calls.items()},
                          {name: r for name, (_, _, r) in calls.items()}, failed)
  return {name: _ms(v) for name, v in ts.items()}


def gather_mlp(x, weights, indices, w1, w3, w2):
  """Routed experts with each token's k expert matrices gathered ([N, k, D, F] per weight)."""
  a = jnp.einsum("nd,nkdf->nkf", x, w1[indices])
  b = jnp.einsum("nd,nkdf->nkf", x, w3[indices])
  out = jnp.einsum("nkf,nkfd->nkd", moe.situ_glu(a, b), w2[indices])
  return jnp.sum(weights[..., None] * out, axis=1)


def bench_experts(n, d, f, e, k, methods, repeats, dtype=jnp.float32):
  """({name: (min_ms, median_ms) or None}, {name: error}) for the expert MLP fwd+bwd and the
  dense reference, inputs and weights in `dtype`: None for a method skipped (Pallas on CPU) or
  failed (its error in the second dict)."""
  x, weights, indices, w1, w3, w2 = _problem(n, d, f, e, k, dtype=dtype)
  probe = jnp.ones((n, d), jnp.float32) / n
  res, calls = {}, {}

  def moe_step(method, cap):
    # indices are an argument, not a closure constant (XLA would constant-fold the sort).
    def loss(x, w, w1, w3, w2, indices):
      if method == "gather":
        y = gather_mlp(x, w, indices, w1, w3, w2)
      else:
        y, _ = _expert_fn(method)(x, w, indices, w1, w3, w2, capacity=cap)
      return jnp.sum(y.astype(jnp.float32) * probe)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))

  if "gather" in methods:   # the bench-only variant must compute the same function
    want = moe.expert_mlp_reference(x, weights, indices, w1, w3, w2)[0]
    got = jax.jit(gather_mlp)(x, weights, indices, w1, w3, w2)
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)

  for name in methods:
    if name == "gmm" and jax.default_backend() == "cpu":
      res[name] = None  # interpret mode on CPU: correctness only, timing meaningless
      continue
    method, cap = _method(name, n, k, e)
    calls[name] = (moe_step(method, cap), (x, weights, w1, w3, w2, indices),
                   1 if name in ("reference", "gather") else repeats)

  rng = np.random.default_rng(1)
  h = k * f
  d1 = jnp.asarray(rng.normal(size=(d, h)) / np.sqrt(d), dtype)
  d3 = jnp.asarray(rng.normal(size=(d, h)) / np.sqrt(d), dtype)
  d2 = jnp.asarray(rng.normal(size=(h, d)) / np.sqrt(h), dtype)

  def dense_loss(x, d1, d3, d2):
    y = moe.situ_glu(x @ d1, x @ d3) @ d2
    return jnp.sum(y.astype(jnp.float32) * probe)

  calls["dense"] = (jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1, 2, 3))),
                    (x, d1, d3, d2), repeats)
  failed = {}
  timed = _time_round_robin(calls, failed)
  return ({name: res[name] if name in res else timed.get(name) for name in [*methods, "dense"]},
          failed)


def bench_qat(n, d, f, e, k, repeats):
  """QAT's cost (ModelConfig.modes.expert_qat="mxfp4_mxfp8"): the sorted expert MLP fwd+bwd with
  fake-quantised weights and inputs vs without, and the quantisers alone — `mx.fake_round`
  (what QAT runs) vs the codec round trip it equals (unpack(pack(·))), on the three expert
  kernels and on the k·N rows of both expert inputs. {name: (min_ms, median_ms)}."""
  from k3jax.quant import mx, qat
  x, weights, indices, w1, w3, w2 = _problem(n, d, f, e, k)
  probe = jnp.ones((n, d), jnp.float32) / n

  def step(quant):
    def loss(x, w, w1, w3, w2, indices):
      if quant:
        w1, w3, w2 = (qat.fake_mxfp4_expert(a) for a in (w1, w3, w2))
      y, _ = moe.expert_mlp(x, w, indices, w1, w3, w2, input_quant="mxfp8" if quant else None)
      return jnp.sum(y * probe)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))

  rows = jnp.asarray(np.random.default_rng(2).normal(size=(n * k, d)), jnp.float32)
  hidden = jnp.asarray(np.random.default_rng(3).normal(size=(n * k, f)), jnp.float32)

  def codec_weights(w1, w3, w2):
    return [mx.unpack_expert(*mx.pack_expert(a)) for a in (w1, w3, w2)]

  def direct_weights(w1, w3, w2):
    return [mx.fake_round(a, "mxfp4", axis=-2) for a in (w1, w3, w2)]

  def codec_inputs(a, b):
    return mx.mx_round(a, "mxfp8"), mx.mx_round(b, "mxfp8")

  def direct_inputs(a, b):
    return mx.fake_round(a, "mxfp8"), mx.fake_round(b, "mxfp8")

  for ref, fast, args in ((codec_weights, direct_weights, (w1, w3, w2)),
                          (codec_inputs, direct_inputs, (rows, hidden))):
    for r, q in zip(jax.jit(ref)(*args), jax.jit(fast)(*args)):   # the same values
      np.testing.assert_array_equal(np.asarray(r), np.asarray(q))
  return _time_round_robin({
      "sort": (step(False), (x, weights, w1, w3, w2, indices), repeats),
      "sort+qat": (step(True), (x, weights, w1, w3, w2, indices), repeats),
      "mxfp4 weights, codec": (jax.jit(codec_weights), (w1, w3, w2), repeats),
      "mxfp4 weights, fake_round": (jax.jit(direct_weights), (w1, w3, w2), repeats),
      "mxfp8 inputs, codec": (jax.jit(codec_inputs), (rows, hidden), repeats),
      "mxfp8 inputs, fake_round": (jax.jit(direct_inputs), (rows, hidden), repeats)})


def bench_ragged_dot(n, d, f, e, k, repeats):
  """GFLOP/s of ragged_dot [N·k, D] × [E, D, F] vs dense [N·k, D] × [D, F] (same FLOPs).

  Called with N ≤ 1024 (8192 rows): on CPU ragged_dot's temporary grows like rows·E·D.
  """
  p = n * k
  rng = np.random.default_rng(2)
  lhs = jnp.asarray(rng.normal(size=(p, d)), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=(e, d, f)), jnp.float32)
  sizes = jnp.full((e,), p // e, jnp.int32).at[0].add(p - (p // e) * e)
  flops = 2.0 * p * d * f
  t_r, _ = _time(jax.jit(jax.lax.ragged_dot), lhs, rhs, sizes, repeats=repeats)
  t_d, _ = _time(jax.jit(jnp.matmul), lhs, rhs[0], repeats=repeats)
  return {"ragged_dot_gflops": flops / t_r / 1e6, "dense_matmul_gflops": flops / t_d / 1e6,
          "ragged_over_dense_time": t_r / t_d}


def bench_layer(repeats, capacity_factor):
  """fwd+bwd ms of StableLatentMoE on the `small` preset with `capacity_factor`, x [8, 512, d];
  None if absent."""
  try:
    from k3jax.config import preset
    from k3jax.layers import backend
    from k3jax.layers.moe import StableLatentMoE
  except ImportError:
    return None, None
  cfg = preset("small", moe_capacity_factor=capacity_factor)
  layer = StableLatentMoE(cfg)
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 512, cfg.text.d_model), jnp.float32)
  variables = layer.init(jax.random.PRNGKey(1), x)
  params = variables["params"]
  rest = {c: v for c, v in variables.items() if c != "params"}

  def loss(params, x):
    return jnp.mean(layer.apply({"params": params, **rest}, x) ** 2)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  method = "sort" if backend.kernels(cfg).gmm is None else "gmm"
  return _time(step, params, x, repeats=repeats)[0], method


def main(argv):
  del argv
  if FLAGS.headline not in FLAGS.methods or FLAGS.headline == "gmm":
    raise ValueError(f"--headline={FLAGS.headline!r} must be one of the timed --methods "
                     f"{FLAGS.methods} (not gmm)")
  n, d, f, e, k = FLAGS.tokens, FLAGS.dim, FLAGS.ffn, FLAGS.experts, FLAGS.k
  dtype = jnp.dtype(FLAGS.dtype)
  load = os.getloadavg()[0]
  print(f"backend={jax.default_backend()} devices={jax.device_count()} cpus={os.cpu_count()} "
        f"load1={load:.1f}  N={n} D={d} F={f} E={e} k={k}  {FLAGS.dtype}, fwd+bwd")
  res, failed = bench_experts(n, d, f, e, k, FLAGS.methods, FLAGS.repeats, dtype)
  drops = drop_fractions(n, d, f, e, k, FLAGS.methods)
  dense = res["dense"][0]
  ns = FLAGS.small_tokens
  small, small_failed = (bench_experts(ns, d, f, e, k, FLAGS.small_methods, FLAGS.repeats,
                                       dtype) if FLAGS.small_methods else ({}, {}))
  print(f"{'method':<14}{'tokens':>8}{'min ms':>10}{'median ms':>12}{'× dense':>10}"
        f"{'dropped (bench / skewed+QB router)':>38}")
  for tokens, table, errors in ((n, res, failed), (ns, small, small_failed)):
    for name, v in table.items():
      if v is None:
        why = errors.get(name, "skipped (Pallas interpret mode on CPU)")
        print(f"{name:<14}{tokens:>8}  {why}")
        continue
      dr = drops.get(name) if tokens == n else None
      dr = f"{100 * dr['bench']:.2f}% / {100 * dr['skewed_qb']:.2f}%" if dr else ""
      print(f"{name:<14}{tokens:>8}{v[0]:>10.1f}{v[1]:>12.1f}{v[0] / table['dense'][0]:>10.2f}"
            f"{dr:>38}")
  rd, qat_ms = {}, {}
  if FLAGS.extras:
    rd = bench_ragged_dot(min(n, 1024), d, f, e, k, FLAGS.repeats)
    print(f"ragged_dot {rd['ragged_dot_gflops']:.1f} GFLOP/s vs dense matmul "
          f"{rd['dense_matmul_gflops']:.1f} GFLOP/s "
          f"({rd['ragged_over_dense_time']:.1f}× the time)")
    qat_ms = bench_qat(n, d, f, e, k, FLAGS.repeats)
    for name, v in qat_ms.items():
      print(f"QAT  {name:<28}{v[0]:>10.1f} ms (median {v[1]:.1f})")
    print(f"QAT overhead: sort+qat / sort = {qat_ms['sort+qat'][0] / qat_ms['sort'][0]:.2f}×")
  head_cf = float(FLAGS.headline.split("@")[1]) if "@" in FLAGS.headline else None
  layer_ms, layer_method = (bench_layer(FLAGS.repeats, head_cf) if FLAGS.layer
                            else (None, None))
  if layer_ms is not None:
    print(f"StableLatentMoE layer (small, x [8,512,512], method={layer_method}, capacity "
          f"factor {head_cf}): {layer_ms:.1f} ms fwd+bwd")
  head = FLAGS.headline
  out = {
      "moe_ms": res[head] and res[head][0], "dense_ms": dense,
      "ratio": res[head] and res[head][0] / dense,
      "method": head, "backend": jax.default_backend(), "load1": load, "dtype": FLAGS.dtype,
      "shape": dict(tokens=n, dim=d, ffn=f, experts=e, k=k),
      "methods_ms": {m: (None if v is None else v[0]) for m, v in res.items()},
      "small_tokens": ns,
      "small_methods_ms": {m: (None if v is None else v[0]) for m, v in small.items()},
      "dropped_fraction": drops, **rd, "failed": failed, "small_failed": small_failed,
      "layer_ms": layer_ms,
      "qat_ms": {m: v[0] for m, v in qat_ms.items()},
      "qat_overhead": qat_ms["sort+qat"][0] / qat_ms["sort"][0] if qat_ms else None,
  }
  if FLAGS.json:
    print(json.dumps(out))
  if FLAGS.out:
    results.write_json(FLAGS.out, out, indent=1)


if __name__ == "__main__":
  app.run(main)
