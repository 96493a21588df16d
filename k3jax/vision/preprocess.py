"""Image/video preprocessing for the MoonViT towers: pixels → (pixel_values, grid_thw) (§11).

`preprocess(config, media)` takes a list of images and videos and returns
`pixel_values` [L, 3, 14, 14] float32 and `grid_thw` [n, 3] int32, ready for
`k3jax.vision.encode(config, variables, pixel_values, grid_thw, ...)`. Host-side numpy + Pillow.

Per sample (an image, or a video = a list of frames):
  1. decode with Pillow (a path, bytes or a `PIL.Image.Image`) and convert to RGB, compositing
     any transparency onto white (as transformers' `convert_to_rgb` does);
  2. resize to fit the patch budget keeping the aspect ratio, never upscaling (`fit_size`):
     §11 gives the budget — at most `config.max_patches_per_frame` (65,536 = 256×256) patches
     and `config.max_grid_side` (512) patches per side; both can be overridden per call;
  3. pad at the bottom/right with black (0) to a multiple of 28 pixels (2×2 merge of 14-pixel
     patches), before normalisation, so padding becomes −1 after it;
  4. rescale by 1/255 and normalise per channel with mean = std = (0.5, 0.5, 0.5);
  5. cut into patches [t·h·w, 3, 14, 14] in (t, row, col) order; the grid is (t, h, w).

§11 fixes the budget but not the resampling filter, the size rounding or the mean/std: those
follow transformers' Kimi K2.5 image processor (`transformers/models/kimi_k25/
image_processing_kimi_k25.py`: `navit_resize`, BICUBIC, IMAGENET_STANDARD mean/std 0.5, zero
padding at the bottom/right, patchify order). Two differences, both deliberate:
  * the resize is Pillow's BICUBIC on uint8 (transformers' PIL-backend resize); the released
    processor uses torchvision's antialiased bicubic, which can differ by ~1 uint8 level;
  * `navit_resize` checks the budget on the *unpadded* floor patch count, so padding to 28
    usually pushes a downscaled image's grid a little past it (e.g. 3590×3590 → 258×258 >
    65,536 patches). Over the config's bounds (`max_patches_per_frame`, `max_grid_side`, which
    `packing.check_grid` enforces) such a grid would be rejected, so `preprocess` shrinks the
    scale until the padded grid fits them (`fit_size(..., limit_patches=, limit_side=)`).
    Under the bounds transformers' size is kept exactly, so a K2.5-style call with
    `max_patches=16384` gives the released processor's grids. A budget above the config's
    bounds is not shrunk: `check_grid` rejects the grid, naming the input.
Video: §11's merger averages over all t frames and the time table has `config.max_frames` (4)
rows, so a video is one sample of t = len(frames) ≤ max_frames frames, all of the same size after
the resize (K2.5's video processor cuts longer videos into chunks of 4 frames = one sample each;
here the caller does that). K2.5's video processor uses a smaller default budget (4096 patches
per frame): pass `max_patches=` to reproduce it.

Errors are ValueErrors naming the input (`media[i]`, its path, the frame) and the problem.
"""

from __future__ import annotations

import io
import math
import os
from typing import Any, Sequence

import numpy as np
from PIL import Image

from k3jax.vision.packing import check_grid

IMAGE_MEAN = (0.5, 0.5, 0.5)   # transformers IMAGENET_STANDARD_MEAN (K2.5 image processor)
IMAGE_STD = (0.5, 0.5, 0.5)    # transformers IMAGENET_STANDARD_STD
RESAMPLE = "bicubic"           # K2.5 image processor: PILImageResampling.BICUBIC


def _describe(x: Any) -> str:
  if isinstance(x, (str, os.PathLike)):
    return repr(os.fspath(x))
  if isinstance(x, (bytes, bytearray, memoryview)):
    return f"<{len(x)} bytes>"
  return f"<{type(x).__name__}>"


