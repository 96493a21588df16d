"""Kimi Delta Attention layer (spec §3).

x [B,T,d] → q,k,v projections [B,T,H,K|V] → causal depthwise short convs (kernel W=4, no bias)
+ SiLU → L2-normalised q,k per head → decay g = kda_gate(f_b(f_a(x)), A_log, dt_bias,
config.kda_lower_bound), β = sigmoid(b_proj x) → chunked delta rule (kernel chosen by
`backend.kda_chunked_fn(config.kernel_backend)`) → per-head RMSNorm(o) · sigmoid(output gate)
→ o_proj. The gate, β, the recurrence and the output norm are fp32.

Parameter names/shapes: docs/contracts.md ("KDA self_attn").
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.layers import backend
from k3jax.layers.linear import linear, param
from k3jax.layers.norms import rms_norm


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
    h, k, r, w = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_gate_rank, cfg.kda_conv_size
    self.q_proj = linear(cfg, (h, k), ("embed", "heads", "head_dim"), name="q_proj")
    self.k_proj = linear(cfg, (h, k), ("embed", "heads", "head_dim"), name="k_proj")
    self.v_proj = linear(cfg, (h, k), ("embed", "heads", "head_dim"), name="v_proj")
    conv_names = ("conv", "heads", "head_dim")
    self.q_conv1d = param(self, "q_conv1d", _conv_init, (w, h, k), conv_names)
    self.k_conv1d = param(self, "k_conv1d", _conv_init, (w, h, k), conv_names)
    self.v_conv1d = param(self, "v_conv1d", _conv_init, (w, h, k), conv_names)
    self.f_a_proj = linear(cfg, r, ("embed", "gate_rank"), name="f_a_proj")
    self.f_b_proj = linear(cfg, (h, k), ("gate_rank", "heads", "head_dim"), name="f_b_proj")
    self.b_proj = linear(cfg, h, ("embed", "heads"), name="b_proj")
    if cfg.full_rank_gates:
      self.g_proj = linear(cfg, (h, k), ("embed", "heads", "head_dim"), name="g_proj")
    else:
      self.g_a_proj = linear(cfg, r, ("embed", "gate_rank"), name="g_a_proj")
      self.g_b_proj = linear(cfg, (h, k), ("gate_rank", "heads", "head_dim"), name="g_b_proj")
    self.A_log = param(self, "A_log", _a_log_init, (h,), ("heads",))
    self.dt_bias = param(self, "dt_bias", _dt_bias_init, (h, k), ("heads", "head_dim"))
    self.o_norm = param(self, "o_norm", nn.initializers.ones, (k,), ("head_dim",))
    self.o_proj = linear(cfg, cfg.d_model, ("heads", "head_dim", "embed"), axis=(-2, -1),
                         name="o_proj")

  # The pieces below are public so that decoding can reuse them token by token.
  def project(self, x, segment_ids=None):
    """q, k (L2-normalised), v after convs + SiLU, g (fp32 log-decay), β [B,T,H] fp32."""
    from k3jax.ops.kda import kda_gate
    conv = backend.short_conv_fn(short_conv)
    q = jax.nn.silu(conv(self.q_proj(x), self.q_conv1d, segment_ids))
    k = jax.nn.silu(conv(self.k_proj(x), self.k_conv1d, segment_ids))
    v = jax.nn.silu(conv(self.v_proj(x), self.v_conv1d, segment_ids))
    q, k = l2_normalize(q), l2_normalize(k)
    z = self.f_b_proj(self.f_a_proj(x)).astype(jnp.float32)
    g = kda_gate(z, self.A_log, self.dt_bias, lower_bound=self.config.kda_lower_bound)
    beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
    return q, k, v, g, beta

  def output(self, x, o):
    """Per-head RMSNorm of o [B,T,H,V] times sigmoid(output gate of x), then o_proj."""
    gate = (self.g_proj(x) if self.config.full_rank_gates
            else self.g_b_proj(self.g_a_proj(x)))
    o = rms_norm(o, self.o_norm, self.config.rms_norm_eps) * jax.nn.sigmoid(
        gate.astype(jnp.float32))
    return self.o_proj(o).astype(x.dtype)

  def __call__(self, x, segment_ids=None):
    cfg = self.config
    if x.ndim != 3 or x.shape[-1] != cfg.d_model:
      raise ValueError(f"KDA: x must be [B,T,d={cfg.d_model}], found {x.shape}")
    q, k, v, g, beta = self.project(x, segment_ids)
    if self.is_initializing():
      # Parameters never depend on the recurrence's output: skip it, so that `init` (and its
      # compilation) costs projections only.
      return self.output(x, jnp.zeros(v.shape, jnp.float32))
    fn = backend.kda_chunked_fn(cfg.kernel_backend, lower_bound=cfg.kda_lower_bound,
                                packed=segment_ids is not None)
    kwargs = {} if segment_ids is None else {"segment_ids": segment_ids}
    o, _ = fn(q, k, v, g, beta, scale=cfg.kda_head_dim ** -0.5, chunk_size=cfg.kda_chunk_size,
              **kwargs)
    return self.output(x, o.astype(jnp.float32))


__all__ = ["KDA", "short_conv", "l2_normalize"]
