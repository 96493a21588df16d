"""Quantisation-aware training in K3Model (docs/k3.md §13): modules outside the routed experts
untouched by `expert_qat`; the MoE layer's routed path = the per-pair QAT reference
(tests/quant/qat_reference.py); the served packed (MXFP4) model = the QAT model."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import preset
from k3jax.ops import moe as moe_ops
from k3jax.quant import mx
from qat_reference import qat_reference


TOKENS = [[5, 9, 11, 3, 7, 1, 2, 8], [7, 1, 4, 4, 200, 13, 5, 6]]


def _flat(tree, prefix=""):
  """{"a/b/c": leaf-tuple} of a captured-intermediates dict."""
  out = {}
  for k, x in tree.items():
    if isinstance(x, dict):
      out.update(_flat(x, f"{prefix}{k}/"))
    else:
      out[prefix + k] = x
  return out


@pytest.fixture(scope="module")
def tiny_model():
  """2 layers (compile time: layer 0 KDA + dense MLP, layer 1 MLA + MoE), expert_qat on; the
  params, and the logits and every module's output with and without the flag (one compile)."""
  from k3jax.model import K3Model
  cfg = preset("tiny", num_layers=2, moe_capacity_factor=None, expert_qat="mxfp4_mxfp8")
  toks = jnp.asarray(TOKENS)
  v = nn.unbox(jax.jit(K3Model(cfg).init)(jax.random.key(0), toks[:, :4]))

  @jax.jit
  def forward(v_, t):
    out = []
    for c in (cfg, cfg.replace(expert_qat=None)):
      logits, state = K3Model(c).apply(v_, t, capture_intermediates=True)   # [B, T, vocab]
      out.append((logits, _flat(state["intermediates"])))
    return out

  return cfg, v, forward(v, toks)


# Modules whose inputs do not depend on the routed experts in the 2-layer model: their outputs
# must be bit-identical with and without the flag (a module that read expert_qat would differ).
_BEFORE_EXPERTS = ("embed", "layers_0/", "layers_1/self_attn", "layers_1/input_layernorm",
                   "layers_1/self_attention_res", "layers_1/post_attention_layernorm",
                   "layers_1/block_sparse_moe/gate/", "layers_1/block_sparse_moe/shared_experts",
                   "layers_1/block_sparse_moe/routed_expert_down_proj/",
                   "layers_1/block_sparse_moe/experts/")


def test_modules_outside_the_experts_are_untouched_by_the_flag(tiny_model):
  """Attention (KDA, MLA), dense MLP, norms, AttnRes, embedding, router, latent down projection
  and shared experts give the same outputs with the flag; the latent up projection and the head
  apply their unquantised kernels; the routed experts do change."""
  _, v, ((lq, iq), (lp, ip)) = tiny_model
  assert set(iq) == set(ip)
  compared = [k for k in iq if k.startswith(_BEFORE_EXPERTS)]
  assert len(compared) > 20 and any(k.startswith("layers_0/mlp") for k in compared)
  for k in compared:
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b, err_msg=k), iq[k], ip[k])
  p = v["params"]
  moe = "layers_1/block_sparse_moe/"
  np.testing.assert_allclose(iq[moe + "routed_expert_up_proj/__call__"][0],
                             iq[moe + "routed_expert_norm/__call__"][0]
                             @ p["layers_1"]["block_sparse_moe"]["routed_expert_up_proj"]["kernel"],
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(iq["lm_head/__call__"][0],
                             iq["norm/__call__"][0] @ p["lm_head"]["kernel"], rtol=1e-5,
                             atol=1e-5)
  assert float(jnp.max(jnp.abs(iq[moe + "__call__"][0] - ip[moe + "__call__"][0]))) > 1e-4
  assert float(jnp.max(jnp.abs(lq - lp))) > 1e-4


def test_qat_moe_layer_equals_quantised_reference(tiny_model):
  """Inside the model, the routed path = the reference QAT expert MLP (ml_dtypes-quantised
  weights and inputs) on the layer's z and routing, then the unquantised RMSNorm."""
  cfg, v, ((_, iq), _) = tiny_model
  p = v["params"]["layers_1"]["block_sparse_moe"]
  moe = "layers_1/block_sparse_moe/"
  z = iq[moe + "routed_expert_down_proj/__call__"][0]
  scores, bias = iq[moe + "gate/__call__"][0]
  w, idx, _ = moe_ops.route(scores, bias, cfg.text.experts_per_token)
  u = qat_reference(z, w * cfg.text.routed_scaling_factor, idx,
                     *(p["experts"][n] for n in ("w1", "w3", "w2")))[0]
  normed = u * jax.lax.rsqrt(jnp.mean(u * u, -1, keepdims=True) + cfg.text.rms_norm_eps)
  normed = normed * p["routed_expert_norm"]["weight"]
  np.testing.assert_allclose(iq[moe + "routed_expert_norm/__call__"][0], normed, rtol=1e-4,
                             atol=1e-5)


def test_served_packed_model_is_the_qat_model(tiny_model):
  """Packed MXFP4 experts + the config's MXFP8 inputs, through the serving forward
  (`generate.prefill`, with caches; decode steps run the same forward), give the QAT model's
  logits."""
  from k3jax.serve import generate as G
  cfg, v, ((lq, _), _) = tiny_model
  served_cfg = cfg.replace(expert_format="mxfp4")
  served_v = {**v, "params": jax.jit(mx.pack_expert_params)(v["params"])}
  toks, lengths = G.padded_prompts(TOKENS)
  served = np.asarray(G.prefill(served_cfg, served_v, toks, lengths)[0])
  want = np.asarray(lq[:, -1])
  np.testing.assert_allclose(served, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