def load_image(image: Any, *, name: str = "image"):
  """A decoded RGB `PIL.Image.Image` from a path, bytes or a PIL image.

  Transparency is composited onto white (transformers' `convert_to_rgb`). Raises ValueError
  naming `name` for an unreadable/corrupt file, an unsupported type or a zero-size image."""
  where = f"{name} ({_describe(image)})"
  if isinstance(image, Image.Image):
    img = image
  elif isinstance(image, (str, os.PathLike, bytes, bytearray, memoryview)):
    try:
      src = (io.BytesIO(bytes(image)) if isinstance(image, (bytes, bytearray, memoryview))
             else os.fspath(image))
      img = Image.open(src)
      img.load()  # decode now: a truncated or corrupt file fails here, not later
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
      raise ValueError(f"{where}: cannot read or decode as an image "
                       f"({type(e).__name__}: {e})") from None
  else:
    raise ValueError(f"{where}: expected a path, bytes or a PIL.Image.Image "
                     f"(or, for a video, a list of those), found {type(image).__name__}")
  if img.width == 0 or img.height == 0:
    raise ValueError(f"{where}: zero-size image ({img.width}×{img.height} pixels)")
  try:
    if "A" in img.getbands() or img.info.get("transparency") is not None:
      rgba = img.convert("RGBA")
      white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
      img = Image.alpha_composite(white, rgba).convert("RGB")
    elif img.mode != "RGB":
      img = img.convert("RGB")
  except (OSError, ValueError) as e:
    raise ValueError(f"{where}: cannot convert mode {img.mode!r} to RGB ({e})") from None
  return img


