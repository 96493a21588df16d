"""The serving engine (k3jax/serve/engine.py) against `generate()`, its reference: greedy tokens
equal, log-probs those of the full forward; stop rules, limits, cancellation, admission under
page pressure, the prefix cache (hits, turn boundaries, copy-on-write, LRU, host offload) and
no page leaks."""

import jax
import numpy as np
import pytest

from k3jax.data.tokenizers import ByteTokenizer
from k3jax.model import K3Model
from k3jax.serve import generate as G
from k3jax.serve.engine import EngineConfig, RequestParams
from serve.engine_fixtures import engine, model, prompt


def _baseline(eng):
  """No page held by a request; every used page is a cache entry's."""
  st = eng.stats()
  assert st["running"] == 0 and st["waiting"] == 0 and st["pages_in_use"] == 0
  assert st["pages_used"] == len(eng.cache.pages_held)
  eng.clear_cache()
  assert eng.allocator.num_used == 0


def test_matches_generate_and_the_full_forward():
  cfg, v = model()
  rng = np.random.default_rng(0)
  prompts = [prompt(rng, n) for n in (5, 40, 70, 12)]
  eng = engine()
  out = eng.generate(prompts, RequestParams(max_tokens=6))
  ref = G.generate(cfg, v, prompts, max_new_tokens=6)
  assert [r.tokens for r in out] == ref
  fwd = jax.jit(K3Model(cfg.for_inference()).apply)
  for p, r in zip(prompts, out):
    seq = np.zeros((1, 80), np.int32)           # one compiled length (causal: the tail is inert)
    seq[0, :len(p) + len(r.tokens)] = p + r.tokens
    logp = np.asarray(jax.nn.log_softmax(fwd(v, seq)[0], -1))
    want = [logp[len(p) - 1 + i, t] for i, t in enumerate(r.tokens)]
    np.testing.assert_allclose(r.logprobs, want, atol=1e-4)
    assert r.finish_reason == "length" and len(r.top[0]) == 5
  _baseline(eng)


def test_stop_rules_and_limits():
  rng = np.random.default_rng(1)
  p = prompt(rng, 20)
  tok = ByteTokenizer()
  eng = engine(decode=tok.decode)
  free = eng.generate([p], RequestParams(max_tokens=8))[0]
  stop_at = free.tokens[3]
  cut = eng.generate([p], RequestParams(max_tokens=8, stop_tokens=(stop_at,)))[0]
  assert cut.tokens == free.tokens[:free.tokens.index(stop_at)] and cut.finish_reason == "stop"
  text = tok.decode(free.tokens[:5])
  s = eng.generate([p], RequestParams(max_tokens=8, stop_strings=(text[-1:],)))[0]
  assert s.finish_reason == "stop" and text[-1:] in tok.decode(s.tokens)
  one = eng.generate([p], RequestParams(max_tokens=1))[0]
  assert one.tokens == free.tokens[:1] and one.finish_reason == "length"
  _baseline(eng)


def test_submit_errors_name_the_problem():
  eng = engine()
  with pytest.raises(ValueError, match="non-empty"):
    eng.submit([])
  with pytest.raises(ValueError, match="vocab_size"):
    eng.submit([1, 999])
  with pytest.raises(ValueError, match="exceed the context of 96"):
    eng.submit([1] * 90, RequestParams(max_tokens=7))
  with pytest.raises(ValueError, match="temperature"):
    RequestParams(temperature=-1.0)
  with pytest.raises(ValueError, match="max_tokens"):
    RequestParams(max_tokens=0)
  with pytest.raises(ValueError, match="stop_strings need a decode"):
    eng.submit([1, 2], RequestParams(stop_strings=("x",)))
  with pytest.raises(ValueError, match="EngineConfig.logprobs: expected one of"):
    EngineConfig(logprobs="tempered")
  assert not eng.has_work


