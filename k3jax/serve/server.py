"""The OpenAI-compatible HTTP server over an `Engine` (FastAPI + uvicorn).

    app = create_app(engine, protocol)          # starts the engine's loop thread
    ServerThread(app, port=8000).start()        # or uvicorn.run(app, ...)

Endpoints: POST /v1/chat/completions and /v1/completions (server-sent events with
`"stream": true`), GET /v1/models, /health, /metrics (k3jax/serve/metrics.py). Requests are
parsed and checked by `openai_api.Protocol`; the engine runs in its own thread
(`EngineLoop`), each request's tokens come back through a per-request asyncio queue.

Nothing a client sends can break the server: a body that is not JSON, an unknown model, a bad
field, a prompt over the context, too many or undecodable images → an OpenAI-style error body
with a 4xx status, nothing queued; a client that disconnects (mid-stream or while waiting) has
its request cancelled, which frees its slot and pages at the next engine step; a failed
engine step fails the requests it held (500 / an error event) and the loop goes on.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
import time
import uuid

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3jax.serve import openai_api as api
from k3jax.serve.engine import Engine, EngineLoop
from k3jax.serve.metrics import CONTENT_TYPE, Metrics
from k3jax.vision.media import media_from_pixels
from k3jax.vision.preprocess import preprocess


def _sse(obj) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def prepare_media(vision, images: list[bytes], image_messages: dict):
  """Images → (Media, {message: [placeholders per image]}, per-placeholder keys int64).
  APIError 400 for an image that does not decode or does not fit the tower's buckets."""
  try:
    pixels, grid = preprocess(vision, images)
    media = media_from_pixels(vision, pixels, grid)
  except ValueError as e:
    raise api.APIError(400, f"image: {e}", param="messages", code="invalid_image") from None
  counts = [(h // 2) * (w // 2) for _, h, w in grid.tolist()]
  per_msg, k = {}, 0
  for m in sorted(image_messages):
    per_msg[m] = counts[k:k + image_messages[m]]
    k += image_messages[m]
  keys = np.concatenate([np.full(c, int.from_bytes(hashlib.sha256(img).digest()[:8], "little",
                                                   signed=True), np.int64)
                         for c, img in zip(counts, images)])
  return media, per_msg, keys


class _Handlers:
  def __init__(self, engine: Engine, protocol: api.Protocol, metrics: Metrics, loop: EngineLoop):
    self.engine, self.protocol, self.metrics, self.loop = engine, protocol, metrics, loop
    self.created = int(time.time())

  # ------------------------------------------------------------------ plumbing
  def _submit(self, endpoint: str, p: api.Prepared, media=None, keys=None):
    """Submit to the engine; (request id, asyncio queue of its updates)."""
    aloop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def on_update(u):   # engine thread
      if u.finished and u.record is not None:
        self.metrics.observe(endpoint, u.record, u.finish_reason)
      aloop.call_soon_threadsafe(queue.put_nowait, u)

    try:
      rid = self.engine.submit(p.prompt, p.params, on_update=on_update, media=media,
                               media_keys=keys, keep=False,
                               request_id=f"{uuid.uuid4().hex[:24]}")
    except ValueError as e:
      raise api.APIError(400, str(e)) from None
    return rid, queue

  async def _next(self, rid: str, queue: asyncio.Queue, request: Request):
    """The next update; None when the client went away (the request is cancelled)."""
    while True:
      try:
        return await asyncio.wait_for(queue.get(), timeout=1.0)
      except asyncio.TimeoutError:
        if await request.is_disconnected():
          self.engine.cancel(rid)
          return None

  async def _collect(self, rid: str, queue: asyncio.Queue, request: Request, feed):
    """A non-streamed request's updates to the end, each one's tokens through `feed`:
    (last update, tokens, log-probs, top pairs); None when the client went away."""
    tokens, lps, tops = [], [], []
    while True:
      u = await self._next(rid, queue, request)
      if u is None:
        return None
      tokens += u.tokens
      lps += u.logprobs
      tops += u.top
      feed(u.tokens)
      if u.finished:
        break
    if u.finish_reason == "error":
      raise api.APIError(500, u.error or "generation failed", type="server_error")
    return u, tokens, lps, tops

  async def _body(self, request: Request):
    raw = await request.body()
    try:
      return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise api.APIError(400, f"The request body is not valid JSON: {e}",
                         code="invalid_json") from None

  # ------------------------------------------------------------------ chat
  async def chat(self, request: Request):
    p = self.protocol.chat(await self._body(request))
    media = keys = counts = None
    if p.images:
      media, counts, keys = await run_in_threadpool(prepare_media, self.protocol.vision,
                                                    p.images, p.image_messages)
    self.protocol.encode_chat(p, counts)
    rid, queue = self._submit("chat", p, media, keys)
    parser = api.ReplyParser(self.protocol.tokenizer.decode, self.protocol.encoder.marker_ids,
                             p.thinking, p.params.stop_strings)
    cid, model = f"chatcmpl-{rid}", self.protocol.model_name
    if p.stream:
      return StreamingResponse(self._chat_stream(request, p, rid, queue, parser, cid, model),
                               media_type="text/event-stream")
    got = await self._collect(rid, queue, request, parser.feed)
    if got is None:
      return Response(status_code=499)
    u, tokens, lps, tops = got
    _, (think, content, calls) = parser.finish()
    message = {"role": "assistant", "content": content, "reasoning_content": think}
    reason = u.finish_reason
    if calls:
      message["tool_calls"] = api.tool_calls_json(calls, rid)
      reason = "tool_calls"
    logprobs = None
    if p.logprobs:
      logprobs = {"content": api.chat_logprobs(self.protocol.tokenizer, tokens, lps, tops,
                                                 p.top_logprobs)}
    rec = u.record
    return JSONResponse({
        "id": cid, "object": "chat.completion", "created": api.now(), "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                     "finish_reason": reason}],
        "usage": api.usage(len(rec.prompt), len(rec.tokens), rec.cached_tokens)})

  async def _chat_stream(self, request, p, rid, queue, parser, cid, model):
    done = False
    created = api.now()

    def chunk(delta, reason=None, logprobs=None):
      return _sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                   "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                                "finish_reason": reason}]})
    try:
      yield chunk({"role": "assistant", "content": ""})
      while True:
        u = await queue.get()
        lp = None
        if p.logprobs and u.tokens:
          lp = {"content": api.chat_logprobs(self.protocol.tokenizer, u.tokens, u.logprobs,
                                              u.top, p.top_logprobs)}
        deltas = parser.feed(u.tokens)
        if u.finished:
          done = True
          break
        merged = _merge(deltas)
        if merged or lp:
          yield chunk(merged, logprobs=lp)
      if u.finish_reason == "error":
        yield _sse(api.APIError(500, u.error or "generation failed", type="server_error").body())
        yield "data: [DONE]\n\n"
        return
      tail, (_, _, calls) = parser.finish()
      merged = _merge(deltas + tail)
      if merged:
        yield chunk(merged)
      reason = u.finish_reason
      if calls:
        yield chunk({"tool_calls": [dict(index=j, **c) for j, c in
                                    enumerate(api.tool_calls_json(calls, rid))]})
        reason = "tool_calls"
      yield chunk({}, reason)
      if p.include_usage:
        rec = u.record
        yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [],
                    "usage": api.usage(len(rec.prompt), len(rec.tokens), rec.cached_tokens)})
      yield "data: [DONE]\n\n"
    finally:
      if not done:        # the client went away: free the slot and its pages
        self.engine.cancel(rid)

  # ------------------------------------------------------------------ completions
  async def completion(self, request: Request):
    p = self.protocol.completion(await self._body(request))
    rid, queue = self._submit("completions", p)
    text = api.TextStream(self.protocol.tokenizer.decode, p.params.stop_strings)
    cid, model = f"cmpl-{rid}", self.protocol.model_name
    if p.stream:
      return StreamingResponse(self._completion_stream(p, rid, queue, text, cid, model),
                               media_type="text/event-stream")
    got = await self._collect(rid, queue, request, text.push)
    if got is None:
      return Response(status_code=499)
    u, tokens, lps, tops = got
    rec = u.record
    return JSONResponse({
        "id": cid, "object": "text_completion", "created": api.now(), "model": model,
        "choices": [{"index": 0, "text": text.text(),
                     "logprobs": self._completion_logprobs(p, tokens, lps, tops),
                     "finish_reason": u.finish_reason}],
        "usage": api.usage(len(rec.prompt), len(rec.tokens), rec.cached_tokens)})

  def _completion_logprobs(self, p, tokens, lps, tops):
    if not p.logprobs:
      return None
    tok = self.protocol.tokenizer
    strs = [tok.decode([t], specials=True) for t in tokens]
    offsets = np.cumsum([0] + [len(s) for s in strs[:-1]]).tolist() if strs else []
    return {"tokens": strs, "token_logprobs": lps,
            "top_logprobs": [{tok.decode([i], specials=True): l for i, l in top[:p.top_logprobs]}
                             for top in tops],
            "text_offset": offsets}

  async def _completion_stream(self, p, rid, queue, text, cid, model):
    done = False
    created = api.now()

    def chunk(s, reason=None, logprobs=None):
      return _sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                   "choices": [{"index": 0, "text": s, "logprobs": logprobs,
                                "finish_reason": reason}]})
    try:
      while True:
        u = await queue.get()
        s = text.push(u.tokens)
        if u.finished:
          done = True
          break
        if s or (p.logprobs and u.tokens):
          yield chunk(s, logprobs=self._completion_logprobs(p, u.tokens, u.logprobs, u.top))
      if u.finish_reason == "error":
        yield _sse(api.APIError(500, u.error or "generation failed", type="server_error").body())
        yield "data: [DONE]\n\n"
        return
      yield chunk(s + text.final(), u.finish_reason)
      if p.include_usage:
        rec = u.record
        yield _sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                    "choices": [],
                    "usage": api.usage(len(rec.prompt), len(rec.tokens), rec.cached_tokens)})
      yield "data: [DONE]\n\n"
    finally:
      if not done:
        self.engine.cancel(rid)


