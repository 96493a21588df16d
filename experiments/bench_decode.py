r"""Decode / prefill benchmark for k3jax.serve.generate.

  python -m experiments.bench_decode              # full: contexts 1K/8K/64K, long 64K/256K/1M
  python -m experiments.bench_decode --quick      # smoke: contexts 1K/4K, long 4K/16K/64K

Reports, on `small` (random init; timings do not depend on the weights):
  1. decode step time (median) at each context for the full hybrid model and for its KDA layers
     alone ("KDA-only": the KDA token mixers + MLPs of small, no MLA). A context of N tokens is a
     cache holding N tokens (MLA buffers of N+1 slots, lengths = N); the per-step cost depends only
     on that, not on the cached values. KDA-only must stay flat (≤ 1.2× from the smallest to the
     largest context); MLA attention grows linearly with the context.
  2. cache bytes per token vs a plain MHA model of the same width (K and V of d per layer).
  3. prefill tokens/s of the full hybrid model (batch 1, chunked).
  4. long context: prefill through a KDA-only variant of small (its KDA token mixers; --long_mlp
     adds the MLPs), chunk by chunk with constant memory; peak RSS after each length and time per
     token (linear time ⇒ constant µs/token).
Prints a table and one JSON line (also written to --json_out).

  python -m experiments.bench_decode --hybrid_prefill=8192,32768 --json_out=FILE

measures only a chunked prefill of a 2-layer tiny hybrid (KDA + MLA) through the serving path
(`hybrid_prefill`): seconds, µs/token, cache bytes and peak RSS per length; with
--prefill_key_block=N the MLA reads its cache N slots at a time (`modes.mla_key_block`);
--prefill_overrides=field=value,... changes the tiny preset's fields (e.g. the MLA's heads and
latent width, so that a 1M-token prefill of the hybrid fits a CPU's afternoon: the code path is
the same at any width).

  python -m experiments.bench_decode --k3_shaped --json_out=FILE
  python -m experiments.bench_decode --packed --json_out=FILE

measures instead the decode step of a K3-shaped stack with tiny widths (`tiny` with 93 layers,
AttnRes blocks of 12, the first layer dense: K3's layout of 4 unrolled layers, 22 scanned
groups and one suffix layer): the first call's seconds (trace + compile + one step), the
median step afterwards, and their difference (compile seconds). --packed measures the decode
step of `small` with packed MXFP4 experts against the same model with float experts
(`packed_vs_float`).
"""

from __future__ import annotations

import functools
import json
import os
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import results, timing
from experiments.bench_sharding import parse_modes

_QUICK = flags.DEFINE_bool("quick", False, "Small contexts/lengths (smoke mode).")
_CONTEXTS = flags.DEFINE_string("contexts", None, "Decode contexts, comma separated.")
_LONG = flags.DEFINE_string("long_lengths", None, "Long prefill lengths, comma separated.")
_LONG_CHUNK = flags.DEFINE_integer("long_chunk", 4096, "Tokens per long-prefill call.")
_LONG_MLP = flags.DEFINE_bool("long_mlp", False, "Include the MLPs in the long prefill.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed decode steps per point.")
_PREFILL = flags.DEFINE_integer("prefill_tokens", 2048, "Prompt length of the prefill figure.")
_JSON = flags.DEFINE_string("json_out", None, "Also write the JSON result here.")
_PACKED = flags.DEFINE_bool("packed", False, "Only the decode step of small with packed MXFP4 "
                            "experts vs its float experts, side by side.")
_HYBRID = flags.DEFINE_string("hybrid_prefill", None, "Only: chunked prefill of a 2-layer "
                              "tiny hybrid (KDA + MLA) through generate.prefill at these "
                              "lengths (comma separated; chunks of --long_chunk)")
_PREFILL_KDA_ONLY = flags.DEFINE_bool("prefill_kda_only", False, "--hybrid_prefill with "
                                      "both layers KDA (no MLA, no MTP): linear time")
