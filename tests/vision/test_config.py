"""VisionConfig ⇄ a checkpoint's `vision_config` (docs/k3.md §11)."""

import pytest

from k3jax.vision import vision_preset
from k3jax.hf_config import vision_config_from_hf, vision_config_to_hf

K3_VISION_CONFIG = {  # §11, as released
    "model_type": "kimi_k3_vision", "vt_num_hidden_layers": 27, "vt_hidden_size": 1024,
    "vt_num_attention_heads": 12, "qkv_hidden_size": 1536, "vt_intermediate_size": 4096,
    "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64,
    "merge_kernel_size": [2, 2], "text_hidden_size": 7168,
}


def test_k3_vision_config_is_the_preset_and_round_trips():
  cfg = vision_config_from_hf(K3_VISION_CONFIG)
  assert cfg == vision_preset("moonvit_v2")
  assert vision_config_from_hf(vision_config_to_hf(cfg)) == cfg
  # A norm eps in the file wins over the 1e-5 default (one port reads 2^-7).
  assert vision_config_from_hf({**K3_VISION_CONFIG, "rms_norm_eps": 2 ** -7}).norm_eps == 2 ** -7


def test_k25_vision_config_from_transformers():
  import transformers
  from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig
  vc = Kimi_K25VisionConfig().to_dict()
  cfg = vision_config_from_hf(vc, text_hidden_size=7168, projector_norm_eps=1e-5)
  assert cfg == vision_preset("moonvit_k25")
  del transformers


def test_hf_config_errors_name_the_key():
  with pytest.raises(ValueError, match="vision_config.vt_hidden_size: missing"):
    vision_config_from_hf({k: v for k, v in K3_VISION_CONFIG.items() if k != "vt_hidden_size"})
  with pytest.raises(ValueError, match="vision_config.model_type"):
    vision_config_from_hf({"model_type": "siglip"})
  with pytest.raises(ValueError, match="text_hidden_size: required"):
    vision_config_from_hf({"model_type": "kimi_k25_vision"})
  with pytest.raises(ValueError, match="only the moonvit_v2 family"):
    vision_config_to_hf(vision_preset("moonvit_k25"))
