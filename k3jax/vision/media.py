"""Media inside the token stream (docs/k3.md §11): packed vision inputs for `K3Model` and the op that
puts the projector's outputs at the placeholder positions.

A text row holds, for each image or video, (h/2)(w/2) copies of `media_placeholder_token_id`.
`K3Model.apply(variables, tokens, media=Media(...))` runs the vision tower, the merger and the
projector over `media` and replaces the embeddings at the placeholders, in order: row-major over
the batch [B, T], against the merged tokens of stream 0, then stream 1, … (each stream's
samples in packing order).
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.vision.packing import META_FIELDS, pack


@flax.struct.dataclass
class Media:
  """Packed vision inputs: S streams of one bucket length L.

  patches [S, L, C·P·P] float (pixel patches, (channel, row, col) flattened; padding rows 0);
  meta {field: [S, L]} (`packing.META_FIELDS`); num_merged [S] int32: merged tokens of each
  stream (a prefix of its L/4 merged rows).
  """
  patches: jax.Array
  meta: dict
  num_merged: jax.Array

  @property
  def num_streams(self) -> int:
    return self.patches.shape[0]


@flax.struct.dataclass
class MediaEmbeddings:
  """Media already through the tower and projector: features [S, M, d] fp32 (stream s's first
  num_merged[s] rows are real) and num_merged [S] int32 — what `K3Model.encode_media` returns,
  or a slice of it. `K3Model.extend(..., media=MediaEmbeddings(...))` places them at the
  placeholders without running the tower again: a serving engine encodes a request's images
  once and feeds each prefill piece the rows of the placeholders it holds."""
  features: jax.Array
  num_merged: jax.Array

  @property
  def num_streams(self) -> int:
    return self.features.shape[0]


def media_from_pixels(vision_config, pixel_values, grid_thw, *, length: int | None = None
                      ) -> Media:
  """One stream holding the samples of `grid_thw` [n, 3] (host values), whose patches
  `pixel_values` [Σ t·h·w, C, P, P] are concatenated in (t, row, col) order as
  `k3jax.vision.preprocess` returns them; padded to `length` patches (default: the smallest
  bucket of `vision_config.pack_buckets` that holds them)."""
  cfg = vision_config
  shape = tuple(np.shape(pixel_values))
  want = (cfg.in_channels, cfg.patch_size, cfg.patch_size)
  if len(shape) != 4 or shape[1:] != want:
    raise ValueError(f"pixel_values: expected [L, {want[0]}, {want[1]}, {want[2]}], found "
                     f"shape {shape}")
  pk = pack(cfg, grid_thw, num_patches=shape[0], length=length)
  patches = np.zeros((pk.length, cfg.patch_dim), np.float32)
  patches[:shape[0]] = np.asarray(pixel_values, np.float32).reshape(shape[0], cfg.patch_dim)
  return Media(patches=patches[None], meta={k: pk.meta[k][None] for k in META_FIELDS},
               num_merged=np.asarray([pk.num_merged], np.int32))


def dummy_media(vision_config, length: int | None = None) -> Media:
  """One 2×2 image of zeros in a stream of `length` patches (default: the smallest bucket):
  what `init` runs the tower on (parameter shapes do not depend on it)."""
  length = length or vision_config.pack_buckets[0]
  meta = pack(vision_config, [[1, 2, 2]], length=length).meta
  return Media(patches=jnp.zeros((1, length, vision_config.patch_dim), jnp.float32),
               meta={k: jnp.asarray(meta[k])[None] for k in META_FIELDS},
               num_merged=jnp.ones((1,), jnp.int32))


def stack_media(streams: Sequence[Media]) -> Media:
  """Concatenate media along the stream axis (all of one bucket length)."""
  if not streams:
    raise ValueError("stack_media: no streams")
  lengths = sorted({m.patches.shape[1] for m in streams})
  if len(lengths) > 1:
    raise ValueError(f"stack_media: streams of different lengths {lengths}; pad them to one "
                     f"bucket (media_from_pixels(length=...))")
  return Media(patches=np.concatenate([np.asarray(m.patches) for m in streams]),
               meta={k: np.concatenate([np.asarray(m.meta[k]) for m in streams])
                     for k in META_FIELDS},
               num_merged=np.concatenate([np.asarray(m.num_merged) for m in streams]))


def check_placeholders(tokens, media: Media, placeholder_id: int, where: str = "K3Model"):
  """Raise ValueError when the number of placeholder tokens and of merged vision tokens
  disagree. No-op on traced values (under `jit` the data pipeline must check)."""
  try:
    ids, counts = np.asarray(tokens), np.asarray(media.num_merged)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return
  n = int((ids == placeholder_id).sum())
  m = int(counts.sum())
  if n != m:
    raise ValueError(f"{where}: tokens hold {n} media placeholders (id {placeholder_id}) but "
                     f"the media give {m} merged vision tokens (num_merged {counts.tolist()})")


def place_media(embeddings, tokens, features, num_merged, placeholder_id: int):
  """Replace the embeddings at placeholder tokens by media features, in order.

  embeddings [B, T, d]; tokens [B, T] int; features [S, M, d] (stream s's first num_merged[s]
  rows are real); num_merged [S] int. The k-th placeholder in row-major order over [B, T]
  takes the k-th real feature (stream 0's, then stream 1's, …). Placeholders beyond the real
  features keep their embedding (`check_placeholders` makes that an error on host values).
  Returns [B, T, d] in embeddings' dtype; differentiable in embeddings and features.
  """
  b, t, d = embeddings.shape
  s, m, _ = features.shape
  is_ph = (tokens == placeholder_id).reshape(-1)
  rank = jnp.cumsum(is_ph.astype(jnp.int32)) - 1                        # [B·T]
  ends = jnp.cumsum(num_merged.astype(jnp.int32))                       # [S]
  stream = jnp.minimum(jnp.searchsorted(ends, rank, side="right"), s - 1)
  starts = ends - num_merged.astype(jnp.int32)
  index = stream * m + jnp.clip(rank - starts[stream], 0, m - 1)
  gathered = features.reshape(s * m, d)[index].astype(embeddings.dtype)
  take = is_ph & (rank < ends[-1])
  out = jnp.where(take[:, None], gathered, embeddings.reshape(b * t, d))
  return out.reshape(b, t, d)


def place_media_reference(embeddings, tokens, features, num_merged, placeholder_id: int):
  """`place_media` as an explicit loop over host arrays (the test reference)."""
  out = np.array(embeddings, copy=True)
  real = [f for s in range(features.shape[0]) for f in np.asarray(features[s, :num_merged[s]])]
  k = 0
  for i in range(out.shape[0]):
    for j in range(out.shape[1]):
      if tokens[i, j] == placeholder_id and k < len(real):
        out[i, j] = real[k]
        k += 1
  return out


__all__ = ["Media", "MediaEmbeddings", "media_from_pixels", "dummy_media", "stack_media", "check_placeholders", "place_media",
           "place_media_reference"]
