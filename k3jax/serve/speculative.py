"""Speculative decoding pieces: exact rejection sampling and the LK draft loss (docs/k3.md §10).

`verify_drafts` is the standard speculative-sampling acceptance rule: draft token d (drawn from
the draft distribution q) is accepted with probability min(1, p(d)/q(d)); at the first rejection
the token is redrawn from the residual norm(max(p − q, 0)); if every draft is accepted a bonus
token is drawn from the target at the next position. The emitted token then has exactly the
target distribution p: P(x) = q(x)·min(1, p(x)/q(x)) + (1 − Σ_y min(p(y), q(y)))·residual(x) = p(x).
With greedy sampling p and q are one-hots, so a draft is kept iff it equals the target argmax and
the sequence is exactly plain greedy decoding.

`speculative_generate` runs the draft / verify loop through the model's own decode path
(`K3Model.draft` drafts one or a chain of tokens — the MTP layer, or the EAGLE-3 draft of
k3jax/posttrain/eagle.py —, `K3Model.extend` verifies with the KDA layers sowing their
per-token states) and `rewind` undoes the rejected tokens exactly.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.serve import generate as G
from k3jax.cache import Cache, MLACache
from k3jax.config import ModelConfig
from k3jax.serve.sampling import SamplingParams, sample, sampling_probs


def lk_loss(target_logits: jax.Array, draft_logits: jax.Array) -> jax.Array:
  """LK loss −log Σ_x min(p(x), q(x)) per position: [..., V] logits → [...] float32.

  Σ_x min(p, q) is exactly the acceptance probability of one draft under `verify_drafts`, so
  minimising this loss maximises the expected acceptance rate. Zero iff p == q.
  """
  p = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
  q = jax.nn.softmax(draft_logits.astype(jnp.float32), axis=-1)
  overlap = jnp.sum(jnp.minimum(p, q), axis=-1)
  return -jnp.log(jnp.maximum(overlap, jnp.finfo(jnp.float32).tiny))


def residual_distribution(p: jax.Array, q: jax.Array) -> jax.Array:
  """norm(max(p − q, 0)) over the last axis; falls back to p where p == q (never sampled then)."""
  r = jnp.maximum(p - q, 0.0)
  total = jnp.sum(r, axis=-1, keepdims=True)
  return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p)


def verify_drafts(key: jax.Array, target_probs: jax.Array, draft_probs: jax.Array,
                  draft_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Accept a prefix of the drafts and draw the next token.

  target_probs: [B, n+1, V] target distributions at the n draft positions and one more.
  draft_probs: [B, n, V] the distributions the drafts were drawn from.
  draft_tokens: [B, n] int.
  Returns (num_accepted [B] int32 in [0, n], next_token [B] int32): the output of this round is
  draft_tokens[:num_accepted] followed by next_token.
  """
  b, n, _ = draft_probs.shape
  if target_probs.shape[:2] != (b, n + 1):
    raise ValueError(f"target_probs: expected [B={b}, n+1={n + 1}, V], found "
                     f"{target_probs.shape}")
  k_accept, k_next = jax.random.split(key)
  p_d = jnp.take_along_axis(target_probs[:, :n], draft_tokens[..., None], -1)[..., 0]
  q_d = jnp.take_along_axis(draft_probs, draft_tokens[..., None], -1)[..., 0]
  u = jax.random.uniform(k_accept, (b, n), jnp.float32)
  # u < p/q written without dividing (q_d > 0 for a drawn token; p_d may be 0).
  ok = u * q_d < p_d
  num = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
  p_next = jnp.take_along_axis(target_probs, num[:, None, None], 1)[:, 0]
  q_pad = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)
  q_next = jnp.take_along_axis(q_pad, num[:, None, None], 1)[:, 0]
  # Rejected at `num` < n: residual of p and q there; all accepted: q_pad is 0, residual is p.
  dist = residual_distribution(p_next, q_next)
  nxt = jax.random.categorical(k_next, jnp.log(dist), axis=-1).astype(jnp.int32)
  return num, nxt


