r"""Benchmark: the packed vision tower vs a dense transformer of the same width and FLOPs.

  .venv/bin/python -m experiments.bench_vision                        # table + JSON line
  .venv/bin/python -m experiments.bench_vision --json /tmp/bench_vision.json

The tower (`k3jax.vision.VisionModel`, stage "encoded": patch embedding, divided-fixed position
embedding, `--layers` pre-norm blocks with 2-D RoPE and block-diagonal packed attention, final
norm) runs on ONE packed stream of images of mixed sizes (and a 2-frame clip) that fills its
bucket exactly, so the stream's L patches are all real. The reference, timed in the same
process in turns with it, is a plain dense transformer over one unpacked sequence of the same
L tokens with the same weights: the same patch projection, norms, q/k/v/o and MLP matmuls and
full softmax attention (L×L logits, as the packed op also computes before masking), without
RoPE, position embedding, segment ids or masks. Their time ratio is the packing overhead (the
project's target: ≤ 1.3×). Also printed: the pieces that only the packed tower has (the
attention op against plain attention on the same q/k/v, the position embedding, RoPE on the
queries, the merger's scatter-add) and the merger + projector ("projected" minus "encoded").

Forward only, in fp32; widths of `--preset` (moonvit_v2: hidden 1024, 12 heads of 128, MLP
4096) with `--layers` blocks; time = min over `--repeats` (the machine may be shared: the load
average is stored, and the ratio is the figure to compare). With --json the JSON object is also
written to that file (a temporary file, renamed).

  XLA_FLAGS=--xla_force_host_platform_device_count=4 \
      .venv/bin/python -m experiments.bench_vision --context 4

also runs the tower with the stream split over a context axis of that many devices
(`k3jax.parallel.vision`) and reports its largest difference from the unsharded tower, relative
to the output's largest magnitude (its time on simulated CPU devices says nothing of a real
mesh and is stored only for the record).
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import results, timing

# (t, h, w) per sample: 512 + 192 + 112 + 96 + 64 + 32 + 16 = 1024 patches, one 1024 bucket.
DEFAULT_GRID = "1x16x32,1x12x16,1x8x14,2x6x8,1x8x8,1x4x8,1x2x8"


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Registers the flags on `flag_values` (only when run as a script: importing registers
  nothing)."""
  fv = dict(flag_values=flag_values)
  flags.DEFINE_string("json", None, "also write the JSON result to this file", **fv)
  flags.DEFINE_string("preset", "moonvit_v2", "k3jax.vision preset giving the widths", **fv)
  flags.DEFINE_integer("layers", 2, "encoder blocks (the preset's num_layers overridden)", **fv)
  flags.DEFINE_string("grid", DEFAULT_GRID, "samples as TxHxW, comma separated", **fv)
  flags.DEFINE_integer("length", None, "stream length (default: Σ t·h·w, no padding)", **fv)
  flags.DEFINE_integer("query_block", None, "the tower's query_block", **fv)
  flags.DEFINE_integer("repeats", 5, "timed repeats (min is reported)", **fv)
  flags.DEFINE_integer("context", 0, "also run the tower split over a context axis of this many "
                       "devices and compare it with the unsharded one (0: no)", **fv)


def parse_grid(text: str) -> np.ndarray:
  """'1x16x32,2x6x8' → [[1, 16, 32], [2, 6, 8]] (int64); ValueError naming --grid."""
  try:
    rows = [[int(x) for x in s.split("x")] for s in text.split(",") if s]
  except ValueError:
    rows = []
  if not rows or any(len(r) != 3 for r in rows):
    raise ValueError(f"--grid: expected comma-separated TxHxW, found {text!r}")
  return np.asarray(rows, np.int64)


def _time_round_robin(calls: dict, repeats: int) -> dict:
  """{name: min seconds} of calls {name: (fn, args)} (`timing.round_robin`)."""
  ts = timing.round_robin({name: (lambda fn=fn, args=args: fn(*args))
                           for name, (fn, args) in calls.items()}, repeats)
  return {name: min(v) for name, v in ts.items()}


