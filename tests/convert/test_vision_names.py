"""Release names ⇄ k3jax parameter paths for the vision tower and projector (docs/k3.md §11)."""

import jax
import numpy as np
import pytest

from k3jax.vision import init_vision, vision_preset
from k3jax.convert import vision_names as vnames


def _flat(tree, prefix=()):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _flat(v, prefix + (k,))
    else:
      yield prefix + (k,), v


@pytest.mark.parametrize("name", ["moonvit_v2", "moonvit_k25", "tiny_moonvit_v2",
                                  "tiny_moonvit_k25"])
def test_specs_cover_every_parameter_once_with_its_shape(name):
  cfg = vision_preset(name)
  shapes = jax.eval_shape(lambda k: init_vision(cfg, k), jax.random.PRNGKey(0))["params"]
  params = dict(_flat(shapes))
  specs = vnames.tensor_specs(cfg)
  assert sorted(s.path for s in specs) == sorted(params)
  for s in specs:  # zero-stride views: nothing of the full size is allocated
    y = vnames.to_k3jax(cfg, s, np.broadcast_to(np.float32(0), s.shape))
    assert y.shape == params[s.path].shape, s.name


def test_moonvit_v2_names_and_shapes_are_the_release():
  cfg = vision_preset("moonvit_v2")
  specs = {s.name: s.shape for s in vnames.tensor_specs(cfg)}
  assert len(specs) == 168
  want = {
      "vision_tower.patch_embed.proj.weight": (1024, 3, 14, 14),
      "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1024),
      "vision_tower.encoder.blocks.26.norm0.weight": (1024,),
      "vision_tower.encoder.blocks.0.norm1.weight": (1024,),
      "vision_tower.encoder.blocks.0.wqkv.weight": (4608, 1024),
      "vision_tower.encoder.blocks.0.wo.weight": (1024, 1536),
      "vision_tower.encoder.blocks.0.mlp.fc0.weight": (4096, 1024),
      "vision_tower.encoder.blocks.0.mlp.fc1.weight": (1024, 4096),
      "vision_tower.encoder.final_layernorm.weight": (1024,),
      "mm_projector.proj.0.weight": (4096, 4096),
      "mm_projector.proj.2.weight": (7168, 4096),
      "mm_projector.post_norm.weight": (7168,),
  }
  for k, shape in want.items():
    assert specs[k] == shape, k
  assert not any(k.endswith(".bias") for k in specs)
  k25 = {s.name for s in vnames.tensor_specs(vision_preset("moonvit_k25"))}
  assert {"mm_projector.pre_norm.bias", "vision_tower.encoder.blocks.0.wqkv.bias",
          "vision_tower.patch_embed.proj.bias"} <= k25
  assert vnames.name_map(cfg)["vision_tower.encoder.blocks.3.mlp.fc1.weight"] == (
      "vision_tower/encoder/blocks_3/mlp/fc1/kernel")


@pytest.mark.parametrize("name", ["tiny_moonvit_v2", "tiny_moonvit_k25"])
def test_round_trip_is_bit_exact(name):
  cfg = vision_preset(name)
  v = jax.tree_util.tree_map(np.asarray, init_vision(cfg, jax.random.PRNGKey(1)))
  sd = vnames.to_state_dict(cfg, v)
  back = vnames.from_state_dict(cfg, {**sd, "language_model.model.norm.weight": np.ones(3)})
  a, b = dict(_flat(v["params"])), dict(_flat(back["params"]))
  assert sorted(a) == sorted(b)
  for p in a:
    assert a[p].dtype == b[p].dtype
    np.testing.assert_array_equal(a[p], b[p])


