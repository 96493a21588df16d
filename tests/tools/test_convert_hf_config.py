"""config.json ⇄ ModelConfig (k3jax/hf_config.py)."""


import pytest

from k3jax import hf_config
from k3jax.config import preset

# Moonshot's Kimi-Linear-48B-A3B config.json as published (keys recalled from the public file, not
# downloaded here: the keys that matter; layer lists 1-based).
KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72,
    "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_experts": 256,
    "num_experts_per_token": 8, "num_shared_experts": 1, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446, "num_expert_group": 1, "topk_group": 1,
    "use_grouped_topk": True, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "linear_attn_config": {
        "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)]},
}

def _arch(c):
  """What config.json describes: the architecture, the tower and its placeholder."""
  return (c.text, c.vision, c.media_placeholder_token_id)


def test_published_kimi_linear_config_is_the_preset():
  c = hf_config.from_hf_config(KIMI_LINEAR_48B)
  assert _arch(c) == _arch(preset("kimi_linear_48b"))
  assert [i for i, (m, _) in enumerate(c.text.layer_types()) if m == "mla"] == [3, 7, 11, 15, 19, 23, 26]


@pytest.mark.parametrize("name", ["k3", "kimi_linear_48b", "small", "tiny", "tiny_kimi_linear"])
def test_round_trip_presets(name):
  c = preset(name)
  d = hf_config.to_hf_config(c)
  assert d["model_type"] == ("kimi_linear" if name.startswith("kimi") or "kimi_linear" in name
                             else "kimi_k3")
  assert _arch(hf_config.from_hf_config(d)) == _arch(c)


def test_a_log_axis_round_trips():
  """The per-channel reading of A_log is written as k3jax's linear_attn_config key
  `a_log_per_channel` (absent for the per-head reading, like the release's config.json) and
  read back; Kimi Linear has no form for it; a non-boolean value is refused."""
  c = preset("k3", kda_a_log_axis="channel")
  d = hf_config.to_hf_config(c)
  assert d["text_config"]["linear_attn_config"]["a_log_per_channel"] is True
  assert hf_config.declared_a_log_axis(d) == "channel"
  assert _arch(hf_config.from_hf_config(d)) == _arch(c)
  plain = hf_config.to_hf_config(preset("k3"))
  assert "a_log_per_channel" not in plain["text_config"]["linear_attn_config"]
  assert hf_config.declared_a_log_axis(plain) is None
  assert hf_config.from_hf_config(plain).text.kda_a_log_axis == "head"
  assert hf_config.is_k3_style(preset("tiny_kimi_linear", kda_a_log_axis="channel"))
  with pytest.raises(ValueError, match=r"ModelConfig\.text\.kda_a_log_axis: 'channel' has no Kimi "
                     r"Linear config\.json form"):
    hf_config.to_hf_config(preset("tiny_kimi_linear", kda_a_log_axis="channel"), "kimi_linear")
  d["text_config"]["linear_attn_config"]["a_log_per_channel"] = "yes"
  with pytest.raises(ValueError, match=r"'linear_attn_config\.a_log_per_channel': expected "
                     r"true or false, found 'yes'"):
    hf_config.from_hf_config(d)


def test_k3_config_layout():
  d = hf_config.to_hf_config(preset("k3"))
  tc = d["text_config"]
  assert tc["linear_attn_config"]["full_attn_layers"] == list(range(4, 93, 4)) + [93]
  assert len(tc["linear_attn_config"]["kda_layers"]) == 69
  assert tc["linear_attn_config"]["gate_lower_bound"] == -5.0
  assert tc["linear_attn_config"]["use_full_rank_gate"] is True
  assert tc["routed_expert_hidden_size"] == 3584 and tc["hidden_act"] == "situ"
  assert tc["q_lora_rank"] == 1536 and tc["mla_use_output_gate"] is True


def test_transformers_layer_types_are_accepted():
  d = {k: v for k, v in KIMI_LINEAR_48B.items() if k != "linear_attn_config"}
  d["layer_types"] = ["full_attention" if i in (3, 7, 11, 15, 19, 23, 26) else "linear_attention"
                      for i in range(27)]
  d.update(linear_num_heads=32, linear_head_dim=128)
  assert _arch(hf_config.from_hf_config(d)) == _arch(preset("kimi_linear_48b"))


@pytest.mark.parametrize("key,value,match", [
    ("moe_router_activation_func", "softmax", "moe_router_activation_func"),
    ("moe_renormalize", False, "moe_renormalize"),
    ("topk_group", 2, "topk_group"),
    ("hidden_act", "gelu", "hidden_act"),
    ("attention_bias", True, "attention_bias"),
])
def test_unsupported_keys_are_refused(key, value, match):
  d = dict(KIMI_LINEAR_48B, **{key: value})
  if key == "topk_group":
    d["num_expert_group"] = 4
  with pytest.raises(ValueError, match=match):
    hf_config.from_hf_config(d)


@pytest.mark.parametrize("kv_heads", [1, 8, 64])
def test_num_key_value_heads_is_ignored_and_reported(kv_heads):
  # transformers' KimiLinearAttention sizes no weight by num_key_value_heads (MLA shares one
  # latent KV across heads), so such a config is the same network as kv_heads == heads.
  d = dict(KIMI_LINEAR_48B, num_key_value_heads=kv_heads)
  c = hf_config.from_hf_config(d)
  assert _arch(c) == _arch(preset("kimi_linear_48b"))
  ignored = hf_config.ignored_keys(d)
  assert list(ignored) == ["num_key_value_heads"]
  assert f"{kv_heads} != num_attention_heads (32)" in ignored["num_key_value_heads"]
  # the round trip writes a config with nothing ignored, describing the same model
  back = hf_config.to_hf_config(c)
  assert back["num_key_value_heads"] == back["num_attention_heads"] == 32
  assert hf_config.ignored_keys(back) == {}
  assert _arch(hf_config.from_hf_config(back)) == _arch(c)


def test_num_key_value_heads_in_k3_text_config_is_reported():
  d = hf_config.to_hf_config(preset("tiny"))
  d["text_config"]["num_key_value_heads"] = 1
  assert list(hf_config.ignored_keys(d)) == ["num_key_value_heads"]
  assert _arch(hf_config.from_hf_config(d)) == _arch(preset("tiny"))


def test_nothing_ignored_in_written_or_published_configs():
  for name in ("k3", "kimi_linear_48b", "tiny"):
    assert hf_config.ignored_keys(hf_config.to_hf_config(preset(name))) == {}, name
  assert hf_config.ignored_keys(KIMI_LINEAR_48B) == {}


def test_irregular_layer_layout_is_refused():
  d = dict(KIMI_LINEAR_48B)
  d["linear_attn_config"] = dict(d["linear_attn_config"], full_attn_layers=[3, 8, 27],
                                 kda_layers=[i for i in range(1, 28) if i not in (3, 8, 27)])
  with pytest.raises(ValueError, match=r"full_attn_layers.*\[3, 8, 27\]"):
    hf_config.from_hf_config(d)


def test_kimi_linear_cannot_express_k3_features():
  with pytest.raises(ValueError, match="attn_res_block_size"):
    hf_config.to_hf_config(preset("tiny"), "kimi_linear")
