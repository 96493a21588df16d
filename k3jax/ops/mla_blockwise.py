"""Causal MLA attention in key blocks, straight from the latents (docs/k3.md §4), for long rows.

`ops.mla.mla_attention` takes materialised keys and values: [S, H, nope+rope] and [S, H, V]
for all S keys — at k3's 96 heads 61 GiB at S = 1M in bf16 — and materialises fp32 logits
[H, T, S] (a query block of them with `query_block`). Here keys and values stay latent until
they are used:

    c [B,S,L] (the normalised latent), k_rope [B,S,R] (the key part shared by the heads),
    w_kv [L,H,nope+V] (kv_b):  k_j = [c_j·w_kv[..., :nope], k_rope_j],  v_j = c_j·w_kv[..., nope:]

for one block j of `key_block` keys at a time, inside a loop with an online softmax (running
max m, sum l and weighted sum per query), so the largest temporaries are one block's logits
[B,H,T,key_block] and keys/values [B,key_block,H,·]. Key blocks wholly after the last query
are never visited (causal: about half the blocks of a square problem; a context-parallel
shard of the first positions visits only its own).

The backward pass is written out (`jax.custom_vjp`): it keeps the output and the log-sum-exp
per query, and loops over the same key blocks again, re-expanding each block and taking the
expansion's own VJP for the gradients of c, k_rope and w_kv — nothing per block is kept
between the passes. Gradients are those of the materialised form (the same function).

Queries are the positions `q_start + [0, T)` of the keys' sequence (`q_start` may be traced: a
context-parallel shard passes its offset). Segment ids restrict attention to a document, as in
`ops.mla.attention_mask`. Returns the fp32 output and `max_logit` [H] (QK-Clip's statistic,
over the queries marked in `q_valid`); like ops/mla.py, logits and softmax are fp32 and matmul
inputs keep their dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

_NEG = -1e30   # a masked logit (finite: never nan)
f32 = jnp.float32


def expand_latent(c, k_rope, w_kv, nope: int):
  """(k [B,S,H,nope+R], v [B,S,H,V]) of latents c [B,S,L], k_rope [B,S,R] and kv_b w_kv
  [L,H,nope+V], in c's dtype (fp32 accumulation), as `layers.mla.MLA.keys_values`."""
  kv = jnp.einsum("bsl,lhd->bshd", c, w_kv, preferred_element_type=f32).astype(c.dtype)
  k_nope, v = kv[..., :nope], kv[..., nope:]
  shared = jnp.broadcast_to(k_rope[:, :, None, :].astype(c.dtype),
                            k_nope.shape[:3] + (k_rope.shape[-1],))
  return jnp.concatenate([k_nope, shared], axis=-1), v


def _blocks_needed(q_start, t: int, key_block: int, num_blocks: int):
  """Key blocks up to the last query's position (a traced int when q_start is)."""
  return jnp.minimum(num_blocks, (q_start + t - 1) // key_block + 1)


def _block_inputs(c, k_rope, seg_k, j, key_block: int):
  take = lambda x: lax.dynamic_slice_in_dim(x, j * key_block, key_block, axis=1)  # noqa: E731
  return take(c), take(k_rope), take(seg_k)


def _mask(q_start, t: int, seg_q, seg_kb, j, key_block: int):
  """Allowed (query, key) pairs of key block j, bool [B,1,T,key_block]."""
  qpos = q_start + jnp.arange(t)
  kpos = j * key_block + jnp.arange(key_block)
  causal = kpos[None, :] <= qpos[:, None]
  return causal[None, None] & (seg_q[:, None, :, None] == seg_kb[:, None, None, :])


def _logits(q, k, scale):
  return jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=f32) * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _attention(q, c, k_rope, w_kv, seg_q, seg_k, q_start, scale, key_block, nope):
  return _forward(q, c, k_rope, w_kv, seg_q, seg_k, q_start, scale, key_block, nope)[0]


def _forward(q, c, k_rope, w_kv, seg_q, seg_k, q_start, scale, key_block, nope):
  b, t, h, _ = q.shape
  v_dim = w_kv.shape[-1] - nope
  num_blocks = c.shape[1] // key_block

  def body(j, carry):
    m, l, acc = carry
    c_b, kr_b, sk_b = _block_inputs(c, k_rope, seg_k, j, key_block)
    k_b, v_b = expand_latent(c_b, kr_b, w_kv, nope)
    mask = _mask(q_start, t, seg_q, sk_b, j, key_block)
    s = jnp.where(mask, _logits(q, k_b, scale), _NEG)            # [B,H,T,kb]
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    l = l * alpha + jnp.sum(p, axis=-1)
    acc = acc * jnp.moveaxis(alpha, 1, 2)[..., None] + jnp.einsum(
        "bhts,bshv->bthv", p, v_b.astype(f32))
    return m_new, l, acc

  init = (jnp.full((b, h, t), _NEG, f32), jnp.zeros((b, h, t), f32),
          jnp.zeros((b, t, h, v_dim), f32))
  n = _blocks_needed(q_start, t, key_block, num_blocks)
  m, l, acc = lax.fori_loop(0, n, body, init)
  o = acc / jnp.moveaxis(l, 1, 2)[..., None]
  lse = m + jnp.log(l)
  # m: each query's largest allowed logit (QK-Clip's statistic, before the max over queries).
  return (o, m), (q, c, k_rope, w_kv, seg_q, seg_k, q_start, o, lse)


