"""MoonViT math as pure jnp functions (docs/k3.md §11): no parameters, no Flax.

Conventions. A *packed stream* holds the patches of several samples (images, or videos of up to
`max_frames` frames) one after another, each sample's patches in (t, row, col) order, padded to
a fixed length L from a small set of buckets so that `jit` compiles once per bucket. Per-patch
metadata (built on the host by `k3jax.vision.packing.pack`) travels as int arrays of the
stream's shape [..., L]: `segment_ids` (sample index, −1 for padding), `frames` (τ), `rows`,
`cols`, and the sample's own `heights`, `widths`, `num_frames`. Everything here takes those
arrays as traced values, so one compiled program serves every mix of image sizes in a bucket.

Numerics: interpolation weights, RoPE angles, attention logits/softmax/output and norm
statistics are fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_NEG = -1e30          # finite "minus infinity" for masked logits: never produces nan
_CUBIC_A = -0.75      # PyTorch's bicubic kernel coefficient (K2.5 resamples with F.interpolate)


# ----------------------------------------------------------------------------- patch embedding
def patch_embed(patches, kernel, bias=None):
  """Conv(kernel = stride = patch) as a matmul. patches [..., L, C, P, P] or [..., L, C·P·P],
  kernel [C·P·P, D] (the conv weight [D, C, P, P] reshaped and transposed), bias [D] or None
  → [..., L, D] (fp32 accumulation, cast to the patches' dtype)."""
  k = kernel.shape[0]
  if patches.shape[-1] != k:
    patches = patches.reshape(*patches.shape[:-3], k)
  y = jnp.einsum("...k,kd->...d", patches, kernel.astype(patches.dtype),
                 preferred_element_type=jnp.float32)
  if bias is not None:
    y = y + bias
  return y.astype(patches.dtype)


# ----------------------------------------------------------------------------- position tables
def _cubic_weights(t):
  """The four cubic-convolution weights (A = −0.75) for taps at offsets −1, 0, 1, 2."""
  a = _CUBIC_A
  near = lambda x: ((a + 2) * x - (a + 3)) * x * x + 1           # |x| ≤ 1
  far = lambda x: ((a * x - 5 * a) * x + 8 * a) * x - 4 * a      # 1 < |x| < 2
  return jnp.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], axis=-1)


def interpolation_taps(dst, out_size, in_size: int, mode: str):
  """Source taps of a 1-D resize from `in_size` to `out_size` samples, PyTorch semantics
  (`F.interpolate(..., align_corners=False)`: half-pixel centres; bilinear clamps the source
  coordinate at 0, bicubic clamps the tap indices to the border).

  dst [...] int (output index), out_size [...] int (traced is fine), in_size static
  → (index [..., taps] int32, weight [..., taps] fp32), taps = 2 (bilinear) or 4 (bicubic).
  At out_size == in_size the weights are one-hot on dst (the table is used as is).
  """
  scale = jnp.float32(in_size) / out_size.astype(jnp.float32)
  src = (dst.astype(jnp.float32) + 0.5) * scale - 0.5
  if mode == "bilinear":
    src = jnp.maximum(src, 0.0)
    i0 = jnp.floor(src).astype(jnp.int32)
    i1 = i0 + (i0 < in_size - 1).astype(jnp.int32)
    lam = src - i0.astype(jnp.float32)
    return jnp.stack([i0, i1], -1), jnp.stack([1.0 - lam, lam], -1)
  if mode == "bicubic":
    i = jnp.floor(src)
    t = src - i
    idx = i.astype(jnp.int32)[..., None] + jnp.arange(-1, 3, dtype=jnp.int32)
    return jnp.clip(idx, 0, in_size - 1), _cubic_weights(t)
  raise ValueError(f"interpolation mode: expected 'bilinear' or 'bicubic', found {mode!r}")


def resize_matrix(out_size: int, in_size: int, mode: str) -> np.ndarray:
  """The 1-D resize as an explicit [out_size, in_size] fp32 matrix (static sizes): the slow,
  per-sample form of `interpolation_taps`."""
  idx, w = interpolation_taps(jnp.arange(out_size), jnp.full((out_size,), out_size), in_size, mode)
  m = np.zeros((out_size, in_size), np.float32)
  for o, (ii, ww) in enumerate(zip(np.asarray(idx), np.asarray(w))):
    for i, x in zip(ii, ww):
      m[o, i] += x
  return m


def resize_table(table, height: int, width: int, mode: str):
  """The learned spatial table [H, W, D] resized to one sample's grid → [height, width, D]
  (separable: rows then columns, fp32)."""
  ry = jnp.asarray(resize_matrix(height, table.shape[0], mode))
  rx = jnp.asarray(resize_matrix(width, table.shape[1], mode))
  return jnp.einsum("yi,xj,ijd->yxd", ry, rx, table.astype(jnp.float32))


