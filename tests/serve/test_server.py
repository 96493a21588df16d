"""The OpenAI-compatible server with the `openai` client on loopback: one server per module (a
tiny multimodal model saved as a checkpoint and loaded by experiments/serve.py's `build`).

Chat and completions, streaming and not; the think channel as `reasoning_content`; tool calls
both ways; images; multi-turn prefix-cache hits; cancellation by disconnect; every kind of bad
input → an OpenAI-style 4xx and the server still serving; a bounded load test (64 requests
from 16 clients, some cancelled) in which every completed response equals the same request
served alone; pages back to the baseline after every test.

Replies the random model cannot be made to write (a tool call, a think channel) come from a
script: requests whose user text starts with "SCRIPT:" have their sampled tokens replaced by
the script's (`_scripted`), so the server's parsing of real marker tokens is exercised
end to end."""

import base64
import concurrent.futures as cf
import io
import json
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
from PIL import Image

from k3jax.convert.checkpoint import save_pretrained
from k3jax.data import chat
from k3jax.serve.server import ServerThread
from serve.engine_fixtures import model

MODEL = "k3-tiny"
TIMEOUT = 120
ENGINE = dict(num_slots=4, tile_rows=2, max_len=320, page_size=16, prefill_chunk=32,
              prefill_buckets=(16, 32), checkpoint_interval=32, step_tokens=64,
              num_checkpoints=16, prefill_rows=2)


SCRIPTS = {   # "SCRIPT:<name>" → the reply's segments (markers become their ids)
    "tool": [(chat.TEXT, "add them"), (chat.MARK, chat.CLOSE), (chat.MARK, chat.OPEN),
             (chat.NAME, "tools"), (chat.MARK, chat.SEP),
             (chat.TEXT, '[{"arguments":{"a":2,"b":3},"name":"add"}]'), (chat.MARK, chat.CLOSE),
             (chat.MARK, chat.END)],
    "think": [(chat.TEXT, "hmm [close] é"), (chat.MARK, chat.CLOSE), (chat.MARK, chat.OPEN),
              (chat.NAME, "response"), (chat.MARK, chat.SEP), (chat.TEXT, "five <eos>"),
              (chat.MARK, chat.CLOSE), (chat.MARK, chat.END)],
}


def _scripted(engine, encoder):
  """engine._emit with the sampled token replaced by the script of a "SCRIPT:" request."""
  real = engine._emit
  replies = {name: encoder.segments(segs) for name, segs in SCRIPTS.items()}
  marks = {name: encoder.text(f"SCRIPT:{name}") for name in SCRIPTS}

  def emit(slot, out, i):
    prompt = slot.req.prompt.tolist()
    for name, key in marks.items():
      if any(prompt[j:j + len(key)] == key for j in range(len(prompt))):
        out.tokens = np.array(out.tokens)
        out.tokens[i] = replies[name][min(len(slot.req.tokens), len(replies[name]) - 1)]
    real(slot, out, i)
  engine._emit = emit


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  from experiments.serve import build
  cfg, v = model("tiny_multimodal")
  ckpt = tmp_path_factory.mktemp("ckpt")
  save_pretrained(ckpt, cfg, v)
  app, engine = build(checkpoint=str(ckpt), model_name=MODEL, max_images=2,
                      default_max_tokens=8, **ENGINE)
  from k3jax.data.chat_tokens import ChatEncoder
  from k3jax.data.tokenizers import ByteTokenizer
  _scripted(engine, ChatEncoder(ByteTokenizer()))
  srv = ServerThread(app).start()
  yield srv
  srv.stop()


@pytest.fixture
def client(server):
  c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                    timeout=TIMEOUT)
  yield c
  _at_baseline(server)


def _at_baseline(server, timeout=30.0):
  """No request running or waiting and no page held by one (cancellations take a step)."""
  eng = server.app.state.engine
  t0 = time.time()
  while True:
    st = eng.stats()
    if st["running"] == 0 and st["waiting"] == 0 and st["pages_in_use"] == 0:
      break
    assert time.time() - t0 < timeout, st
    time.sleep(0.05)
  assert st["pages_used"] == st["pages_cached"], st


