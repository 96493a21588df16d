"""Inference: prefill and decode with KDA states and MLA latent caches; generation loops.

Pure functions over the `K3Model` variables (read by path, docs/contracts.md); the layers'
own modules are reused through `Module.apply(..., method=...)` for projections, gates, output
heads and MLPs, so training and decoding share one definition of every parameterised piece.

Cache (`Cache`, a pytree), per sequence b of the batch:
  * `lengths[b]`: tokens already fed.
  * KDA layer: `state` [B,H,K,V] fp32 (the delta-rule state after the last fed token) and
    `conv_q/conv_k/conv_v` [B,W−1,H,K] fp32 (the last W−1 = 3 short-conv inputs): constant size.
  * MLA layer: `c_kv` [B,S,kv_rank] (normalised latent) and `k_rope` [B,S,rope] (shared key part)
    in a buffer preallocated for S = `max_len` tokens; slots ≥ lengths[b] are zero.
  * `mtp`: the MTP layer's own MLA cache (position i holds the MTP input built from h_i and
    token i+1), present when the config has an MTP layer.

One function, `forward`, feeds T new tokens per sequence (`num_new[b] ≤ T`, right-padded) on
top of a cache. Two paths for the KDA recurrence:
  * "chunked" (prefill): `kda_chunked` from the cached state (WY/UT form);
  * "step" (decode, speculative verify): a scan of `kda_step` that also returns the state after
    every token, so a rejected draft can be undone exactly (`rewind`).
Padded positions get g = 0 and β = 0, which leave a KDA state unchanged, and their MLA latents
are dropped, so batches of different lengths share one static shape.
MLA decoding is absorbed: kv_b's key half is folded into the query and its value half applied
after attention over the latent buffer; no per-head K/V is materialised.

AttnRes (spec §5) at decode: the finished-block set is constant for all mixers between two
block appends, so at each append the partial softmax triple over the finished blocks is
computed once for every mixer of the coming block (one batched contraction), and each mixer
then only merges in the in-block partial (`ops.attnres.attn_res_merge`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from k3jax.config import DENSE, KDA, ModelConfig, dtype_of
from k3jax.layers.kda import KDA as KDALayer, l2_normalize
from k3jax.layers.mla import MLA as MLALayer
from k3jax.layers.mlp import MLP
from k3jax.layers.moe import StableLatentMoE
from k3jax.layers.norms import rms_norm
from k3jax.ops import attnres as ar
from k3jax.ops.kda import kda_chunked, kda_gate, kda_step
from k3jax.sampling import SamplingParams, StopChecker, sample, sampling_probs

_NEG = -1e30


# ============================================================================ cache pytrees
@struct.dataclass
class KDACache:
  state: jax.Array      # [B,H,K,V] fp32
  conv_q: jax.Array     # [B,W-1,H,K] fp32: last W-1 inputs of the q short conv
  conv_k: jax.Array
  conv_v: jax.Array


@struct.dataclass
class MLACache:
  c_kv: jax.Array       # [B,S,kv_rank]
  k_rope: jax.Array     # [B,S,rope]


@struct.dataclass
class Cache:
  lengths: jax.Array                 # [B] int32 tokens fed so far
  layers: tuple                      # one KDACache | MLACache per layer
  mtp: Any = None                    # MLACache of the MTP layer, or None
  mtp_lengths: Any = None            # [B] int32 MTP positions fed

  @property
  def max_len(self) -> int:
    for c in self.layers:
      if isinstance(c, MLACache):
        return c.c_kv.shape[1]
    return np.iinfo(np.int32).max    # KDA-only stacks have no length limit

  def nbytes(self) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))


def init_cache(config: ModelConfig, batch: int, max_len: int) -> Cache:
  """A zero cache for `batch` sequences of up to `max_len` tokens."""
  if max_len < 1:
    raise ValueError(f"max_len: expected >= 1, found {max_len}")
  cfg = config
  h, k, w = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
  cdt = dtype_of(cfg.dtype)

  def mla():
    return MLACache(jnp.zeros((batch, max_len, cfg.kv_lora_rank), cdt),
                    jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), cdt))

  layers = []
  for mixer, _ in cfg.layer_types():
    if mixer == KDA:
      conv = jnp.zeros((batch, w - 1, h, k), jnp.float32)
      layers.append(KDACache(jnp.zeros((batch, h, k, k), jnp.float32), conv, conv, conv))
    else:
      layers.append(mla())
  zeros = jnp.zeros((batch,), jnp.int32)
  if cfg.num_mtp_layers:
    return Cache(zeros, tuple(layers), mla(), zeros)
  return Cache(zeros, tuple(layers))


# ============================================================================ parameters
def layer_variables(config: ModelConfig, variables, i: int) -> dict:
  """The variables ({"params", "balance"}) of global layer i, sliced out of the scanned body."""
  prefix, groups, _ = config.stack_layout()
  p = config.mla_every
  out = {}
  for col in ("params", "balance"):
    tree = variables.get(col)
    if tree is None:
      continue
    if prefix <= i < prefix + groups * p:
      g, j = divmod(i - prefix, p)
      sub = tree.get("body", {}).get(f"layers_{j}")
      if sub is not None:
        out[col] = jax.tree_util.tree_map(lambda a: a[g], sub)
    elif f"layers_{i}" in tree:
      out[col] = tree[f"layers_{i}"]
  return out


def _sub(vs: dict, name: str) -> dict:
  return {c: t[name] for c, t in vs.items() if name in t}


def unbox(variables) -> dict:
  """Plain arrays (drops flax's logical-partitioning boxes)."""
  return nn.meta.unbox(dict(variables))


# ============================================================================ token mixers
def _gather_time(x, idx):
  """x [B,T,...], idx [B,n] → [B,n,...] (per-sequence time gather)."""
  return jax.vmap(lambda a, i: a[i])(x, idx)


def _conv_with_tail(x, tail, kernel, num_new):
  """Causal depthwise conv continuing from `tail`. x [B,T,H,C], tail [B,W-1,H,C] fp32,
  kernel [W,H,C] → (y fp32 [B,T,H,C], new tail [B,W-1,H,C], xcat [B,W-1+T,H,C])."""
  w, t = kernel.shape[0], x.shape[1]
  xcat = jnp.concatenate([tail, x.astype(jnp.float32)], axis=1)
  y = jnp.zeros(x.shape, jnp.float32)
  for tap in range(w):  # tap W-1 multiplies the current token (same order as short_conv)
    y = y + xcat[:, tap:tap + t] * kernel[tap].astype(jnp.float32)
  return y, _tail_after(xcat, num_new, w), xcat


def _tail_after(xcat, num_new, w):
  """The last W-1 conv inputs after feeding num_new[b] tokens: xcat[b, n : n+W-1]."""
  idx = num_new[:, None] + jnp.arange(w - 1)[None]
  return _gather_time(xcat, idx)


def _kda_mixer(cfg, vs, x, cache: KDACache, num_new, path):
  """KDA over T new tokens. Returns (out [B,T,d], new KDACache, rewind aux or None)."""
  t = x.shape[1]
  valid = jnp.arange(t)[None] < num_new[:, None]                      # [B,T]

  def fn(m):
    qx, kx, vx = m.q_proj(x), m.k_proj(x), m.v_proj(x)
    q, tq, xq = _conv_with_tail(qx, cache.conv_q, m.q_conv1d, num_new)
    k, tk, xk = _conv_with_tail(kx, cache.conv_k, m.k_conv1d, num_new)
    v, tv, xv = _conv_with_tail(vx, cache.conv_v, m.v_conv1d, num_new)
    q, k, v = l2_normalize(jax.nn.silu(q)), l2_normalize(jax.nn.silu(k)), jax.nn.silu(v)
    z = m.f_b_proj(m.f_a_proj(x)).astype(jnp.float32)
    g = kda_gate(z, m.A_log, m.dt_bias, lower_bound=cfg.kda_lower_bound)
    beta = jax.nn.sigmoid(m.b_proj(x).astype(jnp.float32))
    # Padded tokens: no decay, no write, so the state is exactly that after num_new tokens.
    g = jnp.where(valid[..., None, None], g, 0.0)
    beta = jnp.where(valid[..., None], beta, 0.0)
    k = jnp.where(valid[..., None, None], k, 0.0)
    scale = cfg.kda_head_dim ** -0.5
    aux = None
    if path == "chunked":
      o, state = kda_chunked(q, k, v, g, beta, scale=scale, initial_state=cache.state,
                             chunk_size=cfg.kda_chunk_size)
    else:
      def step(s, xs):
        o_t, s = kda_step(*xs, s, scale=scale)
        return s, (o_t, s)
      tm = lambda a: jnp.moveaxis(a, 1, 0)
      state, (o, states) = jax.lax.scan(step, cache.state, (tm(q), tm(k), tm(v), tm(g), tm(beta)))
      o = jnp.moveaxis(o, 0, 1)
      aux = dict(states=jnp.concatenate([cache.state[None], states], 0), xq=xq, xk=xk, xv=xv)
    out = m.output(x, o.astype(jnp.float32))
    return out, KDACache(state, tq, tk, tv), aux

  return KDALayer(cfg).apply(vs, method=fn)


def _write_latent(buf, new, pos, valid):
  """Scatter new [B,T,C] into buf [B,S,C] at pos [B,T]; invalid tokens are dropped."""
  s = buf.shape[1]
  pos = jnp.where(valid, pos, s)                                       # out of range → dropped
  b_idx = jnp.broadcast_to(jnp.arange(buf.shape[0])[:, None], pos.shape)
  return buf.at[b_idx, pos].set(new.astype(buf.dtype), mode="drop")


def absorbed_attention(q_nope, q_rope, c_kv, k_rope, w_kb, w_vb, qpos, *, scale):
  """Absorbed MLA attention over a latent buffer.

  q_nope [B,T,H,N], q_rope [B,T,H,R], c_kv [B,S,L], k_rope [B,S,R], w_kb [L,H,N], w_vb [L,H,V],
  qpos [B,T] absolute query positions (key s is visible iff s ≤ qpos). → o fp32 [B,T,H,V].
  """
  q_lat = jnp.einsum("bthn,lhn->bthl", q_nope, w_kb, preferred_element_type=jnp.float32)
  logits = (jnp.einsum("bthl,bsl->bhts", q_lat, c_kv.astype(jnp.float32))
            + jnp.einsum("bthr,bsr->bhts", q_rope, k_rope, preferred_element_type=jnp.float32))
  logits = logits * scale
  mask = jnp.arange(c_kv.shape[1])[None, None, None, :] <= qpos[:, None, :, None]
  logits = jnp.where(mask, logits, _NEG)
  probs = jax.nn.softmax(logits, axis=-1)
  ctx = jnp.einsum("bhts,bsl->bthl", probs, c_kv.astype(jnp.float32))
  return jnp.einsum("bthl,lhv->bthv", ctx, w_vb.astype(jnp.float32))


def _mla_mixer(cfg, vs, x, cache: MLACache, lengths, num_new):
  """Absorbed MLA over T new tokens appended at lengths[b]. → (out [B,T,d], new MLACache)."""
  t = x.shape[1]
  pos = lengths[:, None] + jnp.arange(t)[None]
  valid = jnp.arange(t)[None] < num_new[:, None]

  def fn(m):
    q = m.query(x)
    c, kr = m.latent(x)
    c_buf = _write_latent(cache.c_kv, c, pos, valid)
    kr_buf = _write_latent(cache.k_rope, kr, pos, valid)
    kv_b = m.kv_b_proj.variables["params"]["kernel"].astype(dtype_of(cfg.dtype))
    w_kb, w_vb = kv_b[..., :cfg.qk_nope_head_dim], kv_b[..., cfg.qk_nope_head_dim:]
    q_nope, q_rope = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
    o = absorbed_attention(q_nope, q_rope, c_buf, kr_buf, w_kb, w_vb, pos,
                           scale=cfg.qk_head_dim ** -0.5)
    return m.output(x, o), MLACache(c_buf, kr_buf)

  return MLALayer(cfg).apply(vs, method=fn)


def _mlp(cfg, vs, kind, x):
  if kind == DENSE:
    return MLP(cfg, cfg.dense_intermediate_size).apply(_sub(vs, "mlp"), x)
  return StableLatentMoE(cfg.for_inference()).apply(_sub(vs, "block_sparse_moe"), x)


# ============================================================================ AttnRes helpers
def _mixer_params(vs, name):
  p = vs["params"][name]
  return p["proj"], p["norm"]


def _block_triples(cfg, blocks, queries):
  """Partial softmax triples over the finished blocks for many mixers at once.

  blocks: list of [B,T,d]; queries: list of (w, norm) → MixPartial with a leading [M] axis.
  """
  src = jnp.stack(blocks)
  w = jnp.stack([q for q, _ in queries])
  n = jnp.stack([nw for _, nw in queries])
  return jax.vmap(lambda wi, ni: ar.attn_res_partial(src, wi, ni, cfg.rms_norm_eps))(w, n)


def _mix(cfg, triples, m, partial, w, n):
  """Mixer m: merge its precomputed block triple with the in-block partial."""
  part = ar.attn_res_partial(partial[None], w, n, cfg.rms_norm_eps)
  if triples is None:
    return ar.attn_res_finalize(part)
  blk = jax.tree_util.tree_map(lambda a: a[m], triples)
  return ar.attn_res_finalize(ar.attn_res_merge(blk, part))


# ============================================================================ forward
def _logits(cfg, params, h):
  hn = rms_norm(h, params["norm"]["weight"], cfg.rms_norm_eps)
  dt = dtype_of(cfg.dtype)
  if cfg.tie_word_embeddings:
    w = params["embed_tokens"]["embedding"].astype(dt)
    return jnp.einsum("btd,vd->btv", hn.astype(dt), w).astype(jnp.float32)
  w = params["lm_head"]["kernel"].astype(dt)
  return jnp.einsum("btd,dv->btv", hn.astype(dt), w).astype(jnp.float32)


def forward(config: ModelConfig, variables, cache: Cache, tokens, num_new, *,
            path: str = "chunked"):
  """Feed tokens [B,T] (the first num_new[b] of row b are real) on top of `cache`.

  Returns (logits fp32 [B,T,vocab], hidden fp32 [B,T,d] (before the final norm: the MTP input),
  new cache, aux) where aux (path="step" only) lets `rewind` undo part of the tokens.
  Rows past num_new[b] of the outputs are meaningless.
  """
  cfg = config
  params = variables["params"]
  tokens = tokens.astype(jnp.int32)
  num_new = num_new.astype(jnp.int32)
  x = jnp.take(params["embed_tokens"]["embedding"], tokens, axis=0).astype(jnp.float32)
  types = cfg.layer_types()
  attn_res = cfg.attn_res_block_size is not None
  bs = cfg.attn_res_block_size
  new_layers, aux = [], []
  blocks: list = []
  partial = x
  triples, base = None, 0   # triples of the current block; index of its first mixer

  def block_queries(start):
    """(w, norm) of every mixer that sees the block set fixed at layer `start`'s append."""
    qs = [_mixer_params(layer_variables(cfg, variables, start), "mlp_res")]
    for j in range(start + 1, min(start + bs, cfg.num_layers)):
      lv = layer_variables(cfg, variables, j)
      qs += [_mixer_params(lv, "self_attention_res"), _mixer_params(lv, "mlp_res")]
    if start + bs < cfg.num_layers:
      qs.append(_mixer_params(layer_variables(cfg, variables, start + bs), "self_attention_res"))
    else:
      p = params["output_attn_res"]
      qs.append((p["proj"], p["norm"]))
    return qs

  for i, (mixer, mlp_kind) in enumerate(types):
    vs = layer_variables(cfg, variables, i)
    eps = cfg.rms_norm_eps
    if attn_res:
      # Mixer before attention: its block set is the previous block's (or none at layer 0).
      h = partial if not blocks else _mix(cfg, triples, 2 * (i - base) - 1, partial,
                                          *_mixer_params(vs, "self_attention_res"))
      if i % bs == 0:
        blocks.append(partial)
        partial = jnp.zeros_like(partial)
        triples, base = _block_triples(cfg, blocks, block_queries(i)), i
    else:
      h = partial
    hn = rms_norm(h, vs["params"]["input_layernorm"]["weight"], eps).astype(h.dtype)
    attn_vs = _sub(vs, "self_attn")
    if mixer == KDA:
      out, c, a = _kda_mixer(cfg, attn_vs, hn, cache.layers[i], num_new, path)
    else:
      out, c = _mla_mixer(cfg, attn_vs, hn, cache.layers[i], cache.lengths, num_new)
      a = None
    new_layers.append(c)
    aux.append(a)
    partial = partial + out.astype(jnp.float32)
    if attn_res:
      h = _mix(cfg, triples, 2 * (i - base), partial, *_mixer_params(vs, "mlp_res"))
    else:
      h = partial
    hn = rms_norm(h, vs["params"]["post_attention_layernorm"]["weight"], eps).astype(h.dtype)
    partial = partial + _mlp(cfg, vs, mlp_kind, hn).astype(jnp.float32)

  if attn_res:
    p = params["output_attn_res"]
    last = 2 * (cfg.num_layers - base) - 1
    h = _mix(cfg, triples, last, partial, p["proj"], p["norm"])
  else:
    h = partial
  logits = _logits(cfg, params, h)
  new = cache.replace(lengths=cache.lengths + num_new, layers=tuple(new_layers))
  return logits, h, new, (aux if path == "step" else None)


def rewind(cache_after: Cache, cache_before: Cache, aux, keep) -> Cache:
  """The cache as if only the first keep[b] of the tokens fed by a "step" forward were fed.

  KDA: the state after keep[b] tokens (kept by the step scan) and the conv tail from the
  saved inputs; MLA: length back to before+keep and the dropped slots zeroed. Exactly the cache
  a forward of those keep[b] tokens would have produced.
  """
  keep = keep.astype(jnp.int32)
  lengths = cache_before.lengths + keep
  layers = []
  for c, a in zip(cache_after.layers, aux):
    if isinstance(c, KDACache):
      w1 = c.conv_q.shape[1] + 1
      state = jnp.take_along_axis(a["states"], keep[None, :, None, None, None], 0)[0]
      layers.append(KDACache(state, _tail_after(a["xq"], keep, w1), _tail_after(a["xk"], keep, w1),
                             _tail_after(a["xv"], keep, w1)))
    else:
      live = (jnp.arange(c.c_kv.shape[1])[None] < lengths[:, None])[..., None]
      layers.append(MLACache(jnp.where(live, c.c_kv, 0), jnp.where(live, c.k_rope, 0)))
  return cache_after.replace(lengths=lengths, layers=tuple(layers))


# ============================================================================ prefix-cache payloads
def kda_checkpoint(cache: Cache, row: int) -> list[dict]:
  """Row `row`'s KDA checkpoint: per KDA layer {state, conv_q, conv_k, conv_v} (numpy)."""
  return [{f: np.asarray(getattr(c, f)[row]) for f in ("state", "conv_q", "conv_k", "conv_v")}
          for c in cache.layers if isinstance(c, KDACache)]


def mla_latents(cache: Cache, row: int, start: int, end: int) -> np.ndarray:
  """Row `row`'s latents of tokens [start, end): [L_mla, end−start, kv_rank+rope] (numpy)."""
  return np.stack([np.concatenate([np.asarray(c.c_kv[row, start:end], np.float32),
                                   np.asarray(c.k_rope[row, start:end], np.float32)], -1)
                   for c in cache.layers if isinstance(c, MLACache)])


def cache_from_prefix(config: ModelConfig, rows: Sequence[tuple], max_len: int) -> Cache:
  """A cache resuming each row from a reused prefix.

  rows: per sequence (latents [L_mla, n, kv_rank+rope] or None, kda checkpoint list or None);
  n = 0 / None means a cold start for that row. The inverse of `mla_latents`/`kda_checkpoint`.
  """
  cache = init_cache(config, len(rows), max_len)
  layers = list(cache.layers)
  lengths = np.zeros(len(rows), np.int32)
  r = config.kv_lora_rank
  for b, (lat, kda) in enumerate(rows):
    n = 0 if lat is None else lat.shape[1]
    if n and kda is None and any(isinstance(c, KDACache) for c in layers):
      raise ValueError(f"rows[{b}]: latents of {n} tokens but no KDA checkpoint")
    lengths[b] = n
    mi = ki = 0
    for i, c in enumerate(layers):
      if isinstance(c, MLACache) and n:
        layers[i] = MLACache(c.c_kv.at[b, :n].set(lat[mi, :, :r].astype(c.c_kv.dtype)),
                             c.k_rope.at[b, :n].set(lat[mi, :, r:].astype(c.k_rope.dtype)))
        mi += 1
      elif isinstance(c, KDACache) and kda is not None:
        layers[i] = KDACache(*(getattr(c, f).at[b].set(kda[ki][f])
                               for f in ("state", "conv_q", "conv_k", "conv_v")))
        ki += 1
  return cache.replace(lengths=jnp.asarray(lengths), layers=tuple(layers))


# ============================================================================ MTP
def mtp_forward(config: ModelConfig, variables, cache: Cache, h, next_tokens, num_new):
  """MTP over new positions: h [B,T,d] main hidden states, next_tokens [B,T] (token t+1).

  Appends to `cache.mtp` at cache.mtp_lengths. Returns (logits fp32 [B,T,vocab] predicting
  token t+2, new cache).
  """
  cfg = config
  params = variables["params"]
  mp = params["mtp"]
  eps = cfg.rms_norm_eps
  emb = jnp.take(params["embed_tokens"]["embedding"], next_tokens.astype(jnp.int32), axis=0)
  x = jnp.concatenate([rms_norm(emb.astype(jnp.float32), mp["enorm"]["weight"], eps),
                       rms_norm(h, mp["hnorm"]["weight"], eps)], axis=-1)
  x = jnp.einsum(
      "btc,cd->btd", x.astype(dtype_of(cfg.dtype)),
      mp["eh_proj"]["kernel"].astype(dtype_of(cfg.dtype))).astype(jnp.float32)
  lv = {c: t["mtp"]["layer"] for c, t in variables.items() if "mtp" in t}
  num_new = num_new.astype(jnp.int32)
  hn = rms_norm(x, lv["params"]["input_layernorm"]["weight"], eps)
  out, c = _mla_mixer(cfg, _sub(lv, "self_attn"), hn, cache.mtp, cache.mtp_lengths, num_new)
  x = x + out.astype(jnp.float32)
  hn = rms_norm(x, lv["params"]["post_attention_layernorm"]["weight"], eps)
  x = x + _mlp(cfg, lv, "moe", hn).astype(jnp.float32)
  x = rms_norm(x, mp["norm"]["weight"], eps)
  dt = dtype_of(cfg.dtype)
  if cfg.tie_word_embeddings:
    logits = jnp.einsum("btd,vd->btv", x.astype(dt), params["embed_tokens"]["embedding"].astype(dt))
  else:
    logits = jnp.einsum("btd,dv->btv", x.astype(dt), params["lm_head"]["kernel"].astype(dt))
  return logits.astype(jnp.float32), cache.replace(mtp=c, mtp_lengths=cache.mtp_lengths + num_new)


# ============================================================================ public API
def _check_tokens(config, tokens, what="tokens"):
  arr = np.asarray(tokens)
  if arr.size and (arr.min() < 0 or arr.max() >= config.vocab_size):
    raise ValueError(f"{what}: token ids must be in [0, vocab_size={config.vocab_size}), found "
                     f"[{arr.min()}, {arr.max()}]")


@functools.lru_cache(maxsize=None)
def _jitted(config: ModelConfig, path: str):
  return jax.jit(functools.partial(forward, config, path=path))


@functools.lru_cache(maxsize=None)
def _jitted_mtp(config: ModelConfig):
  return jax.jit(functools.partial(mtp_forward, config))


def prefill(config: ModelConfig, variables, tokens, lengths, *, max_len: int | None = None,
            cache: Cache | None = None, chunk: int | None = None, return_all: bool = False):
  """Feed prompts (chunked KDA form), chunk by chunk of `chunk` tokens (default min(T, 512)).

  Every chunk has the same shape (the last one is padded), so one compilation serves all.

  tokens: [B,T] int, row b's prompt in its first lengths[b] entries (right padding).
  max_len: cache capacity (default T) when `cache` is None; with `cache`, the prompts are
  appended to it (continuing a prefix). Returns (last_logits fp32 [B,vocab] at each prompt's
  last token, cache) — or (logits [B,T,vocab], hidden [B,T,d], cache) with return_all.
  """
  variables = unbox(variables)
  tokens = np.asarray(tokens)
  lengths = np.asarray(lengths, np.int32)
  if tokens.ndim != 2 or lengths.shape != tokens.shape[:1]:
    raise ValueError(f"tokens/lengths: expected [B,T] and [B], found {tokens.shape} and "
                     f"{lengths.shape}")
  b, t = tokens.shape
  if (lengths < 1).any():
    raise ValueError(f"lengths: every prompt needs at least one token, found {lengths.tolist()}")
  if (lengths > t).any():
    raise ValueError(f"lengths: must be <= T={t}, found {lengths.tolist()}")
  _check_tokens(config, np.concatenate([tokens[i, :min(lengths[i], t)] for i in range(b)]))
  if cache is None:
    cache = init_cache(config, b, max_len or t)
  have = np.asarray(cache.lengths)
  if (have + lengths > cache.max_len).any():
    raise ValueError(f"tokens: prompt of {(have + lengths).max()} tokens (with the cached "
                     f"prefix) exceeds the cache capacity max_len={cache.max_len}")
  fwd = _jitted(config, "chunked")
  chunk = chunk or min(t, 512)
  outs = []
  last = None
  for s in range(0, t, chunk):
    part = tokens[:, s:s + chunk]
    n = np.clip(lengths - s, 0, part.shape[1]).astype(np.int32)
    if part.shape[1] < chunk:   # one compiled shape for every chunk (the tail is padded)
      part = np.pad(part, ((0, 0), (0, chunk - part.shape[1])))
    logits, hidden, cache, _ = fwd(variables, cache, jnp.asarray(part), jnp.asarray(n))
    if return_all:
      outs.append((logits[:, :min(chunk, t - s)], hidden[:, :min(chunk, t - s)]))
    else:
      idx = np.clip(lengths - 1 - s, 0, part.shape[1] - 1)
      sel = jnp.take_along_axis(logits, jnp.asarray(idx)[:, None, None], 1)[:, 0]
      here = jnp.asarray((lengths - 1 >= s) & (lengths - 1 < s + part.shape[1]))[:, None]
      last = sel if last is None else jnp.where(here, sel, last)
  if return_all:
    return (jnp.concatenate([o[0] for o in outs], 1), jnp.concatenate([o[1] for o in outs], 1),
            cache)
  return last, cache


def decode_step(config: ModelConfig, variables, cache: Cache, token, active=None):
  """Feed one token per sequence ([B] int). Returns (logits fp32 [B,vocab], new cache).

  `active` [B] bool (default all): inactive rows leave their cache untouched. Jitted once per
  (config, batch, max_len): static shapes.
  """
  token = jnp.asarray(token, jnp.int32)
  n = jnp.ones(token.shape, jnp.int32) if active is None else jnp.asarray(active, jnp.int32)
  logits, _, cache, _ = _decode_jit(config)(unbox(variables), cache, token, n)
  return logits, cache


@functools.lru_cache(maxsize=None)
def _decode_jit(config):
  def f(variables, cache, token, n):
    logits, h, new, _ = forward(config, variables, cache, token[:, None], n, path="step")
    return logits[:, 0], h[:, 0], new, None
  return jax.jit(f)


def generate(config: ModelConfig, variables, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, sampling: SamplingParams = SamplingParams(), seed: int = 0,
             max_len: int | None = None, decode: Callable | None = None,
             on_token: Callable[[int, int], None] | None = None) -> list[list[int]]:
  """Sample continuations of a batch of prompts (different lengths allowed).

  Returns the generated tokens of each prompt (without stop tokens). `on_token(row, token)` is
  called for every emitted token (streaming). `decode` (ids → text) is needed for stop strings.
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("prompts: expected non-empty prompts, found an empty one")
  if max_new_tokens < 0:
    raise ValueError(f"max_new_tokens: expected >= 0, found {max_new_tokens}")
  lengths = np.array([len(p) for p in prompts], np.int32)
  need = int(lengths.max()) + max_new_tokens
  max_len = max_len or need
  if need > max_len:
    raise ValueError(f"prompts: longest prompt ({lengths.max()}) + max_new_tokens "
                     f"({max_new_tokens}) exceeds the cache capacity max_len={max_len}")
  toks = np.zeros((len(prompts), int(lengths.max())), np.int32)
  for i, p in enumerate(prompts):
    toks[i, :len(p)] = p
  checkers = [StopChecker(sampling, decode) for _ in prompts]
  if max_new_tokens == 0:
    return [[] for _ in prompts]
  variables = unbox(variables)
  logits, cache = prefill(config, variables, toks, lengths, max_len=max_len)
  key = jax.random.PRNGKey(seed)
  for step in range(max_new_tokens):
    key, sub = jax.random.split(key)
    tok = np.asarray(sample(sub, logits, sampling))
    active = np.zeros(len(prompts), bool)
    for i, c in enumerate(checkers):
      if not c.stopped:
        stopped = c.add(tok[i])
        if not stopped and on_token is not None:
          on_token(i, int(tok[i]))
        active[i] = not stopped
    if not active.any() or step == max_new_tokens - 1:
      break
    logits, cache = decode_step(config, variables, cache, tok, active)
  return [c.tokens for c in checkers]


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
  from k3jax.serving.speculative import verify_drafts
  if not config.num_mtp_layers:
    raise ValueError("config.num_mtp_layers: speculative decoding needs the MTP layer, found 0")
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("prompts: expected non-empty prompts, found an empty one")
  variables = unbox(variables)
  bsz = len(prompts)
  lengths = np.array([len(p) for p in prompts], np.int32)
  max_len = max_len or int(lengths.max()) + max_new_tokens + 2
  if int(lengths.max()) + max_new_tokens + 1 > max_len:
    raise ValueError(f"prompts: longest prompt + max_new_tokens + 1 exceeds max_len={max_len}")
  toks = np.zeros((bsz, int(lengths.max())), np.int32)
  for i, p in enumerate(prompts):
    toks[i, :len(p)] = p
  logits, hidden, cache = prefill(config, variables, toks, lengths, max_len=max_len,
                                  return_all=True)
  mtp = _jitted_mtp(config)
  # MTP entries for prompt positions 0..len−2 (pairs (h_i, token i+1)).
  nxt = np.zeros_like(toks)
  nxt[:, :-1] = toks[:, 1:]
  _, cache = mtp(variables, cache, hidden, jnp.asarray(nxt), jnp.asarray(lengths - 1))
  idx = jnp.asarray(lengths - 1)[:, None, None]
  last_logits = jnp.take_along_axis(logits, idx, 1)[:, 0]
  last_h = jnp.take_along_axis(hidden, idx, 1)[:, 0]
  key = jax.random.PRNGKey(seed)
  key, sub = jax.random.split(key)
  x_n = sample(sub, last_logits, sampling)
  # Pairs the MTP layer still has to see: (h, next token); the last one drafts.
  pend_h = jnp.stack([last_h, last_h], 1)
  pend_t = jnp.stack([x_n, x_n], 1)
  pend_n = jnp.ones((bsz,), jnp.int32)
  out = [[int(t)] for t in np.asarray(x_n)]
  verify = _verify_jit(config)
  accepted = drafts = rounds = 0
  while min(len(o) for o in out) < max_new_tokens:
    rounds += 1
    key, k_draft, k_ver = jax.random.split(key, 3)
    q_logits, cache = mtp(variables, cache, pend_h, pend_t, pend_n)
    q_last = jnp.take_along_axis(q_logits, (pend_n - 1)[:, None, None], 1)[:, 0]
    d = sample(k_draft, q_last, sampling)
    x_n = jnp.take_along_axis(pend_t, (pend_n - 1)[:, None], 1)[:, 0]
    feed = jnp.stack([x_n, d], 1)
    before = cache
    logits, hidden, after, aux = verify(variables, cache, feed, jnp.full((bsz,), 2, jnp.int32))
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


@functools.lru_cache(maxsize=None)
def _verify_jit(config):
  return jax.jit(functools.partial(forward, config, path="step"))


__all__ = ["Cache", "KDACache", "MLACache", "init_cache", "forward", "rewind", "mtp_forward",
           "prefill", "decode_step", "generate", "speculative_generate", "absorbed_attention",
           "layer_variables", "unbox", "kda_checkpoint", "mla_latents", "cache_from_prefix"]
