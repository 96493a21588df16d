"""The K3 release's tensors as published: names, shapes and dtypes typed by hand.

Sources: docs/k3.md §2 (which layers are MLA), §9 (the per-layer tensors), §11 (the vision
tower), §12 (the release as a whole: 497,220 entries, 1.561 TB, no MTP tensors, A_log F32
[128]) and the public facts about the files quoted with them (per MoE layer
`w1/w3.weight_packed` U8 3072×1792 + `weight_scale` U8 3072×112, `w2.weight_packed` U8
3584×1536 + `weight_scale` U8 3584×96; `kv_a_proj_with_mqa` BF16 576×7168, `kv_b_proj` BF16
24576×512, `q_a_proj` BF16 1536×7168, `q_b_proj` BF16 18432×1536, `g_proj` BF16 12288×7168;
vision `patch_embed.proj` BF16 1024×3×14×14, `pos_emb` 64×64×1024, `wqkv` 4608×1024,
`final_layernorm` 1024). Nothing here is computed by k3jax: tests/tools/test_release_layout.py
holds k3jax's tensor map to it, tests/tools/test_check_only.py and
experiments/bench_check_only.py give `--check_only` these headers.

Spelling: the spec's shorthand names modules (`q_a_proj`, `routed_expert_norm`); a module's
tensor is `<module>.weight`. Dtypes the publications do not state are those of §12's size
accounting: F32 for A_log, dt_bias, the short convs, o_norm and the router bias, BF16 for every
other float tensor — the router matrices included, the reading the published 1.561 TB fits.
"""

from __future__ import annotations

ENTRIES = 497_220           # §12
TERABYTES = 1.561           # §12, decimal, as published (rounded to the last digit shown)
LAYERS = 93                 # §1
EXPERTS = 896               # §1
VISION_BLOCKS = 27          # §11
BYTES_PER = {"BF16": 2, "F32": 4, "U8": 1}