def _png(rng, h=56, w=56) -> str:
  buf = io.BytesIO()
  Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
  return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _http(method, url, raw: bytes | None = None):
  """(status, body text) of a plain HTTP request (errors included)."""
  req = urllib.request.Request(url, data=raw, method=method,
                               headers={"content-type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
      return r.status, r.read().decode()
  except urllib.error.HTTPError as e:
    return e.code, e.read().decode()


# ---------------------------------------------------------------------- basics
def test_models_health_and_metrics(server, client):
  assert [m.id for m in client.models.list().data] == [MODEL]
  assert json.loads(_http("GET", server.url + "/health")[1]) == {"status": "ok"}
  client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
  text = _http("GET", server.url + "/metrics")[1]
  for name in ("k3jax_requests_total", "k3jax_queue_length", "k3jax_pages_in_use",
               "k3jax_time_to_first_token_seconds_bucket",
               "k3jax_time_per_output_token_seconds_bucket", "k3jax_prefix_cache_hit_rate"):
    assert name in text, name


def test_chat_streaming_equals_non_streaming(client):
  kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi <eos> [open]"}],
            max_tokens=6, temperature=0.7, seed=4, logprobs=True, top_logprobs=2)
  full = client.chat.completions.create(**kw)
  msg = full.choices[0].message
  assert full.choices[0].finish_reason in ("length", "stop")
  assert full.usage.completion_tokens == len(full.choices[0].logprobs.content)
  chunks = list(client.chat.completions.create(**kw, stream=True,
                                               stream_options={"include_usage": True}))
  think = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                  for c in chunks if c.choices)
  content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert think == (msg.model_extra.get("reasoning_content") or "")
  assert content == (msg.content or "")
  assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
  lps = [x.logprob for c in chunks if c.choices and c.choices[0].logprobs
         for x in c.choices[0].logprobs.content]
  assert lps == [x.logprob for x in full.choices[0].logprobs.content]


def test_completions_streaming_and_stop(client):
  full = client.completions.create(model=MODEL, prompt="The cat", max_tokens=8, logprobs=1)
  assert len(full.choices[0].logprobs.token_logprobs) == full.usage.completion_tokens
  streamed = "".join(c.choices[0].text for c in client.completions.create(
      model=MODEL, prompt="The cat", max_tokens=8, stream=True) if c.choices)
  assert streamed == full.choices[0].text
  if len(full.choices[0].text) > 2:
    stop = full.choices[0].text[1:3]
    cut = client.completions.create(model=MODEL, prompt="The cat", max_tokens=8, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text


# ---------------------------------------------------------------------- channels and tools
def test_reasoning_and_tool_calls_come_back(client):
  """The think channel → reasoning_content (a typed "[close]" stays text); the tools channel
  → tool_calls (finish_reason "tool_calls"); a tool result goes back in."""
  r = client.chat.completions.create(model=MODEL, max_tokens=40,
                                     messages=[{"role": "user", "content": "SCRIPT:think"}])
  m = r.choices[0].message
  assert m.model_extra["reasoning_content"] == "hmm [close] é" and m.content == "five <eos>"
  assert r.choices[0].finish_reason == "stop"
  tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
  msgs = [{"role": "user", "content": "SCRIPT:tool 2+3?"}]
  r = client.chat.completions.create(model=MODEL, max_tokens=60, messages=msgs, tools=tools)
  call = r.choices[0].message.tool_calls[0]
  assert r.choices[0].finish_reason == "tool_calls"
  assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
  chunks = list(client.chat.completions.create(model=MODEL, max_tokens=60, messages=msgs,
                                               tools=tools, stream=True))
  calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
  assert calls[0].function.name == "add" and chunks[-1].choices[0].finish_reason == "tool_calls"
  follow = msgs + [r.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "5"}]
  r2 = client.chat.completions.create(model=MODEL, max_tokens=3, messages=follow, tools=tools,
                                      extra_body={"chat_template_kwargs": {"thinking": False}})
  assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_multi_turn_prefills_only_the_new_turn(client):
  rng = np.random.default_rng(0)
  msgs = [{"role": "system", "content": "x" * 40},
          {"role": "user", "content": "".join(chr(97 + i) for i in rng.integers(0, 26, 20))}]
  r1 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
  msgs += [{"role": "assistant", "content": r1.choices[0].message.content or "ok"},
           {"role": "user", "content": "more"}]
  r2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
  cached = r2.usage.prompt_tokens_details.cached_tokens
  # Turn 1's prompt is [BOS] + system block + user block + the reply's 18-token opening
  # ([open]assistant[sep][open]think[sep]); turn 2 resumes right after the user block's
  # [end_of_msg] (a turn boundary): it prefills the reply and the new turn only.
  assert cached == r1.usage.prompt_tokens - 18


