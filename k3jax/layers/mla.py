"""Gated Multi-head Latent Attention with NoPE (docs/k3.md §4).

q: q_a_proj → RMSNorm → q_b_proj (or a single q_proj when q_lora_rank is None), split into the
per-head "nope" part and the "rope" part (never rotated: NoPE). kv: kv_a_proj_with_mqa gives the
latent c (RMSNorm'd) and a key part shared by all heads; kv_b_proj(c) gives per-head key and value.
Causal softmax attention with scale (nope+rope)^-0.5 — on materialised keys/values, or with
`mla_key_block` straight from the latents in key blocks (k3jax/ops/mla_blockwise.py) — fp32
output, × sigmoid(g_proj x) when `mla_output_gate`, then o_proj. Sows `max_logit` [H] (fp32)
into "stats" for QK-Clip.

Decoding: with `cache` (an `MLACache`: the normalised latent and the shared key part of every
cached token, in a buffer preallocated for max_len tokens) and a `Feed`, the new tokens'
latents are written at their positions and the queries attend the buffer in the absorbed form
(`ops.mla.mla_absorbed_attention`: kv_b folded into the query and the output; no per-head keys
or values are materialised), in key blocks of `modes.mla_key_block` when set.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from k3jax.config import dtype_of
from k3jax.layers import backend
from k3jax.layers.feed import Feed, write_slots
from k3jax.layers.linear import effective_kernel, linear
from k3jax.layers.norms import RMSNorm
from k3jax.ops.mla import mla_absorbed_attention


@struct.dataclass
class MLACache:
  """An MLA layer's decode cache; slots at or past a row's length are zero."""
  c_kv: jax.Array       # [B,S,kv_rank] normalised latent, compute dtype
  k_rope: jax.Array     # [B,S,rope] the key part shared by all heads

  @classmethod
  def zeros(cls, config, batch: int, max_len: int) -> "MLACache":
    dt = dtype_of(config.modes.dtype)
    return cls(jnp.zeros((batch, max_len, config.text.kv_lora_rank), dt),
               jnp.zeros((batch, max_len, config.text.qk_rope_head_dim), dt))

  def truncated(self, lengths) -> "MLACache":
    """Slots at or past lengths[b] ([B] int) zeroed (a leading groups axis broadcasts)."""
    live = (jnp.arange(self.c_kv.shape[-2])[None] < lengths[:, None])[..., None]
    return MLACache(jnp.where(live, self.c_kv, 0), jnp.where(live, self.k_rope, 0))


def sow_stat(module: nn.Module, name: str, value):
  """Store `value` as a plain array in "stats" (overwrite, not tuple-append); no-op at init."""
  if module.is_initializing():
    return
  module.sow("stats", name, value, init_fn=lambda: None, reduce_fn=lambda _, v: v)


class MLA(nn.Module):
  """Gated MLA token mixer. __call__(x [B,T,d], segment_ids [B,T] | None) → [B,T,d]."""
  config: object

  def setup(self):
    cfg = self.config
    h, dqk = cfg.text.num_heads, cfg.text.qk_head_dim
    if cfg.text.q_lora_rank is not None:
      self.q_a_proj = linear(cfg, cfg.text.q_lora_rank, ("embed", "q_latent"), name="q_a_proj",
                             target="q")
      self.q_a_layernorm = RMSNorm(eps=cfg.text.mla_latent_norm_eps, axis_name="norm", name="q_a_layernorm")
      self.q_b_proj = linear(cfg, (h, dqk), ("q_latent", "heads", "head_dim"), name="q_b_proj",
                             target="q")
    else:
      self.q_proj = linear(cfg, (h, dqk), ("embed", "heads", "head_dim"), name="q_proj", target="q")
    self.kv_a_proj_with_mqa = linear(cfg, cfg.text.kv_lora_rank + cfg.text.qk_rope_head_dim,
                                     ("embed", "kv_latent"), name="kv_a_proj_with_mqa",
                                     target=("k", "v"))
    self.kv_a_layernorm = RMSNorm(eps=cfg.text.mla_latent_norm_eps, axis_name="norm", name="kv_a_layernorm")
    self.kv_b_proj = linear(cfg, (h, cfg.text.qk_nope_head_dim + cfg.text.v_head_dim),
                            ("kv_latent", "heads", "head_dim"), name="kv_b_proj",
                            target=("k", "v"))
    if cfg.text.mla_output_gate:
      self.g_proj = linear(cfg, (h, cfg.text.v_head_dim), ("embed", "heads", "head_dim"), name="g_proj",
                           target="gates")
    self.o_proj = linear(cfg, cfg.text.d_model, ("heads", "head_dim", "embed"), axis=(-2, -1),
                         name="o_proj", target="o")

  # Public pieces (decoding reuses them with a latent cache).
  def query(self, x):
    """q [B,T,H,nope+rope] in compute dtype."""
    if self.config.text.q_lora_rank is not None:
      return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
    return self.q_proj(x)

  def latent(self, x):
    """(c_kv [B,T,kv_rank] normalised latent, k_rope [B,T,rope] shared key part): the cache."""
    kv = self.kv_a_proj_with_mqa(x)
    c, k_rope = jnp.split(kv, [self.config.text.kv_lora_rank], axis=-1)
    return self.kv_a_layernorm(c), k_rope

  def keys_values(self, c_kv, k_rope):
    """Materialised k [B,S,H,nope+rope] and v [B,S,H,V] from the latent."""
    cfg = self.config
    kv = self.kv_b_proj(c_kv)
    k_nope, v = jnp.split(kv, [cfg.text.qk_nope_head_dim], axis=-1)
    k_shared = jnp.broadcast_to(k_rope[:, :, None, :].astype(k_nope.dtype),
                                k_nope.shape[:3] + (cfg.text.qk_rope_head_dim,))
    return jnp.concatenate([k_nope, k_shared], axis=-1), v

  def output(self, x, o):
    """Gate the fp32 attention output o [B,T,H,V] and project to d."""
    if self.config.text.mla_output_gate:
      o = o * jax.nn.sigmoid(self.g_proj(x).astype(jnp.float32))
    return self.o_proj(o).astype(x.dtype)

  def __call__(self, x, segment_ids=None, cache: MLACache | None = None,
               feed: Feed | None = None):
    """x [B,T,d] → [B,T,d]; with `cache` and `feed` → (out, updated MLACache)."""
    cfg = self.config
    if x.ndim != 3 or x.shape[-1] != cfg.text.d_model:
      raise ValueError(f"MLA: x must be [B,T,d={cfg.text.d_model}], found {x.shape}")
    if cache is not None:
      return self._extend(x, cache, feed)
    q = self.query(x)
    scale = cfg.text.qk_head_dim ** -0.5
    c_kv, k_rope = self.latent(x)
    if cfg.modes.mla_key_block and not self.is_initializing():
      # Long rows: attention from the latents, keys expanded one block at a time (the
      # latents, not the keys, are gathered under a context mesh).
      kv_b = effective_kernel(self.kv_b_proj).astype(dtype_of(cfg.modes.dtype))
      attention = backend.mla_latent_attention_fn()
      o, max_logit = attention(q, c_kv, k_rope, kv_b, scale=scale,
                               key_block=cfg.modes.mla_key_block, segment_ids=segment_ids,
                               query_block=cfg.modes.mla_query_block)
    else:
      k, v = self.keys_values(c_kv, k_rope)
      attention = backend.mla_attention_fn()   # context-parallel under a context mesh
      o, max_logit = attention(q, k, v, scale=scale, segment_ids=segment_ids,
                               query_block=cfg.modes.mla_query_block)
    sow_stat(self, "max_logit", max_logit)
    return self.output(x, o)

  def _extend(self, x, cache: MLACache, feed: Feed):
    cfg = self.config
    t, n = x.shape[1], cfg.text.qk_nope_head_dim
    pos, valid = feed.positions(t), feed.valid(t)
    c, k_rope = self.latent(x)
    new = MLACache(write_slots(cache.c_kv, c, pos, valid),
                   write_slots(cache.k_rope, k_rope, pos, valid))
    q = self.query(x)
    # [L,H,nope+V]; an adapted kv_b folds its adapter in (W + s·A·B, docs/notes/lora.md)
    kv_b = effective_kernel(self.kv_b_proj).astype(dtype_of(cfg.modes.dtype))
    # With mla_key_block the buffer is read a key block at a time and the blocks after the
    # last new position are skipped: a long prefill's chunk costs what is written so far.
    o, _ = mla_absorbed_attention(q[..., :n], q[..., n:], new.c_kv, new.k_rope, kv_b[..., :n],
                                  kv_b[..., n:], scale=cfg.text.qk_head_dim ** -0.5,
                                  query_positions=pos, key_block=cfg.modes.mla_key_block)
    return self.output(x, o), new


__all__ = ["MLA", "MLACache", "sow_stat"]
