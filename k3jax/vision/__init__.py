"""Native vision for K3: MoonViT-V2 (and K2.5's MoonViT), the merger and the projector (§11).

Public API: `VisionConfig`, `vision_preset`, `vision_config_from_hf`, `init_vision`, `encode`,
`pack`, `preprocess` (images/videos → pixel_values, grid_thw; see `k3jax.vision.preprocess`),
`load_vision` (a converted tower: `k3jax.vision.load`), `Media` / `media_from_pixels` /
`stack_media` (packed inputs of `K3Model(media=)`: `k3jax.vision.media`).
The math lives in `k3jax.vision.ops`, the modules in `k3jax.vision.tower`, release
tensor names in `k3jax.vision.names`.
"""

from k3jax.vision.config import (VisionConfig, vision_config_from_hf, vision_config_to_hf,
                                  vision_preset)
from k3jax.vision.load import load_vision
from k3jax.vision.media import Media, media_from_pixels, stack_media
from k3jax.vision.packing import Packing, pack
from k3jax.vision.preprocess import fit_size, load_image, preprocess
from k3jax.vision.tower import VisionModel, encode, init_vision

__all__ = ["VisionConfig", "vision_preset", "vision_config_from_hf", "vision_config_to_hf",
           "Packing", "pack", "VisionModel", "encode", "init_vision",
           "preprocess", "load_image", "fit_size", "load_vision", "Media", "media_from_pixels",
           "stack_media"]