TEXT = "language_model.model."
MODEL = [
    ("language_model.model.embed_tokens.weight", (163840, 7168), "BF16"),
    ("language_model.model.norm.weight", (7168,), "BF16"),
    ("language_model.model.output_attn_res_norm.weight", (7168,), "BF16"),
    ("language_model.model.output_attn_res_proj.weight", (1, 7168), "BF16"),
    ("language_model.lm_head.weight", (163840, 7168), "BF16"),
]
# Under language_model.model.layers.N.
EVERY_LAYER = [
    ("input_layernorm.weight", (7168,), "BF16"),
    ("post_attention_layernorm.weight", (7168,), "BF16"),
    ("self_attention_res_norm.weight", (7168,), "BF16"),
    ("self_attention_res_proj.weight", (1, 7168), "BF16"),
    ("mlp_res_norm.weight", (7168,), "BF16"),
    ("mlp_res_proj.weight", (1, 7168), "BF16"),
]
KDA_LAYER = [
    ("self_attn.q_proj.weight", (12288, 7168), "BF16"),
    ("self_attn.k_proj.weight", (12288, 7168), "BF16"),
    ("self_attn.v_proj.weight", (12288, 7168), "BF16"),
    ("self_attn.q_conv1d.weight", (12288, 1, 4), "F32"),
    ("self_attn.k_conv1d.weight", (12288, 1, 4), "F32"),
    ("self_attn.v_conv1d.weight", (12288, 1, 4), "F32"),
    ("self_attn.f_a_proj.weight", (128, 7168), "BF16"),
    ("self_attn.f_b_proj.weight", (12288, 128), "BF16"),
    ("self_attn.b_proj.weight", (96, 7168), "BF16"),
    ("self_attn.g_proj.weight", (12288, 7168), "BF16"),
    ("self_attn.A_log", (128,), "F32"),
    ("self_attn.dt_bias", (12288,), "F32"),
    ("self_attn.o_norm.weight", (128,), "F32"),
    ("self_attn.o_proj.weight", (7168, 12288), "BF16"),
]
MLA_LAYER = [
    ("self_attn.q_a_proj.weight", (1536, 7168), "BF16"),
    ("self_attn.q_a_layernorm.weight", (1536,), "BF16"),
    ("self_attn.q_b_proj.weight", (18432, 1536), "BF16"),
    ("self_attn.kv_a_proj_with_mqa.weight", (576, 7168), "BF16"),
    ("self_attn.kv_a_layernorm.weight", (512,), "BF16"),
    ("self_attn.kv_b_proj.weight", (24576, 512), "BF16"),
    ("self_attn.g_proj.weight", (12288, 7168), "BF16"),
    ("self_attn.o_proj.weight", (7168, 12288), "BF16"),
]
DENSE_LAYER = [      # layer 0 only
    ("mlp.gate_proj.weight", (33792, 7168), "BF16"),
    ("mlp.up_proj.weight", (33792, 7168), "BF16"),
    ("mlp.down_proj.weight", (7168, 33792), "BF16"),
]
MOE_LAYER = [        # layers 1–92
    ("block_sparse_moe.gate.weight", (896, 7168), "BF16"),
    ("block_sparse_moe.gate.e_score_correction_bias", (896,), "F32"),
    ("block_sparse_moe.routed_expert_down_proj.weight", (3584, 7168), "BF16"),
    ("block_sparse_moe.routed_expert_norm.weight", (3584,), "BF16"),
    ("block_sparse_moe.routed_expert_up_proj.weight", (7168, 3584), "BF16"),
    ("block_sparse_moe.shared_experts.gate_proj.weight", (6144, 7168), "BF16"),
    ("block_sparse_moe.shared_experts.up_proj.weight", (6144, 7168), "BF16"),
    ("block_sparse_moe.shared_experts.down_proj.weight", (7168, 6144), "BF16"),
]
# Under block_sparse_moe.experts.E., E = 0 … 895
EXPERT = [
    ("w1.weight_packed", (3072, 1792), "U8"),
    ("w1.weight_scale", (3072, 112), "U8"),
    ("w3.weight_packed", (3072, 1792), "U8"),
    ("w3.weight_scale", (3072, 112), "U8"),
    ("w2.weight_packed", (3584, 1536), "U8"),
    ("w2.weight_scale", (3584, 96), "U8"),
]
VISION = [
    ("vision_tower.patch_embed.proj.weight", (1024, 3, 14, 14), "BF16"),
    ("vision_tower.patch_embed.pos_emb.weight", (64, 64, 1024), "BF16"),
    ("vision_tower.encoder.final_layernorm.weight", (1024,), "BF16"),
    ("mm_projector.proj.0.weight", (4096, 4096), "BF16"),
    ("mm_projector.proj.2.weight", (7168, 4096), "BF16"),
    ("mm_projector.post_norm.weight", (7168,), "BF16"),
]
# Under vision_tower.encoder.blocks.N., N = 0 … 26
VISION_BLOCK = [
    ("norm0.weight", (1024,), "BF16"),
    ("norm1.weight", (1024,), "BF16"),
    ("wqkv.weight", (4608, 1024), "BF16"),
    ("wo.weight", (1024, 1536), "BF16"),
    ("mlp.fc0.weight", (4096, 1024), "BF16"),
    ("mlp.fc1.weight", (1024, 4096), "BF16"),
]


def is_mla(i: int) -> bool:
  """§2, 0-based: MLA at every 4th layer and the last (1-based 4, 8, …, 92 and 93)."""
  return i % 4 == 3 or i == LAYERS - 1


def entries() -> list[tuple[str, tuple[int, ...], str]]:
  """Every published tensor: (name, shape, safetensors dtype), the templates above expanded."""
  out = list(MODEL)
  for i in range(LAYERS):
    layer = f"{TEXT}layers.{i}."
    templates = EVERY_LAYER + (MLA_LAYER if is_mla(i) else KDA_LAYER)
    templates += DENSE_LAYER if i == 0 else MOE_LAYER
    out += [(layer + n, s, d) for n, s, d in templates]
    if i > 0:
      out += [(f"{layer}block_sparse_moe.experts.{e}.{n}", s, d)
              for e in range(EXPERTS) for n, s, d in EXPERT]
  out += VISION
  for b in range(VISION_BLOCKS):
    out += [(f"vision_tower.encoder.blocks.{b}.{n}", s, d) for n, s, d in VISION_BLOCK]
  return out


def nbytes(entry) -> int:
  _, shape, dtype = entry
  n = BYTES_PER[dtype]
  for s in shape:
    n *= s
  return n
