"""Kimi Delta Attention layer (docs/k3.md §3).

x [B,T,d] → q,k,v projections [B,T,H,K|V] → causal depthwise short convs (kernel W=4, no bias)
+ SiLU → L2-normalised q,k per head → decay g = kda_gate(f_b(f_a(x)), A_log, dt_bias,
config.text.kda_lower_bound, config.text.kda_a_log_axis) (A_log [H] per head, or [K] per key channel
shared by the heads), β = sigmoid(b_proj x) → chunked delta rule (kernel chosen by
`backend.kda_chunked_fn(config.modes.kernel_backend)`) → per-head RMSNorm(o) · sigmoid(output gate)
→ o_proj. The gate, β, the recurrence and the output norm are fp32.

Decoding: with `cache` (a `KDACache`: the fp32 state and the last W−1 inputs of each short
conv) and a `Feed`, the layer continues from the cache and returns the updated one. Padded
inputs (past feed.num_new) get g = 0, β = 0, k = 0, which leave the state unchanged, so rows
of different lengths share one shape. One new token (or a caller asking for the "rewind"
collection) runs the exact recurrence token by token; more tokens run the chunked kernel
from the cached state.

Parameter names/shapes: docs/contracts.md ("KDA self_attn").
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from k3jax.layers import backend
from k3jax.layers.feed import Feed, gather_time
from k3jax.layers.linear import linear, param
from k3jax.layers.norms import rms_norm
from k3jax.ops.kda import kda_gate, kda_step


@struct.dataclass
class KDACache:
  """A KDA layer's decode cache (constant size, whatever the context)."""
  state: jax.Array      # [B,H,K,V] fp32: the delta-rule state after the last fed token
  conv_q: jax.Array     # [B,W−1,H,K] fp32: the last W−1 inputs of the q short conv
  conv_k: jax.Array
  conv_v: jax.Array

  @classmethod
  def zeros(cls, config, batch: int) -> "KDACache":
    h, k, w = config.text.kda_num_heads, config.text.kda_head_dim, config.text.kda_conv_size
    conv = jnp.zeros((batch, w - 1, h, k), jnp.float32)
    return cls(jnp.zeros((batch, h, k, k), jnp.float32), conv, conv, conv)

  def rewound(self, rewind: dict, keep) -> "KDACache":
    """This cache as if only the first keep[b] ([B] int) of the tokens of the call that sowed
    `rewind` (its "rewind" collection: the state before and after every token, and the conv
    inputs) had been fed."""
    state = jnp.take_along_axis(rewind["states"], keep[None, :, None, None, None], 0)[0]
    w = self.conv_q.shape[1] + 1
    return KDACache(state, *(conv_tail(rewind[n], keep, w) for n in ("xq", "xk", "xv")))


def conv_tail(xcat, num_new, w: int):
  """The last W−1 conv inputs after feeding num_new[b] tokens: xcat[b, n : n+W−1], where
  xcat [B,W−1+T,H,C] is the previous tail followed by the T new inputs."""
  return gather_time(xcat, num_new[:, None] + jnp.arange(w - 1)[None])


def short_conv(x, kernel, segment_ids=None):
  """Causal depthwise conv. x [B,T,H,C], kernel [W,H,C] (tap W−1 = current token) → fp32.

  With `segment_ids` [B,T], taps reaching into a previous document are dropped (packing).
  """
  w = kernel.shape[0]
  x = x.astype(jnp.float32)
  t = x.shape[1]
  y = jnp.zeros_like(x)
  for tap in range(w):
    lag = w - 1 - tap  # this tap multiplies x[t - lag]
    if lag >= t:
      continue
    xs = jnp.pad(x, ((0, 0), (lag, 0), (0, 0), (0, 0)))[:, :t]
    if segment_ids is not None and lag:
      same = segment_ids == jnp.pad(segment_ids, ((0, 0), (lag, 0)), constant_values=-1)[:, :t]
      xs = jnp.where(same[:, :, None, None], xs, 0.0)
    y = y + xs * kernel[tap].astype(jnp.float32)
  return y