def rewind(cache_after: Cache, cache_before: Cache, aux, keep) -> Cache:
  """The cache as if only the first keep[b] of the tokens fed by a path="step" forward
  (`k3jax.serve.generate.forward`, whose aux is the KDA layers' "rewind" collection) were fed.

  KDA: the state after keep[b] tokens and the conv tail from the saved inputs; MLA: the
  slots past before+keep zeroed. Exactly the cache a forward of those keep[b] tokens makes.
  """
  keep = keep.astype(jnp.int32)
  lengths = cache_before.lengths + keep

  def one(c, saved, stacked):
    if isinstance(c, MLACache):
      return c.truncated(lengths)
    sown = saved["self_attn"]
    if stacked:   # a scanned group's caches: a leading [num_groups] axis
      return jax.vmap(lambda cc, ss: cc.rewound(ss, keep))(c, sown)
    return c.rewound(sown, keep)

  stack = {}
  for key, c in cache_after.stack.items():
    if key == "body":
      stack[key] = {j: one(cj, aux["body"].get(j), True) for j, cj in c.items()}
    else:
      stack[key] = one(c, aux.get(key), False)
  return cache_after.replace(lengths=lengths, stack=stack)


def speculative_round(config: ModelConfig, draft_len: int, sampling: SamplingParams,
                      variables, cache: Cache, pend, key):
  """One draft / verify round of `speculative_generate` (one compiled program).

  pend = (features [B,n+1,d], tokens [B,n+1], count [B]): the pairs the draft has not seen,
  the last valid one drafting. Returns (cache, next pend, drafts [B,n], num_accepted [B],
  next token [B]): the round emits drafts[:num_accepted] then the next token.
  """
  n = draft_len
  pend_h, pend_t, pend_n = pend
  bsz = pend_t.shape[0]
  k_draft, k_ver = jax.random.split(key)
  q_logits, a, cache = G.draft(config, variables, cache, pend_h, pend_t, pend_n,
                               return_hidden=True)
  committed = cache.mtp_lengths
  last = (pend_n - 1)[:, None]
  q_j = jnp.take_along_axis(q_logits, last[..., None], 1)[:, 0]
  a_j = jnp.take_along_axis(a, last[..., None], 1)[:, 0]
  ds, qs = [], []
  for j, k in enumerate(jax.random.split(k_draft, n)):
    if j:   # chain on the draft's own hidden state and token
      q_j, a_j, cache = G.draft(config, variables, cache, a_j[:, None], ds[-1][:, None],
                                jnp.ones((bsz,), jnp.int32), return_hidden=True)
      q_j, a_j = q_j[:, 0], a_j[:, 0]
    ds.append(sample(k, q_j, sampling))
    qs.append(sampling_probs(q_j, sampling))
  d = jnp.stack(ds, 1)
  # The chain's entries leave the draft's cache: next round it sees the target's features.
  cache = cache.replace(mtp=cache.mtp.truncated(committed), mtp_lengths=committed)
  x_n = jnp.take_along_axis(pend_t, last, 1)[:, 0]
  logits, hidden, after, aux = G.forward(config, variables, cache,
                                         jnp.concatenate([x_n[:, None], d], 1),
                                         jnp.full((bsz,), n + 1, jnp.int32), path="step")
  num, y = verify_drafts(k_ver, sampling_probs(logits, sampling), jnp.stack(qs, 1), d)
  cache = rewind(after, cache, aux, num + 1)
  # Next round's pairs: (feature of x_n, d_1), …, (feature of d_num, y).
  pend_t = jnp.where(jnp.arange(n + 1)[None] < num[:, None], jnp.pad(d, ((0, 0), (0, 1))),
                     y[:, None])
  return cache, (hidden, pend_t, num + 1), d, num, y


@functools.lru_cache(maxsize=None)
def _round_jit(config: ModelConfig, draft_len: int, sampling: SamplingParams):
  return jax.jit(functools.partial(speculative_round, config, draft_len, sampling))


