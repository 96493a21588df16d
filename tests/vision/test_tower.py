"""The vision tower, merger and projector: `encode` against a slow per-sample reference built
from the same ops, packing/padding invariance, presets and bad-input errors (docs/k3.md §11)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.norms import rms_norm
from k3jax.vision import encode, init_vision, pack, vision_preset
from k3jax.vision import ops
from k3jax.config import VisionConfig

# Two images of different sizes and a 3-frame clip, packed into one stream.
GRID = np.array([[1, 4, 6], [1, 2, 2], [3, 2, 4]])


@functools.cache
def _perturbed_init(cfg):
  """seed → initialised variables with every parameter perturbed, jitted: one compile per
  config (run eagerly, each parameter shape compiled its own init and noise ops: ~10 s)."""
  def make(seed):
    v = init_vision(cfg, jax.random.PRNGKey(seed))
    leaves, tree = jax.tree_util.tree_flatten(v)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    leaves = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(tree, leaves)
  return jax.jit(make)


def _variables(name, seed=0):
  """Initialised variables with every parameter perturbed (non-trivial norms and biases)."""
  cfg = vision_preset(name)
  return cfg, _perturbed_init(cfg)(seed)


def _pixels(grid, seed=0):
  n = int(np.prod(grid, axis=1).sum())
  return np.random.RandomState(seed).randn(n, 3, 14, 14).astype(np.float32)


# ----------------------------------------------------------------------------- slow reference
def _norm(cfg, p, x, eps=None, kind=None):
  eps = cfg.norm_eps if eps is None else eps
  if (kind or cfg.norm) == "rmsnorm":
    return rms_norm(x, p["weight"], eps)
  return ops.layer_norm(x, p["weight"], p.get("bias"), eps)


def _lin(p, x, spec="...i,io->...o"):
  y = jnp.einsum(spec, x, p["kernel"])
  return y + p["bias"] if "bias" in p else y


def reference_sample(cfg: VisionConfig, params, px, t, h, w):
  """One sample alone, no packing: (encoded [t·h·w, D], merged [(h/2)(w/2), 4, D],
  projected [(h/2)(w/2), text_hidden]). Full softmax over the sample's patches.

  The position table is resized eagerly (its interpolation taps are host values); the rest
  runs jitted per sample shape: eagerly, every op of every layer compiled alone for each
  sample's shape cost ~9 s a preset."""
  pos = ops.resize_table(params["vision_tower"]["patch_embed"]["pos_emb"]["weight"], h, w,
                         cfg.pos_emb_interpolation)
  return _reference_sample(cfg, params, jnp.asarray(px), pos, t, h, w)


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6))
def _reference_sample(cfg: VisionConfig, params, px, pos, t, h, w):
  vt = params["vision_tower"]
  pe = vt["patch_embed"]
  x = _lin(pe["proj"], px.reshape(t * h * w, -1))
  pos = jnp.broadcast_to(pos, (t, h, w, cfg.hidden_size))
  if t > 1:
    pos = pos + ops.time_table(cfg.max_frames, cfg.hidden_size)[:t, None, None]
  x = x + pos.reshape(t * h * w, -1)
  rows = np.tile(np.repeat(np.arange(h), w), t)
  cols = np.tile(np.tile(np.arange(w), h), t)
  ang = ops.rope_angles(jnp.asarray(rows), jnp.asarray(cols), cfg.head_dim,
                        theta=cfg.rope_theta, layout=cfg.rope_layout)
  for i in range(cfg.num_layers):
    b = vt["encoder"][f"blocks_{i}"]
    qkv = _lin(b["wqkv"], _norm(cfg, b["norm0"], x), "li,icnd->lcnd")
    q, k, v = (qkv[:, j] for j in range(3))
    q, k = ops.apply_rope(q, ang), ops.apply_rope(k, ang)
    logits = jnp.einsum("qnd,knd->nqk", q, k) / np.sqrt(cfg.head_dim)
    o = jnp.einsum("nqk,knd->qnd", jax.nn.softmax(logits, -1), v)
    x = x + _lin(b["wo"], o, "lnd,ndo->lo")
    hdn = jax.nn.gelu(_lin(b["mlp"]["fc0"], _norm(cfg, b["norm1"], x)), approximate=True)
    x = x + _lin(b["mlp"]["fc1"], hdn)
  enc = _norm(cfg, vt["encoder"]["final_layernorm"], x)
  merged = ops.sd2_tpool(enc.reshape(t, h, w, -1))
  pj = params["mm_projector"]
  y = merged
  if cfg.projector_norm == "pre":
    y = _norm(cfg, pj["pre_norm"], y, cfg.projector_norm_eps, "layernorm")
  y = jax.nn.gelu(_lin(pj["proj_0"], y.reshape(len(y), -1)), approximate=False)
  y = _lin(pj["proj_2"], y)
  if cfg.projector_norm == "post":
    y = _norm(cfg, pj["post_norm"], y, cfg.projector_norm_eps, "rmsnorm")
  return enc, merged, y


