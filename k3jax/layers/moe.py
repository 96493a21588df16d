"""Stable LatentMoE (docs/k3.md §6); with `latent_moe_dim=None` the classic Kimi Linear MoE.

  logits = x·W_r (fp32), s = sigmoid(logits)
  (p, idx, cutoff) = route(s, b, k)        b: selection-only bias, collection "balance"
  p ← p · routed_scaling_factor
  latent:  y_routed = W_up RMSNorm( Σ_i p_i E_i(W_down x) )
  classic: y_routed = Σ_i p_i E_i(x)
  y = y_routed + shared_experts(x)          shared: one MLP of width num_shared·F

With `expert_qat="mxfp4_mxfp8"` (quantisation-aware training, docs/k3.md §13, docs/notes/qat.md)
every E_i sees MXFP4 weights (float masters fake-quantised by the exporter's quantiser; packed
"mxfp4" experts are MXFP4 already) and MXFP8 inputs (z, and the gated activation before w2),
straight-through gradients. The router, W_down, RMSNorm, W_up and the shared experts are never
quantised.

Sows into "stats": `load` [E] f32 (tokens per expert), `margin_hist` [E, qb_num_bins] int32
(margins s − cutoff over config.modes.qb_range), `dropped` [] int32 (tokens over capacity).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from k3jax.config import dtype_of
from k3jax.layers import backend
from k3jax.layers.linear import default_kernel_init, linear, lora_variables, param
from k3jax.layers.mla import sow_stat
from k3jax.layers.mlp import MLP
from k3jax.layers.norms import RMSNorm
from k3jax.ops import balance as balance_ops
from k3jax.ops import moe as moe_ops
from k3jax.ops.lora import LoRAExperts
from k3jax.ops.moe import MXFP4Weight
from k3jax.quant import mx
from k3jax.quant import qat


# Each expert matrix is initialised like its own [in, out] Linear (fan-in = in).
_expert_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2,
                                                out_axis=-1, batch_axis=(0,))


class PackedExpertMatrix(nn.Module):
  """One expert matrix in MXFP4 (`expert_format="mxfp4"`): params `weight_packed` uint8
  [E, out, in/2] and `weight_scale` uint8 [E, out, in/32] (the release's bytes per expert,
  k3jax/quant/mx.py). __call__() → `ops.moe.MXFP4Weight` (logical kernel [E, in, out]).

  Init draws the float kernel as the "bf16" form would and packs it with the exporter's
  quantiser (both leaves from one draw).
  """
  shape: tuple[int, int, int]         # logical kernel (E, in, out)
  axes: tuple[str, str, str]          # logical axes of the kernel (experts, in, out)

  @nn.compact
  def __call__(self):
    e, din, dout = self.shape
    pshape, sshape = mx.packed_expert_shapes(e, din, dout)
    drawn = {}

    def leaf(i):
      def init(key, shape, dtype):
        if "w" not in drawn:   # the first leaf's key draws for both
          drawn["w"] = mx.pack_expert(_expert_init(key, self.shape, jnp.float32))
        return drawn["w"][i]
      return init

    ex, ax_in, ax_out = self.axes
    # The packed bytes keep the kernel's sharding (the in/2 axis as `in`); the scales are
    # 1/16 of the bytes and left replicated along their block axis.
    packed = param(self, "weight_packed", leaf(0), pshape, (ex, ax_out, ax_in), jnp.uint8)
    scale = param(self, "weight_scale", leaf(1), sshape, (ex, ax_out, None), jnp.uint8)
    return MXFP4Weight(packed, scale)


class Experts(nn.Module):
  """Routed expert weights: w1, w3 [E,D,F] and w2 [E,F,D] (D = ℓ, or d for classic MoE).

  expert_format "bf16": three params in param_dtype, returned as arrays. "mxfp4": three
  `PackedExpertMatrix` submodules (`w1/weight_packed`, `w1/weight_scale`, …), returned as
  `ops.moe.MXFP4Weight`s of the same logical shapes (k3jax/quant/mx.py gives the layout).
  With LoRA target "experts": each returned as `ops.lora.LoRAExperts(base, A, s·B)`.
  """
  config: object
  in_dim: int
  in_axis: str

  @nn.compact
  def __call__(self):
    cfg = self.config
    e, dim, f = cfg.text.num_experts, self.in_dim, cfg.text.moe_intermediate_size
    up = ("experts", self.in_axis, "expert_mlp")
    down = ("experts", "expert_mlp", self.in_axis)
    if cfg.modes.expert_format == "mxfp4":
      ws = (PackedExpertMatrix((e, dim, f), up, name="w1")(),
            PackedExpertMatrix((e, dim, f), up, name="w3")(),
            PackedExpertMatrix((e, f, dim), down, name="w2")())
    else:
      dt = dtype_of(cfg.modes.param_dtype)   # like every Linear kernel (the bulk of K3's parameters)
      ws = (param(self, "w1", _expert_init, (e, dim, f), up, dt),
            param(self, "w3", _expert_init, (e, dim, f), up, dt),
            param(self, "w2", _expert_init, (e, f, dim), down, dt))
    if not cfg.lora_on("experts"):
      return ws
    # One adapter per expert and matrix ("lora" collection: w1_lora_a [E, in, r],
    # w1_lora_b [E, r, out], …), handed to the expert op with the base (packed or not) as
    # `LoRAExperts`, the scale folded into B.
    out = []
    for name, w, axes in zip(("w1", "w3", "w2"), ws, (up, up, down)):
      _, din, dout = w.shape
      a, b = lora_variables(self, (din,), (dout,), axes[1:2], axes[2:], cfg.modes.lora_rank,
                            prefix=f"{name}_", batch_shape=(e,), batch_names=axes[:1])
      out.append(LoRAExperts(w, a, b * cfg.lora_scale))
    return tuple(out)


class Router(nn.Module):
  """Router `gate`: kernel [d,E] (params, applied in fp32) and the selection-only bias
  `e_score_correction_bias` [E] (collection "balance", zeros init; written by Quantile Balancing).

  __call__(x [N,d]) → (scores = sigmoid(x·W_r) fp32 [N,E], bias fp32 [E]).
  """
  config: object

  @nn.compact
  def __call__(self, x):
    e = self.config.text.num_experts
    w = param(self, "kernel", default_kernel_init, (x.shape[-1], e), ("embed", "experts"))
    bias = self.variable(
        "balance", "e_score_correction_bias",
        nn.with_logical_partitioning(lambda: jnp.zeros((e,), jnp.float32), ("experts",)))
    logits = jnp.dot(x.astype(jnp.float32), w, precision="highest")
    return nn.sigmoid(logits), bias.value.astype(jnp.float32)


def expert_capacity(config, num_tokens: int) -> int | None:
  """ceil(capacity_factor · N · k / E) clamped to [1, N], or None (dropless)."""
  if config.modes.moe_capacity_factor is None:
    return None
  return moe_ops.capacity(num_tokens, config.text.experts_per_token, config.text.num_experts,
                          config.modes.moe_capacity_factor)


class StableLatentMoE(nn.Module):
  """MoE MLP. __call__(x [B,T,d]) → [B,T,d] (x.dtype). See module docstring."""
  config: object

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    if x.ndim != 3 or x.shape[-1] != cfg.text.d_model:
      raise ValueError(f"StableLatentMoE: x must be [B,T,d={cfg.text.d_model}], found {x.shape}")
    b, t, d = x.shape
    e, k = cfg.text.num_experts, cfg.text.experts_per_token
    xf = x.reshape(b * t, d)

    scores, bias = Router(cfg, name="gate")(xf)
    weights, indices, cutoff = moe_ops.route(scores, bias, k)
    weights = weights.astype(jnp.float32) * cfg.text.routed_scaling_factor

    compute = dtype_of(cfg.modes.dtype)
    latent = cfg.text.latent_moe_dim is not None
    if latent:
      z = linear(cfg, cfg.text.latent_moe_dim, ("embed", "moe_latent"),
                 name="routed_expert_down_proj", target="latent")(xf)
      w1, w3, w2 = Experts(cfg, cfg.text.latent_moe_dim, "moe_latent", name="experts")()
    else:
      z = xf.astype(compute)
      w1, w3, w2 = Experts(cfg, d, "embed", name="experts")()
    if self.is_initializing():  # params never depend on the dispatch: skip it in init
      u, dropped = jnp.zeros(z.shape, jnp.float32), 0
    else:
      # Packed (MXFP4Weight) experts stay packed: the expert op dequantises them in chunks.
      # QAT fake-quantises float masters before the cast to the compute dtype, so that the
      # codes are the ones the exporter writes from the masters (MXFP4 values are exact in bf16).
      qat_kw = {}
      if cfg.modes.expert_qat is not None:
        fq = qat.weight_quantizer(cfg.modes.expert_qat)
        w1, w3, w2 = (w if isinstance(w, tuple) else fq(w) for w in (w1, w3, w2))
        qat_kw = dict(input_quant=qat.input_format(cfg.modes.expert_qat))
      cast = lambda w: w if isinstance(w, tuple) else w.astype(compute)
      if cfg.modes.expert_grad_barrier and not any(isinstance(w, tuple) for w in (w1, w3, w2)):
        z, w1, w3, w2 = moe_ops.tie_gradients(z, w1, w3, w2)
      u, dropped = backend.expert_mlp_fn(cfg)(
          z, weights, indices.astype(jnp.int32), cast(w1), cast(w3), cast(w2),
          activation=cfg.text.activation, beta1=cfg.text.situ_beta1,
          beta2=cfg.text.situ_beta2, capacity=expert_capacity(cfg, b * t), **qat_kw)
    if latent:
      u = RMSNorm(eps=cfg.text.rms_norm_eps, axis_name="norm", name="routed_expert_norm")(
          u.astype(jnp.float32))
      y = linear(cfg, d, ("moe_latent", "embed"), name="routed_expert_up_proj",
                 target="latent")(u)
    else:
      y = u
    y = y.astype(jnp.float32)
    if cfg.text.num_shared_experts:
      y = y + MLP(cfg, cfg.text.shared_intermediate_size, lora_target="shared",
                  name="shared_experts")(xf).astype(
          jnp.float32)

    if self.is_initializing() or not self.is_mutable_collection("stats"):
      return y.reshape(b, t, d).astype(x.dtype)  # statistics cost a histogram: only on request
    sow_stat(self, "load", jnp.zeros((e,), jnp.float32).at[indices.reshape(-1)].add(1.0))
    sow_stat(self, "margin_hist", balance_ops.margin_histogram(
        scores, cutoff, cfg.modes.qb_num_bins, cfg.modes.qb_range).astype(jnp.int32))
    sow_stat(self, "dropped", jnp.asarray(dropped, jnp.int32))
    return y.reshape(b, t, d).astype(x.dtype)