def _merge(deltas: list[dict]) -> dict:
  """Consecutive channel deltas as one delta (texts of one key concatenated)."""
  out: dict = {}
  for d in deltas:
    for k, v in d.items():
      out[k] = out.get(k, "") + v
  return out


def create_app(engine: Engine, protocol: api.Protocol, *, loop: EngineLoop | None = None
               ) -> FastAPI:
  """The FastAPI app (module doc). Starts an `EngineLoop` on the engine unless given one;
  `app.state.engine`, `.loop`, `.metrics` hold them."""
  loop = loop or EngineLoop(engine).start()
  metrics = Metrics(engine)
  h = _Handlers(engine, protocol, metrics, loop)
  app = FastAPI(title="k3jax", docs_url=None, redoc_url=None, openapi_url=None)
  app.state.engine, app.state.loop, app.state.metrics = engine, loop, metrics

  @app.exception_handler(api.APIError)
  async def _api_error(request: Request, e: api.APIError):
    metrics.errors.labels(str(e.status)).inc()
    return JSONResponse(e.body(), status_code=e.status)

  @app.exception_handler(StarletteHTTPException)
  async def _http_error(request: Request, e: StarletteHTTPException):
    metrics.errors.labels(str(e.status_code)).inc()
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(api.APIError(e.status_code, f"{request.method} {request.url.path}: "
                                     f"{e.detail}", type=kind).body(), status_code=e.status_code)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await h.chat(request)

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await h.completion(request)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{
        "id": protocol.model_name, "object": "model", "created": h.created, "owned_by": "k3jax",
        "max_model_len": protocol.max_len}]}

  @app.get("/health")
  async def health():
    if not loop.thread.is_alive():
      return JSONResponse({"status": "error", "detail": "the engine loop is not running"},
                          status_code=503)
    return {"status": "ok"}

  @app.get("/metrics")
  async def prometheus():
    body = await run_in_threadpool(metrics.render)
    return Response(body, media_type=CONTENT_TYPE)

  return app


def free_port(host: str = "127.0.0.1") -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


class ServerThread:
  """uvicorn serving `app` on (host, port) in a background thread (tests, benchmarks).
  `start()` returns once it accepts connections; `stop()` shuts it down and the app's loop."""

  def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int | None = None):
    self.app, self.host, self.port = app, host, port or free_port(host)
    self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port,
                                                log_level="warning", lifespan="off"))
    self.thread = threading.Thread(target=self.server.run, name="k3jax-http", daemon=True)

  @property
  def url(self) -> str:
    return f"http://{self.host}:{self.port}"

  def start(self, timeout: float = 30.0) -> "ServerThread":
    self.thread.start()
    t0 = time.time()
    while not self.server.started:
      if time.time() - t0 > timeout or not self.thread.is_alive():
        raise RuntimeError(f"server on {self.url} did not start")
      time.sleep(0.02)
    return self

  def stop(self) -> None:
    self.server.should_exit = True
    self.thread.join(timeout=30)
    self.app.state.loop.stop()


__all__ = ["create_app", "prepare_media", "ServerThread", "free_port"]