def test_qkv_and_wo_layouts_match_torch_linear():
  """The fused wqkv [3·H·Dh, D] applied as a PyTorch Linear, split (q, k, v) then heads, equals
  the k3jax kernel [D, 3, H, Dh]; wo likewise."""
  cfg = vision_preset("tiny_moonvit_k25")
  rng = np.random.RandomState(0)
  spec = {s.name: s for s in vnames.tensor_specs(cfg)}
  d, h, dh = cfg.hidden_size, cfg.num_heads, cfg.head_dim
  w = rng.randn(3 * h * dh, d).astype(np.float32)
  b = rng.randn(3 * h * dh).astype(np.float32)
  x = rng.randn(5, d).astype(np.float32)
  torch_out = (x @ w.T + b).reshape(5, 3, h, dh)
  n = "vision_tower.encoder.blocks.0.wqkv"
  k = vnames.to_k3jax(cfg, spec[n + ".weight"], w)
  kb = vnames.to_k3jax(cfg, spec[n + ".bias"], b)
  np.testing.assert_allclose(np.einsum("ld,dcnk->lcnk", x, k) + kb, torch_out, rtol=1e-5,
                             atol=1e-5)
  wo = rng.randn(d, h * dh).astype(np.float32)
  o = rng.randn(5, h, dh).astype(np.float32)
  ko = vnames.to_k3jax(cfg, spec["vision_tower.encoder.blocks.0.wo.weight"], wo)
  np.testing.assert_allclose(np.einsum("lnk,nkd->ld", o, ko), o.reshape(5, -1) @ wo.T,
                             rtol=1e-5, atol=1e-5)


def test_state_dict_errors_name_the_tensor():
  cfg = vision_preset("tiny_moonvit_v2")
  sd = vnames.to_state_dict(cfg, init_vision(cfg, jax.random.PRNGKey(0)))
  bad = dict(sd)
  del bad["mm_projector.post_norm.weight"]
  with pytest.raises(ValueError, match="missing.*mm_projector.post_norm.weight"):
    vnames.from_state_dict(cfg, bad)
  with pytest.raises(ValueError, match="unexpected.*mm_projector.pre_norm.weight"):
    vnames.from_state_dict(cfg, {**sd, "mm_projector.pre_norm.weight": np.ones(32)})
  bad = {**sd, "vision_tower.encoder.blocks.1.wo.weight": np.zeros((32, 31))}
  with pytest.raises(ValueError, match=r"blocks.1.wo.weight: expected shape \(32, 32\)"):
    vnames.from_state_dict(cfg, bad)


def test_rope_half_to_pairs_turns_rotate_half_into_adjacent_pairs():
  """transformers' rotate-half RoPE on the rows as it stores them = `ops.apply_rope` (adjacent
  pairs, layout interleaved_cols_rows) on the rows permuted by `rope_half_to_pairs`."""
  from k3jax.vision import ops
  dh, h = 16, 2
  perm = vnames.rope_half_to_pairs(dh)
  np.testing.assert_array_equal(vnames.rope_half_to_pairs(8), [0, 4, 1, 5, 2, 6, 3, 7])
  rng = np.random.default_rng(0)
  x = rng.normal(size=(5, h, dh)).astype(np.float32)         # rows in transformers' order
  rows, cols = rng.integers(0, 20, 5), rng.integers(0, 20, 5)
  # transformers: angles per element, (col, row) interleaved over j, the half repeated
  f = 10000.0 ** (-np.arange(dh // 4) / (dh // 4))
  half = np.stack([cols[:, None] * f, rows[:, None] * f], -1).reshape(5, dh // 2)
  ang = np.concatenate([half, half], -1)[:, None, :]
  rot = np.concatenate([-x[..., dh // 2:], x[..., :dh // 2]], -1)
  theirs = x * np.cos(ang) + rot * np.sin(ang)
  angles = ops.rope_angles(rows, cols, dh, theta=10000.0, layout="interleaved_cols_rows")
  ours = np.asarray(ops.apply_rope(x[..., perm], angles))
  np.testing.assert_allclose(ours, theirs[..., perm], rtol=1e-5, atol=1e-5)
  # on a weight [H·Dh, in]: rows permuted inside each head, heads kept in place
  w = np.arange(h * dh * 3).reshape(h * dh, 3)
  pw = vnames.permute_heads(w, h, perm)
  np.testing.assert_array_equal(pw[dh:], w[dh:][perm])
  np.testing.assert_array_equal(pw[:dh], w[:dh][perm])
  with pytest.raises(ValueError, match="are not 3 heads"):
    vnames.permute_heads(w, 3, perm)
