"""Vision tower configuration: one frozen dataclass and the named presets (spec §11).

`VisionConfig` is data only, validated by its constructor (errors name the field). Two tower
families share the whole pipeline (patch embedding → divided-fixed position embedding → pre-norm
blocks with 2-D RoPE → final norm → `sd2_tpool` merger → projector) and differ in fields:

  moonvit_v2   K3's released MoonViT-V2: RMSNorm, no biases, bilinear position resampling,
               q/k/v width 1536 ≠ hidden 1024, post-norm projector.
  moonvit_k25  Kimi K2.5/K2.6's MoonViT: LayerNorm and biases everywhere, hidden 1152, 16 heads
               of 72, bicubic position resampling, pre-norm projector.

Spec references: K3_SPEC.md §11 (the released layout wins over the report's prose).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from k3jax.presets import from_presets


# Padded stream lengths the packer chooses from (patches): `jit` compiles once per bucket.
DEFAULT_BUCKETS = tuple(2 ** k for k in range(8, 19))  # 256 … 262,144


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """Architecture of a MoonViT tower and its projector into the text stream."""

  name: str = "custom"
  patch_size: int = 14
  in_channels: int = 3
  hidden_size: int = 1024                 # vt_hidden_size
  num_layers: int = 27                    # vt_num_hidden_layers
  num_heads: int = 12                     # vt_num_attention_heads
  head_dim: int = 128                     # qkv_hidden_size / num_heads
  intermediate_size: int = 4096           # vt_intermediate_size
  norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
  norm_eps: float = 1e-5
  use_bias: bool = False                  # every Linear/conv of the tower and the projector

  # --- divided-fixed absolute position (§11)
  pos_emb_height: int = 64                # init_pos_emb_height
  pos_emb_width: int = 64                 # init_pos_emb_width
  pos_emb_interpolation: Literal["bilinear", "bicubic"] = "bilinear"
  max_frames: int = 4                     # rows of the fixed sin-cos time table (not resampled)

  # --- 2-D RoPE (§11)
  rope_theta: float = 10000.0
  # "rows_then_cols": complex pairs [0, P/2) rotate by the row, [P/2, P) by the column (K3 §11).
  # "interleaved_cols_rows": pair 2j by the column, 2j+1 by the row, both with frequency j
  #   (Kimi-VL / K2.5's MoonViT: `transformers`' Kimi_K25VisionRotaryEmbedding recomposition).
  rope_layout: Literal["rows_then_cols", "interleaved_cols_rows"] = "rows_then_cols"
  max_grid_side: int = 512                # rows/cols per sample the RoPE tables cover
  max_patches_per_frame: int = 65536      # preprocessing budget (256×256 patches)

  # --- merger and projector (§11)
  merge_kernel: tuple[int, int] = (2, 2)  # sd2_tpool: only 2×2 is defined
  # post: RMSNorm(text_hidden) after the projector (K3); pre: LayerNorm(hidden) before (K2.5)
  projector_norm: Literal["post", "pre"] = "post"
  projector_norm_eps: float = 1e-5
  text_hidden_size: int = 7168            # projector output width = the text model's d_model

  # --- packing and numerics
  pack_buckets: tuple[int, ...] = DEFAULT_BUCKETS
  dtype: str = "float32"
  param_dtype: str = "float32"

  def __post_init__(self):
    self.validate()

  # ------------------------------------------------------------------ derived quantities
  @property
  def qkv_hidden_size(self) -> int:
    return self.num_heads * self.head_dim

  @property
  def patch_dim(self) -> int:
    """Flattened patch width, in (channel, row, col) order: 3·14·14 = 588."""
    return self.in_channels * self.patch_size * self.patch_size

  @property
  def merged_dim(self) -> int:
    """Width of one merged token: 4 · hidden."""
    return self.merge_kernel[0] * self.merge_kernel[1] * self.hidden_size

  def replace(self, **overrides: Any) -> "VisionConfig":
    return dataclasses.replace(self, **overrides)

  # ------------------------------------------------------------------ validation
  def validate(self) -> None:
    def bad(field: str, msg: str):
      raise ValueError(f"VisionConfig.{field}: {msg}")

    for f in ("patch_size", "in_channels", "hidden_size", "num_layers", "num_heads", "head_dim",
              "intermediate_size", "pos_emb_height", "pos_emb_width", "max_frames",
              "max_grid_side", "max_patches_per_frame", "text_hidden_size"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        bad(f, f"expected a positive int, found {v!r}")
    if self.norm not in ("rmsnorm", "layernorm"):
      bad("norm", f"expected 'rmsnorm' or 'layernorm', found {self.norm!r}")
    if self.pos_emb_interpolation not in ("bilinear", "bicubic"):
      bad("pos_emb_interpolation", f"expected 'bilinear' or 'bicubic', found "
          f"{self.pos_emb_interpolation!r}")
    if self.rope_layout not in ("rows_then_cols", "interleaved_cols_rows"):
      bad("rope_layout", f"expected 'rows_then_cols' or 'interleaved_cols_rows', found "
          f"{self.rope_layout!r}")
    if self.projector_norm not in ("post", "pre"):
      bad("projector_norm", f"expected 'post' or 'pre', found {self.projector_norm!r}")
    # Two rotation axes, each over an equal number of complex pairs: head_dim % 4 == 0.
    if self.head_dim % 4:
      bad("head_dim", f"2-D RoPE needs a multiple of 4, found {self.head_dim}")
    if self.hidden_size % 2:
      bad("hidden_size", f"the sin-cos time table needs an even width, found {self.hidden_size}")
    if tuple(self.merge_kernel) != (2, 2):
      bad("merge_kernel", f"sd2_tpool is defined for (2, 2) only, found {self.merge_kernel!r}")
    for f in ("norm_eps", "projector_norm_eps", "rope_theta"):
      if not getattr(self, f) > 0:
        bad(f, f"expected a positive float, found {getattr(self, f)!r}")
    b = self.pack_buckets
    if (not b or any(not isinstance(x, int) or x <= 0 or x % 4 for x in b)
        or list(b) != sorted(set(b))):
      bad("pack_buckets", f"expected strictly increasing positive multiples of 4, found {b!r}")
    for f in ("dtype", "param_dtype"):
      if getattr(self, f) not in ("float32", "bfloat16", "float16"):
        bad(f, f"expected 'float32', 'bfloat16' or 'float16', found {getattr(self, f)!r}")


# ---------------------------------------------------------------------- presets
def _moonvit_v2() -> dict:
  return dict(name="moonvit_v2")  # the dataclass defaults are K3's released tower (§11)


def _moonvit_k25() -> dict:
  return dict(
      name="moonvit_k25", hidden_size=1152, num_layers=27, num_heads=16, head_dim=72,
      intermediate_size=4304, norm="layernorm", norm_eps=1e-5, use_bias=True,
      pos_emb_interpolation="bicubic", rope_layout="interleaved_cols_rows",
      projector_norm="pre", projector_norm_eps=1e-5, text_hidden_size=7168)


def _tiny(base: dict, name: str) -> dict:
  # Seconds per test: 2 layers, 2 heads of 16, an 8×8 position table, small buckets.
  return {**base, **dict(
      name=name, hidden_size=32, num_layers=2, num_heads=2, head_dim=16, intermediate_size=64,
      pos_emb_height=8, pos_emb_width=8, max_grid_side=32, text_hidden_size=48,
      pack_buckets=(64, 128, 256))}


PRESETS = {
    "moonvit_v2": _moonvit_v2,
    "moonvit_k25": _moonvit_k25,
    "tiny_moonvit_v2": lambda: _tiny(_moonvit_v2(), "tiny_moonvit_v2"),
    "tiny_moonvit_k25": lambda: _tiny(_moonvit_k25(), "tiny_moonvit_k25"),
}


def vision_preset(name: str, **overrides: Any) -> VisionConfig:
  """A validated vision preset, with `overrides` applied (unknown fields raise ValueError)."""
  return from_presets(VisionConfig, PRESETS, name, overrides, label="vision preset")


def as_vision_config(value, *, text_hidden_size: int | None = None) -> VisionConfig | None:
  """The vision tower a config file or checkpoint names, as a VisionConfig (or None).

  value: None, "" or "none" → None; a preset name → that preset; a dict → the preset its
  "preset" key names (default: the dataclass defaults) with the other keys as fields (lists
  become tuples; the form `dataclasses.asdict` and JSON give back); a VisionConfig → itself.
  `text_hidden_size`, when given, sets the projector's width unless the dict sets it.
  Unknown names and fields raise ValueError naming them.
  """
  if value is None or (isinstance(value, str) and value.lower() in ("", "none")):
    return None
  if isinstance(value, VisionConfig):
    return value
  width = {} if text_hidden_size is None else {"text_hidden_size": text_hidden_size}
  if isinstance(value, str):
    return vision_preset(value, **width)
  if hasattr(value, "to_dict"):  # ml_collections.ConfigDict
    value = value.to_dict()
  if not isinstance(value, dict):
    raise ValueError(f"vision: expected None, a preset name, a dict or a VisionConfig, found "
                     f"{type(value).__name__}")
  fields = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
  name = fields.pop("preset", None)
  if name is None:
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(VisionConfig)})
    if unknown:
      raise ValueError(f"unknown VisionConfig field(s) {unknown}")
    return VisionConfig(**{**width, **fields})
  return vision_preset(name, **{**width, **fields})


# ---------------------------------------------------------------------- config.json
def vision_config_from_hf(vision_config: dict, *, text_hidden_size: int | None = None,
                          projector_norm_eps: float | None = None) -> VisionConfig:
  """A `vision_config` dict of a checkpoint's config.json → VisionConfig.

  model_type "kimi_k3_vision" (K3's release, §11: `vt_*` keys, `qkv_hidden_size`,
  `init_pos_emb_*`, `text_hidden_size`; a norm eps key, when present, wins over 1e-5) →
  the moonvit_v2 family; "kimi_k25_vision" (`transformers`' Kimi_K25VisionConfig keys; the
  projector width and eps live at the top level: pass `text_hidden_size` = text_config's
  hidden_size and `projection_layer_norm_eps`) → the moonvit_k25 family. Unknown model types
  and missing keys raise ValueError naming them.
  """
  vc = dict(vision_config)
  kind = vc.get("model_type")

  def get(key, default=None):
    if key in vc:
      return vc[key]
    if default is None:
      raise ValueError(f"vision_config.{key}: missing (model_type {kind!r})")
    return default

  if kind == "kimi_k3_vision":
    heads = get("vt_num_attention_heads")
    qkv = get("qkv_hidden_size")
    if qkv % heads:
      raise ValueError(f"vision_config.qkv_hidden_size: {qkv} is not a multiple of "
                       f"vt_num_attention_heads = {heads}")
    eps = next((vc[k] for k in ("rms_norm_eps", "norm_eps", "layer_norm_eps") if k in vc), 1e-5)
    fields = dict(
        num_layers=get("vt_num_hidden_layers"), hidden_size=get("vt_hidden_size"),
        num_heads=heads, head_dim=qkv // heads, intermediate_size=get("vt_intermediate_size"),
        patch_size=get("patch_size", 14), pos_emb_height=get("init_pos_emb_height", 64),
        pos_emb_width=get("init_pos_emb_width", 64), norm_eps=eps, projector_norm_eps=eps,
        merge_kernel=tuple(get("merge_kernel_size", [2, 2])),
        text_hidden_size=text_hidden_size or get("text_hidden_size"))
    return vision_preset("moonvit_v2").replace(**fields)
  if kind == "kimi_k25_vision":
    if text_hidden_size is None:
      raise ValueError("text_hidden_size: required for a kimi_k25_vision config (the "
                       "projector's output width is text_config.hidden_size)")
    heads = get("num_attention_heads", 16)
    hidden = get("hidden_size", 1152)
    rope = vc.get("rope_parameters") or {}
    fields = dict(
        num_layers=get("num_hidden_layers", 27), hidden_size=hidden,
        num_heads=heads, head_dim=hidden // heads, intermediate_size=get("intermediate_size", 4304),
        patch_size=get("patch_size", 14), pos_emb_height=get("pos_emb_height", 64),
        pos_emb_width=get("pos_emb_width", 64), max_frames=get("pos_emb_time", 4),
        merge_kernel=tuple(get("merge_kernel_size", [2, 2])),
        rope_theta=float(rope.get("rope_theta", 10000.0)), text_hidden_size=text_hidden_size,
        projector_norm_eps=projector_norm_eps or 1e-5)
    return vision_preset("moonvit_k25").replace(**fields)
  raise ValueError(f"vision_config.model_type: expected 'kimi_k3_vision' or 'kimi_k25_vision', "
                   f"found {kind!r}")


def vision_config_to_hf(config: VisionConfig) -> dict:
  """VisionConfig of the moonvit_v2 family → the released K3 `vision_config` dict (§11)."""
  if config.norm != "rmsnorm" or config.use_bias or config.projector_norm != "post":
    raise ValueError(f"VisionConfig.norm/use_bias/projector_norm: only the moonvit_v2 family "
                     f"has a K3 vision_config, found {config.name!r}")
  return {
      "model_type": "kimi_k3_vision", "vt_num_hidden_layers": config.num_layers,
      "vt_hidden_size": config.hidden_size, "vt_num_attention_heads": config.num_heads,
      "qkv_hidden_size": config.qkv_hidden_size, "vt_intermediate_size": config.intermediate_size,
      "patch_size": config.patch_size, "init_pos_emb_height": config.pos_emb_height,
      "init_pos_emb_width": config.pos_emb_width, "merge_kernel_size": list(config.merge_kernel),
      "text_hidden_size": config.text_hidden_size, "rms_norm_eps": config.norm_eps,
  }


__all__ = ["VisionConfig", "vision_preset", "as_vision_config", "vision_config_from_hf",
           "vision_config_to_hf",
           "PRESETS", "DEFAULT_BUCKETS"]