def test_cancel_waiting_and_running_and_wait_for_pages():
  rng = np.random.default_rng(2)
  eng = engine(prefix_cache=False, num_slots=2)
  # 8 free pages (the rest held aside): a request of 40 + 20 tokens takes all of them; the
  # next one waits for it.
  held = eng.allocator.alloc(eng.allocator.num_free - 8)
  events = []
  a = eng.submit(prompt(rng, 40), RequestParams(max_tokens=20), on_update=events.append)
  b = eng.submit(prompt(rng, 40), RequestParams(max_tokens=20))
  c = eng.submit(prompt(rng, 10), RequestParams(max_tokens=5))
  eng.step()
  assert eng.stats()["running"] == 1 and eng.stats()["waiting"] == 2
  eng.cancel(c)                                   # waiting → cancelled
  for _ in range(3):
    eng.step()
  eng.cancel(a)                                   # running → cancelled, pages freed
  eng.step()
  assert eng.requests[a].finish_reason == "cancelled" and events[-1].finished
  assert eng.requests[c].finish_reason == "cancelled" and not eng.requests[c].tokens
  while eng.step():
    pass
  assert eng.requests[b].finish_reason == "length" and len(eng.requests[b].tokens) == 20
  eng.allocator.decref(held)
  _baseline(eng)


def test_prefix_cache_hits_turn_boundaries_and_offload():
  """A later turn resumes at the longest cached checkpoint (grid point or turn boundary, the
  partly filled last page copied) and computes exactly what a cold run computes; entries
  move to the host when device slots run out and come back from there."""
  rng = np.random.default_rng(3)
  turn1 = prompt(rng, 45, boundaries=(9, 36))       # boundaries after 10 and 37 tokens
  turn2 = turn1 + prompt(rng, 20, boundaries=(7,))
  params = RequestParams(max_tokens=4, temperature=0.9, seed=5)
  other = prompt(rng, 33)
  cold = engine(prefix_cache=False).generate([turn2], params)[0]
  for changes in ({}, dict(num_checkpoints=1, host_checkpoint_bytes=1 << 20)):
    eng = engine(**changes)
    eng.generate([turn1], params)
    st = eng.stats()
    assert st["cache_inserted"] == 3                  # at 10, 32 and 37
    eng.generate([other], params)                     # one more entry (at 32)
    if changes:                                       # one device slot: the rest offloaded
      assert eng.stats()["cache_offloaded"] == 3 and eng.stats()["cache_entries_host"] == 3
    warm = eng.generate([turn2], params)[0]
    assert warm.cached_tokens == 37                   # the turn boundary, mid-page
    if changes:
      assert eng.stats()["cache_host_restores"] == 1
    assert warm.tokens == cold.tokens and warm.logprobs == cold.logprobs
    again = eng.generate([turn2], params)[0]          # its own entries: at 64 and 53
    assert again.cached_tokens == 64 and again.tokens == cold.tokens
    assert again.logprobs == cold.logprobs
    _baseline(eng)


def test_lru_eviction_under_page_pressure():
  rng = np.random.default_rng(4)
  eng = engine(num_slots=2)
  held = eng.allocator.alloc(eng.allocator.num_free - 20)   # 20 pages: two requests' worth
  ps = [prompt(rng, 64) for _ in range(3)]
  for p in ps:
    eng.generate([p], RequestParams(max_tokens=2))
  st = eng.stats()
  assert st["cache_dropped"] >= 1 and st["pages_used"] - len(held) <= 20
  # The most recent prompt is still cached; the oldest was evicted.
  assert eng.generate([ps[2]], RequestParams(max_tokens=2))[0].cached_tokens == 32
  eng.allocator.decref(held)
  _baseline(eng)


