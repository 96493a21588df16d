"""Speculative decoding pieces: exact rejection sampling and the LK draft loss (spec §10).

`verify_drafts` is the standard speculative-sampling acceptance rule: draft token d (drawn from
the draft distribution q) is accepted with probability min(1, p(d)/q(d)); at the first rejection
the token is redrawn from the residual norm(max(p − q, 0)); if every draft is accepted a bonus
token is drawn from the target at the next position. The emitted token then has exactly the
target distribution p: P(x) = q(x)·min(1, p(x)/q(x)) + (1 − Σ_y min(p(y), q(y)))·residual(x) = p(x).
With greedy sampling p and q are one-hots, so a draft is kept iff it equals the target argmax and
the sequence is exactly plain greedy decoding.

The MTP draft/verify loop over the model's caches is `k3jax.generate.speculative_generate`
(it needs the decode path); this module only holds the model-independent math.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


__all__ = ["lk_loss", "residual_distribution", "verify_drafts"]