@pytest.mark.parametrize("name", ["tiny_moonvit_v2", "tiny_moonvit_k25"])
def test_encode_matches_per_sample_reference(name):
  cfg, variables = _variables(name)
  px = _pixels(GRID)
  got = {s: np.asarray(encode(cfg, variables, px, GRID, stage=s))
         for s in ("encoded", "merged", "projected")}
  n_merged = int(sum((h // 2) * (w // 2) for _, h, w in GRID))
  assert got["encoded"].shape == (len(px), cfg.hidden_size)
  assert got["merged"].shape == (n_merged, 4, cfg.hidden_size)
  assert got["projected"].shape == (n_merged, cfg.text_hidden_size)
  ref = [reference_sample(cfg, variables["params"], px[s:e], *g)
         for g, s, e in zip(GRID.tolist(), *_offsets(GRID))]
  for j, stage in enumerate(("encoded", "merged", "projected")):
    want = np.concatenate([np.asarray(r[j]) for r in ref])
    err = np.max(np.abs(got[stage] - want)) / np.max(np.abs(want))
    assert err < 1e-5, (stage, err)


def _offsets(grid):
  ends = np.cumsum(np.prod(grid, axis=1))
  return np.concatenate([[0], ends[:-1]]), ends


def test_packing_equals_each_sample_alone_and_padding_changes_nothing():
  cfg, variables = _variables("tiny_moonvit_v2", seed=3)
  # Images of different sizes and a 4-frame clip; the stream (48 + 4 + 32 + 32 patches) is
  # padded to the 128-patch bucket.
  grid = np.array([[1, 4, 6], [1, 2, 2], [4, 2, 4], [2, 4, 4]])
  px = _pixels(grid, seed=1)
  packed = np.asarray(encode(cfg, variables, px, grid, stage="merged"))
  alone = []
  for g, s, e in zip(grid, *_offsets(grid)):
    alone.append(np.asarray(encode(cfg, variables, px[s:e], g[None], stage="merged")))
  np.testing.assert_allclose(packed, np.concatenate(alone), atol=2e-5)
  # The same samples in a larger bucket (more padding) give the same result.
  big = cfg.replace(pack_buckets=(256,))
  np.testing.assert_allclose(encode(big, variables, px, grid, stage="merged"), packed, atol=2e-5)


def test_pack_layout():
  cfg = vision_preset("tiny_moonvit_v2")
  pk = pack(cfg, GRID)
  assert (pk.length, pk.num_patches, pk.num_merged, pk.merged_length) == (64, 52, 9, 16)
  assert list(pk.patch_offsets) == [0, 24, 28, 52]
  assert list(pk.merged_offsets) == [0, 6, 7, 9]
  seg = pk.meta["segment_ids"]
  assert list(seg[:52]) == [0] * 24 + [1] * 4 + [2] * 24 and (seg[52:] == -1).all()
  # The clip: 3 frames of a 2×4 grid in (t, row, col) order; merged tokens weigh 1/t.
  np.testing.assert_array_equal(pk.meta["frames"][28:52], [0] * 8 + [1] * 8 + [2] * 8)
  np.testing.assert_array_equal(pk.meta["rows"][28:36], [0, 0, 0, 0, 1, 1, 1, 1])
  np.testing.assert_array_equal(pk.meta["cols"][28:36], [0, 1, 2, 3, 0, 1, 2, 3])
  np.testing.assert_array_equal(pk.meta["merge_index"][28:36] - 7 * 4,
                                [0, 1, 4, 5, 2, 3, 6, 7])
  np.testing.assert_allclose(pk.meta["merge_weight"][28:52], 1 / 3)
  assert (pk.meta["merge_index"][52:] == 16 * 4).all() and (pk.meta["merge_weight"][52:] == 0).all()
  with pytest.raises(ValueError, match="pack_buckets"):
    pack(cfg.replace(pack_buckets=(16,)), GRID)


# ----------------------------------------------------------------------------- configs
def test_presets_follow_the_spec():
  v2 = vision_preset("moonvit_v2")
  assert (v2.num_layers, v2.hidden_size, v2.num_heads, v2.head_dim, v2.qkv_hidden_size,
          v2.intermediate_size, v2.norm, v2.use_bias, v2.pos_emb_interpolation,
          v2.projector_norm, v2.text_hidden_size, v2.merged_dim, v2.patch_dim) == (
              27, 1024, 12, 128, 1536, 4096, "rmsnorm", False, "bilinear", "post", 7168, 4096,
              588)
  assert (v2.pos_emb_height, v2.pos_emb_width, v2.max_frames, v2.max_grid_side,
          v2.rope_layout, v2.norm_eps) == (64, 64, 4, 512, "rows_then_cols", 1e-5)
  k25 = vision_preset("moonvit_k25")
  assert (k25.hidden_size, k25.num_heads, k25.head_dim, k25.intermediate_size, k25.norm,
          k25.use_bias, k25.pos_emb_interpolation, k25.projector_norm) == (
              1152, 16, 72, 4304, "layernorm", True, "bicubic", "pre")
  assert vision_preset("tiny_moonvit_k25").norm == "layernorm"
  assert vision_preset("moonvit_v2", num_layers=2).num_layers == 2


def test_param_count_and_names_of_moonvit_v2():
  """§11: 168 tensors; the tower holds the "401M parameters" (the projector adds 46.1M:
  4096² + 4096·7168 + 7168). Abstract init: nothing allocated."""
  cfg = vision_preset("moonvit_v2")
  shapes = jax.eval_shape(lambda k: init_vision(cfg, k), jax.random.PRNGKey(0))["params"]
  assert len(jax.tree_util.tree_leaves(shapes)) == 168
  count = lambda t: sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(t))
  assert 400.5e6 < count(shapes["vision_tower"]) < 401.5e6, count(shapes["vision_tower"])
  assert count(shapes["mm_projector"]) == 4096 * 4096 + 4096 * 7168 + 7168


@pytest.mark.parametrize("field,value,match", [
    ("head_dim", 70, "VisionConfig.head_dim"),
    ("norm", "batchnorm", "VisionConfig.norm"),
    ("merge_kernel", (3, 3), "VisionConfig.merge_kernel"),
    ("pack_buckets", (128, 64), "VisionConfig.pack_buckets"),
    ("num_layers", 0, "VisionConfig.num_layers"),
    ("pos_emb_interpolation", "nearest", "VisionConfig.pos_emb_interpolation"),
])
def test_config_errors_name_the_field(field, value, match):
  with pytest.raises(ValueError, match=match):
    vision_preset("tiny_moonvit_v2", **{field: value})
  with pytest.raises(ValueError, match="unknown VisionConfig field"):
    vision_preset("tiny_moonvit_v2", hidden=3)
  with pytest.raises(ValueError, match="unknown vision preset"):
    vision_preset("moonvit_v3")


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("grid,n,match", [
    ([[1, 4, 6]], 20, r"Σ t·h·w = 24 patches, but pixel_values holds 20"),
    ([[1, 3, 4]], 12, r"grid_thw\[0\] = \(t=1, h=3, w=4\).*even"),
    ([[5, 2, 2]], 20, r"grid_thw\[0\] = \(t=5, h=2, w=2\).*max_frames = 4"),
    ([[1, 2, 2], [1, 2, 34]], 72, r"grid_thw\[1\] = \(t=1, h=2, w=34\).*max_grid_side = 32"),
    ([[0, 2, 2]], 0, r"grid_thw\[0\].*≥ 1"),
    ([1, 2, 2], 4, r"grid_thw: expected \[n, 3\]"),
    ([[1.0, 2, 2]], 4, r"grid_thw: expected integers"),
])
def test_bad_input_errors_name_the_input(grid, n, match):
  cfg = vision_preset("tiny_moonvit_v2")
  with pytest.raises(ValueError, match=match):
    encode(cfg, {}, np.zeros((n, 3, 14, 14), np.float32), np.asarray(grid))


def test_bad_pixel_values_and_stage():
  cfg = vision_preset("tiny_moonvit_v2")
  with pytest.raises(ValueError, match=r"pixel_values: expected \[L, 3, 14, 14\]"):
    encode(cfg, {}, np.zeros((4, 3, 16, 16), np.float32), np.array([[1, 2, 2]]))
  with pytest.raises(ValueError, match="stage"):
    encode(cfg, {}, np.zeros((4, 3, 14, 14), np.float32), np.array([[1, 2, 2]]), stage="x")


def test_one_compile_per_bucket():
  """Different mixes of sample sizes that fit one bucket reuse one compiled program."""
  from k3jax.vision import tower
  cfg, variables = _variables("tiny_moonvit_v2", seed=5)
  cfg = cfg.replace(pack_buckets=(96,))   # a config no other test uses: a fresh cache entry
  before = tower._run_jit._cache_size()
  for grid in ([[1, 4, 6]], [[2, 2, 4], [1, 6, 2]], [[4, 4, 4], [1, 2, 2]]):
    grid = np.array(grid)
    out = encode(cfg, variables, _pixels(grid), grid, stage="merged")
    assert out.shape[0] == sum((h // 2) * (w // 2) for _, h, w in grid)
  assert tower._run_jit._cache_size() == before + 1