def test_speculative_rounds():
  """draft_len=2: MTP draft / verify rounds per slot (rejection-exact: greedy tokens are the
  plain engine's), sampled rounds, pages back to the baseline."""
  rng = np.random.default_rng(6)
  prompts = [prompt(rng, n) for n in (7, 45)]
  plain = engine().generate(prompts, RequestParams(max_tokens=6))
  eng = engine(draft_len=2, prefill_buckets=(32,))     # one compiled piece: 32 tokens
  spec = eng.generate(prompts, RequestParams(max_tokens=6))
  assert [r.tokens for r in spec] == [r.tokens for r in plain]
  np.testing.assert_allclose([r.logprobs for r in spec], [r.logprobs for r in plain], atol=1e-4)
  assert eng.counters["drafted"] > 0
  sampled = eng.generate(prompts, RequestParams(max_tokens=6, temperature=1.0, seed=2))
  assert all(len(r.tokens) == 6 or r.finish_reason == "stop" for r in sampled)
  _baseline(eng)
  # Paused after a round (the pending draft pairs go with it), the slots reused, resumed into
  # other slots: the same sampled tokens and log-probs as the uninterrupted rounds.
  eng.clear_cache()
  ids = [eng.submit(p, RequestParams(max_tokens=6, temperature=1.0, seed=2)) for p in prompts]
  while not all(eng.requests[i].tokens for i in ids):
    eng.step()
  held = [len(eng.requests[i].tokens) for i in ids]
  for i in ids:
    eng.pause(i)
  eng.generate([prompt(rng, 9), prompt(rng, 9)], RequestParams(max_tokens=4))
  for i in reversed(ids):
    eng.resume(i)
  while eng.step():
    eng.check()
  assert all(0 < n < 6 for n in held)
  for i, r in zip(ids, sampled):
    assert eng.requests[i].tokens == r.tokens
    np.testing.assert_allclose(eng.requests[i].logprobs, r.logprobs, atol=1e-6)
  _baseline(eng)


def test_packed_mxfp4_experts():
  """`expert_format="mxfp4"` (the release's packed experts) through the engine: its greedy
  tokens and log-probs are those of the full forward of the same packed model."""
  from k3jax.serve.engine import Engine
  from serve.engine_fixtures import ENGINE
  import dataclasses
  cfg, v = model("tiny", expert_format="mxfp4", num_layers=2)
  rng = np.random.default_rng(7)
  prompts = [prompt(rng, n) for n in (9, 40)]
  eng = Engine(cfg, v, dataclasses.replace(ENGINE, prefill_buckets=(32,)))
  out = eng.generate(prompts, RequestParams(max_tokens=4))
  fwd = jax.jit(K3Model(cfg.for_inference()).apply)
  for p, r in zip(prompts, out):
    seq = np.zeros((1, 48), np.int32)           # one compiled length (causal: the tail is inert)
    seq[0, :len(p) + len(r.tokens)] = p + r.tokens
    logp = np.asarray(jax.nn.log_softmax(fwd(v, seq)[0], -1))
    rows = logp[len(p) - 1:len(p) - 1 + len(r.tokens)]
    assert r.tokens == rows.argmax(-1).tolist()
    np.testing.assert_allclose(r.logprobs, rows[np.arange(len(r.tokens)), r.tokens], atol=1e-4)


def test_pause_resume_keeps_the_cache():
  """Requests paused mid-decode and mid-prefill, their slots reused by another request, then
  resumed into other slots: the same tokens and log-probs as an uninterrupted run (sampled, so
  the draw counters carry over too), no prefill of what they held, pages all free at the end."""
  rng = np.random.default_rng(8)
  prompts = [prompt(rng, n) for n in (6, 30, 70)]
  params = [RequestParams(max_tokens=10, temperature=0.9, seed=s) for s in (1, 2, 3)]
  ref = engine(prefix_cache=False).generate(prompts, params)
  eng = engine(prefix_cache=False)
  ids = [eng.submit(p, q) for p, q in zip(prompts, params)]
  eng.step()                       # 40-token budget: the 70-token prompt is still prefilling
  eng.step()
  assert eng.requests[ids[0]].tokens and not eng.requests[ids[2]].tokens
  before = eng.counters["prefill_tokens"]
  slots = {s.req.id: s.index for s in eng.slots if s.req}
  for i in ids:
    eng.pause(i)
  eng.check()
  held = eng.paused[ids[2]].length           # the long prompt's tokens prefilled before
  assert 0 < held < 70 and eng.paused[ids[2]].pieces
  st = eng.stats()
  assert st["running"] == 0 and st["paused"] == 3 and st["pages_paused"] == st["pages_used"]
  assert not eng.step()            # only paused requests: nothing to do
  other = eng.submit(prompt(rng, 8), RequestParams(max_tokens=3))
  eng.step()                       # takes slot 0
  assert eng.slots[0].req.id == other
  for i in reversed(ids):          # resumed in another order: other slots
    eng.resume(i)
  eng.step()
  assert {s.req.id: s.index for s in eng.slots if s.req and s.req.id in ids} != slots
  while eng.step():
    eng.check()
  for i, r in zip(ids, ref):
    assert eng.requests[i].tokens == r.tokens and eng.requests[i].logprobs == r.logprobs
  # Prefill after the pause: the other request's 8 tokens and the rest of the 70-token prompt;
  # none of the tokens the paused requests held.
  assert eng.counters["prefill_tokens"] - before == 8 + (70 - held)
  assert eng.counters["pauses"] == 3 and eng.counters["resumes"] == 3
  eng.check()
  _baseline(eng)