def speculative_generate(config: ModelConfig, variables, prompts: Sequence[Sequence[int]], *,
                         max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                         seed: int = 0, max_len: int | None = None,
                         draft_len: int = 1) -> tuple[list[list[int]], dict]:
  """MTP / EAGLE-3 speculative decoding: the draft proposes `draft_len` tokens, the model
  verifies them in one forward.

  Each round per sequence: the draft layer first sees the pairs (feature of position i,
  token i+1) verified since the last round, the last of which drafts d_1 ~ q_1; for
  draft_len > 1 it chains on its own pre-norm hidden state: (a_{j−1}, d_{j−1}) drafts d_j
  (the EAGLE-3 inference rule; its chain entries leave its cache after the round). The
  model is fed [x_n, d_1 … d_n] with the step path (the KDA state kept after each token);
  `verify_drafts` accepts a prefix with probability min(1, p/q) per draft and draws the next
  token (exact rejection sampling: the output distribution of `generate`; under greedy
  sampling exactly `generate`'s tokens). The rejected tokens are undone with `rewind`.
  Returns (generated tokens per prompt, {"acceptance_rate" (accepted / drafted tokens),
  "tokens_per_round", "rounds", "drafts"}). Stop tokens/strings are not applied here
  (fixed-length output).
  """
  if not config.text.num_mtp_layers:
    raise ValueError("config.text.num_mtp_layers: speculative decoding needs the MTP layer, found 0")
  if not isinstance(draft_len, int) or draft_len < 1:
    raise ValueError(f"draft_len: expected an int >= 1, found {draft_len!r}")
  n = draft_len
  toks, lengths = G.padded_prompts(prompts)
  variables = G.unbox(variables)
  bsz = len(prompts)
  max_len = max_len or int(lengths.max()) + max_new_tokens + n + 1
  if int(lengths.max()) + max_new_tokens + n > max_len:
    raise ValueError(f"prompts: longest prompt + max_new_tokens + draft_len exceeds "
                     f"max_len={max_len}")
  logits, hidden, cache = G.prefill(config, variables, toks, lengths, max_len=max_len,
                                    return_all=True)
  mtp = G._jitted_draft(config)
  # Draft entries for prompt positions 0..len−2 (pairs (feature i, token i+1)).
  nxt = np.zeros_like(toks)
  nxt[:, :-1] = toks[:, 1:]
  _, _, cache = mtp(variables, cache, hidden, jnp.asarray(nxt), jnp.asarray(lengths - 1))
  idx = jnp.asarray(lengths - 1)[:, None, None]
  last_logits = jnp.take_along_axis(logits, idx, 1)[:, 0]
  last_h = jnp.take_along_axis(hidden, idx, 1)[:, 0]
  key, sub = jax.random.split(jax.random.PRNGKey(seed))
  x_n = sample(sub, last_logits, sampling)
  # Pairs the draft still has to see, [B, n+1] (the first pend_n valid); the last one drafts.
  pend = (jnp.zeros((bsz, n + 1, config.text.d_model), jnp.float32).at[:, 0].set(last_h),
          jnp.zeros((bsz, n + 1), jnp.int32).at[:, 0].set(x_n), jnp.ones((bsz,), jnp.int32))
  out = [[int(t)] for t in np.asarray(x_n)]
  one_round = _round_jit(config, n, sampling)
  accepted = drafts = rounds = 0
  while min(len(o) for o in out) < max_new_tokens:
    rounds += 1
    key, sub = jax.random.split(key)
    cache, pend, d, num, y = one_round(variables, cache, pend, sub)
    acc, d_np, y_np = np.asarray(num), np.asarray(d), np.asarray(y)
    accepted += int(acc.sum())
    drafts += bsz * n
    for i in range(bsz):
      out[i].extend(int(t) for t in d_np[i, :acc[i]])
      out[i].append(int(y_np[i]))
  return [o[:max_new_tokens] for o in out], dict(
      acceptance_rate=accepted / max(drafts, 1), rounds=rounds, drafts=drafts,
      tokens_per_round=(accepted + bsz * rounds) / max(bsz * rounds, 1))


__all__ = ["lk_loss", "residual_distribution", "rewind", "speculative_generate",
           "speculative_round", "verify_drafts"]
