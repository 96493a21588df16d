r"""Serve a k3jax model over an OpenAI-compatible HTTP API.

  python -m experiments.serve --checkpoint=runs/small --port=8000
  make serve                                   # the same on `make train`'s runs/small

Endpoints (k3jax/serve/server.py): POST /v1/chat/completions, /v1/completions (streaming with
"stream": true), GET /v1/models, /health, /metrics. Any OpenAI client works, e.g.

  from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
  client.chat.completions.create(model="small", messages=[{"role": "user", "content": "hi"}])

--checkpoint: a run / checkpoint / converted directory (`k3jax.load_pretrained`); its
`tiktoken.model` is the tokenizer when present, else the byte tokenizer. Without it, --preset
serves a randomly initialised model (smoke tests). --model_name: the name clients ask for
(default: the checkpoint directory's name, or the preset's).

The engine (k3jax/serve/engine.py): --num_slots concurrent requests in decode tiles of
--tile_rows; --max_len tokens per request; MLA latents in pages of --page_size tokens
(--num_pages, default: enough for every slot twice); prefill in pieces of at most
--prefill_chunk tokens on a fixed grid, --step_tokens per step; prefix-cache checkpoints every
--checkpoint_interval tokens and at every chat turn boundary, --num_checkpoints on device,
--host_offload_mb on the host (0: none); --no_prefix_cache turns it off. --draft_len=n:
speculative decoding with the model's MTP (or EAGLE-3) draft, n drafted tokens per round.
"""

from __future__ import annotations

import os

from absl import app, flags

def define_flags() -> None:
  """The CLI's flags. Defined when run as a program only: tests import `build` beside other
  entry points whose flags share names (--checkpoint, --preset, --tokenizer)."""
  d = flags
  d.DEFINE_string("checkpoint", None, "Checkpoint / run / converted directory.")
  d.DEFINE_string("preset", None, "Random-init preset when no --checkpoint.")
  d.DEFINE_string("tokenizer", None, "tiktoken.model path (default: auto).")
  d.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
  d.DEFINE_integer("port", 8000, "Port to listen on.")
  d.DEFINE_string("model_name", None, "Model id clients use (default: from the path).")
  d.DEFINE_integer("num_slots", 8, "Concurrent requests.")
  d.DEFINE_integer("tile_rows", 4, "Rows of the decode program.")
  d.DEFINE_integer("max_len", 2048, "Tokens per request (prompt + generated).")
  d.DEFINE_integer("page_size", 16, "Tokens per MLA latent page.")
  d.DEFINE_integer("num_pages", None, "Pages in the pool (default: every slot's max_len, twice).")
  d.DEFINE_integer("prefill_chunk", 128, "Longest prefill piece (the grid).")
  d.DEFINE_integer("step_tokens", 256, "Token budget of a step.")
  d.DEFINE_integer("checkpoint_interval", 512, "KDA checkpoint interval (tokens).")
  d.DEFINE_integer("num_checkpoints", 32, "Device checkpoint slots.")
  d.DEFINE_integer("host_offload_mb", 0, "Host memory for offloaded checkpoints (MiB).")
  d.DEFINE_bool("no_prefix_cache", False, "Turn the prefix cache off.")
  d.DEFINE_integer("draft_len", 0, "Speculative decoding with the model's MTP / EAGLE-3 "
                   "draft: drafted tokens per round (0: off).")
  d.DEFINE_integer("prefill_rows", 1, "Pieces (of different requests) per prefill program.")
  d.DEFINE_integer("max_images", 4, "Images per request.")
  d.DEFINE_integer("default_max_tokens", 256,
                   "max_tokens when a request gives none (capped by the context).")


def build(checkpoint=None, preset=None, tokenizer=None, model_name=None, warmup=True,
          **engine_kw):
  """(app, engine): the FastAPI app over a started engine loop (module doc), every program
  compiled first with `warmup`. engine_kw: `EngineConfig` fields (num_slots, max_len, …) plus
  max_images and default_max_tokens."""
  from experiments.model_loading import load_model, load_tokenizer
  from k3jax.data.chat_tokens import ChatEncoder
  from k3jax.serve.engine import Engine, EngineConfig
  from k3jax.serve.openai_api import Protocol
  from k3jax.serve.server import create_app
  max_images = engine_kw.pop("max_images", 4)
  default_max = engine_kw.pop("default_max_tokens", 256)
  cfg, variables = load_model(checkpoint, preset)
  tok = load_tokenizer(checkpoint, tokenizer, cfg.text.vocab_size)
  encoder = ChatEncoder(tok, media_id=cfg.media_placeholder_token_id)
  ec = EngineConfig(boundary_token=encoder.end_id, **engine_kw)
  engine = Engine(cfg, variables, ec, decode=tok.decode)
  if warmup:
    engine.warmup()
  name = model_name or (os.path.basename(os.path.normpath(checkpoint)) if checkpoint else preset)
  eos = getattr(tok, "eos_id", None)
  protocol = Protocol(model_name=name, tokenizer=tok, encoder=encoder, max_len=ec.max_len,
                      default_max_tokens=default_max, max_images=max_images,
                      num_top=ec.num_top_logprobs, vision=cfg.vision,
                      stop_ids=() if eos is None else (eos,), vocab_size=cfg.text.vocab_size)
  return create_app(engine, protocol), engine


def main(argv):
  del argv
  import uvicorn
  f = flags.FLAGS
  if (f.checkpoint is None) == (f.preset is None):
    raise ValueError("exactly one of --checkpoint / --preset is required")
  application, _ = build(
      f.checkpoint, f.preset, f.tokenizer, f.model_name, num_slots=f.num_slots,
      tile_rows=f.tile_rows, max_len=f.max_len, page_size=f.page_size, num_pages=f.num_pages,
      prefill_chunk=f.prefill_chunk, step_tokens=f.step_tokens,
      checkpoint_interval=f.checkpoint_interval, num_checkpoints=f.num_checkpoints,
      host_checkpoint_bytes=f.host_offload_mb << 20, prefix_cache=not f.no_prefix_cache,
      draft_len=f.draft_len, prefill_rows=f.prefill_rows, max_images=f.max_images,
      default_max_tokens=f.default_max_tokens)
  print(f"[serve] http://{f.host}:{f.port}/v1 ready", flush=True)
  uvicorn.run(application, host=f.host, port=f.port, log_level="info")


if __name__ == "__main__":
  define_flags()
  app.run(main)