_PREFILL_KEY_BLOCK = flags.DEFINE_integer("prefill_key_block", 0, "--hybrid_prefill with "
                                          "modes.mla_key_block = this (0: None): the cache "
                                          "read in key blocks, later blocks skipped")
_PREFILL_OVERRIDES = flags.DEFINE_string(
    "prefill_overrides", None, "--hybrid_prefill with these preset fields changed "
    "('num_heads=1,kv_lora_rank=8'; ints, floats, true/false, none)")
_K3_SHAPED = flags.DEFINE_bool("k3_shaped", False,
                               "Only the decode compile/step time of a 93-layer K3-shaped stack "
                               "with tiny widths.")


def _peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def _variables(cfg):
  from k3jax.model import K3Model
  from k3jax.serve import generate as G
  return G.unbox(jax.jit(K3Model(cfg).init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32)))


def kda_only(cfg, with_mlp: bool):
  """`cfg`'s KDA layers alone, each extending its own cache (`layers.kda.KDA` with a `Feed`),
  plain residuals, with the MoE MLP when `with_mlp`. One set of weights serves every layer
  (timings do not depend on the weights). → (jitted run(caches, x [1,T,d], num_new [1]) →
  (y, caches), zero caches)."""
  from k3jax.layers.feed import Feed
  from k3jax.layers.kda import KDA, KDACache
  from k3jax.layers.moe import StableLatentMoE
  n = sum(m == "kda" for m, _ in cfg.text.layer_types())
  x0 = jnp.zeros((1, 4, cfg.text.d_model))
  kda, moe = KDA(cfg), StableLatentMoE(cfg.for_inference())
  kv = kda.init(jax.random.PRNGKey(0), x0)
  mv = moe.init(jax.random.PRNGKey(1), x0) if with_mlp else None

  def run(caches, x, num_new):
    feed = Feed(jnp.zeros_like(num_new), num_new)
    out = []
    for c in caches:
      o, c = kda.apply(kv, x, None, c, feed)
      x = x + o
      if with_mlp:
        x = x + moe.apply(mv, x)
      out.append(c)
    return x, tuple(out)

  return jax.jit(run), tuple(KDACache.zeros(cfg, 1) for _ in range(n))


def k3_shaped(steps: int) -> dict:
  """Decode compile and step seconds of `tiny` widths in K3's 93-layer layout (batch 1)."""
  from k3jax.serve import generate as G
  from k3jax.config import preset
  cfg = preset("tiny", num_layers=93, attn_res_block_size=12, first_dense_layers=1)
  v = _variables(cfg)
  _, cache = G.prefill(cfg, v, np.ones((1, 8), np.int32), np.array([8]), max_len=64, chunk=8)
  tok = np.array([1], np.int32)
  t0 = time.perf_counter()
  logits, _ = G.decode_step(cfg, v, cache, tok)
  jax.block_until_ready(logits)
  first = time.perf_counter() - t0
  step = timing.median_seconds(lambda: G.decode_step(cfg, v, cache, tok)[0], steps)
  return {"config": "tiny widths, 93 layers (K3 layout)", "layout": cfg.text.stack_layout(),
          "backend": jax.default_backend(), "first_call_s": first, "step_ms": step * 1e3,
          "compile_s": first - step}