def spatial_pos_emb(table, rows, cols, heights, widths, mode: str):
  """Per-patch spatial position embedding: `table` [H, W, D] resized to each patch's sample grid
  (heights, widths) and read at (rows, cols); all metadata [...] int → [..., D] fp32.

  A weighted gather of taps² table rows (4 bilinear, 16 bicubic), accumulated tap by tap so
  the largest temporary is [..., D]; equal to `resize_table(...)[rows, cols]`.
  """
  th, tw, d = table.shape
  flat = table.reshape(th * tw, d).astype(jnp.float32)
  iy, wy = interpolation_taps(rows, heights, th, mode)
  ix, wx = interpolation_taps(cols, widths, tw, mode)
  out = jnp.zeros(rows.shape + (d,), jnp.float32)
  for a in range(iy.shape[-1]):
    for b in range(ix.shape[-1]):
      w = (wy[..., a] * wx[..., b])[..., None]
      out = out + w * jnp.take(flat, iy[..., a] * tw + ix[..., b], axis=0)
  return out


def time_table(num_frames: int, dim: int):
  """Fixed sin-cos time table [num_frames, dim] fp32: row τ = [sin(τ·ω), cos(τ·ω)],
  ω_i = 10000^(−i/(dim/2)), i = 0 … dim/2 − 1 (§11)."""
  omega = 1.0 / (10000.0 ** (jnp.arange(dim // 2, dtype=jnp.float32) / (dim // 2)))
  ang = jnp.arange(num_frames, dtype=jnp.float32)[:, None] * omega
  return jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], axis=-1)


def divided_fixed_pos_emb(table, rows, cols, frames, heights, widths, num_frames, *,
                          mode: str, max_frames: int):
  """Absolute position ("divided_fixed", §11): the spatial table resized to the sample's grid,
  plus the time table's row τ only for samples with t > 1 (a single image gets no time term).
  table [H, W, D]; metadata [...] int → [..., D] fp32."""
  pos = spatial_pos_emb(table, rows, cols, heights, widths, mode)
  tt = time_table(max_frames, table.shape[-1])
  t_term = jnp.take(tt, jnp.clip(frames, 0, max_frames - 1), axis=0)
  return pos + jnp.where((num_frames > 1)[..., None], t_term, 0.0)


# ----------------------------------------------------------------------------- 2-D RoPE
def rope_angles(rows, cols, head_dim: int, *, theta: float, layout: str):
  """Rotation angles of the head_dim/2 complex pairs, per patch. rows, cols [...] int
  → [..., head_dim/2] fp32. Frequencies θ^(−j/F), j < F = head_dim/4, shared by both axes.

  layout "rows_then_cols" (K3 §11): pairs [0, F) rotate by the row, [F, 2F) by the column.
  layout "interleaved_cols_rows" (Kimi-VL / K2.5): pair 2j by the column, 2j+1 by the row.
  """
  f = head_dim // 4
  freq = theta ** (-jnp.arange(f, dtype=jnp.float32) / f)
  r = rows.astype(jnp.float32)[..., None] * freq
  c = cols.astype(jnp.float32)[..., None] * freq
  if layout == "rows_then_cols":
    return jnp.concatenate([r, c], axis=-1)
  if layout == "interleaved_cols_rows":
    return jnp.stack([c, r], axis=-1).reshape(*r.shape[:-1], 2 * f)
  raise ValueError(f"rope layout: expected 'rows_then_cols' or 'interleaved_cols_rows', found "
                   f"{layout!r}")


def apply_rope(x, angles):
  """Rotate adjacent pairs (x[2i], x[2i+1]) as complex numbers by e^{i·angles[i]}.
  x [..., L, H, D], angles [..., L, D/2] (broadcast over heads) → fp32 [..., L, H, D]."""
  x = x.astype(jnp.float32)
  x0, x1 = x[..., 0::2], x[..., 1::2]
  cos = jnp.cos(angles)[..., None, :]
  sin = jnp.sin(angles)[..., None, :]
  return jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(x.shape)


# ----------------------------------------------------------------------------- attention
def packed_attention(q, k, v, segment_ids, *, scale: float | None = None,
                     query_block: int | None = None, kv_segment_ids=None):
  """Bidirectional softmax attention, block-diagonal over the samples of a packed stream.

  q [B, L, H, Dk], k [B, S, H, Dk], v [B, S, H, V], segment_ids [B, L] int (−1 = padding)
  → fp32 [B, L, H, V]. kv_segment_ids [B, S]: the keys' ids when the keys are not the queries'
  own patches (a context shard's queries against the whole stream's keys,
  `k3jax.parallel.vision`); None: S = L and the keys carry `segment_ids`.
  Query i attends key j iff segment_ids[i] == kv_segment_ids[j] ≥ 0: no sample sees another,
  padding keys are never attended and padding queries output zeros. scale defaults to Dk^−½.
  query_block: None (logits [B, H, L, S] at once) or a divisor of L: queries in blocks of that
  many (`lax.map`), so the largest temporary is [B, H, query_block, S]. Same maths.
  """
  b, l, h, dk = q.shape
  kv_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
  s = kv_ids.shape[-1] if kv_ids.ndim == 2 else -1
  if (segment_ids.shape != (b, l) or kv_ids.shape != (b, s) or k.shape != (b, s, h, dk)
      or v.shape[:3] != (b, s, h)):
    raise ValueError(f"packed_attention: q {q.shape}, k {k.shape}, v {v.shape}, segment_ids "
                     f"{segment_ids.shape}, kv_segment_ids {kv_ids.shape} must be q [B, L, H, "
                     f"Dk], k/v [B, S, H, ·], ids [B, L] / [B, S] with [B, L, H] = [{b}, {l}, "
                     f"{h}]")
  scale = dk ** -0.5 if scale is None else scale
  # Zero the padding values too: 0·nan would leak a non-finite padding patch into every row.
  vf = jnp.where((kv_ids >= 0)[..., None, None], v.astype(jnp.float32), 0.0)

  def block(qb, sq):  # qb [B, T, H, Dk], sq [B, T]
    logits = jnp.einsum("bthd,bshd->bhts", qb, k, preferred_element_type=jnp.float32) * scale
    mask = ((sq[:, :, None] == kv_ids[:, None, :]) & (kv_ids[:, None, :] >= 0))[:, None]
    logits = jnp.where(mask, logits, _NEG)
    p = jnp.where(mask, jnp.exp(logits - jnp.max(logits, -1, keepdims=True)), 0.0)
    denom = jnp.sum(p, -1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)  # a padding query (no allowed key) outputs zeros
    return jnp.einsum("bhts,bshv->bthv", p, vf)

  if query_block is None or query_block >= l:
    return block(q, segment_ids)
  if l % query_block:
    raise ValueError(f"packed_attention: query_block {query_block} must divide L = {l}")
  n = l // query_block
  qs = jnp.moveaxis(q.reshape(b, n, query_block, h, dk), 1, 0)
  ss = jnp.moveaxis(segment_ids.reshape(b, n, query_block), 1, 0)
  out = lax.map(lambda a: jax.checkpoint(block)(*a), (qs, ss))
  return jnp.moveaxis(out, 0, 1).reshape(b, l, h, v.shape[-1])


# ----------------------------------------------------------------------------- norms
def layer_norm(x, weight, bias, eps: float):
  """LayerNorm over the last axis with fp32 statistics → fp32 (bias may be None)."""
  x = x.astype(jnp.float32)
  mu = jnp.mean(x, -1, keepdims=True)
  var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
  y = (x - mu) * lax.rsqrt(var + eps) * weight
  return y if bias is None else y + bias


# ----------------------------------------------------------------------------- merger
def sd2_tpool(x):
  """The `sd2_tpool` merger of one sample (the reference form): x [t, h, w, D] → mean over the
  t frames, then 2×2 space-to-depth → [(h/2)·(w/2), 4, D] fp32, tokens in (row, col) order of
  the merged grid, the 4 slots (row-in-window, col-in-window) major."""
  t, h, w, d = x.shape
  m = jnp.mean(x.astype(jnp.float32), axis=0)
  m = m.reshape(h // 2, 2, w // 2, 2, d).transpose(0, 2, 1, 3, 4)
  return m.reshape((h // 2) * (w // 2), 4, d)


def sd2_tpool_packed(x, merge_index, merge_weight, num_tokens: int):
  """`sd2_tpool` over a packed stream as one scatter-add. x [L, D]; merge_index [L] int =
  token·4 + slot (num_tokens·4 for padding: a dump row); merge_weight [L] = 1/t (0 for padding)
  → [num_tokens, 4, D] fp32 (tokens of all samples in stream order)."""
  d = x.shape[-1]
  y = jax.ops.segment_sum(x.astype(jnp.float32) * merge_weight[:, None], merge_index,
                          num_segments=num_tokens * 4 + 1)
  return y[:-1].reshape(num_tokens, 4, d)


def gelu(x, *, approximate: bool):
  """GELU in fp32: tanh approximation (the blocks' MLP) or exact erf (the projector)."""
  return jax.nn.gelu(x.astype(jnp.float32), approximate=approximate)


__all__ = [
    "patch_embed", "interpolation_taps", "resize_matrix", "resize_table", "spatial_pos_emb",
    "time_table", "divided_fixed_pos_emb", "rope_angles", "apply_rope", "packed_attention",
    "layer_norm", "sd2_tpool", "sd2_tpool_packed", "gelu",
]
