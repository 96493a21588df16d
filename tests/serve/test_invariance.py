"""Batch invariance: a request's tokens and log-probs (fp32 model) are bit-identical whether it
runs alone or among other requests, in any slot, with any number of slots, any per-step token
budget, arriving at any step, with or without prefix-cache hits (warm entries, LRU eviction,
host offload), and whoever else is cancelled. Greedy and seeded sampling alike.

The reference of every request is the same request alone in a fresh two-slot engine with the
prefix cache off. The MoE dispatch — the one place tokens of different rows meet (grouped by
expert) — is also held to it on its own: a row's output never depends on the other rows."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from k3jax.layers.moe import StableLatentMoE
from k3jax.serve.engine import RequestParams
from serve.engine_fixtures import engine, model, prompt

_RNG = np.random.default_rng(7)
_BASE = prompt(_RNG, 60, boundaries=(9, 33))
# Prompts that share prefixes with each other (so cache entries are hit at grid points and
# turn boundaries), and some that share nothing.
PROMPTS = [_BASE[:45], _BASE, _BASE[:34] + prompt(_RNG, 20, boundaries=(5,)),
           _BASE[:10] + prompt(_RNG, 30), prompt(_RNG, 7), prompt(_RNG, 40, boundaries=(31,)),
           _BASE[:64 - 4] + prompt(_RNG, 4)]
PARAMS = [RequestParams(max_tokens=5),
          RequestParams(max_tokens=4, temperature=0.8, top_k=20, seed=3),
          RequestParams(max_tokens=6, temperature=1.1, top_p=0.9, seed=11)]


@functools.lru_cache(maxsize=None)
def alone(pi: int, qi: int):
  """Request (prompt pi, params qi) alone: (tokens, logprobs, top)."""
  r = engine(num_slots=2, prefix_cache=False).generate([PROMPTS[pi]], PARAMS[qi])[0]
  return r.tokens, r.logprobs, r.top


SCENARIO = dict(
    requests=st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1),
                                st.integers(0, len(PARAMS) - 1),
                                st.integers(0, 4)),           # the step it arrives at
                      min_size=2, max_size=6),
    num_slots=st.sampled_from([2, 4, 6]),
    step_tokens=st.sampled_from([8, 24, 64]),
    warm=st.lists(st.integers(0, len(PROMPTS) - 1), max_size=3),
    cache=st.sampled_from(["off", "device", "offload"]),
    cancel=st.none() | st.integers(0, 5))


@settings(max_examples=10)
@given(**SCENARIO)
def test_outputs_do_not_depend_on_the_batch(requests, num_slots, step_tokens, warm, cache,
                                            cancel):
  changes = dict(num_slots=num_slots, step_tokens=step_tokens, prefix_cache=cache != "off")
  if cache == "offload":
    changes.update(num_checkpoints=2, host_checkpoint_bytes=1 << 20)
  eng = engine(**changes)
  for w in warm:                                  # cache entries from other requests
    eng.generate([PROMPTS[w]], RequestParams(max_tokens=2, temperature=0.5, seed=1))
  ids, step = {}, 0
  pending = sorted(enumerate(requests), key=lambda x: x[1][2])
  while pending or eng.has_work:
    while pending and pending[0][1][2] <= step:
      k, (pi, qi, _) = pending.pop(0)
      ids[k] = eng.submit(PROMPTS[pi], PARAMS[qi])
    if cancel is not None and cancel in ids and step == 3:
      eng.cancel(ids[cancel])
    eng.step()
    step += 1
  for k, (pi, qi, _) in enumerate(requests):
    r = eng.requests[ids[k]]
    if r.finish_reason == "cancelled":
      assert k == cancel
      continue
    tokens, logprobs, top = alone(pi, qi)
    assert r.tokens == tokens, (k, pi, qi)
    assert r.logprobs == logprobs, (k, pi, qi)    # bit for bit
    assert r.top == top
  st_ = eng.stats()
  assert st_["running"] == 0 and st_["pages_in_use"] == 0
  assert st_["pages_used"] == len(eng.cache.pages_held)


def test_moe_rows_are_independent():
  """StableLatentMoE (dropless, as served): row 0's output is the same bits whatever the other
  rows hold and wherever row 0 sits, for a decode tile [2, 1] and a prefill piece [1, 32]."""
  cfg, _ = model()
  cfg = cfg.for_inference()
  moe = StableLatentMoE(cfg)
  rng = np.random.default_rng(0)
  v = nn.meta.unbox(moe.init(jax.random.PRNGKey(0), jnp.zeros((1, 1, cfg.text.d_model))))
  apply = jax.jit(moe.apply)
  for shape in ((2, 1), (1, 32)):
    x0 = rng.standard_normal(cfg.text.d_model).astype(np.float32)
    outs = set()
    for trial in range(4):
      x = rng.standard_normal(shape + (cfg.text.d_model,)).astype(np.float32).reshape(-1, cfg.text.d_model)
      pos = trial % x.shape[0]
      x[pos] = x0
      y = np.asarray(apply(v, jnp.asarray(x.reshape(shape + (cfg.text.d_model,))))).reshape(
          -1, cfg.text.d_model)
      outs.add(y[pos].tobytes())
    assert len(outs) == 1, shape
