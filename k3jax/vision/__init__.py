"""Native vision for K3: MoonViT-V2 (and K2.5's MoonViT), the merger and the projector (§11).

Public API: `VisionConfig` / `vision_preset` (records of `k3jax.config`), `init_vision`,
`encode`, `pack`, `preprocess` (images/videos → pixel_values, grid_thw; see
`k3jax.vision.preprocess`), `load_vision` (a converted tower: `k3jax.convert.vision`),
`Media` / `media_from_pixels` / `stack_media` (packed inputs of `K3Model(media=)`:
`k3jax.vision.media`). The math lives in `k3jax.vision.ops`, the modules in
`k3jax.vision.tower`; the release's tensor names and loading live with the rest of conversion
(`k3jax.convert.vision_names`, `k3jax.convert.vision`).
"""

import importlib

from k3jax.config import VisionConfig, vision_preset
from k3jax.vision.media import Media, media_from_pixels, stack_media
from k3jax.vision.packing import Packing, pack
from k3jax.vision.preprocess import fit_size, load_image, preprocess
from k3jax.vision.tower import VisionModel, encode, init_vision


def __getattr__(name: str):
  # `load_vision` reads checkpoints, which is conversion's business (k3jax.convert imports the
  # model, and the model imports this package): resolved on first use, so that importing the
  # model never loads the converter.
  if name == "load_vision":
    return importlib.import_module("k3jax.convert.vision").load_vision
  raise AttributeError(f"module 'k3jax.vision' has no attribute {name!r}")


__all__ = ["VisionConfig", "vision_preset", "Packing", "pack", "VisionModel", "encode",
           "init_vision", "preprocess", "load_image", "fit_size", "load_vision", "Media",
           "media_from_pixels", "stack_media"]
