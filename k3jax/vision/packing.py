"""Packing samples into one fixed-shape stream (NaViT style), on the host, in numpy.

`pack(config, grid_thw, num_patches)` checks the grid (errors name the sample and its values),
picks the smallest bucket length L ≥ Σ t·h·w from `config.pack_buckets`, and returns the
per-patch metadata the tower's ops read as traced arrays (see `k3jax.vision.ops`), so that one
compiled program serves every mix of sample sizes that fits a bucket.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Per-patch metadata arrays, all [L], in the order the tower takes them.
META_FIELDS = ("segment_ids", "frames", "rows", "cols", "heights", "widths", "num_frames",
               "merge_index", "merge_weight")


@dataclasses.dataclass(frozen=True)
class Packing:
  """Layout of one packed stream.

  length: padded stream length L (a bucket); num_patches: Σ t·h·w real patches (a prefix);
  merged_length: L // 4, the padded merged-token count (≥ num_merged since t ≥ 1);
  num_merged: Σ (h/2)(w/2); patch_offsets / merged_offsets [n+1]: where each sample starts.
  meta: the arrays of META_FIELDS, each [L] (int32; merge_weight fp32). Padding patches have
  segment id −1, a 1×1 grid at (0, 0), merge_index = merged_length·4 (the dump row), weight 0.
  """
  grid_thw: np.ndarray
  length: int
  num_patches: int
  merged_length: int
  num_merged: int
  patch_offsets: np.ndarray
  merged_offsets: np.ndarray
  meta: dict


def check_grid(config, grid_thw, num_patches: int | None = None) -> np.ndarray:
  """Validate grid_thw [n, 3] (t, h, w per sample) against the config; returns it as int64.
  Raises ValueError naming the input and the offending values."""
  g = np.asarray(grid_thw)
  if g.ndim != 2 or g.shape[1] != 3 or g.shape[0] == 0:
    raise ValueError(f"grid_thw: expected [n, 3] (t, h, w) with n ≥ 1, found shape {g.shape}")
  if not np.issubdtype(g.dtype, np.integer):
    raise ValueError(f"grid_thw: expected integers, found dtype {g.dtype}")
  g = g.astype(np.int64)
  for i, (t, h, w) in enumerate(g.tolist()):
    where = f"grid_thw[{i}] = (t={t}, h={h}, w={w})"
    if min(t, h, w) < 1:
      raise ValueError(f"{where}: every entry must be ≥ 1")
    if h % 2 or w % 2:
      raise ValueError(f"{where}: h and w must be even (the sd2_tpool merger takes 2×2 windows)")
    if t > config.max_frames:
      raise ValueError(f"{where}: t exceeds max_frames = {config.max_frames} (the time table "
                       f"has {config.max_frames} rows)")
    if max(h, w) > config.max_grid_side:
      raise ValueError(f"{where}: a side exceeds max_grid_side = {config.max_grid_side} "
                       f"(the RoPE / position-table bound)")
    if h * w > config.max_patches_per_frame:
      raise ValueError(f"{where}: h·w = {h * w} exceeds max_patches_per_frame = "
                       f"{config.max_patches_per_frame}")
  total = int(np.sum(np.prod(g, axis=1)))
  if num_patches is not None and total != num_patches:
    raise ValueError(f"grid_thw: Σ t·h·w = {total} patches, but pixel_values holds "
                     f"{num_patches}")
  return g


def bucket_length(config, num_patches: int) -> int:
  """The smallest of config.pack_buckets holding num_patches."""
  for b in config.pack_buckets:
    if b >= num_patches:
      return b
  raise ValueError(f"{num_patches} patches exceed the largest bucket of "
                   f"VisionConfig.pack_buckets = {config.pack_buckets}; split the batch")


def pack(config, grid_thw, num_patches: int | None = None, *, length: int | None = None
         ) -> Packing:
  """Layout of the samples of `grid_thw` [n, 3] packed in order into one stream of `length`
  patches (default: the smallest bucket that holds them)."""
  g = check_grid(config, grid_thw, num_patches)
  total = int(np.sum(np.prod(g, axis=1)))
  if length is None:
    length = bucket_length(config, total)
  elif length < total or length % 4:
    raise ValueError(f"length: expected a multiple of 4 ≥ {total} patches, found {length}")
  merged_length = length // 4
  meta = {f: np.zeros(length, np.int32) for f in META_FIELDS if f != "merge_weight"}
  meta["merge_weight"] = np.zeros(length, np.float32)
  meta["segment_ids"][:] = -1
  meta["heights"][:] = 1
  meta["widths"][:] = 1
  meta["num_frames"][:] = 1
  meta["merge_index"][:] = merged_length * 4
  patch_offsets, merged_offsets = [0], [0]
  for i, (t, h, w) in enumerate(g.tolist()):
    s, m = patch_offsets[-1], merged_offsets[-1]
    f, r, c = (x.reshape(-1) for x in np.meshgrid(np.arange(t), np.arange(h), np.arange(w),
                                                    indexing="ij"))
    sl = slice(s, s + t * h * w)
    meta["segment_ids"][sl] = i
    meta["frames"][sl], meta["rows"][sl], meta["cols"][sl] = f, r, c
    meta["heights"][sl], meta["widths"][sl], meta["num_frames"][sl] = h, w, t
    meta["merge_index"][sl] = (m + (r // 2) * (w // 2) + c // 2) * 4 + (r % 2) * 2 + c % 2
    meta["merge_weight"][sl] = 1.0 / t
    patch_offsets.append(s + t * h * w)
    merged_offsets.append(m + (h // 2) * (w // 2))
  return Packing(grid_thw=g, length=length, num_patches=total, merged_length=merged_length,
                 num_merged=merged_offsets[-1], patch_offsets=np.asarray(patch_offsets),
                 merged_offsets=np.asarray(merged_offsets), meta=meta)


__all__ = ["Packing", "META_FIELDS", "check_grid", "bucket_length", "pack"]