def fit_size(height: int, width: int, *, patch_size: int = 14, merge: int = 2,
             max_patches: int = 65536, max_side: int = 512, limit_patches: int | None = None,
             limit_side: int | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
  """((resized_h, resized_w), (padded_h, padded_w)) in pixels for an image of height×width.

  transformers' K2.5 `navit_resize` with budget `max_patches` / `max_side` (scale = min(1,
  √(budget / floor-patch count), side bounds), sizes truncated with int(), then padded up to a
  multiple of merge·patch_size; never upscales). With `limit_patches` / `limit_side` set, a
  padded grid over either limit makes the scale shrink until it fits (None: no limit, exactly
  transformers)."""
  if height < 1 or width < 1:
    raise ValueError(f"fit_size: expected a positive size, found {height}×{width}")
  if max_side < merge or max_patches < merge * merge:
    raise ValueError(f"fit_size: the budget (max_patches={max_patches}, max_side={max_side}) "
                     f"cannot hold one {merge}×{merge} merge window")
  limit_patches = math.inf if limit_patches is None else limit_patches
  limit_side = math.inf if limit_side is None else limit_side
  if limit_side < merge or limit_patches < merge * merge:
    raise ValueError(f"fit_size: the limits (limit_patches={limit_patches}, limit_side="
                     f"{limit_side}) cannot hold one {merge}×{merge} merge window")
  factor = merge * patch_size
  count = max(1.0, height // patch_size) * max(1.0, width // patch_size)
  scale = min(1.0, math.sqrt(max_patches / count), max_side * patch_size / height,
              max_side * patch_size / width)
  while True:
    rh = min(max(1, int(height * scale)), max_side * patch_size)
    rw = min(max(1, int(width * scale)), max_side * patch_size)
    ph, pw = -(-rh // factor) * factor, -(-rw // factor) * factor
    gh, gw = ph // patch_size, pw // patch_size
    if gh * gw <= limit_patches and max(gh, gw) <= limit_side:
      return (rh, rw), (ph, pw)
    # Padding pushed the grid over a limit: shrink (each step strictly reduces the scale; at
    # 1×1 pixels the grid is merge×merge, which fits).
    scale *= min(math.sqrt(limit_patches / (gh * gw)), limit_side / max(gh, gw), 0.999)


def _to_patches(frames: np.ndarray, patch_size: int) -> np.ndarray:
  """[t, 3, H, W] → [t·(H/p)·(W/p), 3, p, p] in (t, row, col) order."""
  t, c, hh, ww = frames.shape
  gh, gw = hh // patch_size, ww // patch_size
  x = frames.reshape(t, c, gh, patch_size, gw, patch_size).transpose(0, 2, 4, 1, 3, 5)
  return np.ascontiguousarray(x.reshape(t * gh * gw, c, patch_size, patch_size))


def _normalise(rgb: np.ndarray, padded: tuple[int, int]) -> np.ndarray:
  """uint8 [h, w, 3] → float32 [3, ph, pw]: zero-pad bottom/right, /255, (x − mean) / std."""
  ph, pw = padded
  out = np.zeros((3, ph, pw), np.float32)
  out[:, :rgb.shape[0], :rgb.shape[1]] = rgb.transpose(2, 0, 1)
  out *= np.float32(1 / 255)
  mean = np.asarray(IMAGE_MEAN, np.float32)[:, None, None]
  std = np.asarray(IMAGE_STD, np.float32)[:, None, None]
  return (out - mean) / std


def preprocess_sample(config, item: Any, *, name: str = "media[0]", max_patches: int | None = None,
                      max_side: int | None = None) -> tuple[np.ndarray, tuple[int, int, int]]:
  """One image, or one video (a list/tuple of frames), → (patches [t·h·w, 3, p, p] float32,
  (t, h, w)). The resize budget (`max_patches` patches per frame, `max_side` per side)
  defaults to the config's bounds `max_patches_per_frame`, `max_grid_side`."""
  p = config.patch_size
  merge = config.merge_kernel[0]
  max_patches = config.max_patches_per_frame if max_patches is None else max_patches
  max_side = config.max_grid_side if max_side is None else max_side
  # Absorb the padding overflow up to the config's bounds, unless the budget itself exceeds them.
  within = max_patches <= config.max_patches_per_frame and max_side <= config.max_grid_side
  limits = (dict(limit_patches=config.max_patches_per_frame, limit_side=config.max_grid_side)
            if within else {})
  is_video = isinstance(item, (list, tuple))
  if is_video:
    if len(item) == 0:
      raise ValueError(f"{name}: a video needs at least one frame, found an empty list")
    if len(item) > config.max_frames:
      raise ValueError(f"{name}: {len(item)} frames exceed max_frames = {config.max_frames} "
                       f"(the time table has {config.max_frames} rows); split the video into "
                       f"samples of ≤ {config.max_frames} frames")
    frames = [load_image(f, name=f"{name} frame {j}") for j, f in enumerate(item)]
  else:
    frames = [load_image(item, name=name)]
  sizes = [fit_size(f.height, f.width, patch_size=p, merge=merge, max_patches=max_patches,
                    max_side=max_side, **limits) for f in frames]
  (rh, rw), padded = sizes[0]
  for j, ((rhj, rwj), _) in enumerate(sizes[1:], 1):
    if (rhj, rwj) != (rh, rw):
      raise ValueError(
          f"{name} frame {j} ({_describe(item[j])}): frames of different sizes — "
          f"{frames[j].width}×{frames[j].height} resizes to {rwj}×{rhj} (w×h), but frame 0 "
          f"({frames[0].width}×{frames[0].height}) resizes to {rw}×{rh}")
  arrays = []
  for f in frames:
    if f.size != (rw, rh):
      f = f.resize((rw, rh), Image.Resampling.BICUBIC)
    arrays.append(_normalise(np.asarray(f, dtype=np.uint8), padded))
  grid = (len(frames), padded[0] // p, padded[1] // p)
  try:
    check_grid(config, np.asarray([grid], np.int64))
  except ValueError as e:
    raise ValueError(f"{name}: the resized grid (t, h, w) = {grid} is out of the config's "
                     f"bounds — {e}") from None
  return _to_patches(np.stack(arrays), p), grid


def preprocess(config, media: Sequence[Any], *, max_patches: int | None = None,
               max_side: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Images and videos → (pixel_values [L, 3, p, p] float32, grid_thw [n, 3] int32) for
  `encode`. Each item of `media` is an image (a path, bytes or a PIL image) or a video (a
  list/tuple of such frames, ≤ config.max_frames, one sample with t = len(frames)). The
  samples' patches are concatenated in order."""
  if isinstance(media, (str, bytes, bytearray, os.PathLike)) or not isinstance(media, Sequence):
    raise ValueError(f"media: expected a list of images/videos, found {type(media).__name__}")
  if len(media) == 0:
    raise ValueError("media: expected at least one image or video, found an empty list")
  patches, grids = [], []
  for i, item in enumerate(media):
    x, g = preprocess_sample(config, item, name=f"media[{i}]", max_patches=max_patches,
                             max_side=max_side)
    patches.append(x)
    grids.append(g)
  return np.concatenate(patches, axis=0), np.asarray(grids, np.int32)


__all__ = ["IMAGE_MEAN", "IMAGE_STD", "RESAMPLE", "load_image", "fit_size", "preprocess_sample",
           "preprocess"]
