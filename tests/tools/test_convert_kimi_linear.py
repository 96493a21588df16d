"""Parity with Hugging Face transformers' KimiLinearForCausalLM (PyTorch, CPU, fp32).

A tiny random model is saved with `save_pretrained`, converted with tools' converter, and its
logits compared with K3Model's on random tokens. Every parameter (and the router's
`e_score_correction_bias` buffer) is randomised first: several initialise to exact zeros/ones.

Known differences between transformers 5.24 and our model, handled explicitly here:
- `save_pretrained` writes the dense layer-0 MLP as `block_sparse_moe.{gate,up,down}_proj`
  (its reverse rename of `.mlp.` is applied to every layer): a transformers bug; the converter
  reads those names as Moonshot's `mlp.*` (k3jax.convert.pipeline.normalize_names).
- transformers' MLA latent norms (`q_a_layernorm`, `kv_a_layernorm`) use eps 1e-6 (the
  DeepSeek-V3 default; Moonshot's code does the same), not `rms_norm_eps`: our
  `ModelConfig.text.mla_latent_norm_eps` (1e-6) matches it.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from k3jax import hf_config
from k3jax.convert import convert, export
from k3jax.convert.safetensors_io import Source
from k3jax.model import K3Model
from k3jax.convert.checkpoint import load_pretrained



def _hf_model(num_layers, full_attn, q_lora_rank, seed, **config_kw):
  from transformers import KimiLinearConfig, KimiLinearForCausalLM
  torch.manual_seed(seed)
  cfg = KimiLinearConfig(**{**dict(
      vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
      num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=2,
      kv_lora_rank=16, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, qk_nope_head_dim=8,
      v_head_dim=8, num_local_experts=6, num_experts_per_tok=2, n_shared_experts=1,
      routed_scaling_factor=1.7, rms_norm_eps=1e-5,
      linear_attn_config=dict(head_dim=8, num_heads=2, short_conv_kernel_size=4,
                              full_attn_layers=full_attn,
                              kda_layers=[i for i in range(1, num_layers + 1)
                                          if i not in full_attn]),
      first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2), **config_kw})
  model = KimiLinearForCausalLM(cfg).eval()
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
      if name.endswith("A_log"):
        p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=g).log())
      elif "norm" in name:
        p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
      elif name.endswith("e_score_correction_bias"):
        p.copy_(0.3 * torch.randn(p.shape, generator=g))
      elif name.endswith("dt_bias") or "conv1d" in name:
        p.copy_(0.5 * torch.randn(p.shape, generator=g))
      elif "embed_tokens" in name:
        p.copy_(torch.randn(p.shape, generator=g))
      else:  # [.., out, in] weights: unit-variance outputs
        p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
  return model


@pytest.mark.parametrize("num_layers,full_attn,q_lora_rank", [
    # MLA every 2nd layer + the last: prefix 0–1, scanned groups [2,3] [4,5], suffix 6;
    # a single q_proj
    (7, [2, 4, 6, 7], None),
    # MLA at 4 and 5 (1-based): layers 0–4 unrolled; q_a_proj / q_a_layernorm / q_b_proj
    (5, [4, 5], 16),
])
def test_logits_match_transformers(tmp_path, num_layers, full_attn, q_lora_rank):
  model = _hf_model(num_layers, full_attn, q_lora_rank, seed=num_layers)
  src, dst = tmp_path / "hf", tmp_path / "k3"
  model.save_pretrained(src)
  tokens = np.random.default_rng(0).integers(3, 96, size=(2, 21))
  with torch.no_grad():
    ref = model(torch.tensor(tokens)).logits.numpy()

  convert(src, dst, arch="auto", dtype="float32", progress=False, log=lambda s: None,
          kda_chunk_size=16)
  config, variables = load_pretrained(dst)
  assert config.text.q_lora_rank == q_lora_rank and config.text.kda_lower_bound is None
  assert config.text.num_layers == num_layers and not config.text.full_rank_gates
  out = np.asarray(jax.jit(K3Model(config).apply)(variables, jnp.asarray(tokens)))
  scale = np.abs(ref).max()
  assert scale > 1.0
  err = np.abs(out - ref).max()
  assert err <= 1e-4 * scale, (err, scale)

  # and back: export → the same tensors transformers saved (fp32 experts, exact)
  back = tmp_path / "back"
  export(dst, back, arch="kimi_linear", expert_format="bf16", dtype="float32", progress=False)
  a, b = Source(src), Source(back)
  renamed = {n.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): n for n in a.names()}
  assert sorted(renamed) == b.names()
  for n in b.names():
    np.testing.assert_array_equal(b.get(n), a.get(renamed[n]), err_msg=n)
  cfg = json.loads((back / "config.json").read_text())
  assert cfg["linear_attn_config"]["full_attn_layers"] == full_attn
  assert cfg["routed_scaling_factor"] == pytest.approx(1.7)


def test_transformers_ignores_num_key_value_heads():
  """Why from_hf_config accepts num_key_value_heads != num_attention_heads (reporting it in
  hf_config.ignored_keys): transformers' MLA sizes no weight by it, and where its forward runs
  with such a value (here: v_head_dim = qk head dim and no mask, SDPA's GQA path) the logits are
  those of num_key_value_heads = num_attention_heads. With v_head_dim != qk head dim and
  num_attention_heads // num_key_value_heads > 1, transformers' own forward raises."""
  from transformers import KimiLinearConfig, KimiLinearForCausalLM
  kw = dict(v_head_dim=16)
  ref = _hf_model(3, [2, 3], None, seed=3, **kw)
  gqa = _hf_model(3, [2, 3], None, seed=3, num_key_value_heads=1, **kw)
  a, b = ref.state_dict(), gqa.state_dict()
  assert sorted(a) == sorted(b)
  for n in a:
    torch.testing.assert_close(b[n], a[n], rtol=0, atol=0, msg=n)
  tokens = torch.tensor(np.random.default_rng(0).integers(3, 96, size=(2, 11)))
  with torch.no_grad():
    torch.testing.assert_close(gqa(tokens).logits, ref(tokens).logits, rtol=0, atol=0)

  d = gqa.config.to_dict()
  assert list(hf_config.ignored_keys(d)) == ["num_key_value_heads"]
  config = hf_config.from_hf_config(d)
  assert config == hf_config.from_hf_config(ref.config.to_dict())
  # the round trip is a config transformers builds the same weights from, with nothing ignored
  # (token ids are not part of ModelConfig: transformers' defaults lie outside this tiny vocab)
  back = hf_config.to_hf_config(config, "kimi_linear")
  assert hf_config.ignored_keys(back) == {}
  assert back["num_key_value_heads"] == back["num_attention_heads"] == 2
  rebuilt = KimiLinearForCausalLM(KimiLinearConfig(
      **back, pad_token_id=0, bos_token_id=1, eos_token_id=2)).state_dict()
  assert {n: t.shape for n, t in rebuilt.items()} == {n: t.shape for n, t in a.items()}
