"""tools/param_count: docs/k3.md §1 figures for k3, and a hand count for tiny."""

import json
import subprocess
import sys

import numpy as np
import pytest

from k3jax.config import preset
from tools.param_count import count_params


def test_k3_matches_table_1():
  c = count_params(preset("k3"))
  assert abs(c["total"] / 2.7795e12 - 1) < 1e-3, c["total"]
  assert abs(c["activated"] / 104.19e9 - 1) < 1e-3, c["activated"]
  comps = c["components"]
  assert comps["embedding"]["total"] == 163840 * 7168 and comps["embedding"]["activated"] == 0
  assert comps["routed_experts"]["total"] == 92 * 896 * 3 * 3584 * 3072
  assert comps["routed_experts"]["activated"] == 92 * 16 * 3 * 3584 * 3072
  assert comps["dense_mlp"]["total"] == 3 * 7168 * 33792
  assert comps["router"]["total"] == 92 * 7168 * 896
  assert c["router_bias"] == 92 * 896
  assert c["mtp"] > 0 and sum(v["total"] for v in comps.values()) == c["total"]


def _hand_count_tiny(cfg):
  d, v, L = cfg.text.d_model, cfg.text.vocab_size, cfg.text.num_layers
  h, k, r, w = cfg.text.kda_num_heads, cfg.text.kda_head_dim, cfg.text.kda_gate_rank, cfg.text.kda_conv_size
  kda = (3 * d * h * k + 3 * w * h * k + d * r + r * h * k + d * h + d * h * k + h + h * k
         + h * k * d)  # + o_norm (k) counted as a norm
  mh, q, kv = cfg.text.num_heads, cfg.text.q_lora_rank, cfg.text.kv_lora_rank
  mla = (d * q + q * mh * cfg.text.qk_head_dim + d * (kv + cfg.text.qk_rope_head_dim)
         + kv * mh * (cfg.text.qk_nope_head_dim + cfg.text.v_head_dim) + d * mh * cfg.text.v_head_dim
         + mh * cfg.text.v_head_dim * d)
  e, f, ell = cfg.text.num_experts, cfg.text.moe_intermediate_size, cfg.text.latent_moe_dim
  moe_layers = L - cfg.text.first_dense_layers
  n_mla = sum(cfg.text.is_mla(i) for i in range(L))
  return {
      "kda": (L - n_mla) * kda, "mla": n_mla * mla,
      "routed_experts": moe_layers * e * 3 * ell * f,
      "latent_projections": moe_layers * 2 * d * ell,
      "router": moe_layers * d * e,
      "shared_experts": moe_layers * 3 * d * cfg.text.shared_intermediate_size,
      "dense_mlp": cfg.text.first_dense_layers * 3 * d * cfg.text.dense_intermediate_size,
      "attn_res": (2 * L + 1) * 2 * d,
      "embedding": v * d, "lm_head": v * d,
      "norms": (2 * L + 1) * d + (L - n_mla) * k + n_mla * (q + kv) + moe_layers * ell,
  }


def test_tiny_components_match_hand_count():
  cfg = preset("tiny")
  c = count_params(cfg)
  hand = _hand_count_tiny(cfg)
  for name, n in hand.items():
    assert c["components"][name]["total"] == n, name
  frac = cfg.text.experts_per_token / cfg.text.num_experts
  assert c["activated"] == sum(hand.values()) - hand["embedding"] - round(
      hand["routed_experts"] * (1 - frac))


def test_per_channel_a_log_counts_k_rates_per_kda_layer():
  """kda_a_log_axis="channel": each KDA layer's A_log has K entries instead of H, still
  counted as KDA (the layer is told from its A_log, whatever its shape)."""
  head, channel = preset("tiny"), preset("tiny", kda_a_log_axis="channel")
  n_kda = sum(not head.text.is_mla(i) for i in range(head.text.num_layers))
  a, b = count_params(head)["components"], count_params(channel)["components"]
  assert b["kda"]["total"] - a["kda"]["total"] == n_kda * (head.text.kda_head_dim - head.text.kda_num_heads)
  assert b["mla"] == a["mla"] and b["kda"]["activated"] == b["kda"]["total"]


def test_cli_json():
  out = subprocess.run([sys.executable, "-m", "tools.param_count", "--preset", "tiny", "--json"],
                       capture_output=True, text=True, check=True)
  data = json.loads(out.stdout)
  assert data["total"] == count_params(preset("tiny"))["total"]
  assert set(data["components"]) >= {"embedding", "lm_head", "kda", "mla", "routed_experts"}


def _cli(*args):
  out = subprocess.run([sys.executable, "-m", "tools.param_count", "--json", *args],
                       capture_output=True, text=True, check=True)
  return json.loads(out.stdout)


def test_k3_vision_counted_separately():
  import jax

  from k3jax.vision import vision_preset
  from k3jax.vision.tower import init_vision

  shapes = jax.eval_shape(lambda k: init_vision(vision_preset("moonvit_v2"), k),
                          jax.random.key(0))["params"]
  tower = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["vision_tower"]))
  projector = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["mm_projector"]))
  assert projector == 4096 * 4096 + 4096 * 7168 + 7168  # proj_0, proj_2, post_norm (no biases)
  assert abs(tower / 401e6 - 1) < 0.01, tower  # docs/k3.md §11: MoonViT-V2 401M

  data = _cli("--preset", "k3")
  assert data["vision"] == {"preset": "moonvit_v2", "tower": tower, "projector": projector,
                            "total": tower + projector}
  assert data == count_params(preset("k3"))
  assert abs(data["total"] / 2.7795e12 - 1) < 1e-3

  none = _cli("--preset", "k3", "--vision_preset", "none")  # Table 1 totals: unchanged
  assert "vision" not in none
  assert none == {k: v for k, v in data.items() if k != "vision"}
  assert "vision" not in _cli("--preset", "tiny")  # a text-only preset


def test_importing_registers_no_flags():
  """The tool shares processes with other entry points that define --preset / --json."""
  from absl import flags
  import experiments.generate  # noqa: F401  (defines --preset)
  import tools.param_count  # noqa: F401
  assert "vision_preset" not in flags.FLAGS


def test_bytes_per_expert_format():
  """mxfp4 bytes = the packed model's actual leaf bytes for the experts (4.25 bits a weight);
  counts are those of the unquantised model whatever the config's expert_format."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  from k3jax.model import K3Model
  cfg = preset("tiny", expert_format="mxfp4")
  c = count_params(cfg)
  assert c == count_params(cfg.replace(expert_format="bf16"))
  routed = c["components"]["routed_experts"]["total"]
  b = c["bytes"]
  assert b["bf16"] == 2 * c["total"]
  assert b["routed_experts"] == {"bf16": 2 * routed, "mxfp4": routed * 4.25 / 8}
  assert b["mxfp4"] == 2 * (c["total"] - routed) + routed * 4.25 / 8
  shapes = nn.unbox(jax.eval_shape(K3Model(cfg).init, jax.random.key(0),
                                   jnp.zeros((1, 2), jnp.int32)))
  packed_bytes = sum(x.size * x.dtype.itemsize for p, x in
                     jax.tree_util.tree_leaves_with_path(shapes["params"])
                     if "weight_packed" in jax.tree_util.keystr(p) or
                     "weight_scale" in jax.tree_util.keystr(p))
  mtp_packed = sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(
      shapes["params"].get("mtp", {})) if x.dtype == jnp.uint8)
  assert packed_bytes - mtp_packed == b["routed_experts"]["mxfp4"]