def test_pause_errors_cancel_and_new_weights():
  """Bad ids are clear errors; cancel of a paused request frees its pages; new weights
  (`set_variables`) leave a paused request's cache as it was: its next log-probs are those of
  the old weights' cache decoded by the new weights, not those of a recomputed prefix."""
  cfg, v = model()
  rng = np.random.default_rng(9)
  p = prompt(rng, 12)
  eng = engine(prefix_cache=False)
  with pytest.raises(ValueError, match="unknown request id 'nope'"):
    eng.pause("nope")
  with pytest.raises(ValueError, match="unknown request id"):
    eng.resume("nope")
  a = eng.submit(p, RequestParams(max_tokens=8))
  b = eng.submit(prompt(rng, 20), RequestParams(max_tokens=8))
  with pytest.raises(ValueError, match=f"resume: request '{a}' is not paused"):
    eng.resume(a)
  for _ in range(4):
    eng.step()
  eng.pause(a)
  eng.pause(b)
  with pytest.raises(ValueError, match="already paused"):
    eng.pause(a)
  eng.cancel(b)
  eng.step()
  assert eng.requests[b].finish_reason == "cancelled" and eng.stats()["paused"] == 1
  eng.check()
  head = list(eng.requests[a].tokens)
  n = len(head)
  assert 1 <= n < 8
  noise = np.random.default_rng(0)
  new = jax.tree_util.tree_map(
      lambda x: (x + 0.05 * noise.standard_normal(x.shape) * (np.abs(x).mean() + 1e-3)).astype(
          x.dtype) if np.issubdtype(x.dtype, np.floating) else x, v)
  eng.set_variables(new)           # allowed: nothing runs; the paused request keeps its cache
  eng.resume(a)
  while eng.step():
    pass
  ra = eng.requests[a]
  assert ra.finish_reason == "length" and ra.tokens[:n] == head
  with pytest.raises(ValueError, match="has finished"):
    eng.pause(a)
  # Reference: prefill prompt + head[:-1] with the old weights, then decode with the new ones.
  toks = np.array([p + head[:-1]], np.int32)
  _, cache = G.prefill(cfg, v, toks, [toks.shape[1]], max_len=40)
  want, feed = [], head[-1]
  for t in ra.tokens[n:n + 3]:
    logits, cache = G.decode_step(cfg, new, cache, [feed])
    want.append(float(jax.nn.log_softmax(logits[0])[t]))
    feed = t
  np.testing.assert_allclose(ra.logprobs[n:n + 3], want, atol=1e-4)
  # A recomputed prefix (the new weights throughout) gives other log-probs.
  fwd = jax.jit(K3Model(cfg.for_inference()).apply)
  seq = np.zeros((1, 80), np.int32)
  seq[0, :len(p) + len(ra.tokens)] = p + ra.tokens
  logp = np.asarray(jax.nn.log_softmax(fwd(new, seq)[0], -1))
  recomputed = logp[len(p) - 1 + n, ra.tokens[n]]
  assert abs(recomputed - ra.logprobs[n]) > 1e-3
  eng.check()
  _baseline(eng)
