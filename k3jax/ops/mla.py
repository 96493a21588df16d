"""Causal softmax attention for Gated MLA (docs/k3.md §4), materialised and absorbed forms.

Conventions: queries q [B,T,H,Dk], keys k [B,S,H,Dk], values v [B,S,H,V] with T ≤ S; the T
queries are the *last* T positions of the S keys (T = S for training/prefill, T = 1 for a
decode step against a cache). Query t may attend key s when s ≤ t + (S − T) — or, given
`query_positions` [B,T] (queries of a decode step written into a preallocated cache at
per-row positions), when s ≤ query_positions[b, t] — when `segment_ids` (of the keys, [B,S];
the queries use its last T columns) agree, and when `kv_mask` [B,S] (valid cache slots) is
True. Logits, softmax and the output are fp32
(matmul inputs may be bf16; they accumulate in fp32).

Both functions also return `max_logit` [H]: the largest *scaled* pre-softmax logit per head
over batch and all allowed (query, key) pairs — the statistic QK-Clip needs (§8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_NEG = -1e30  # finite "minus infinity": a masked logit, never produces nan


def attention_mask(batch: int, t: int, s: int, *, segment_ids=None, kv_mask=None,
                   query_positions=None):
  """Allowed (query, key) pairs, bool [B,1,T,S] (broadcast over heads)."""
  if query_positions is None:
    qpos = jnp.broadcast_to(jnp.arange(t) + (s - t), (batch, t))
  elif query_positions.shape != (batch, t):
    raise ValueError(f"mla: query_positions must be [B,T]=[{batch},{t}], found "
                     f"{query_positions.shape}")
  else:
    qpos = query_positions
  mask = (jnp.arange(s)[None, None, :] <= qpos[:, :, None])[:, None]
  if segment_ids is not None:
    if segment_ids.shape != (batch, s):
      raise ValueError(f"mla: segment_ids must be [B,S]=[{batch},{s}], found {segment_ids.shape}")
    mask = mask & (segment_ids[:, None, s - t:, None] == segment_ids[:, None, None, :])
  if kv_mask is not None:
    if kv_mask.shape != (batch, s):
      raise ValueError(f"mla: kv_mask must be [B,S]=[{batch},{s}], found {kv_mask.shape}")
    mask = mask & kv_mask[:, None, None, :].astype(bool)
  return mask


def _softmax_and_max(logits, mask):
  """Masked fp32 softmax over the last axis and per-head max logit ([B,H,T,S] → probs, [H])."""
  logits = jnp.where(mask, logits, _NEG)
  max_logit = jnp.max(logits, axis=(0, 2, 3))
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.where(mask, jnp.exp(logits - m), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  # A row with no allowed key (only possible through kv_mask) outputs zeros.
  probs = p / jnp.where(denom > 0, denom, 1.0)
  return probs, max_logit


def _attend(q, k, v, mask, scale):
  """Softmax attention of q [B,T,H,Dk] over k, v with an allowed-pairs mask [B,1,T,S]."""
  logits = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
  probs, max_logit = _softmax_and_max(logits, mask)
  return jnp.einsum("bhts,bshv->bthv", probs, v.astype(jnp.float32)), max_logit


def mla_attention(q, k, v, *, scale: float | None = None, segment_ids=None, kv_mask=None,
                  query_block: int | None = None):
  """Causal softmax attention. q [B,T,H,Dk], k [B,S,H,Dk], v [B,S,H,V] → (o fp32 [B,T,H,V], max_logit [H]).

  scale defaults to Dk^-0.5 (MLA: (nope+rope)^-0.5).
  query_block: None (all T queries at once: fp32 logits [B,H,T,S]), or, when T is larger, the
    queries in blocks of this many (`lax.map`), each block rematerialised in the backward
    pass, so the largest temporaries are [B,H,query_block,S] (k3 at T=4096: 6 GiB of fp32
    logits per sequence otherwise). Same maths, row by row.
  """
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"mla_attention: q, k, v must be rank 4, found {q.shape}, {k.shape}, {v.shape}")
  b, t, h, dk = q.shape
  s = k.shape[1]
  if k.shape != (b, s, h, dk):
    raise ValueError(f"mla_attention: k must be [B,S,H,Dk]=[{b},S,{h},{dk}], found {k.shape}")
  if v.shape[:3] != (b, s, h):
    raise ValueError(f"mla_attention: v must be [B,S,H,V] with B,S,H={b},{s},{h}, found {v.shape}")
  if t > s:
    raise ValueError(f"mla_attention: queries T={t} must not exceed keys S={s}")
  if query_block is not None and (not isinstance(query_block, int) or query_block < 1):
    raise ValueError(f"mla_attention: query_block must be None or a positive int, found "
                     f"{query_block!r}")
  scale = dk ** -0.5 if scale is None else scale
  mask = attention_mask(b, t, s, segment_ids=segment_ids, kv_mask=kv_mask)
  if query_block is None or t <= query_block:
    return _attend(q, k, v, mask, scale)
  n = -(-t // query_block)
  pad = n * query_block - t
  # Padded query rows have no allowed key: zero output, logits at _NEG (never the max).
  qb = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n, query_block, h, dk)
  mb = jnp.pad(mask, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(b, 1, n, query_block, s)
  block = jax.checkpoint(lambda qm: _attend(qm[0], k, v, qm[1], scale))
  o, m = lax.map(block, (jnp.moveaxis(qb, 1, 0), jnp.moveaxis(mb, 2, 0)))
  o = jnp.moveaxis(o, 0, 1).reshape(b, n * query_block, h, -1)[:, :t]
  return o, jnp.max(m, axis=0)


def mla_absorbed_attention(q_nope, q_rope, c_kv, k_rope, w_kb, w_vb, *, scale: float,
                           segment_ids=None, kv_mask=None, query_positions=None,
                           key_block: int | None = None):
  """Attention straight from the cached latents, kv_b folded into the query and output.

  q_nope [B,T,H,N], q_rope [B,T,H,R]; c_kv [B,S,L] (normalised latent), k_rope [B,S,R]
  (shared key part); w_kb [L,H,N] and w_vb [L,H,V] are the key and value halves of kv_b.
  logit = (q_nope·w_kbᵀ)·c + q_rope·k_rope; output = (probs·c)·w_vb. Equal to
  `mla_attention` on the materialised k = [c·w_kb, k_rope], v = c·w_vb. Decoding passes the
  cache buffer as c_kv/k_rope and the new tokens' slots as `query_positions` [B,T].
  key_block: None (fp32 logits [B,H,T,S] over the whole buffer at once), or the keys in
    blocks of this many with an online softmax (`_absorbed_in_key_blocks`): the largest
    temporaries are [B,H,T,key_block], and blocks wholly after every query's position are
    skipped — a chunk of a long prefill reads the latents written so far, not the buffer's
    capacity. Same maths; the sums are taken in a different order (≤ 1e-5 relative).
  Returns (o fp32 [B,T,H,V], max_logit [H]).
  """
  b, t, h, _ = q_nope.shape
  s = c_kv.shape[1]
  if c_kv.shape[0] != b or k_rope.shape[:2] != (b, s):
    raise ValueError(f"mla_absorbed_attention: c_kv [B,S,L] and k_rope [B,S,R] disagree: "
                     f"{c_kv.shape}, {k_rope.shape} (B={b})")
  if w_kb.shape[0] != c_kv.shape[-1] or w_vb.shape[0] != c_kv.shape[-1]:
    raise ValueError(f"mla_absorbed_attention: w_kb/w_vb must start with L={c_kv.shape[-1]}, "
                     f"found {w_kb.shape}, {w_vb.shape}")
  if key_block is not None and (not isinstance(key_block, int) or isinstance(key_block, bool)
                                or key_block < 1):
    raise ValueError(f"mla_absorbed_attention: key_block must be None or a positive int, "
                     f"found {key_block!r}")
  q_lat = jnp.einsum("bthn,lhn->bthl", q_nope, w_kb, preferred_element_type=jnp.float32)
  if key_block is not None and s > key_block:
    ctx, max_logit = _absorbed_in_key_blocks(
        q_lat, q_rope, c_kv, k_rope, scale=scale, key_block=key_block,
        segment_ids=segment_ids, kv_mask=kv_mask, query_positions=query_positions)
  else:
    logits = (jnp.einsum("bthl,bsl->bhts", q_lat, c_kv.astype(jnp.float32))
              + jnp.einsum("bthr,bsr->bhts", q_rope, k_rope,
                           preferred_element_type=jnp.float32))
    logits = logits * scale
    probs, max_logit = _softmax_and_max(logits, attention_mask(
        b, t, s, segment_ids=segment_ids, kv_mask=kv_mask, query_positions=query_positions))
    ctx = jnp.einsum("bhts,bsl->bthl", probs, c_kv.astype(jnp.float32))
  o = jnp.einsum("bthl,lhv->bthv", ctx, w_vb.astype(jnp.float32))
  return o, max_logit


def _absorbed_in_key_blocks(q_lat, q_rope, c_kv, k_rope, *, scale, key_block, segment_ids,
                            kv_mask, query_positions):
  """The absorbed attention's context probs·c [B,T,H,L] fp32 and max_logit [H], one block of
  `key_block` keys at a time with a running max m, sum l and weighted sum acc per (query,
  head). Block j covers keys [j·kb, (j+1)·kb); the last block, when kb does not divide S, is
  read from S − kb on with the keys before j·kb masked (no copy of the buffer is padded). A
  block is skipped (`lax.cond`) when it starts after the last query's position; the loop is a
  `lax.scan`, so the function stays differentiable."""
  b, t, h, lat = q_lat.shape
  s = c_kv.shape[1]
  n = -(-s // key_block)
  if query_positions is None:
    qpos = jnp.broadcast_to(jnp.arange(t) + (s - t), (b, t))
  elif query_positions.shape != (b, t):
    raise ValueError(f"mla: query_positions must be [B,T]=[{b},{t}], found "
                     f"{query_positions.shape}")
  else:
    qpos = query_positions
  if segment_ids is not None and segment_ids.shape != (b, s):
    raise ValueError(f"mla: segment_ids must be [B,S]=[{b},{s}], found {segment_ids.shape}")
  if kv_mask is not None and kv_mask.shape != (b, s):
    raise ValueError(f"mla: kv_mask must be [B,S]=[{b},{s}], found {kv_mask.shape}")
  seg_q = None if segment_ids is None else segment_ids[:, s - t:]
  last = jnp.max(qpos)

  def visit(carry, j):
    m, l, acc, mx = carry
    lo = j * key_block
    start = jnp.minimum(lo, s - key_block)
    take = lambda x: lax.dynamic_slice_in_dim(x, start, key_block, axis=1)  # noqa: E731
    kpos = start + jnp.arange(key_block)
    mask = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos >= lo)[None, None, :]
    if seg_q is not None:
      mask = mask & (seg_q[:, :, None] == take(segment_ids)[:, None, :])
    if kv_mask is not None:
      mask = mask & take(kv_mask)[:, None, :].astype(bool)
    mask = mask[:, None]                                                # [B,1,T,kb]
    c_b = take(c_kv).astype(jnp.float32)
    logits = (jnp.einsum("bthl,bsl->bhts", q_lat, c_b)
              + jnp.einsum("bthr,bsr->bhts", q_rope, take(k_rope),
                           preferred_element_type=jnp.float32)) * scale
    logits = jnp.where(mask, logits, _NEG)
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1))                    # [B,H,T]
    p = jnp.where(mask, jnp.exp(logits - m_new[..., None]), 0.0)
    decay = jnp.exp(m - m_new)
    l = l * decay + jnp.sum(p, axis=-1)
    acc = acc * jnp.moveaxis(decay, 1, 2)[..., None] + jnp.einsum("bhts,bsl->bthl", p, c_b)
    return (m_new, l, acc, jnp.maximum(mx, jnp.max(logits, axis=(0, 2, 3)))), None

  def step(carry, j):
    return lax.cond(j * key_block <= last, lambda c: visit(c, j)[0], lambda c: c, carry), None

  init = (jnp.full((b, h, t), _NEG, jnp.float32), jnp.zeros((b, h, t), jnp.float32),
          jnp.zeros((b, t, h, lat), jnp.float32), jnp.full((h,), _NEG, jnp.float32))
  (m, l, acc, max_logit), _ = lax.scan(step, init, jnp.arange(n))
  # A query with no allowed key (only through kv_mask) outputs zeros, as the unblocked form.
  denom = jnp.moveaxis(jnp.where(l > 0, l, 1.0), 1, 2)[..., None]
  return acc / denom, max_logit


__all__ = ["attention_mask", "mla_attention", "mla_absorbed_attention"]