# ---------------------------------------------------------------------- images
def test_images(client):
  rng = np.random.default_rng(1)
  img = _png(rng)
  parts = [{"type": "text", "text": "What is it?"}, {"type": "image_url",
                                                      "image_url": {"url": img}}]
  r = client.chat.completions.create(model=MODEL, max_tokens=4,
                                     messages=[{"role": "user", "content": parts}])
  # [BOS], [open]user[sep], 4 placeholders (56×56 pixels: 4×4 patches merged 2×2), the text,
  # [end_of_msg], the 18-token opening
  assert r.usage.prompt_tokens == 1 + 6 + 4 + len("What is it?") + 1 + 18
  again = client.chat.completions.create(
      model=MODEL, max_tokens=4, messages=[{"role": "user", "content": parts},
                                           {"role": "assistant", "content": "ok"},
                                           {"role": "user", "content": "and?"}])
  # The image's turn is cached (its entry's key covers the image): at least up to its
  # boundary (here the grid point 32, inside the shared "[open]assistant[sep][open]").
  assert again.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 18
  other = [{"type": "image_url", "image_url": {"url": _png(rng)}}, parts[0]]
  miss = client.chat.completions.create(model=MODEL, max_tokens=4,
                                        messages=[{"role": "user", "content": other}])
  assert miss.usage.prompt_tokens_details.cached_tokens == 0      # another image: no hit


# ---------------------------------------------------------------------- bad input
def _post(server, path, body, raw=None):
  return _http("POST", server.url + path, raw if raw is not None else json.dumps(body).encode())


