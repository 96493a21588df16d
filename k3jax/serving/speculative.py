"""Speculative decoding pieces: exact rejection sampling and the LK draft loss (spec §10).

`verify_drafts` is the standard speculative-sampling acceptance rule: draft token d (drawn from
the draft distribution q) is accepted with probability min(1, p(d)/q(d)); at the first rejection
the token is redrawn from the residual norm(max(p − q, 0)); if every draft is accepted a bonus
token is drawn from the target at the next position. The emitted token then has exactly the
target distribution p: P(x) = q(x)·min(1, p(x)/q(x)) + (1 − Σ_y min(p(y), q(y)))·residual(x) = p(x).
With greedy sampling p and q are one-hots, so a draft is kept iff it equals the target argmax and
the sequence is exactly plain greedy decoding.

`speculative_generate` runs the MTP draft / verify loop through the model's own decode path
(`K3Model.draft` drafts, `K3Model.extend` verifies with the KDA layers sowing their per-token
states) and `rewind` undoes the rejected tokens exactly.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import generate as G
from k3jax.cache import Cache
from k3jax.config import ModelConfig
from k3jax.layers.mla import MLACache
from k3jax.sampling import SamplingParams, sample, sampling_probs


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
  (`k3jax.generate.forward`, whose aux is the KDA layers' "rewind" collection) were fed.

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


def speculative_generate(config: ModelConfig, variables, prompts: Sequence[Sequence[int]], *,
                         max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                         seed: int = 0, max_len: int | None = None) -> tuple[list[list[int]], dict]:
  """MTP speculative decoding: the MTP layer drafts token t+2, the model verifies.

  Each round per sequence: the MTP layer (fed h_{n−1} and the pending token x_n) drafts d ~ q;
  the model is fed [x_n, d] with the step path (keeping the KDA state after each token);
  `verify_drafts` accepts d with probability min(1, p(d)/q(d)) and draws the next token (exact
  rejection sampling: same output distribution as `generate`). A rejected d is undone with
  `rewind`. Returns (generated tokens per prompt, {"acceptance_rate", "rounds", "drafts"}).
  Stop tokens/strings are not applied here (fixed-length output).
  """
  if not config.num_mtp_layers:
    raise ValueError("config.num_mtp_layers: speculative decoding needs the MTP layer, found 0")
  toks, lengths = G.padded_prompts(prompts)
  variables = G.unbox(variables)
  bsz = len(prompts)
  max_len = max_len or int(lengths.max()) + max_new_tokens + 2
  if int(lengths.max()) + max_new_tokens + 1 > max_len:
    raise ValueError(f"prompts: longest prompt + max_new_tokens + 1 exceeds max_len={max_len}")
  logits, hidden, cache = G.prefill(config, variables, toks, lengths, max_len=max_len,
                                    return_all=True)
  mtp = G._jitted_draft(config)
  # MTP entries for prompt positions 0..len−2 (pairs (h_i, token i+1)).
  nxt = np.zeros_like(toks)
  nxt[:, :-1] = toks[:, 1:]
  _, cache = mtp(variables, cache, hidden, jnp.asarray(nxt), jnp.asarray(lengths - 1))
  idx = jnp.asarray(lengths - 1)[:, None, None]
  last_logits = jnp.take_along_axis(logits, idx, 1)[:, 0]
  last_h = jnp.take_along_axis(hidden, idx, 1)[:, 0]
  key, sub = jax.random.split(jax.random.PRNGKey(seed))
  x_n = sample(sub, last_logits, sampling)
  # Pairs the MTP layer still has to see: (h, next token); the last one drafts.
  pend_h = jnp.stack([last_h, last_h], 1)
  pend_t = jnp.stack([x_n, x_n], 1)
  pend_n = jnp.ones((bsz,), jnp.int32)
  out = [[int(t)] for t in np.asarray(x_n)]
  verify = G._verify_jit(config)
  accepted = drafts = rounds = 0
  while min(len(o) for o in out) < max_new_tokens:
    rounds += 1
    key, k_draft, k_ver = jax.random.split(key, 3)
    q_logits, cache = mtp(variables, cache, pend_h, pend_t, pend_n)
    q_last = jnp.take_along_axis(q_logits, (pend_n - 1)[:, None, None], 1)[:, 0]
    d = sample(k_draft, q_last, sampling)
    x_n = jnp.take_along_axis(pend_t, (pend_n - 1)[:, None], 1)[:, 0]
    before = cache
    logits, hidden, after, aux = verify(variables, cache, jnp.stack([x_n, d], 1),
                                        jnp.full((bsz,), 2, jnp.int32))
    p = sampling_probs(logits, sampling)
    q = sampling_probs(q_last, sampling)[:, None]
    num, y = verify_drafts(k_ver, p, q, d[:, None])
    cache = rewind(after, before, aux, num + 1)
    acc = np.asarray(num)
    accepted += int(acc.sum())
    drafts += bsz
    # Next round's MTP pairs: accepted → (h_n, d) then (h_{n+1}, y); rejected → (h_n, y).
    h_n, h_n1 = hidden[:, 0], hidden[:, 1]
    a = jnp.asarray(acc == 1)
    pend_h = jnp.stack([h_n, jnp.where(a[:, None], h_n1, h_n)], 1)
    pend_t = jnp.stack([jnp.where(a, d, y), y], 1)
    pend_n = jnp.where(a, 2, 1).astype(jnp.int32)
    d_np, y_np = np.asarray(d), np.asarray(y)
    for i in range(bsz):
      if acc[i]:
        out[i].append(int(d_np[i]))
      out[i].append(int(y_np[i]))
  return [o[:max_new_tokens] for o in out], dict(
      acceptance_rate=accepted / max(drafts, 1), rounds=rounds, drafts=drafts)


__all__ = ["lk_loss", "residual_distribution", "rewind", "speculative_generate",
           "verify_drafts"]