def packed_vs_float(contexts, steps: int, batch: int = 1) -> dict:
  """Decode step of `small` at each context with its routed experts packed MXFP4
  (`expert_format="mxfp4"`, `mx.pack_expert_params` of the same weights) vs as float params:
  medians timed in turns (float, packed, float, packed …) so that a shared machine's drift
  hits both alike; the greedy next token of the two agree (checked)."""
  from k3jax.serve import generate as G
  from k3jax.config import preset
  from k3jax.quant import mx
  cfg = preset("small")
  cfg_p = cfg.replace(expert_format="mxfp4")
  v = _variables(cfg)
  v_p = {**v, "params": mx.pack_expert_params(v["params"])}
  res = {"config": "small", "batch": batch, "contexts": contexts, "float_ms": [],
         "packed_ms": [], "ratio": []}
  ones = jnp.ones((batch,), jnp.int32)      # the token fed (id 1), and num_new = 1
  for ctx in contexts:
    calls = []
    for c, vv in ((cfg, v), (cfg_p, v_p)):
      cache = G.init_cache(c, batch, ctx + 1).replace(lengths=jnp.full((batch,), ctx, jnp.int32))
      calls.append(functools.partial(G.decode_fn(c), vv, cache, ones, ones))
    outs = [np.asarray(f()[0]) for f in calls]   # compile + warm up
    if not np.array_equal(outs[0].argmax(-1), outs[1].argmax(-1)):
      print(f"note: greedy tokens differ at context {ctx} (MXFP4 rounding of the experts)")
    ts = timing.round_robin(dict(zip(("float", "packed"), calls)), steps)
    f_ms, p_ms = (1e3 * statistics.median(ts[name]) for name in ("float", "packed"))
    res["float_ms"].append(f_ms)
    res["packed_ms"].append(p_ms)
    res["ratio"].append(p_ms / f_ms)
  return res


def hybrid_prefill(lengths, chunk: int, kda_only: bool = False,
                   key_block: int | None = None, overrides: dict | None = None) -> dict:
  """Chunked prefill through the serving path (`generate.prefill`: one compiled [1, chunk]
  forward over a cache preallocated for the whole prompt) of a 2-layer `tiny` hybrid — a KDA
  layer (dense MLP) and an MLA layer (MoE), plus the MTP layer — at each length, ascending, in
  this process: seconds (first chunk's compile included), µs per token, the cache's bytes
  from its shapes, and the process's peak RSS after the length. Memory is bounded by the
  cache (fixed KDA states + the MLA latents of `length` tokens) and one chunk's activations;
  the time is quadratic, since each chunk's absorbed attention reads the whole preallocated
  latent buffer. `kda_only`: the same 2 layers as KDA layers (`kda_only=True`: no MLA, the
  MTP layer's attention is still MLA over its own cache): linear time. `key_block`:
  `modes.mla_key_block` — the absorbed attention reads the buffer in blocks of that many
  slots and skips those after the chunk's last position (memory bounded by a block, time by
  the tokens so far). `overrides`: further `preset` fields (recorded in the result)."""
  from k3jax.serve import generate as G
  from k3jax.config import preset
  kda = dict(kda_only=True, mla_every=3, mla_last=False, num_mtp_layers=0) if kda_only else {}
  cfg = preset("tiny", **{"num_layers": 2, "mla_key_block": key_block, **kda,
                          **(overrides or {})})
  v = _variables(cfg)
  rng = np.random.default_rng(0)
  rows = []
  for length in lengths:
    tokens = rng.integers(0, 256, size=(1, length)).astype(np.int32)
    cache = jax.eval_shape(lambda: G.init_cache(cfg, 1, length))   # noqa: B023
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    t0 = time.perf_counter()
    last, cache = G.prefill(cfg, v, tokens, np.array([length]), max_len=length, chunk=chunk)
    last = np.asarray(jax.block_until_ready(last))
    dt = time.perf_counter() - t0
    if not np.isfinite(last).all() or int(np.asarray(cache.lengths)[0]) != length:
      raise RuntimeError(f"prefill of {length} tokens: non-finite logits or cache length "
                         f"{np.asarray(cache.lengths).tolist()}")
    del cache
    rows.append({"tokens": length, "seconds": dt, "us_per_token": dt / length * 1e6,
                 "cache_bytes": int(cache_bytes), "peak_rss_gb": _peak_rss_gb()})
    print(f"hybrid prefill {length} tokens in chunks of {chunk}: {dt:.1f} s "
          f"({dt / length * 1e6:.0f} us/token), cache {cache_bytes / 2**20:.1f} MiB, peak RSS "
          f"{_peak_rss_gb():.2f} GB", flush=True)
  return {"config": ("tiny, 2 KDA layers (dense, MoE), no MTP" if kda_only else
                     "tiny, 2 layers (KDA + dense, MLA + MoE) + MTP"), "path":
          "generate.prefill (chunked, cache preallocated for the prompt)", "chunk": chunk,
          "mla_key_block": key_block, "overrides": dict(overrides or {}),
          "backend": jax.default_backend(), "layout": cfg.text.stack_layout(),
          "rows": rows, "load1": os.getloadavg()[0]}


