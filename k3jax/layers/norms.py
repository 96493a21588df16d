"""RMSNorm with fp32 statistics (docs/k3.md §2–6: pre-norms, q/kv latent norms, latent MoE norm)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from k3jax.layers.linear import param


def rms_norm(x, weight, eps: float):
  """x / sqrt(mean(x²) + eps) · weight over the last axis, computed in fp32, returned fp32."""
  x = x.astype(jnp.float32)
  return x * jnp.reciprocal(jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)) * weight


class RMSNorm(nn.Module):
  """RMSNorm over the last axis. Param `weight` [dim] (ones init), logical axis `axis_name`.

  Statistics are fp32; the output is cast back to `x.dtype` unless `keep_fp32`.
  """
  eps: float = 1e-5
  axis_name: str = "embed"
  keep_fp32: bool = False

  @nn.compact
  def __call__(self, x):
    w = param(self, "weight", nn.initializers.ones, (x.shape[-1],), (self.axis_name,))
    y = rms_norm(x, w, self.eps)
    return y if self.keep_fp32 else y.astype(x.dtype)


__all__ = ["RMSNorm", "rms_norm"]
