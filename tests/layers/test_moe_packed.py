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
  x = jnp.zeros((2, 4, cfg.text.d_model))
  v = nn.unbox(StableLatentMoE(cfg).init(jax.random.key(0), x))
  ex = v["params"]["experts"]
  e, l, f = cfg.text.num_experts, cfg.text.latent_moe_dim, cfg.text.moe_intermediate_size
  shapes = jax.tree.map(lambda a: (a.shape, str(a.dtype)), ex)
  assert shapes == {
      "w1": {"weight_packed": ((e, f, l // 2), "uint8"), "weight_scale": ((e, f, l // 32), "uint8")},
      "w3": {"weight_packed": ((e, f, l // 2), "uint8"), "weight_scale": ((e, f, l // 32), "uint8")},
      "w2": {"weight_packed": ((e, l, f // 2), "uint8"), "weight_scale": ((e, l, f // 32), "uint8")}}
  # Init packs what the bf16 layer would draw (scales are those of a fan-in init, not zeros).
  assert int(ex["w1"]["weight_scale"].min()) > 100 and int(ex["w1"]["weight_packed"].max()) > 0
  with pytest.raises(ValueError, match="ModelConfig.modes.expert_format"):
    preset("tiny", expert_format="fp4")
  with pytest.raises(ValueError, match="ModelConfig.modes.expert_format: 'mxfp4' needs"):
    preset("tiny", expert_format="mxfp4", latent_moe_dim=48)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_packed_layer_equals_dequantised_bf16_layer(capacity_factor):
  cfg = preset("tiny", expert_format="mxfp4", moe_capacity_factor=capacity_factor)
  x = jax.random.normal(jax.random.key(1), (2, 8, cfg.text.d_model))
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


def test_tiny_mxfp4_model_scores_and_greedy_generates_like_the_dequantised_model():
  """K3Model with packed experts: prefill logits (max rel ≤ 1e-5, fp32) and greedy
  `generate` (prefill + cached decode) equal the bf16-format model's on the dequantised
  weights."""
  from k3jax.serve import generate as G
  from k3jax.model import K3Model
  from k3jax.serve.sampling import SamplingParams
  # 5 layers: dense layer 0, then one KDA×3 + MLA group with MoE (compile time).
  cfg = preset("tiny", num_layers=5, expert_format="mxfp4", moe_capacity_factor=None)
  v = nn.unbox(jax.jit(K3Model(cfg).init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
  packed = [x for p, x in jax.tree_util.tree_leaves_with_path(v["params"])
            if "weight_packed" in jax.tree_util.keystr(p)]
  assert packed and all(x.dtype == jnp.uint8 for x in packed)
  dense_cfg = cfg.replace(expert_format="bf16")
  dense_v = {**v, "params": mx.unpack_expert_params(v["params"])}
  greedy = SamplingParams(temperature=0.0)
  prompts = [[5, 9, 11, 3], [7, 1]]
  # Prefill logits through the same compiled forward `generate` uses below (same shapes).
  toks, lengths = G.padded_prompts(prompts)
  logits = np.asarray(G.prefill(cfg, v, toks, lengths, max_len=16)[0])
  logits_ref = np.asarray(G.prefill(dense_cfg, dense_v, toks, lengths, max_len=16)[0])
  rel = np.abs(logits - logits_ref).max() / np.abs(logits_ref).max()
  assert rel <= 1e-5, rel
  out = G.generate(cfg, v, prompts, max_new_tokens=6, sampling=greedy, max_len=16)
  out_ref = G.generate(dense_cfg, dense_v, prompts, max_new_tokens=6, sampling=greedy,
                       max_len=16)
  assert out == out_ref and all(len(o) == 6 for o in out)
