"""StableLatentMoE with expert_format="mxfp4": params layout, and outputs equal to the "bf16"
layer run on the dequantised weights."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import preset
from k3jax.layers.moe import StableLatentMoE
from k3jax.quant import mx


def test_packed_params_layout():
  cfg = preset("tiny", expert_format="mxfp4")
  x = jnp.zeros((2, 4, cfg.d_model))
  v = nn.unbox(StableLatentMoE(cfg).init(jax.random.key(0), x))
  ex = v["params"]["experts"]
  e, l, f = cfg.num_experts, cfg.latent_moe_dim, cfg.moe_intermediate_size
  shapes = jax.tree.map(lambda a: (a.shape, str(a.dtype)), ex)
  assert shapes == {
      "w1": {"weight_packed": ((e, f, l // 2), "uint8"), "weight_scale": ((e, f, l // 32), "uint8")},
      "w3": {"weight_packed": ((e, f, l // 2), "uint8"), "weight_scale": ((e, f, l // 32), "uint8")},
      "w2": {"weight_packed": ((e, l, f // 2), "uint8"), "weight_scale": ((e, l, f // 32), "uint8")}}
  # Init packs what the bf16 layer would draw (scales are those of a fan-in init, not zeros).
  assert int(ex["w1"]["weight_scale"].min()) > 100 and int(ex["w1"]["weight_packed"].max()) > 0
  with pytest.raises(ValueError, match="ModelConfig.expert_format"):
    preset("tiny", expert_format="fp4")
  with pytest.raises(ValueError, match="ModelConfig.expert_format: 'mxfp4' needs"):
    preset("tiny", expert_format="mxfp4", latent_moe_dim=48)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_packed_layer_equals_dequantised_bf16_layer(capacity_factor):
  cfg = preset("tiny", expert_format="mxfp4", moe_capacity_factor=capacity_factor)
  x = jax.random.normal(jax.random.key(1), (2, 8, cfg.d_model))
  v = nn.unbox(StableLatentMoE(cfg).init(jax.random.key(0), x))
  dense_cfg = cfg.replace(expert_format="bf16")
  dense_v = {**v, "params": mx.unpack_expert_params(v["params"])}
  apply = lambda c: jax.jit(lambda v, x: StableLatentMoE(c).apply(v, x, mutable=["stats"]))
  y, st = apply(cfg)(v, x)
  y_ref, st_ref = apply(dense_cfg)(dense_v, x)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
  jax.tree.map(np.testing.assert_array_equal, st, st_ref)
  # And packing the dense tree back gives the packed params byte for byte.
  again = mx.pack_expert_params(dense_v["params"])
  jax.tree.map(np.testing.assert_array_equal, again["experts"], v["params"]["experts"])
