"""ModelConfig: presets, derived layout, and validation errors that name the field."""

import dataclasses

import pytest

from k3jax import config as cfg


def test_k3_matches_table_1():
  c = cfg.preset("k3")
  assert (c.d_model, c.num_layers, c.latent_moe_dim, c.moe_intermediate_size) == (7168, 93, 3584, 3072)
  assert (c.num_experts, c.experts_per_token, c.num_shared_experts) == (896, 16, 2)
  assert (c.num_heads, c.kda_num_heads, c.vocab_size, c.dense_intermediate_size) == (96, 96, 163840, 33792)
  assert c.activation == "situ" and c.kda_lower_bound == -5.0 and c.attn_res_block_size == 12
  assert c.latent_moe_dim == c.d_model // 2


def test_k3_layout():
  c = cfg.preset("k3")
  types = c.layer_types()
  mla = [i for i, (m, _) in enumerate(types) if m == cfg.MLA]
  assert mla == list(range(3, 92, 4)) + [92]
  assert len(mla) == 24 and sum(m == cfg.KDA for m, _ in types) == 69
  assert [i for i, (_, f) in enumerate(types) if f == cfg.DENSE] == [0]
  # prefix 0–3 unrolled, 22 scanned groups of [KDA, KDA, KDA, MLA] (4–91), suffix 92
  assert c.stack_layout() == (4, 22, 1)
  assert c.num_attn_res_blocks == 8


@pytest.mark.parametrize("name", sorted(cfg.PRESETS))
def test_presets_are_consistent(name):
  c = cfg.preset(name)
  prefix, groups, suffix = c.stack_layout()
  assert prefix + groups * c.mla_every + suffix == c.num_layers
  assert c.is_mla(c.num_layers - 1)


def test_kimi_linear_switches():
  c = cfg.preset("kimi_linear_48b")
  assert c.kda_lower_bound is None and not c.full_rank_gates and c.attn_res_block_size is None
  assert c.latent_moe_dim is None and c.activation == "swiglu" and c.q_lora_rank is None
  assert [i + 1 for i, (m, _) in enumerate(c.layer_types()) if m == cfg.MLA] == [4, 8, 12, 16, 20, 24, 27]
  # A_log one rate per head, in Kimi Linear and (until the release says otherwise) in K3
  assert c.kda_a_log_axis == "head" and cfg.preset("k3").kda_a_log_axis == "head"


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
    (dict(qb_range=(1.0, -1.0)), "qb_range"),
    (dict(first_dense_layers=20), "first_dense_layers"),
])
def test_invalid_configs_name_the_field(overrides, field):
  with pytest.raises(ValueError, match=field):
    cfg.preset("tiny", **overrides)


def test_unknown_preset_and_field():
  with pytest.raises(ValueError, match="unknown preset"):
    cfg.preset("k4")
  with pytest.raises(ValueError, match="not_a_field"):
    cfg.preset("tiny", not_a_field=1)


def test_frozen():
  c = cfg.preset("tiny")
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.d_model = 3  # type: ignore[misc]