def test_bad_input_gets_a_clear_error_and_nothing_breaks(server, client):
  user = [{"role": "user", "content": "hi"}]
  img = {"type": "image_url", "image_url": {"url": _png(np.random.default_rng(2))}}
  cases = [
      (dict(raw=b"{not json"), 400, "not valid JSON"),
      (dict(body={"model": "gpt-9", "messages": user}), 404, "does not exist"),
      (dict(body={"model": MODEL}), 400, "'messages'"),
      (dict(body={"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}), 400,
       "role"),
      (dict(body={"model": MODEL, "messages": user, "temperature": 5}), 400, "temperature"),
      (dict(body={"model": MODEL, "messages": user, "top_p": 0}), 400, "top_p"),
      (dict(body={"model": MODEL, "messages": user, "n": 2}), 400, "'n'"),
      (dict(body={"model": MODEL, "messages": user, "max_tokens": 0}), 400, "max_tokens"),
      (dict(body={"model": MODEL, "messages": user, "max_tokens": 500}), 400,
       "maximum context length"),
      (dict(body={"model": MODEL, "messages": [{"role": "user", "content": "x" * 400}]}), 400,
       "maximum context length"),
      (dict(body={"model": MODEL, "messages": user, "presence_penalty": 1}), 400, "penalty"),
      (dict(body={"model": MODEL, "messages": [{"role": "user", "content": [img] * 3}]}), 400,
       "Too many images"),
      (dict(body={"model": MODEL, "messages": [{"role": "user", "content": [
          {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]}),
       400, "cannot read or decode"),
      (dict(body={"model": MODEL, "messages": [{"role": "user", "content": [
          {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]}),
       400, "data:"),
  ]
  for kw, status, text in cases:
    code, body = _post(server, "/v1/chat/completions", kw.get("body"), kw.get("raw"))
    assert code == status, (kw, body)
    err = json.loads(body)["error"]
    assert text in err["message"] and err["type"], (kw, err)
  code, body = _post(server, "/v1/completions", {"model": MODEL, "prompt": [1, 99999]})
  assert code == 400 and "token ids" in json.loads(body)["error"]["message"]
  code, body = _http("GET", server.url + "/v1/nothing")
  assert code == 404 and json.loads(body)["error"]["type"] == "not_found_error"
  with pytest.raises(openai.NotFoundError):
    client.chat.completions.create(model="nope", messages=user)
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model=MODEL, messages=user, max_tokens=10_000)
  assert e.value.body["code"] == "context_length_exceeded"
  # Still serving.
  assert client.chat.completions.create(model=MODEL, messages=user, max_tokens=2).choices


def test_disconnect_mid_stream_cancels(server, client):
  eng = server.app.state.engine
  before = eng.stats()["finish"].get("cancelled", 0)
  stream = client.chat.completions.create(model=MODEL, stream=True, max_tokens=60,
                                          messages=[{"role": "user", "content": "long"}])
  for _ in zip(range(3), stream):
    pass
  stream.close()
  t0 = time.time()
  while eng.stats()["finish"].get("cancelled", 0) == before:
    assert time.time() - t0 < 30
    time.sleep(0.05)
  # A client that gives up while waiting for a non-streamed reply is cancelled too. The
  # engine is paused meanwhile (its step lock held), so the reply cannot come first.
  before = eng.stats()["finish"].get("cancelled", 0)
  with eng._step_lock:
    with pytest.raises(openai.APITimeoutError):
      client.with_options(timeout=0.5).chat.completions.create(
          model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "slow"}])
    t0 = time.time()
    while not any(kind == "cancel" for kind, _ in eng._inbox):
      assert time.time() - t0 < 30
      time.sleep(0.05)
  while eng.stats()["finish"].get("cancelled", 0) == before:
    assert time.time() - t0 < 30
    time.sleep(0.05)


# ---------------------------------------------------------------------- load
def test_load_every_response_equals_the_request_alone(server, client):
  """64 requests (16 kinds: prompt lengths 3–60, greedy and seeded sampling, shared prefixes)
  from 16 concurrent clients, every 7th a stream closed early. Every completed response is
  the kind's response served alone, bit for bit (text and log-probs)."""
  rng = np.random.default_rng(5)
  shared = "".join(chr(97 + i) for i in rng.integers(0, 26, 40))
  kinds = []
  for k in range(16):
    n = int(rng.integers(3, 60))          # prompts of 32–90 tokens
    text = (shared[:n] if k % 3 == 0 else "".join(chr(97 + i) for i in rng.integers(0, 26, n)))
    kinds.append(dict(messages=[{"role": "user", "content": text}], max_tokens=int(4 + k % 5),
                      temperature=0.0 if k % 2 else 0.8, seed=k, logprobs=True))

  def ask(kind):
    r = client.chat.completions.create(model=MODEL, **kinds[kind])
    m = r.choices[0].message
    return (m.content, m.model_extra.get("reasoning_content"),
            [x.logprob for x in r.choices[0].logprobs.content])

  alone = [ask(k) for k in range(16)]
  server.app.state.engine.clear_cache()          # the load starts cold again

  def job(j):
    kind = j % 16
    if j % 7 == 3:                                # a client that disconnects mid-stream
      s = client.chat.completions.create(model=MODEL, stream=True, **kinds[kind])
      for _ in zip(range(2), s):
        pass
      s.close()
      return None
    return kind, ask(kind)

  with cf.ThreadPoolExecutor(16) as pool:
    results = list(pool.map(job, range(64)))
  done = [r for r in results if r is not None]
  assert len(done) == 64 - len([j for j in range(64) if j % 7 == 3])
  for kind, got in done:
    assert got == alone[kind], kind