def dense_transformer(cfg, params, x):
  """The reference: the tower's weights as a plain pre-norm transformer over one sequence.
  params: the tower's {'params': …}; x [B, L, C·P·P] → [B, L, hidden] fp32. Full softmax
  attention, no RoPE, no position embedding, no segment ids."""
  from k3jax.vision.tower import Norm  # noqa: PLC0415 (the tower's own norm)
  vt = params["params"]["vision_tower"]
  enc = vt["encoder"]
  norm = lambda p, y: Norm(cfg.norm, cfg.norm_eps, cfg.norm == "layernorm").apply(
      {"params": p}, y)
  x = jnp.einsum("blk,kd->bld", x, vt["patch_embed"]["proj"]["kernel"])
  for i in range(cfg.num_layers):
    b = enc[f"blocks_{i}"]
    qkv = jnp.einsum("bli,icnd->blcnd", norm(b["norm0"], x), b["wqkv"]["kernel"])
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    logits = jnp.einsum("bqnd,bknd->bnqk", q, k) * cfg.head_dim ** -0.5
    o = jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(logits, axis=-1), v)
    x = x + jnp.einsum("blnd,ndo->blo", o, b["wo"]["kernel"])
    h = jax.nn.gelu(norm(b["norm1"], x) @ b["mlp"]["fc0"]["kernel"], approximate=True)
    x = x + h @ b["mlp"]["fc1"]["kernel"]
  return norm(enc["final_layernorm"], x)


def tower_flops(cfg, length: int) -> float:
  """Matmul FLOPs of one forward of the tower / the dense reference over `length` tokens."""
  d, q, f = cfg.hidden_size, cfg.qkv_hidden_size, cfg.intermediate_size
  per_layer = 2 * length * (d * 3 * q + q * d + 2 * d * f) + 2 * 2 * length * length * q
  return float(cfg.num_layers * per_layer + 2 * length * cfg.patch_dim * d)


def run(preset: str, layers: int, grid: np.ndarray, length: int | None,
        query_block: int | None, repeats: int, context: int = 0) -> dict:
  """Times the tower, the dense reference and the packed-only pieces; returns the figures."""
  from k3jax.vision import VisionModel, init_vision, pack, vision_preset  # noqa: PLC0415
  from k3jax.vision import ops  # noqa: PLC0415
  from k3jax.vision.packing import META_FIELDS  # noqa: PLC0415

  num = int(np.prod(grid, axis=1).sum())
  length = length or num
  cfg = vision_preset(preset, num_layers=layers, pack_buckets=(length,))
  variables = jax.jit(lambda k: init_vision(cfg, k))(jax.random.PRNGKey(0))
  pk = pack(cfg, grid, length=length)
  meta = {k: jnp.asarray(pk.meta[k])[None] for k in META_FIELDS}
  rng = np.random.RandomState(0)
  patches = jnp.asarray(rng.randn(1, length, cfg.patch_dim).astype(np.float32))

  def tower(stage):
    return jax.jit(lambda v, p, m: VisionModel(cfg, query_block).apply(v, p, m, stage))

  dense = jax.jit(lambda v, p: dense_transformer(cfg, v, p))
  out = dense(variables, patches)
  if out.shape != (1, length, cfg.hidden_size) or not bool(jnp.all(jnp.isfinite(out))):
    raise RuntimeError(f"dense reference: bad output {out.shape}")

  h, dh = cfg.num_heads, cfg.head_dim
  ks = jax.random.split(jax.random.PRNGKey(1), 4)
  q, k, v = (jax.random.normal(kk, (1, length, h, dh)) for kk in ks[:3])
  x = jax.random.normal(ks[3], (1, length, cfg.hidden_size))
  table = variables["params"]["vision_tower"]["patch_embed"]["pos_emb"]["weight"]
  seg = meta["segment_ids"]
  plain = lambda q, k, v: jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(
      jnp.einsum("bqnd,bknd->bnqk", q, k) * dh ** -0.5, axis=-1), v)
  pos = lambda t, m: ops.divided_fixed_pos_emb(
      t, m["rows"], m["cols"], m["frames"], m["heights"], m["widths"], m["num_frames"],
      mode=cfg.pos_emb_interpolation, max_frames=cfg.max_frames)
  rope = lambda q, m: ops.apply_rope(q, ops.rope_angles(
      m["rows"], m["cols"], dh, theta=cfg.rope_theta, layout=cfg.rope_layout))
  merge = lambda x, m: jax.vmap(lambda a, i, w: ops.sd2_tpool_packed(a, i, w, length // 4))(
      x, m["merge_index"], m["merge_weight"])
  t = _time_round_robin({
      "tower": (tower("encoded"), (variables, patches, meta)),
      "dense": (dense, (variables, patches)),
      "projected": (tower("projected"), (variables, patches, meta)),
  }, repeats)
  pieces = _time_round_robin({
      "packed_attention": (jax.jit(lambda q, k, v, s: ops.packed_attention(
          q, k, v, s, query_block=query_block)), (q, k, v, seg)),
      "plain_attention": (jax.jit(plain), (q, k, v)),
      "pos_emb": (jax.jit(pos), (table, meta)),
      "rope_q": (jax.jit(rope), (q, meta)),
      "merger": (jax.jit(merge), (x, meta)),
  }, repeats)
  flops = tower_flops(cfg, length)
  sharded = {}
  if context:
    sharded = _context_run(cfg, tower("encoded"), (variables, patches, meta), context, repeats)
  return {
      **sharded,
      "preset": preset, "layers": layers, "hidden": cfg.hidden_size, "heads": h,
      "head_dim": dh, "mlp": cfg.intermediate_size, "grid": grid.tolist(),
      "patches": num, "stream_length": length, "query_block": query_block,
      "tower_ms": 1e3 * t["tower"], "dense_ms": 1e3 * t["dense"],
      "ratio": t["tower"] / t["dense"], "target_ratio": 1.3,
      "tower_patches_per_s": num / t["tower"], "dense_tokens_per_s": length / t["dense"],
      "tower_gflops": flops / t["tower"] / 1e9, "dense_gflops": flops / t["dense"] / 1e9,
      "projected_ms": 1e3 * t["projected"],
      "merger_projector_ms": 1e3 * (t["projected"] - t["tower"]),
      "pieces_ms": {k: 1e3 * v for k, v in pieces.items()},
  }


def _context_run(cfg, fn, args, context: int, repeats: int) -> dict:
  """The tower under a mesh with context = `context` against the unsharded tower."""
  from k3jax import sharding  # noqa: PLC0415
  if jax.device_count() < context:
    raise ValueError(f"--context={context}: only {jax.device_count()} devices; set "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={context}")
  want = np.asarray(fn(*args))
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, context=context),
                            jax.devices()[:context])
  with jax.set_mesh(mesh):
    out = fn(*args)
    t = _time_round_robin({"sharded": (fn, args)}, repeats)["sharded"]
  # The output's layout shows the sharded program ran (the stream split over `context`).
  spec = str(out.sharding.spec) if hasattr(out.sharding, "spec") else str(out.sharding)
  err = float(np.max(np.abs(np.asarray(out) - want)) / np.max(np.abs(want)))
  return {"context": context, "context_max_rel_err": err, "context_tower_ms": 1e3 * t,
          "context_out_spec": spec}