def _backward(scale, key_block, nope, res, cotangents):
  q, c, k_rope, w_kv, seg_q, seg_k, q_start, o, lse = res
  do = cotangents[0].astype(f32)                                  # the max logit has none
  t = q.shape[1]
  num_blocks = c.shape[1] // key_block
  delta = jnp.moveaxis(jnp.sum(do * o, axis=-1), 1, 2)            # [B,H,T]
  qf = q.astype(f32)

  def body(j, carry):
    dq, dc, dkr, dw = carry
    c_b, kr_b, sk_b = _block_inputs(c, k_rope, seg_k, j, key_block)
    (k_b, v_b), vjp = jax.vjp(lambda c_, kr_, w_: expand_latent(c_, kr_, w_, nope),
                              c_b, kr_b, w_kv)
    mask = _mask(q_start, t, seg_q, sk_b, j, key_block)
    s = _logits(q, k_b, scale)
    p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)         # [B,H,T,kb]
    dv_b = jnp.einsum("bhts,bthv->bshv", p, do)
    dp = jnp.einsum("bthv,bshv->bhts", do, v_b.astype(f32))
    ds = p * (dp - delta[..., None]) * scale
    dq = dq + jnp.einsum("bhts,bshd->bthd", ds, k_b.astype(f32))
    dk_b = jnp.einsum("bhts,bthd->bshd", ds, qf)
    dc_b, dkr_b, dw_b = vjp((dk_b.astype(k_b.dtype), dv_b.astype(v_b.dtype)))
    put = lambda buf, x: lax.dynamic_update_slice_in_dim(  # noqa: E731
        buf, x.astype(buf.dtype), j * key_block, axis=1)
    return dq, put(dc, dc_b), put(dkr, dkr_b), dw + dw_b.astype(f32)

  init = (jnp.zeros(q.shape, f32), jnp.zeros(c.shape, c.dtype),
          jnp.zeros(k_rope.shape, k_rope.dtype), jnp.zeros(w_kv.shape, f32))
  n = _blocks_needed(q_start, t, key_block, num_blocks)
  dq, dc, dkr, dw = lax.fori_loop(0, n, body, init)
  return (dq.astype(q.dtype), dc, dkr, dw.astype(w_kv.dtype), None, None, None)


_attention.defvjp(_forward, _backward)


def mla_latent_attention(q, c, k_rope, w_kv, *, scale: float, key_block: int,
                         segment_ids=None, q_segment_ids=None, q_start=0, q_valid=None,
                         query_block: int | None = None):
  """Causal attention of q [B,T,H,nope+R] over the S latents c [B,S,L], k_rope [B,S,R]
  expanded through w_kv [L,H,nope+V] one key block at a time (module doc).

  segment_ids [B,S] of the keys (None: one document); q_segment_ids [B,T] of the queries
  (default: the keys' at the query positions, when T = S and q_start = 0); q_start: the
  queries' first position among the keys (int or traced); q_valid [T] bool: queries counted
  in max_logit (None: all); query_block: when T is larger, the queries run in blocks of this
  many (`lax.map`), each visiting only the key blocks up to its own last position — causal
  skipping inside one long run of queries, and logits [B,H,query_block,key_block] at most —
  at the cost of expanding those keys once per query block. S is padded to a multiple of
  key_block inside (padded keys come after every query). Returns (o fp32 [B,T,H,V],
  max_logit [H])."""
  b, t, h, dqk = q.shape
  s, nope = c.shape[1], dqk - k_rope.shape[-1]
  if c.shape[0] != b or k_rope.shape[:2] != (b, s):
    raise ValueError(f"mla_latent_attention: c [B,S,L] and k_rope [B,S,R] disagree with q "
                     f"(B={b}): {c.shape}, {k_rope.shape}")
  if w_kv.shape[:2] != (c.shape[-1], h) or w_kv.shape[-1] <= nope:
    raise ValueError(f"mla_latent_attention: w_kv must be [L={c.shape[-1]},H={h},nope+V] with "
                     f"nope={nope}, found {w_kv.shape}")
  if not isinstance(key_block, int) or key_block < 1:
    raise ValueError(f"mla_latent_attention: key_block must be a positive int, found "
                     f"{key_block!r}")
  seg_k = jnp.zeros((b, s), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  if q_segment_ids is None:
    if t != s:
      raise ValueError(f"mla_latent_attention: q_segment_ids is needed when T={t} != S={s}")
    q_segment_ids = seg_k
  pad = -s % key_block
  if pad:
    c, k_rope = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (c, k_rope))
    seg_k = jnp.pad(seg_k, ((0, 0), (0, pad)), constant_values=-1)
  seg_q, q_start = q_segment_ids.astype(jnp.int32), jnp.asarray(q_start, jnp.int32)
  if query_block is None or t <= query_block:
    o, mx = _attention(q, c, k_rope, w_kv, seg_q, seg_k, q_start, scale, key_block, nope)
  else:
    n = -(-t // query_block)
    tp = n * query_block
    # Padded queries sit after the real ones: they only ever see keys the real ones may see.
    qb = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0))).reshape(b, n, query_block, h, dqk)
    sb = jnp.pad(seg_q, ((0, 0), (0, tp - t)), mode="edge").reshape(b, n, query_block)
    one = lambda xs: _attention(xs[0], c, k_rope, w_kv, xs[1], seg_k,  # noqa: E731
                                q_start + xs[2] * query_block, scale, key_block, nope)
    o, mx = lax.map(one, (jnp.moveaxis(qb, 1, 0), jnp.moveaxis(sb, 1, 0), jnp.arange(n)))
    o = jnp.moveaxis(o, 0, 1).reshape(b, tp, h, -1)[:, :t]
    mx = jnp.moveaxis(mx, 0, 2).reshape(b, h, tp)[..., :t]
  if q_valid is not None:
    mx = jnp.where(q_valid[None, None, :], mx, _NEG)
  return o, lax.stop_gradient(jnp.max(mx, axis=(0, 2)))


__all__ = ["mla_latent_attention", "expand_latent"]