def l2_normalize(x, eps: float = 1e-6):
  """x / sqrt(Σx² + eps) over the last axis, fp32."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _conv_init(key, shape, dtype=jnp.float32):
  bound = 1.0 / math.sqrt(shape[0])  # PyTorch Conv1d default: fan_in = kernel size (depthwise)
  return jax.random.uniform(key, shape, dtype, -bound, bound)


def _a_log_init(key, shape, dtype=jnp.float32):
  return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


def _dt_bias_init(key, shape, dtype=jnp.float32):
  # dt log-uniform in [1e-3, 0.1]; dt_bias = softplus⁻¹(dt) (Mamba/FLA convention).
  dt = jnp.exp(jax.random.uniform(key, shape, dtype, math.log(1e-3), math.log(0.1)))
  return dt + jnp.log(-jnp.expm1(-dt))


class KDA(nn.Module):
  """KDA token mixer. __call__(x [B,T,d], segment_ids [B,T] | None) → [B,T,d] (x.dtype)."""
  config: object

  def setup(self):
    cfg = self.config
    h, k, r, w = cfg.text.kda_num_heads, cfg.text.kda_head_dim, cfg.text.kda_gate_rank, cfg.text.kda_conv_size
    self.q_proj = linear(cfg, (h, k), ("embed", "heads", "head_dim"), name="q_proj", target="q")
    self.k_proj = linear(cfg, (h, k), ("embed", "heads", "head_dim"), name="k_proj", target="k")
    self.v_proj = linear(cfg, (h, k), ("embed", "heads", "head_dim"), name="v_proj", target="v")
    conv_names = ("conv", "heads", "head_dim")
    self.q_conv1d = param(self, "q_conv1d", _conv_init, (w, h, k), conv_names)
    self.k_conv1d = param(self, "k_conv1d", _conv_init, (w, h, k), conv_names)
    self.v_conv1d = param(self, "v_conv1d", _conv_init, (w, h, k), conv_names)
    self.f_a_proj = linear(cfg, r, ("embed", "gate_rank"), name="f_a_proj", target="gates")
    self.f_b_proj = linear(cfg, (h, k), ("gate_rank", "heads", "head_dim"), name="f_b_proj",
                           target="gates")
    self.b_proj = linear(cfg, h, ("embed", "heads"), name="b_proj", target="gates")
    if cfg.text.full_rank_gates:
      self.g_proj = linear(cfg, (h, k), ("embed", "heads", "head_dim"), name="g_proj",
                           target="gates")
    else:
      self.g_a_proj = linear(cfg, r, ("embed", "gate_rank"), name="g_a_proj", target="gates")
      self.g_b_proj = linear(cfg, (h, k), ("gate_rank", "heads", "head_dim"), name="g_b_proj",
                             target="gates")
    # One rate per head [H], or per key channel [K] shared by the heads (config.text.kda_a_log_axis;
    # replicated then: every head's shard needs all of it).
    if cfg.text.kda_a_log_axis == "head":
      self.A_log = param(self, "A_log", _a_log_init, (h,), ("heads",))
    else:
      self.A_log = param(self, "A_log", _a_log_init, (k,), ("head_dim",))
    self.dt_bias = param(self, "dt_bias", _dt_bias_init, (h, k), ("heads", "head_dim"))
    self.o_norm = param(self, "o_norm", nn.initializers.ones, (k,), ("head_dim",))
    self.o_proj = linear(cfg, cfg.text.d_model, ("heads", "head_dim", "embed"), axis=(-2, -1),
                         name="o_proj", target="o")

  def project(self, x, conv):
    """q, k (L2-normalised), v after `conv` + SiLU, g (fp32 log-decay), β [B,T,H] fp32.

    conv(name, x_proj [B,T,H,K], kernel [W,H,K]) → fp32 [B,T,H,K], name in {"q","k","v"}.
    """
    q = jax.nn.silu(conv("q", self.q_proj(x), self.q_conv1d))
    k = jax.nn.silu(conv("k", self.k_proj(x), self.k_conv1d))
    v = jax.nn.silu(conv("v", self.v_proj(x), self.v_conv1d))
    q, k = l2_normalize(q), l2_normalize(k)
    z = self.f_b_proj(self.f_a_proj(x)).astype(jnp.float32)
    g = kda_gate(z, self.A_log, self.dt_bias, lower_bound=self.config.text.kda_lower_bound,
                 a_log_axis=self.config.text.kda_a_log_axis)
    beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
    return q, k, v, g, beta

  def output(self, x, o):
    """Per-head RMSNorm of o [B,T,H,V] times sigmoid(output gate of x), then o_proj."""
    gate = (self.g_proj(x) if self.config.text.full_rank_gates
            else self.g_b_proj(self.g_a_proj(x)))
    o = rms_norm(o, self.o_norm, self.config.text.rms_norm_eps) * jax.nn.sigmoid(
        gate.astype(jnp.float32))
    return self.o_proj(o).astype(x.dtype)

  def __call__(self, x, segment_ids=None, cache: KDACache | None = None,
               feed: Feed | None = None):
    """x [B,T,d] → [B,T,d]; with `cache` and `feed` → (out, updated KDACache)."""
    cfg = self.config
    if x.ndim != 3 or x.shape[-1] != cfg.text.d_model:
      raise ValueError(f"KDA: x must be [B,T,d={cfg.text.d_model}], found {x.shape}")
    if cache is not None:
      return self._extend(x, cache, feed)
    conv_fn = backend.short_conv_fn(short_conv)
    q, k, v, g, beta = self.project(x, lambda _, xp, w: conv_fn(xp, w, segment_ids))
    if self.is_initializing():
      # Parameters never depend on the recurrence's output: skip it, so that `init` (and its
      # compilation) costs projections only.
      return self.output(x, jnp.zeros(v.shape, jnp.float32))
    fn = backend.kda_chunked_fn(cfg.modes.kernel_backend, lower_bound=cfg.text.kda_lower_bound)
    kwargs = {} if segment_ids is None else {"segment_ids": segment_ids}
    o, _ = fn(q, k, v, g, beta, scale=cfg.text.kda_head_dim ** -0.5, chunk_size=cfg.modes.kda_chunk_size,
              **kwargs)
    return self.output(x, o.astype(jnp.float32))

  def _extend(self, x, cache: KDACache, feed: Feed):
    cfg = self.config
    t, w = x.shape[1], cfg.text.kda_conv_size
    tails = {"q": cache.conv_q, "k": cache.conv_k, "v": cache.conv_v}
    inputs = {}

    def conv(name, xp, kernel):   # the conv continues from the cached tail
      inputs[name] = jnp.concatenate([tails[name], xp.astype(jnp.float32)], axis=1)
      return short_conv(inputs[name], kernel)[:, w - 1:]

    q, k, v, g, beta = self.project(x, conv)
    valid = feed.valid(t)
    g = jnp.where(valid[..., None, None], g, 0.0)
    beta = jnp.where(valid[..., None], beta, 0.0)
    k = jnp.where(valid[..., None, None], k, 0.0)
    scale = cfg.text.kda_head_dim ** -0.5
    if t == 1 or self.is_mutable_collection("rewind"):
      def one(s, xs):
        o_t, s = kda_step(*xs, s, scale=scale)
        return s, (o_t, s)
      tm = lambda a: jnp.moveaxis(a, 1, 0)
      state, (o, states) = jax.lax.scan(one, cache.state, (tm(q), tm(k), tm(v), tm(g), tm(beta)))
      o = jnp.moveaxis(o, 0, 1)
      if self.is_mutable_collection("rewind"):
        for name, value in (("states", jnp.concatenate([cache.state[None], states], 0)),
                            ("xq", inputs["q"]), ("xk", inputs["k"]), ("xv", inputs["v"])):
          self.sow("rewind", name, value, init_fn=lambda: None, reduce_fn=lambda _, new: new)
    else:
      fn = backend.kda_chunked_fn(cfg.modes.kernel_backend, lower_bound=cfg.text.kda_lower_bound)
      o, state = fn(q, k, v, g, beta, scale=scale, chunk_size=cfg.modes.kda_chunk_size,
                    initial_state=cache.state)
    new = KDACache(state, *(conv_tail(inputs[n], feed.num_new, w) for n in ("q", "k", "v")))
    return self.output(x, o.astype(jnp.float32)), new


__all__ = ["KDA", "KDACache", "conv_tail", "short_conv", "l2_normalize"]
