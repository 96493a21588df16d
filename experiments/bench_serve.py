r"""Serving figures of the engine and the OpenAI-compatible server (docs/notes/serve.md).

  python -m experiments.bench_serve --json=docs/results/serve_small.json
  python -m experiments.bench_serve --checkpoint=runs/small --json=...   # a trained `small`

Model: `small` — `--checkpoint` (e.g. `make train`'s runs/small) or, without it, a freshly
initialised `small` (seed 0; the JSON says which). Every figure is measured in this process,
next to its reference:

  throughput   requests (prompts of 32/64/128/256 random byte tokens in turn, --max_tokens
               greedy tokens each; the first 8, 16, 32 of one list) sent to the server over
               HTTP by 1, 8 and 32 concurrent streaming clients (the `openai` client on
               loopback): output tokens/s, TTFT and time per output token p50/p99 — vs
               `generate()` serving the first --baseline_requests of them one at a time
               (compilation excluded from both: every shape is compiled first);
  multiturn    --conversations chats of --turns turns (--turn_chars characters of user text
               each, the model's reply in between; the context grows to ~4K tokens), each turn
               sent to a server with the prefix cache and then to one without: each turn's
               TTFT (median over the chats) and the cache's hit rate (cached prompt tokens /
               prompt tokens of the later turns);
  bytes        cache bytes per token of context: the MLA latents (every MLA layer, per
               token), the KDA states (constant per request) and the checkpoints (one per
               --checkpoint_interval tokens), vs the KV cache of the same model with
               multi-head attention in every layer;
  invariance   a few requests alone vs together (other slots, other companions, cache hits):
               max |Δ log-prob| and differing tokens, fp32 (the guarantee: 0) and bf16.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import platform
import time

import numpy as np
from absl import app, flags

_CKPT = flags.DEFINE_string("checkpoint", None, "A `small` run directory (default: fresh init).")
_JSON = flags.DEFINE_string("json", None, "Write the figures here.")
_PARTS = flags.DEFINE_list("parts", ["throughput", "multiturn", "bytes", "invariance"],
                           "Which figures.")
_REQUESTS = flags.DEFINE_list("requests", ["8", "16", "32"],
                              "Requests of the throughput run at each concurrency.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Output tokens per request.")
_CONC = flags.DEFINE_list("concurrency", ["1", "8", "32"], "Concurrent clients.")
_TILE = flags.DEFINE_integer("tile_rows", 16, "Rows of the decode program (throughput).")
_PREFILL_ROWS = flags.DEFINE_integer("prefill_rows", 1, "Pieces per prefill program "
                                     "(throughput; the multi-turn chat runs one at a time).")
_TURN_CHUNK = flags.DEFINE_integer("turn_chunk", 128, "Prefill grid of the multi-turn chat.")
_CONVERSATIONS = flags.DEFINE_integer("conversations", 2, "Multi-turn chats measured.")
_TURNS = flags.DEFINE_integer("turns", 4, "Turns of the multi-turn chat.")
_TURN_CHARS = flags.DEFINE_integer("turn_chars", 950, "User characters per turn.")
_INTERVAL = flags.DEFINE_integer("checkpoint_interval", 512, "KDA checkpoint interval.")
_BASELINE = flags.DEFINE_integer("baseline_requests", 8,
                                 "Requests generate() serves one at a time (the reference).")

LENGTHS = (32, 64, 128, 256)


def _model():
  import jax
  import jax.numpy as jnp
  import k3jax
  from k3jax.model import K3Model
  if _CKPT.value:
    cfg, v = k3jax.load_pretrained(_CKPT.value)
    return cfg, v, f"checkpoint {_CKPT.value}"
  cfg = k3jax.preset("small")
  v = jax.jit(K3Model(cfg).init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
  return cfg, v, "freshly initialised small (seed 0)"


def _server(cfg, v, **engine_kw):
  """(ServerThread, engine) serving the model over HTTP on loopback."""
  from k3jax.data.chat_tokens import ChatEncoder
  from k3jax.data.tokenizers import ByteTokenizer
  from k3jax.serve.engine import Engine, EngineConfig
  from k3jax.serve.openai_api import Protocol
  from k3jax.serve.server import ServerThread, create_app
  tok = ByteTokenizer(cfg.text.vocab_size)
  enc = ChatEncoder(tok)
  ec = EngineConfig(boundary_token=enc.end_id, **engine_kw)
  engine = Engine(cfg, v, ec, decode=tok.decode)
  engine.warmup()                              # every shape compiled before any timing
  proto = Protocol(model_name="small", tokenizer=tok, encoder=enc, max_len=ec.max_len,
                   default_max_tokens=64, num_top=ec.num_top_logprobs, stop_ids=(),
                   vocab_size=cfg.text.vocab_size)
  return ServerThread(create_app(engine, proto)).start(), engine


def _pct(xs, q):
  return float(np.percentile(xs, q)) if len(xs) else None


def _stream_completion(client, prompt, max_tokens):
  """(ttft, per-token times, n tokens) of one streamed /v1/completions request."""
  t0 = time.perf_counter()
  times = []
  for c in client.completions.create(model="small", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, stream=True, logprobs=0):
    if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.token_logprobs:
      times += [time.perf_counter()] * len(c.choices[0].logprobs.token_logprobs)
  n = len(times)
  ttft = times[0] - t0 if n else None
  tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else None
  return ttft, tpot, n


def throughput(cfg, v) -> dict:
  import openai
  from k3jax.serve import generate as G
  rng = np.random.default_rng(0)
  counts = [int(n) for n in _REQUESTS.value]
  prompts = [[int(t) for t in rng.integers(0, 256, LENGTHS[i % len(LENGTHS)])]
             for i in range(max(counts + [_BASELINE.value]))]
  mt = _MAX_TOKENS.value
  max_conc = max(int(c) for c in _CONC.value)
  srv, engine = _server(cfg, v, num_slots=max(max_conc, _TILE.value), tile_rows=_TILE.value,
                        max_len=512, page_size=16, prefill_chunk=128, step_tokens=512,
                        checkpoint_interval=_INTERVAL.value, prefix_cache=False,
                        prefill_rows=_PREFILL_ROWS.value)
  client = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=3600)
  out = {"requests": dict(zip(_CONC.value, counts)), "prompt_lengths": list(LENGTHS),
         "max_tokens": mt, "engine": dataclasses.asdict(engine.ec)}
  for n in LENGTHS:                                     # compile every shape first
    _stream_completion(client, prompts[LENGTHS.index(n)], 2)
  runs = {}
  for c, n in zip((int(x) for x in _CONC.value), counts):
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(c) as pool:
      res = list(pool.map(lambda p: _stream_completion(client, p, mt), prompts[:n]))
    wall = time.perf_counter() - t0
    toks = sum(r[2] for r in res)
    ttft = [r[0] for r in res if r[0] is not None]
    tpot = [r[1] for r in res if r[1] is not None]
    runs[str(c)] = {"requests": n, "wall_s": wall, "output_tokens": toks,
                    "tokens_per_s": toks / wall,
                    "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
                    "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99)}
    print(f"[throughput] {c} clients: {toks / wall:.2f} tok/s  {runs[str(c)]}", flush=True)
  srv.stop()
  out["server"] = runs
  # The reference: generate() serving the requests one at a time (same prompts, greedy).
  base = prompts[:_BASELINE.value]
  for n in LENGTHS:
    G.generate(cfg, v, [prompts[LENGTHS.index(n)]], max_new_tokens=2, max_len=512)
  t0 = time.perf_counter()
  toks = 0
  for p in base:
    toks += len(G.generate(cfg, v, [p], max_new_tokens=mt, max_len=512)[0])
  wall = time.perf_counter() - t0
  out["generate_one_at_a_time"] = {"requests": len(base), "wall_s": wall, "output_tokens": toks,
                                   "tokens_per_s": toks / wall}
  print(f"[throughput] generate() one at a time: {toks / wall:.2f} tok/s", flush=True)
  out["speedup_vs_generate"] = {c: r["tokens_per_s"] / (toks / wall) for c, r in runs.items()}
  return out


def _chat_turn(client, msgs):
  """(ttft, reply text, usage) of one streamed chat turn (instruct mode, greedy)."""
  t0 = time.perf_counter()
  ttft, content, usage = None, "", None
  for c in client.chat.completions.create(
      model="small", messages=msgs, max_tokens=32, temperature=0, stream=True,
      stream_options={"include_usage": True},
      extra_body={"chat_template_kwargs": {"thinking": False}}):
    if c.choices and c.choices[0].delta.content and ttft is None:
      ttft = time.perf_counter() - t0
    if c.choices:
      content += c.choices[0].delta.content or ""
    if c.usage:
      usage = c.usage
  return (ttft if ttft is not None else time.perf_counter() - t0), content, usage


def multiturn(cfg, v) -> dict:
  """Two servers side by side, with and without the prefix cache; each turn is sent to one
  and then the other (a busy machine's drift hits both alike), --conversations times."""
  import openai
  rng = np.random.default_rng(1)
  kw = dict(num_slots=4, tile_rows=4, max_len=4608, page_size=16, prefill_chunk=_TURN_CHUNK.value,
            step_tokens=1024, num_checkpoints=64, checkpoint_interval=_INTERVAL.value,
            prefill_rows=1)
  servers = {mode: _server(cfg, v, prefix_cache=mode == "cache", **kw)
             for mode in ("cache", "no_cache")}
  clients = {mode: openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0,
                                 timeout=3600) for mode, (srv, _) in servers.items()}
  out = {"turns": _TURNS.value, "turn_chars": _TURN_CHARS.value,
         "conversations": _CONVERSATIONS.value,
         "engine": dataclasses.asdict(servers["cache"][1].ec), "cache": [], "no_cache": []}
  for conv in range(_CONVERSATIONS.value):
    msgs = []
    rows = {"cache": [], "no_cache": []}
    for k in range(_TURNS.value):
      msgs.append({"role": "user", "content": "".join(
          chr(97 + i) for i in rng.integers(0, 26, _TURN_CHARS.value))})
      replies = {}
      for mode in ("cache", "no_cache"):
        ttft, replies[mode], usage = _chat_turn(clients[mode], msgs)
        rows[mode].append({"prompt_tokens": usage.prompt_tokens, "ttft_s": ttft,
                           "cached_tokens": usage.prompt_tokens_details.cached_tokens})
        print(f"[multiturn] conversation {conv} turn {k + 1} {mode}: {rows[mode][-1]}",
              flush=True)
      out.setdefault("replies_equal", []).append(replies["cache"] == replies["no_cache"])
      msgs.append({"role": "assistant", "content": replies["cache"]})
    for mode in rows:
      out[mode].append(rows[mode])
  for srv, _ in servers.values():
    srv.stop()
  later = range(1, _TURNS.value)
  med = lambda mode, k: float(np.median([c[k]["ttft_s"] for c in out[mode]]))   # noqa: E731
  out["ttft_median_s"] = {mode: [med(mode, k) for k in range(_TURNS.value)]
                          for mode in ("cache", "no_cache")}
  out["ttft_speedup_later_turns"] = [med("no_cache", k) / med("cache", k) for k in later]
  out["ttft_speedup_later_turns_total"] = (sum(med("no_cache", k) for k in later)
                                           / sum(med("cache", k) for k in later))
  out["hit_rate_later_turns"] = (
      sum(c[k]["cached_tokens"] for c in out["cache"] for k in later)
      / sum(c[k]["prompt_tokens"] for c in out["cache"] for k in later))
  return out


