"""k3jax.vision.ops against slow, obviously correct references (docs/k3.md §11)."""

import itertools


import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.vision import ops

RNG = np.random.RandomState(0)


# ----------------------------------------------------------------------------- position tables
@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("size", [(64, 64), (8, 6)])
def test_interpolation_is_identity_at_table_size(mode, size):
  table = jnp.asarray(RNG.randn(*size, 5).astype(np.float32))
  np.testing.assert_array_equal(ops.resize_table(table, *size, mode), table)
  h, w = size
  r, c = (x.reshape(-1) for x in np.meshgrid(np.arange(h), np.arange(w), indexing="ij"))
  got = ops.spatial_pos_emb(table, jnp.asarray(r), jnp.asarray(c), jnp.full(r.shape, h),
                            jnp.full(r.shape, w), mode)
  np.testing.assert_allclose(got, np.asarray(table).reshape(h * w, 5), rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_resize_matches_torch_interpolate(mode):
  import torch
  table = RNG.randn(8, 8, 3).astype(np.float32)
  for h, w in [(4, 6), (12, 10), (2, 16), (8, 8)]:
    want = torch.nn.functional.interpolate(
        torch.from_numpy(table).permute(2, 0, 1)[None], size=(h, w), mode=mode,
        align_corners=False)[0].permute(1, 2, 0).numpy()
    np.testing.assert_allclose(ops.resize_table(jnp.asarray(table), h, w, mode), want,
                               atol=1e-5, err_msg=f"{mode} {(h, w)}")


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_per_patch_gather_equals_per_sample_resize(mode):
  table = jnp.asarray(RNG.randn(8, 8, 4).astype(np.float32))
  rows, cols, hs, ws, want = [], [], [], [], []
  for h, w in [(4, 6), (12, 10), (2, 2)]:
    full = np.asarray(ops.resize_table(table, h, w, mode))
    for r, c in itertools.product(range(h), range(w)):
      rows.append(r), cols.append(c), hs.append(h), ws.append(w), want.append(full[r, c])
  got = ops.spatial_pos_emb(table, *(jnp.asarray(a) for a in (rows, cols, hs, ws)), mode)
  np.testing.assert_allclose(got, np.stack(want), atol=1e-5)


def test_time_table_and_divided_fixed():
  d = 8
  tt = np.asarray(ops.time_table(4, d))
  for tau in range(4):
    for i in range(d // 2):
      omega = 10000.0 ** (-i / (d // 2))
      assert tt[tau, i] == pytest.approx(np.sin(tau * omega), abs=1e-6)
      assert tt[tau, d // 2 + i] == pytest.approx(np.cos(tau * omega), abs=1e-6)
  table = jnp.asarray(RNG.randn(4, 4, d).astype(np.float32))
  z = jnp.zeros((3,), jnp.int32)
  frames = jnp.asarray([0, 1, 2])
  image = ops.divided_fixed_pos_emb(table, z, z, z, z + 4, z + 4, z + 1, mode="bilinear",
                                    max_frames=4)
  clip = ops.divided_fixed_pos_emb(table, z, z, frames, z + 4, z + 4, z + 3, mode="bilinear",
                                   max_frames=4)
  np.testing.assert_allclose(image, np.broadcast_to(np.asarray(table)[0, 0], (3, d)))
  np.testing.assert_allclose(clip - image, tt[:3], atol=1e-6)  # frame 0 gets row 0 (cos = 1)


# ----------------------------------------------------------------------------- 2-D RoPE
@pytest.mark.parametrize("layout", ["rows_then_cols", "interleaved_cols_rows"])
def test_rope_is_a_complex_rotation(layout):
  dh, heads, theta = 16, 2, 10000.0
  rows = np.array([0, 3, 7, 1])
  cols = np.array([0, 5, 2, 9])
  x = RNG.randn(len(rows), heads, dh).astype(np.float32)
  got = np.asarray(ops.apply_rope(jnp.asarray(x), ops.rope_angles(
      jnp.asarray(rows), jnp.asarray(cols), dh, theta=theta, layout=layout)))
  f = dh // 4
  want = np.zeros_like(x)
  for n, h, p in itertools.product(range(len(rows)), range(heads), range(dh // 2)):
    if layout == "rows_then_cols":   # K3 §11: pairs 0..F-1 by the row, F..2F-1 by the column
      j, pos = (p, rows[n]) if p < f else (p - f, cols[n])
    else:                            # K2.5: pair 2j by the column, 2j+1 by the row
      j, pos = p // 2, (cols[n] if p % 2 == 0 else rows[n])
    z = complex(x[n, h, 2 * p], x[n, h, 2 * p + 1]) * np.exp(1j * pos * theta ** (-j / f))
    want[n, h, 2 * p], want[n, h, 2 * p + 1] = z.real, z.imag
  np.testing.assert_allclose(got, want, atol=1e-5)


# ----------------------------------------------------------------------------- attention
def _dense_attention(q, k, v):
  logits = np.einsum("thd,shd->hts", q, k) / np.sqrt(q.shape[-1])
  p = np.exp(logits - logits.max(-1, keepdims=True))
  return np.einsum("hts,shv->thv", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("query_block", [None, 4])
def test_packed_attention_is_block_diagonal(query_block):
  lens, pad, h, d = [5, 3, 6], 2, 2, 8
  l = sum(lens) + pad
  q, k, v = (RNG.randn(1, l, h, d).astype(np.float32) for _ in range(3))
  seg = np.concatenate([np.full(n, i) for i, n in enumerate(lens)] + [np.full(pad, -1)])
  got = np.asarray(ops.packed_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                        jnp.asarray(seg)[None], query_block=query_block))[0]
  s = 0
  for n in lens:
    sl = slice(s, s + n)
    np.testing.assert_allclose(got[sl], _dense_attention(q[0, sl], k[0, sl], v[0, sl]),
                               atol=1e-5)
    s += n
  np.testing.assert_array_equal(got[s:], 0.0)   # padding queries attend nothing
  # Padding keys/values are never read: garbage there changes nothing.
  k2, v2 = k.copy(), v.copy()
  k2[0, s:], v2[0, s:] = 1e4, np.nan
  got2 = np.asarray(ops.packed_attention(jnp.asarray(q), jnp.asarray(k2), jnp.asarray(v2),
                                         jnp.asarray(seg)[None], query_block=query_block))[0]
  np.testing.assert_array_equal(got2[:s], got[:s])


# ----------------------------------------------------------------------------- merger
def test_sd2_tpool_is_the_explicit_loop():
  t, h, w, d = 3, 4, 6, 5
  x = RNG.randn(t, h, w, d).astype(np.float32)
  want = np.zeros(((h // 2) * (w // 2), 4, d), np.float32)
  for i in range(h // 2):
    for j in range(w // 2):
      for a in range(2):
        for b in range(2):
          want[i * (w // 2) + j, a * 2 + b] = sum(x[f, 2 * i + a, 2 * j + b] for f in range(t)) / t
  np.testing.assert_allclose(ops.sd2_tpool(jnp.asarray(x)), want, atol=1e-6)


def test_sd2_tpool_packed_equals_per_sample():
  from k3jax.vision import vision_preset
  from k3jax.vision.packing import pack
  cfg = vision_preset("tiny_moonvit_v2")
  grid = [[1, 4, 6], [3, 2, 4], [2, 2, 2]]
  pk = pack(cfg, grid)
  x = RNG.randn(pk.length, 3).astype(np.float32)
  got = np.asarray(ops.sd2_tpool_packed(jnp.asarray(x), jnp.asarray(pk.meta["merge_index"]),
                                        jnp.asarray(pk.meta["merge_weight"]), pk.merged_length))
  want = [ops.sd2_tpool(jnp.asarray(x[pk.patch_offsets[i]:pk.patch_offsets[i + 1]]
                                    .reshape(t, h, w, 3))) for i, (t, h, w) in enumerate(grid)]
  np.testing.assert_allclose(got[:pk.num_merged], np.concatenate(want), atol=1e-6)
  np.testing.assert_array_equal(got[pk.num_merged:], 0.0)


def test_patch_embed_is_the_conv():
  import torch
  w = RNG.randn(6, 3, 14, 14).astype(np.float32)
  b = RNG.randn(6).astype(np.float32)
  px = RNG.randn(5, 3, 14, 14).astype(np.float32)
  want = torch.nn.functional.conv2d(torch.from_numpy(px), torch.from_numpy(w),
                                    torch.from_numpy(b), stride=14).reshape(5, 6).numpy()
  got = ops.patch_embed(jnp.asarray(px), jnp.asarray(w.reshape(6, -1).T), jnp.asarray(b))
  np.testing.assert_allclose(got, want, atol=1e-4)



def test_k25_rope_layout_matches_transformers():
  """`interleaved_cols_rows` is Kimi K2.5's layout: `transformers`' rotate-half RoPE on q/k
  permuted as its converter does (PermuteForRope: per head [D/2, 2] → [2, D/2]) equals ours
  on the released (unpermuted) layout."""
  import torch
  from transformers.models.kimi_k25 import modeling_kimi_k25 as m
  from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig
  cfg = Kimi_K25VisionConfig(hidden_size=64, num_attention_heads=2, intermediate_size=32,
                             num_hidden_layers=1)
  h, w, heads, dh = 4, 6, 2, 32
  pos = m.get_vision_position_ids(torch.tensor([[1, h, w]]), spatial_merge_size=1)
  cos, sin = m.Kimi_K25VisionRotaryEmbedding(cfg)(torch.zeros(1), pos)
  x = torch.from_numpy(RNG.randn(1, h * w, heads, dh).astype(np.float32))
  permuted = x.view(1, h * w, heads, dh // 2, 2).transpose(-1, -2).reshape(x.shape)
  y, _ = m.apply_rotary_pos_emb_vision(permuted, permuted, cos, sin)
  want = y.view(1, h * w, heads, 2, dh // 2).transpose(-1, -2).reshape(x.shape)[0].numpy()
  rows, cols = np.repeat(np.arange(h), w), np.tile(np.arange(w), h)
  got = ops.apply_rope(jnp.asarray(x[0].numpy()), ops.rope_angles(
      jnp.asarray(rows), jnp.asarray(cols), dh, theta=cfg.rope_parameters["rope_theta"],
      layout="interleaved_cols_rows"))
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_k25_position_embedding_matches_transformers():
  """Bicubic spatial table + sin-cos time table (t > 1 only) = `transformers`' K2.5
  Kimi_K25VisionPositionEmbeddings, for an image and a 3-frame clip packed together."""
  import torch
  from transformers.models.kimi_k25 import modeling_kimi_k25 as m
  from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig
  from k3jax.vision import pack, vision_preset
  d = 64
  hf = m.Kimi_K25VisionPositionEmbeddings(Kimi_K25VisionConfig(
      hidden_size=d, num_attention_heads=2, intermediate_size=32, num_hidden_layers=1,
      pos_emb_height=8, pos_emb_width=8))
  table = RNG.randn(8, 8, d).astype(np.float32)
  grid = np.array([[1, 4, 6], [3, 10, 12]])
  with torch.no_grad():
    hf.position_embeddings.copy_(torch.from_numpy(table))
    want = hf(torch.zeros(int(np.prod(grid, 1).sum()), d), torch.from_numpy(grid)).numpy()
  meta = pack(vision_preset("tiny_moonvit_k25", pack_buckets=(512,)), grid).meta
  got = ops.divided_fixed_pos_emb(
      jnp.asarray(table), *(jnp.asarray(meta[k]) for k in (
          "rows", "cols", "frames", "heights", "widths", "num_frames")),
      mode="bicubic", max_frames=4)
  np.testing.assert_allclose(np.asarray(got)[:len(want)], want, atol=1e-5)
