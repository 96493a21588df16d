"""ModelConfig: presets, derived layout, and validation errors that name the field."""

import dataclasses

import pytest

from k3jax import config as cfg


def test_k3_matches_table_1():
  c = cfg.preset("k3")
  assert (c.text.d_model, c.text.num_layers, c.text.latent_moe_dim, c.text.moe_intermediate_size) == (7168, 93, 3584, 3072)
  assert (c.text.num_experts, c.text.experts_per_token, c.text.num_shared_experts) == (896, 16, 2)
  assert (c.text.num_heads, c.text.kda_num_heads, c.text.vocab_size, c.text.dense_intermediate_size) == (96, 96, 163840, 33792)
  assert c.text.activation == "situ" and c.text.kda_lower_bound == -5.0 and c.text.attn_res_block_size == 12
  assert c.text.latent_moe_dim == c.text.d_model // 2


def test_k3_layout():
  c = cfg.preset("k3")
  types = c.text.layer_types()
  mla = [i for i, (m, _) in enumerate(types) if m == cfg.MLA]
  assert mla == list(range(3, 92, 4)) + [92]
  assert len(mla) == 24 and sum(m == cfg.KDA for m, _ in types) == 69
  assert [i for i, (_, f) in enumerate(types) if f == cfg.DENSE] == [0]
  # prefix 0–3 unrolled, 22 scanned groups of [KDA, KDA, KDA, MLA] (4–91), suffix 92
  assert c.text.stack_layout() == (4, 22, 1)
  assert c.text.num_attn_res_blocks == 8


@pytest.mark.parametrize("name", sorted(cfg.PRESETS))
def test_presets_are_consistent(name):
  c = cfg.preset(name)
  prefix, groups, suffix = c.text.stack_layout()
  assert prefix + groups * c.text.mla_every + suffix == c.text.num_layers
  assert c.text.is_mla(c.text.num_layers - 1)


def test_kimi_linear_switches():
  c = cfg.preset("kimi_linear_48b")
  assert c.text.kda_lower_bound is None and not c.text.full_rank_gates and c.text.attn_res_block_size is None
  assert c.text.latent_moe_dim is None and c.text.activation == "swiglu" and c.text.q_lora_rank is None
  assert [i + 1 for i, (m, _) in enumerate(c.text.layer_types()) if m == cfg.MLA] == [4, 8, 12, 16, 20, 24, 27]
  # A_log one rate per head, in Kimi Linear and (until the release says otherwise) in K3
  assert c.text.kda_a_log_axis == "head" and cfg.preset("k3").text.kda_a_log_axis == "head"


@pytest.mark.parametrize("overrides, field", [
    (dict(experts_per_token=9), "experts_per_token"),
    (dict(experts_per_token=8), "experts_per_token"),
    (dict(activation="gelu"), "activation"),
    (dict(kda_lower_bound=-7.0), "kda_lower_bound"),
    (dict(kda_a_log_axis="key"), r"kda_a_log_axis: expected 'head' \(A_log \[H\]\) or 'channel' "
                                 r"\(A_log \[K\], shared by the heads\), found 'key'"),
    (dict(mla_query_block=0), "mla_query_block"),
    (dict(kda_chunk_size=24), "kda_chunk_size"),
    (dict(d_model=0), "d_model"),
    (dict(kernel_backend="cuda"), "kernel_backend"),
    (dict(mla_every=4, mla_last=False, num_layers=3), "num_layers"),
    (dict(num_layers=4, kda_only=True), "kda_only"),   # layer 3 is MLA
    (dict(mla_key_block=0), "mla_key_block"),
    (dict(remat_offload=True), "remat_offload"),       # without remat
    (dict(qb_range=(1.0, -1.0)), "qb_range"),
    (dict(first_dense_layers=20), "first_dense_layers"),
])
def test_invalid_configs_name_the_field(overrides, field):
  with pytest.raises(ValueError, match=field):
    cfg.preset("tiny", **overrides)


def test_kda_only_stack_when_stated():
  c = cfg.preset("tiny", num_layers=4, mla_every=5, mla_last=False, kda_only=True)
  assert [m for m, _ in c.text.layer_types()] == ["kda"] * 4


def test_unknown_preset_and_field():
  with pytest.raises(ValueError, match="unknown preset"):
    cfg.preset("k4")
  with pytest.raises(ValueError, match="not_a_field"):
    cfg.preset("tiny", not_a_field=1)


def test_frozen():
  c = cfg.preset("tiny")
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.text.d_model = 3  # type: ignore[misc]
