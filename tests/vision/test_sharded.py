"""The vision tower under a mesh (k3jax/parallel/vision.py) against the unsharded tower, on
simulated CPU devices (tests/conftest.py): one stream split over `context` along its patches,
and streams over `data`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import sharding
from k3jax.parallel import vision as pv
from k3jax.vision import VisionModel, encode, init_vision, pack, vision_preset
from k3jax.vision import ops
from k3jax.vision.packing import META_FIELDS

# 24 + 4 + 24 = 52 patches in the 64-patch bucket: on a context axis of 4 (16 patches a shard)
# sample 0 straddles the boundary at 16, the clip (patches 28–51) the ones at 32 and 48, and
# shard 3 ends in 12 padding patches.
GRID = np.array([[1, 4, 6], [1, 2, 2], [3, 2, 4]])
# One image filling the bucket: each shard holds two of its eight rows.
ONE_IMAGE = np.array([[1, 8, 8]])


def _devices(n):
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
  return jax.devices()[:n]


def _mesh(**axes):
  n = int(np.prod(list(axes.values())))
  return sharding.make_mesh(sharding.MeshConfig(**{"data": 1, **axes}), _devices(n))


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


def _close(got, want, what):
  err = np.max(np.abs(np.asarray(got) - np.asarray(want))) / np.max(np.abs(np.asarray(want)))
  assert err < 1e-5, (what, err)


# ----------------------------------------------------------------------------- the op
def test_context_parallel_attention_equals_the_op():
  """Each shard's queries against the gathered keys: the rows of the unsharded op, for two
  streams with samples straddling the shard boundaries, padding, a non-finite padding value,
  and heads over `tensor`."""
  b, length, h, d = 2, 32, 2, 8
  rng = np.random.RandomState(0)
  q, k, v = (jnp.asarray(rng.randn(b, length, h, d).astype(np.float32)) for _ in range(3))
  seg = np.full((b, length), -1, np.int32)
  seg[0, :11], seg[0, 11:27] = 0, 1             # sample 1 spans shards 1–3 of 4 (8 each)
  seg[1, :5], seg[1, 5:9], seg[1, 9:30] = 0, 1, 2
  v = v.at[0, 30].set(jnp.nan)                  # padding: must not reach any output
  seg = jnp.asarray(seg)
  want = ops.packed_attention(q, k, v, seg)
  mesh = _mesh(context=4, tensor=2)
  spec = P(None, "context", "tensor")
  for qb in (None, 4):
    fn = jax.shard_map(
        lambda *a, qb=qb: pv.packed_attention_context_parallel(
            *a, attn_fn=ops.packed_attention, query_block=qb),
        mesh=mesh, in_specs=(spec, spec, spec, P(None, "context")), out_specs=spec,
        check_vma=False)
    got = jax.jit(fn)(q, k, v, seg)
    np.testing.assert_allclose(got, want, atol=1e-6, err_msg=f"query_block={qb}")
  assert np.all(np.asarray(want)[0, 27:] == 0) and np.all(np.isfinite(np.asarray(want)))
  # Gradients w.r.t. q, k, v (the tower trains with the text model): the gather's transpose
  # returns every shard its keys' and values' share (the nan padding value stays out).
  ct = jnp.asarray(rng.randn(b, length, h, d).astype(np.float32))
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, seg) * ct)
  want_g = jax.grad(loss(ops.packed_attention), argnums=(0, 1, 2))(q, k, v)
  got_g = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v)
  for name, g, w in zip("qkv", got_g, want_g):
    np.testing.assert_allclose(g, w, atol=1e-5, err_msg=f"d{name}")


def test_single_device_path_is_the_op_itself():
  """No mesh, or a mesh without a context axis: the tower calls the op unchanged."""
  f = ops.packed_attention
  assert pv.maybe_context_parallel_packed_attention(f) is f
  with jax.set_mesh(_mesh(data=2)):
    assert pv.maybe_context_parallel_packed_attention(f) is f
  tree = {"x": jnp.zeros((1, 8))}
  assert pv.shard_stream(tree) is tree


# ----------------------------------------------------------------------------- the tower
@pytest.mark.parametrize("name", ["tiny_moonvit_v2", "tiny_moonvit_k25"])
def test_context_sharded_encode_equals_unsharded(name):
  """One packed stream split over context = 4 — three samples, or one image over all four
  shards — encoded patches and projected tokens equal the unsharded tower's (one compile per
  stage and layout, both grids share the 64-patch bucket; K2.5: projected tokens only)."""
  cfg, variables = _variables(name)
  stages = ("encoded", "projected") if name == "tiny_moonvit_v2" else ("projected",)
  for grid in (GRID, ONE_IMAGE):
    px = _pixels(grid)
    want = {s: encode(cfg, variables, px, grid, stage=s) for s in stages}
    with jax.set_mesh(_mesh(context=4)):
      for s in stages:
        _close(encode(cfg, variables, px, grid, stage=s), want[s], (s, grid.tolist()))


def test_context_sharded_tower_gathers_keys_and_blocks_queries():
  """The lowered program of the sharded tower holds the all-gather (the context-parallel path
  ran), and a query_block inside each shard (8 of its 16 queries) gives the same result."""
  cfg, variables = _variables("tiny_moonvit_v2", seed=2)
  px = _pixels(GRID, seed=2)
  want = encode(cfg, variables, px, GRID, stage="merged")
  with jax.set_mesh(_mesh(context=4)):
    _close(encode(cfg, variables, px, GRID, stage="merged", query_block=8), want, "merged")
    pk = pack(cfg, GRID)
    meta = {k: jnp.asarray(pk.meta[k])[None] for k in META_FIELDS}
    patches = jnp.zeros((1, pk.length, cfg.patch_dim))
    text = jax.jit(lambda p, m: VisionModel(cfg).apply(variables, p, m, "encoded")).lower(
        patches, meta).as_text()
  assert "all_gather" in text


def test_batch_over_data_and_stream_over_context():
  """Two streams [2, 64] on a data = 2 × context = 2 mesh: each row equals that stream encoded
  alone without a mesh; so does `encode` (one stream) on the same mesh."""
  cfg, variables = _variables("tiny_moonvit_v2", seed=4)
  grids = [GRID, np.array([[1, 6, 4], [2, 4, 4], [1, 2, 2]])]   # 24 + 32 + 4 = 60 patches
  pxs = [_pixels(g, seed=i) for i, g in enumerate(grids)]
  packs = [pack(cfg, g, length=64) for g in grids]
  patches = np.zeros((2, 64, cfg.patch_dim), np.float32)
  for i, (x, pk) in enumerate(zip(pxs, packs)):
    patches[i, :pk.num_patches] = x.reshape(pk.num_patches, -1)
  meta = {k: np.stack([pk.meta[k] for pk in packs]) for k in META_FIELDS}
  mesh = _mesh(data=2, context=2)
  spec = pv.stream_spec(mesh, patches.shape)
  assert spec == P(("data",), "context")
  put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
  with jax.set_mesh(mesh):
    got = jax.jit(lambda p, m: VisionModel(cfg).apply(variables, p, m))(
        put(patches), jax.tree.map(put, meta))
  want = [encode(cfg, variables, x, g) for x, g in zip(pxs, grids)]
  for i, pk in enumerate(packs):
    _close(got[i, :pk.num_merged], want[i], f"stream {i}")
  # encode's single stream: B = 1 is not divisible by data = 2, so it is replicated over data.
  assert pv.stream_spec(mesh, (1, 64)) == P(None, "context")
  with jax.set_mesh(mesh):
    _close(encode(cfg, variables, pxs[0], grids[0]), want[0], "encode on data × context")


# ----------------------------------------------------------------------------- errors
def test_stream_length_not_divisible_by_context_is_an_error():
  cfg, variables = _variables("tiny_moonvit_v2")
  px = _pixels(GRID)
  with jax.set_mesh(_mesh(context=3)):
    with pytest.raises(ValueError, match=r"length L = 64 .* context axis size 3"):
      encode(cfg, variables, px, GRID, stage="encoded")
  with jax.set_mesh(_mesh(context=4)):
    with pytest.raises(ValueError, match=r"query_block: 6 must divide .* = 16"):
      encode(cfg, variables, px, GRID, stage="encoded", query_block=6)