def cache_bytes(cfg, context: int = 4096) -> dict:
  from k3jax.config import KDA, MLA, dtype_of
  itemsize = np.dtype(dtype_of(cfg.modes.dtype)).itemsize
  kinds = [m for m, _ in cfg.text.layer_types()]
  n_mla, n_kda = kinds.count(MLA), kinds.count(KDA)
  mla_per_token = n_mla * (cfg.text.kv_lora_rank + cfg.text.qk_rope_head_dim) * itemsize
  h, k, w = cfg.text.kda_num_heads, cfg.text.kda_head_dim, cfg.text.kda_conv_size
  kda_state = n_kda * (h * k * k + 3 * (w - 1) * h * k) * 4        # fp32 state and conv tails
  checkpoints = (context // _INTERVAL.value) * kda_state
  mha_per_token = cfg.text.num_layers * cfg.text.num_heads * (cfg.text.qk_head_dim + cfg.text.v_head_dim) * itemsize
  hybrid = mla_per_token * context + kda_state
  return {"context": context, "dtype": cfg.modes.dtype, "mla_layers": n_mla, "kda_layers": n_kda,
          "mla_bytes_per_token": mla_per_token, "kda_state_bytes_per_request": kda_state,
          "kda_checkpoint_bytes": kda_state,
          "hybrid_bytes_per_token_at_context": hybrid / context,
          "hybrid_with_checkpoints_bytes_per_token": (hybrid + checkpoints) / context,
          "mha_bytes_per_token": mha_per_token,
          "mha_over_hybrid": mha_per_token * context / hybrid}


def invariance(cfg, v) -> dict:
  from k3jax.serve.engine import Engine, EngineConfig, RequestParams
  rng = np.random.default_rng(2)
  base = [int(t) for t in rng.integers(0, 256, 300)]
  prompts = [base[:200], base, base[:150] + [int(t) for t in rng.integers(0, 256, 60)],
             [int(t) for t in rng.integers(0, 256, 90)]]
  params = RequestParams(max_tokens=8)
  ec = EngineConfig(num_slots=8, tile_rows=4, max_len=512, prefill_chunk=64,
                    checkpoint_interval=64, step_tokens=128)
  out = {}
  for dtype in ("float32", "bfloat16"):
    c = cfg.replace(dtype=dtype)
    alone = [Engine(c, v, dataclasses.replace(ec, prefix_cache=False)).generate([p], params)[0]
             for p in prompts]
    eng = Engine(c, v, ec)
    eng.generate([prompts[1]], params)                 # cache entries for the others to hit
    together = eng.generate(prompts[::-1], params)[::-1]
    diffs = [np.max(np.abs(np.subtract(a.logprobs[:min(len(a.logprobs), len(b.logprobs))],
                                       b.logprobs[:min(len(a.logprobs), len(b.logprobs))])))
             for a, b in zip(alone, together)]
    out[dtype] = {"max_abs_logprob_diff": float(max(diffs)),
                  "requests_with_different_tokens": sum(a.tokens != b.tokens
                                                        for a, b in zip(alone, together)),
                  "cached_tokens": [r.cached_tokens for r in together]}
    out[dtype + "_alone"] = alone
    print(f"[invariance] {dtype}: {out[dtype]}", flush=True)
  f32, b16 = out.pop("float32_alone"), out.pop("bfloat16_alone")
  out["bf16_vs_fp32"] = {
      "first_token_logprob_max_abs_diff": float(max(abs(a.logprobs[0] - b.logprobs[0])
                                                    for a, b in zip(f32, b16))),
      "requests_with_different_tokens": sum(a.tokens != b.tokens for a, b in zip(f32, b16))}
  return out


def main(argv):
  del argv
  import jax
  cfg, v, source = _model()
  figures = {"model": source, "date": time.strftime("%Y-%m-%d"),
             "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__} "
                        f"{jax.default_backend()}"}
  parts = {"throughput": throughput, "multiturn": multiturn, "invariance": invariance}
  for name in _PARTS.value:
    if name == "bytes":
      figures["bytes"] = cache_bytes(cfg)
      print(f"[bytes] {figures['bytes']}", flush=True)
    else:
      figures[name] = parts[name](cfg, v)
  if _JSON.value:
    os.makedirs(os.path.dirname(os.path.abspath(_JSON.value)), exist_ok=True)
    tmp = _JSON.value + ".tmp"
    with open(tmp, "w") as f:
      json.dump(figures, f, indent=1)
    os.replace(tmp, _JSON.value)
  print(json.dumps(figures, indent=1))


if __name__ == "__main__":
  app.run(main)