def _emit(res: dict) -> None:
  """Print the result as one JSON line and write it to --json_out (temporary file, renamed)."""
  print(json.dumps(res))
  if _JSON.value:
    results.write_json(_JSON.value, res)


def main(argv):
  del argv
  if _HYBRID.value:
    _emit(hybrid_prefill([int(c) for c in _HYBRID.value.split(",")], _LONG_CHUNK.value,
                         kda_only=_PREFILL_KDA_ONLY.value,
                         key_block=_PREFILL_KEY_BLOCK.value or None,
                         overrides=parse_modes(_PREFILL_OVERRIDES.value,
                                               "--prefill_overrides")))
    return
  if _PACKED.value:
    contexts = [int(c) for c in (_CONTEXTS.value or "1024,8192").split(",")]
    res = packed_vs_float(contexts, _STEPS.value)
    for c, f, p, r in zip(contexts, res["float_ms"], res["packed_ms"], res["ratio"]):
      print(f"context {c}: float experts {f:.2f} ms, packed MXFP4 {p:.2f} ms ({r:.2f}×)")
    res["load1"] = os.getloadavg()[0]
    _emit(res)
    return
  if _K3_SHAPED.value:
    res = k3_shaped(_STEPS.value)
    print(f"K3-shaped decode: first call {res['first_call_s']:.1f} s, step "
          f"{res['step_ms']:.2f} ms, compile {res['compile_s']:.1f} s")
    _emit(res)
    return
  from k3jax.serve import generate as G
  from k3jax.config import preset
  quick = _QUICK.value
  contexts = [int(c) for c in (_CONTEXTS.value or ("1024,4096" if quick else
                                                     "1024,8192,65536")).split(",")]
  long_lengths = [int(c) for c in (_LONG.value or ("4096,16384,65536" if quick else
                                                    "65536,262144,1048576")).split(",")]
  cfg = preset("small")
  v = _variables(cfg)
  res = {"config": "small", "backend": jax.default_backend(), "contexts": contexts}

  # 1. decode step time vs context.
  hybrid, kda_times = [], []
  kda_step, kda_caches = kda_only(cfg, with_mlp=True)
  key = jax.random.PRNGKey(1)
  for ctx in contexts:
    cache = G.init_cache(cfg, 1, ctx + 1)
    cache = cache.replace(lengths=jnp.array([ctx], jnp.int32))
    tok = jnp.array([1], jnp.int32)
    step = G.decode_fn(cfg)
    one = jnp.ones((1,), jnp.int32)
    hybrid.append(timing.median_seconds(lambda: step(v, cache, tok, one)[0], _STEPS.value))
    x = jax.random.normal(key, (1, 1, cfg.text.d_model))
    kda_times.append(timing.median_seconds(lambda: kda_step(kda_caches, x, one)[0], _STEPS.value))
  res["decode_ms_hybrid"] = [t * 1e3 for t in hybrid]
  res["decode_ms_kda_only"] = [t * 1e3 for t in kda_times]
  res["kda_only_ratio_last_first"] = kda_times[-1] / kda_times[0]
  res["hybrid_ratio_last_first"] = hybrid[-1] / hybrid[0]

  # 2. cache bytes per token.
  n_mla = sum(m == "mla" for m, _ in cfg.text.layer_types())
  n_kda = cfg.text.num_layers - n_mla
  mla_per_token = n_mla * (cfg.text.kv_lora_rank + cfg.text.qk_rope_head_dim) * 4
  kda_fixed = n_kda * 4 * cfg.text.kda_num_heads * cfg.text.kda_head_dim * (
      cfg.text.kda_head_dim + 3 * (cfg.text.kda_conv_size - 1))
  mha_per_token = cfg.text.num_layers * 2 * cfg.text.d_model * 4
  res["cache"] = {
      "mla_bytes_per_token": mla_per_token, "kda_fixed_bytes": kda_fixed,
      "mha_bytes_per_token": mha_per_token,
      "hybrid_bytes_per_token_at": {c: mla_per_token + kda_fixed / c for c in contexts},
      "ratio_vs_mha_at": {c: (mla_per_token + kda_fixed / c) / mha_per_token for c in contexts}}

  # 3. prefill tokens/s (hybrid, batch 1).
  n = _PREFILL.value if not quick else min(_PREFILL.value, 1024)
  toks = np.asarray(jax.random.randint(key, (1, n), 0, cfg.text.vocab_size))
  G.prefill(cfg, v, toks, np.array([n]), chunk=512)  # compile
  t0 = time.perf_counter()
  lg, _ = G.prefill(cfg, v, toks, np.array([n]), chunk=512)
  jax.block_until_ready(lg)
  res["prefill_tokens_per_s"] = n / (time.perf_counter() - t0)
  res["prefill_tokens"] = n

  # 4. long-context prefill through the KDA-only variant, chunk by chunk.
  chunk = _LONG_CHUNK.value
  f, zero_caches = kda_only(cfg, with_mlp=_LONG_MLP.value)
  full = jnp.full((1,), chunk, jnp.int32)
  long_rows = []
  for length in long_lengths:
    kc = zero_caches
    # One random chunk fed repeatedly: the cost does not depend on the values, and generating
    # inputs inside the timed loop would time the random generator too.
    x = jax.random.normal(key, (1, chunk, cfg.text.d_model))
    jax.block_until_ready(f(kc, x, full))  # compile
    t0 = time.perf_counter()
    for _ in range(0, length, chunk):
      _, kc = f(kc, x, full)
    jax.block_until_ready(kc)
    dt = time.perf_counter() - t0
    long_rows.append({"tokens": length, "seconds": dt, "us_per_token": dt / length * 1e6,
                      "peak_rss_gb": _peak_rss_gb()})
  res["long_prefill_kda_only"] = long_rows
  res["long_prefill_with_mlp"] = _LONG_MLP.value

  print(f"{'context':>9} {'hybrid ms':>10} {'KDA-only ms':>12} {'cache B/tok':>12} "
        f"{'vs MHA':>7}")
  for c, h, k in zip(contexts, res["decode_ms_hybrid"], res["decode_ms_kda_only"]):
    print(f"{c:>9} {h:>10.2f} {k:>12.2f} {res['cache']['hybrid_bytes_per_token_at'][c]:>12.0f} "
          f"{res['cache']['ratio_vs_mha_at'][c]:>7.3f}")
  print(f"KDA-only ratio {res['kda_only_ratio_last_first']:.2f}x, hybrid ratio "
        f"{res['hybrid_ratio_last_first']:.2f}x; plain MHA {mha_per_token} B/token")
  print(f"prefill {res['prefill_tokens_per_s']:.0f} tokens/s ({n} tokens)")
  print(f"{'tokens':>9} {'seconds':>9} {'us/token':>9} {'peak RSS GB':>12}")
  for r in long_rows:
    print(f"{r['tokens']:>9} {r['seconds']:>9.1f} {r['us_per_token']:>9.1f} "
          f"{r['peak_rss_gb']:>12.2f}")
  _emit(res)


if __name__ == "__main__":
  app.run(main)
