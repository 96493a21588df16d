"""Gated MLP: dense layer-0 MLP and the fused shared experts (docs/k3.md §2, §6).

y = down_proj( act(gate_proj x, up_proj x) ), act = SiTU-GLU or SwiGLU per
`config.text.activation`, evaluated in fp32 (SiTU's tanh bounds are an fp32 island).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from k3jax.layers.linear import linear
from k3jax.ops import moe as moe_ops


def glu_activation(config, a, b):
  """act(a, b) in fp32 for config.text.activation ("situ" | "swiglu")."""
  a = a.astype(jnp.float32)
  b = b.astype(jnp.float32)
  if config.text.activation == "situ":
    return moe_ops.situ_glu(a, b, beta1=config.text.situ_beta1, beta2=config.text.situ_beta2)
  return moe_ops.swiglu(a, b)


class MLP(nn.Module):
  """Gated MLP of width `intermediate_size`. x [..., d] → [..., d] (x.dtype).

  Params: gate_proj/kernel, up_proj/kernel [d,F]; down_proj/kernel [F,d].
  """
  config: object
  intermediate_size: int
  lora_target: str = "dense"     # LoRA target name: "dense" (layer 0) or "shared" (MoE)

  @nn.compact
  def __call__(self, x):
    cfg, f, d = self.config, self.intermediate_size, x.shape[-1]
    a = linear(cfg, f, ("embed", "mlp"), name="gate_proj",
               target=self.lora_target)(x)
    b = linear(cfg, f, ("embed", "mlp"), name="up_proj",
               target=self.lora_target)(x)
    h = glu_activation(cfg, a, b)
    return linear(cfg, d, ("mlp", "embed"), name="down_proj",
               target=self.lora_target)(h).astype(x.dtype)


__all__ = ["MLP", "glu_activation"]
