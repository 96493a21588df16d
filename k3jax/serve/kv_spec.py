"""Speculative decoding over the engine's device state: the MTP / EAGLE-3 draft per slot.

With `EngineConfig.draft_len = n`, the engine's pools gain the MTP layer's latent pages (same
page ids as the other layers: entry i, built from h_i and token i+1, sits at position i), and
each tile keeps every slot's pending pairs (`pend`: the features [n+1, d] and tokens [n+1] the
draft has not seen yet, and their count). Two programs replace prefill and decode:

  prefill_piece   a piece as before, then the MTP layer over the piece's pairs (h_i, token
                  i+1) — the token after the piece is the prompt's next one, or for the
                  prompt's last piece the first sampled token, which becomes the slot's pend;
  round           one draft / verify round for every row of a tile (fixed shape [rows, n+1]):
                  the draft sees the pending pairs, chains n drafts on its own hidden state
                  (EAGLE-3's rule; its chain entries never reach the pages), the model verifies
                  [x, d_1 … d_n] in one forward with the KDA layers keeping every per-token
                  state, `verify_drafts` accepts a prefix with probability min(1, p/q) per
                  draft and draws the next token from the residual — exact rejection
                  sampling, so the tokens follow the target distribution (greedy: exactly the
                  greedy tokens) — and the rejected tokens are undone exactly
                  (`speculative.rewind`; only kept latents are written to pages).

Every draw uses per-row keys (fold_in of the request's seed and token count), every operation
acts per row: a row's round does not depend on the other rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.cache import commit_mtp, commit_paged, paged_cache
from k3jax.config import ModelConfig
from k3jax.model import K3Model
from k3jax.serve.sampling import logprobs_rows, probs_rows, row_keys, sample_rows
from k3jax.serve.speculative import rewind, verify_drafts


def _prefill_piece(config: ModelConfig, num_top: int, logprobs: str, variables, kda, pools,
                   table, lengths, tokens, num_new, next_tokens, draft_n, seeds, counters,
                   temperature, top_k, top_p, media=None):
  """Pieces on staging rows (like `kv._forward`), then the MTP layer over each row's first
  draft_n pairs (h_i, next_tokens[i]). Returns ((tokens, logprobs, top), hidden at each row's
  last real input [B, d], kda, pools)."""
  model = K3Model(config)
  cache = paged_cache(config, kda, pools, table, lengths, mtp_lengths=lengths)
  logits, hidden, after = model.apply(variables, tokens, cache, num_new, media,
                                      method=K3Model.extend)
  _, after = model.apply(variables, hidden, next_tokens, after, draft_n, method=K3Model.draft)
  last = jnp.maximum(num_new - 1, 0)
  at_last = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
  out = sample_rows(at_last, seeds, counters, temperature, top_k, top_p, num_top,
                    logprobs=logprobs)
  h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
  kda, pools = commit_paged(after, pools, table, lengths, num_new, tokens.shape[1])
  pools = commit_mtp(after, pools, table, lengths, draft_n, tokens.shape[1])
  return out, h_last, kda, pools


def _verify_rows(keys, target_probs, draft_probs, drafts):
  """`verify_drafts` row by row, each with its own key: ([B] accepted, [B] next token)."""
  one = lambda k, p, q, d: tuple(x[0] for x in verify_drafts(k, p[None], q[None], d[None]))
  return jax.vmap(one)(keys, target_probs, draft_probs, drafts)


def _round(config: ModelConfig, n: int, num_top: int, logprobs: str, variables, kda, pools,
           pend, table, lengths, active, seeds, counters, temperature, top_k, top_p):
  """One draft / verify round for every row of a tile (module doc).

  pend = (features [B, n+1, d], tokens [B, n+1], count [B]); lengths [B] tokens in the caches
  (the pend's last token not yet fed); active [B] bool. Returns (drafts [B, n], accepted [B],
  next [B], logprobs [B, n+1] of the emitted tokens (drafts[:accepted], then next; of the
  distribution `logprobs` names, as `sample_rows`), top
  (ids, logprobs) [B, n+1, num_top] or None, kda, pools, pend)."""
  model = K3Model(config)
  act = active.astype(jnp.int32)
  pend_h, pend_t, pend_n = pend
  mtp_start = lengths - pend_n
  cache = paged_cache(config, kda, pools, table, lengths, mtp_lengths=mtp_start)
  q_logits, a, cache = model.apply(variables, pend_h, pend_t, cache, pend_n * act, True,
                                   method=K3Model.draft)
  pools = commit_mtp(cache, pools, table, mtp_start, pend_n * act, pend_t.shape[1])
  keys = row_keys(seeds, counters)
  last = jnp.maximum(pend_n - 1, 0)[:, None]
  q_j = jnp.take_along_axis(q_logits, last[..., None], 1)[:, 0]
  a_j = jnp.take_along_axis(a, last[..., None], 1)[:, 0]
  ds, qs = [], []
  for j in range(n):
    if j:   # chain on the draft's own hidden state and token
      q_j, a_j, cache = model.apply(variables, a_j[:, None], ds[-1][:, None], cache, act, True,
                                    method=K3Model.draft)
      q_j, a_j = q_j[:, 0], a_j[:, 0]
    kj = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, j + 1)
    ds.append(sample_rows(q_j, seeds, counters, temperature, top_k, top_p, keys=kj)[0])
    qs.append(probs_rows(q_j, temperature, top_k, top_p))
  d = jnp.stack(ds, 1)
  x_n = jnp.take_along_axis(pend_t, last, 1)[:, 0]
  feed = jnp.concatenate([x_n[:, None], d], 1)
  cache = cache.replace(mtp=None, mtp_lengths=None)
  (logits, hidden, after), aux = model.apply(variables, feed, cache, (n + 1) * act,
                                             method=K3Model.extend, mutable=["rewind"])
  target = jax.vmap(lambda lg: probs_rows(lg, temperature, top_k, top_p), in_axes=1,
                    out_axes=1)(logits)
  num, y = _verify_rows(jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, 0), target,
                        jnp.stack(qs, 1), d)
  keep = (num + 1) * act
  after = rewind(after, cache, aux["rewind"], keep)
  kda, pools = commit_paged(after, pools, table, lengths, keep, n + 1)
  emitted = jnp.where(jnp.arange(n + 1)[None] < num[:, None], jnp.pad(d, ((0, 0), (0, 1))),
                      y[:, None])
  logp = jax.vmap(lambda lg: logprobs_rows(lg, temperature, top_k, top_p, logprobs),
                  in_axes=1, out_axes=1)(logits)
  lps = jnp.take_along_axis(logp, emitted[..., None], -1)[..., 0]
  top = None
  if num_top:
    top_lp, top_ids = jax.lax.top_k(logp, num_top)
    top = (top_ids.astype(jnp.int32), top_lp)
  on = active[:, None]
  new_pend = (jnp.where(on[..., None], hidden, pend_h), jnp.where(on, emitted, pend_t),
              jnp.where(active, num + 1, pend_n))
  return d, num, y, lps, top, kda, pools, new_pend


def _set_pend(pend, row, h, token):
  """Row `row`'s pend ← the single pair (h [d], token)."""
  ph, pt, pn = pend
  return (ph.at[row].set(jnp.zeros_like(ph[row]).at[0].set(h)),
          pt.at[row].set(jnp.zeros_like(pt[row]).at[0].set(token)), pn.at[row].set(1))


def _take_pend(pend, row):
  """Row `row`'s pending pairs (a paused request's): (features [n+1, d], tokens [n+1], count)."""
  return tuple(x[row] for x in pend)


def _put_pend(pend, row, rows):
  """Row `row`'s pending pairs ← `rows` (from `_take_pend`)."""
  return tuple(x.at[row].set(y) for x, y in zip(pend, rows))


@functools.lru_cache(maxsize=None)
def speculative_programs(config: ModelConfig, draft_len: int, num_top: int,
                         logprobs: str = "model") -> dict:
  """The jitted speculative programs of one config (shared by its engines; state donated);
  `logprobs` as `kv.programs`."""
  return dict(
      prefill=jax.jit(functools.partial(_prefill_piece, config, num_top, logprobs),
                      donate_argnums=(1, 2)),
      round=jax.jit(functools.partial(_round, config, draft_len, num_top, logprobs),
                    donate_argnums=(1, 2, 3)),
      set_pend=jax.jit(_set_pend, donate_argnums=(0,)),
      take_pend=jax.jit(_take_pend),
      put_pend=jax.jit(_put_pend, donate_argnums=(0,)),
  )


__all__ = ["speculative_programs"]