def _emit(res: dict, path: str | None) -> None:
  """Print the result as one JSON line and write it to `path` (temporary file, renamed)."""
  print(json.dumps(res))
  if path:
    results.write_json(path, res)


def main(argv):
  del argv
  fl = flags.FLAGS
  grid = parse_grid(fl.grid)
  load = os.getloadavg()[0]
  print(f"backend={jax.default_backend()} cpus={os.cpu_count()} load1={load:.1f} "
        f"preset={fl.preset} layers={fl.layers} fp32 forward")
  res = run(fl.preset, fl.layers, grid, fl.length, fl.query_block, fl.repeats, fl.context)
  res.update(backend=jax.default_backend(), load1=load,
             date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
  print(f"{res['patches']} patches ({len(grid)} samples) in a stream of {res['stream_length']}")
  print(f"packed tower   {res['tower_ms']:9.1f} ms  {res['tower_patches_per_s']:9.0f} patches/s"
        f"  {res['tower_gflops']:6.1f} GFLOP/s")
  print(f"dense          {res['dense_ms']:9.1f} ms  {res['dense_tokens_per_s']:9.0f} tokens/s "
        f"  {res['dense_gflops']:6.1f} GFLOP/s")
  print(f"ratio          {res['ratio']:9.3f}  (target ≤ {res['target_ratio']})")
  print(f"merger + projector {res['merger_projector_ms']:.1f} ms (projected stage "
        f"{res['projected_ms']:.1f} ms)")
  for name, ms in res["pieces_ms"].items():
    print(f"  {name:<18}{ms:9.2f} ms")
  if fl.context:
    print(f"context = {fl.context} (simulated devices): max |sharded − unsharded| / max |out| = "
          f"{res['context_max_rel_err']:.2e}, {res['context_tower_ms']:.1f} ms, output "
          f"{res['context_out_spec']}")
  _emit(res, fl.json)


if __name__ == "__main__":
  define_flags()
  app.run(main)
