"""The model's configuration: frozen, validated records and the named presets.

  ModelConfig(name, text, vision, media_placeholder_token_id, modes)
    text    TextConfig   the language model's architecture (Table 1, §2–7): every shape and
                         every switch of a formula; config.json's `text_config`
    vision  VisionConfig the MoonViT tower and projector (§11), or None for a text-only model
    modes   RunModes     how the model runs: numerics, compilation, kernels, the experts'
                         storage and QAT, LoRA adapters, the EAGLE-3 draft input, router stats

Each record validates its own fields when built (errors name them: `ModelConfig.text.d_model:
…`); `ModelConfig` checks what spans them. Layer layout is derived, never stored:
`text.layer_types()` gives the token mixer and MLP kind of every layer, `text.stack_layout()`
splits the stack into an unrolled prefix, a repeating body of identical groups (scanned with
`nn.scan` when `modes.scan_layers`) and an unrolled suffix. `preset(name, **overrides)` and
`ModelConfig.replace` take any record's field by its own name. `config.json` ⇄ `ModelConfig` is
`k3jax.hf_config` (that module imports this one, never the reverse); checkpoints store
`config_to_dict`.

Facts cited: docs/k3.md §1 (Table 1), §2 (layout), §3–7 (components), §9 (config keys), §11.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp

# ====================================================================== the vision tower (§11)
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


# ---------------------------------------------------------------------- vision presets
def _moonvit_v2() -> dict:
  return dict(name="moonvit_v2")  # the dataclass defaults are K3's released tower (§11)


def _moonvit_k25() -> dict:
  return dict(
      name="moonvit_k25", hidden_size=1152, num_layers=27, num_heads=16, head_dim=72,
      intermediate_size=4304, norm="layernorm", norm_eps=1e-5, use_bias=True,
      pos_emb_interpolation="bicubic", rope_layout="interleaved_cols_rows",
      projector_norm="pre", projector_norm_eps=1e-5, text_hidden_size=7168)


def _tiny_vision(base: dict, name: str) -> dict:
  # Seconds per test: 2 layers, 2 heads of 16, an 8×8 position table, small buckets.
  return {**base, **dict(
      name=name, hidden_size=32, num_layers=2, num_heads=2, head_dim=16, intermediate_size=64,
      pos_emb_height=8, pos_emb_width=8, max_grid_side=32, text_hidden_size=48,
      pack_buckets=(64, 128, 256))}


VISION_PRESETS = {
    "moonvit_v2": _moonvit_v2,
    "moonvit_k25": _moonvit_k25,
    "tiny_moonvit_v2": lambda: _tiny_vision(_moonvit_v2(), "tiny_moonvit_v2"),
    "tiny_moonvit_k25": lambda: _tiny_vision(_moonvit_k25(), "tiny_moonvit_k25"),
}


def vision_preset(name: str, **overrides: Any) -> VisionConfig:
  """A validated vision preset, with `overrides` applied (unknown fields raise ValueError)."""
  if name not in VISION_PRESETS:
    raise ValueError(f"unknown vision preset {name!r}; expected one of {sorted(VISION_PRESETS)}")
  unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(VisionConfig)})
  if unknown:
    raise ValueError(f"unknown VisionConfig field(s) {unknown}")
  return VisionConfig(**{**VISION_PRESETS[name](), **overrides})


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



# ====================================================================== the model
KDA = "kda"
MLA = "mla"
DENSE = "dense"
MOE = "moe"

# LoRA target names (RunModes.lora_targets) → the projections they adapt:
#   q        KDA q_proj; MLA q_a_proj + q_b_proj (or q_proj)
#   k, v     KDA k_proj / v_proj; MLA's kv_a_proj_with_mqa + kv_b_proj (one latent for keys
#            and values) when either is named
#   o        KDA and MLA o_proj
#   gates    KDA f_a_proj, f_b_proj (decay), b_proj (β), g_proj or g_a/g_b_proj (output
#            gate); MLA g_proj
#   dense    the dense layer-0 MLP (gate_proj, up_proj, down_proj)
#   shared   the shared experts (gate_proj, up_proj, down_proj)
#   latent   the LatentMoE projections routed_expert_down_proj / routed_expert_up_proj
#   experts  per-expert adapters on every routed expert's w1, w3, w2
# Never adapted: embeddings, lm_head, router, norms, convs, MTP's eh_proj, the vision tower.
LORA_TARGETS = ("q", "k", "v", "o", "gates", "dense", "shared", "latent", "experts")


def _bad(record: str, field: str, msg: str):
  raise ValueError(f"{record}.{field}: {msg}")


TEXT = "ModelConfig.text"      # how errors name the records' fields
MODES = "ModelConfig.modes"


def _check_ints(record: str, obj, positive: tuple[str, ...], non_negative: tuple[str, ...]):
  for f in positive + non_negative:
    v = getattr(obj, f)
    lo = 1 if f in positive else 0
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
      _bad(record, f, f"expected a {'positive' if lo else 'non-negative'} int, found {v!r}")


@dataclasses.dataclass(frozen=True)
class TextConfig:
  """The language model's architecture (K3's Table 1 and §2–7; config.json's `text_config`):
  every shape and every switch of a formula. Dimensions follow the spec's names: `d_model` is
  d, `latent_moe_dim` is ℓ. The defaults are K3's."""

  vocab_size: int = 163840
  d_model: int = 7168
  num_layers: int = 93
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = False

  # --- layer layout (§2): layer i is MLA when i % mla_every == mla_every - 1, and the last
  # layer is MLA too when mla_last. The first `first_dense_layers` layers have a dense MLP.
  mla_every: int = 4
  mla_last: bool = True
  first_dense_layers: int = 1
  kda_only: bool = False   # no MLA layer at all: an ablation only (validate)

  # --- Kimi Delta Attention (§3)
  kda_num_heads: int = 96
  kda_head_dim: int = 128          # dk = dv
  kda_conv_size: int = 4
  kda_lower_bound: float | None = -5.0   # None: Kimi Linear's unbounded softplus decay
  # The axis A_log runs along (§3, §12): "head" — A_log [H], one decay rate per head (the
  # spec's formula; Kimi Linear); "channel" — A_log [K], one rate per key dimension, shared by
  # the heads (one reading of the release's 128-entry A_log; docs/notes/convert.md, "When the
  # converter stops on A_log"). Changes A_log's shape, nothing else.
  kda_a_log_axis: Literal["head", "channel"] = "head"
  kda_gate_rank: int = 128         # rank of f_a/f_b (and of g_a/g_b when not full rank)
  full_rank_gates: bool = True     # output gate g_proj: d -> H*dv (K3) vs rank-r pair (Kimi Linear)

  # --- Gated MLA, NoPE (§4)
  num_heads: int = 96
  q_lora_rank: int | None = 1536   # None: a single q_proj (Kimi Linear)
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  mla_output_gate: bool = True     # sigmoid(g_proj(x)) on the attention output
  # q_a_layernorm / kv_a_layernorm eps: 1e-6 in Moonshot's and transformers' code (DeepSeek-V3's
  # default), unlike the decoder norms' rms_norm_eps.
  mla_latent_norm_eps: float = 1e-6

  # --- MLPs and Stable LatentMoE (§6)
  activation: Literal["situ", "swiglu"] = "situ"
  situ_beta1: float = 4.0
  situ_beta2: float = 25.0
  dense_intermediate_size: int = 33792
  num_experts: int = 896
  experts_per_token: int = 16
  num_shared_experts: int = 2
  moe_intermediate_size: int = 3072
  latent_moe_dim: int | None = 3584  # None: classic MoE (experts act on d directly)
  routed_scaling_factor: float = 1.0

  # --- Block Attention Residuals (§5); None = plain pre-norm residuals
  attn_res_block_size: int | None = 12

  # --- Multi-token prediction (one extra layer predicting token t+2)
  num_mtp_layers: int = 1

  def __post_init__(self):
    self.validate()

  # ------------------------------------------------------------------ derived quantities
  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def shared_intermediate_size(self) -> int:
    """Width of the fused shared-expert MLP (the shared experts side by side)."""
    return self.num_shared_experts * self.moe_intermediate_size

  @property
  def expert_in_dim(self) -> int:
    """The routed experts' input width: ℓ (LatentMoE) or d (classic MoE)."""
    return self.latent_moe_dim or self.d_model

  def is_mla(self, i: int) -> bool:
    return i % self.mla_every == self.mla_every - 1 or (
        self.mla_last and i == self.num_layers - 1)

  def layer_types(self) -> tuple[tuple[str, str], ...]:
    """(token mixer, mlp) of every layer: mixer in {"kda","mla"}, mlp in {"dense","moe"}."""
    return tuple(
        (MLA if self.is_mla(i) else KDA, DENSE if i < self.first_dense_layers else MOE)
        for i in range(self.num_layers))

  def stack_layout(self) -> tuple[int, int, int]:
    """Split layers into (prefix, num_groups, suffix) counts.

    The body is `num_groups` consecutive groups of `mla_every` layers, each group
    [KDA]*(mla_every-1) + [MLA] with MoE MLPs, starting at the first group boundary at or
    after `first_dense_layers`. K3: prefix 4 (layers 0–3), 22 groups (4–91), suffix 1 (92).
    """
    p = self.mla_every
    start = -(-self.first_dense_layers // p) * p
    types = self.layer_types()
    group = tuple([(KDA, MOE)] * (p - 1) + [(MLA, MOE)])
    n = 0
    while start + (n + 1) * p <= self.num_layers and types[start + n * p:start + (n + 1) * p] == group:
      n += 1
    if n == 0:
      start = self.num_layers
    return start, n, self.num_layers - start - n * p

  @property
  def num_attn_res_blocks(self) -> int:
    """Completed blocks at the end of the stack (the embedding is block 0)."""
    if self.attn_res_block_size is None:
      return 0
    return -(-self.num_layers // self.attn_res_block_size)

  @property
  def has_moe(self) -> bool:
    return self.first_dense_layers < self.num_layers

  def replace(self, **overrides: Any) -> "TextConfig":
    return dataclasses.replace(self, **overrides)

  # ------------------------------------------------------------------ validation
  def validate(self) -> None:
    def bad(field: str, msg: str):
      _bad(TEXT, field, msg)

    _check_ints(TEXT, self,
                ("vocab_size", "d_model", "num_layers", "mla_every", "kda_num_heads",
                 "kda_head_dim", "kda_conv_size", "kda_gate_rank", "num_heads", "kv_lora_rank",
                 "qk_nope_head_dim", "v_head_dim", "dense_intermediate_size",
                 "moe_intermediate_size"),
                ("qk_rope_head_dim", "first_dense_layers", "num_experts", "experts_per_token",
                 "num_shared_experts", "num_mtp_layers"))
    if self.first_dense_layers > self.num_layers:
      bad("first_dense_layers", f"{self.first_dense_layers} > num_layers={self.num_layers}")
    if self.has_moe:
      if self.num_experts < 1:
        bad("num_experts", "MoE layers need at least one expert")
      if not 1 <= self.experts_per_token <= self.num_experts:
        bad("experts_per_token",
            f"must be in [1, num_experts={self.num_experts}], found {self.experts_per_token}")
      if self.experts_per_token == self.num_experts:
        bad("experts_per_token", "must be < num_experts: Quantile Balancing reads the "
            "(k+1)-th score as the routing cutoff")
    for f in ("q_lora_rank", "latent_moe_dim", "attn_res_block_size"):
      v = getattr(self, f)
      if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
        bad(f, f"expected a positive int or None, found {v!r}")
    if self.kda_lower_bound is not None and not (
        -88.0 / 16 <= self.kda_lower_bound < 0):
      # The chunked form rescales by exp(-cumulative decay) inside 16-token tiles:
      # |lower_bound| * 16 must stay below ln(fp32 max) ≈ 88.7 (§3).
      bad("kda_lower_bound", f"expected None or a value in [-5.5, 0), found {self.kda_lower_bound}")
    if self.kda_a_log_axis not in ("head", "channel"):
      bad("kda_a_log_axis", f"expected 'head' (A_log [H]) or 'channel' (A_log [K], shared by "
          f"the heads), found {self.kda_a_log_axis!r}")
    if self.activation not in ("situ", "swiglu"):
      bad("activation", f"expected 'situ' or 'swiglu', found {self.activation!r}")
    if self.num_mtp_layers > 1:
      bad("num_mtp_layers", f"0 or 1 supported, found {self.num_mtp_layers}")
    # K3 and Kimi Linear both end on MLA (global attention). A stack without any MLA layer
    # (mla_every > num_layers, mla_last=False) is allowed only as that, stated: the KDA-only
    # ablation of experiments/recall_extend.py (kda_only=True); otherwise it is a mistake.
    if not self.kda_only and not any(self.is_mla(i) for i in range(self.num_layers)):
      bad("num_layers", f"{self.num_layers} layers with mla_every={self.mla_every} and "
          "mla_last=False leave no MLA layer (kda_only=True for a KDA-only stack)")
    if self.kda_only and any(self.is_mla(i) for i in range(self.num_layers)):
      bad("kda_only", f"set, but layers {[i for i in range(self.num_layers) if self.is_mla(i)]}"
          " are MLA (mla_every > num_layers and mla_last=False for none)")


@dataclasses.dataclass(frozen=True)
class RunModes:
  """How the model runs, apart from what it is: numerics, compilation, kernels, the routed
  experts' storage and quantisation-aware training, LoRA adapters, the EAGLE-3 draft input
  and the router statistics it sows. None of these is in a release's config.json."""

  # --- numerics and compilation
  dtype: str = "float32"           # compute dtype for matmuls ("bfloat16" on accelerators)
  param_dtype: str = "float32"     # Linear + expert kernels (fp32 masters; "bfloat16" halves
                                   # them; vectors, norms, convs and the router stay fp32)
  scan_layers: bool = True         # nn.scan over the repeating body (fast compile of 93 layers)
  remat: bool = False              # rematerialise each layer (scanned group) in the backward
  remat_offload: bool = False      # with remat: the layer inputs it keeps live in host memory
  kernel_backend: Literal["xla", "pallas", "auto"] = "xla"
  kda_chunk_size: int = 64         # tokens per chunk of the chunked KDA form (× 16)
  # Training/prefill attention over more queries than this runs in query blocks of this size,
  # each rematerialised in the backward pass (temporaries [B,H,block,S] instead of [B,H,T,S]);
  # None: all queries at once. Numerics are the same.
  mla_query_block: int | None = 512
  # Long rows: an int runs training/prefill attention straight from the latents in blocks of
  # this many keys (ops/mla_blockwise.py: keys/values expanded one block at a time, online
  # softmax, causal blocks skipped); under a context mesh the latents (kv_lora_rank + rope
  # numbers a token) are all-gathered instead of the expanded keys and values. The serving
  # path (decode, chunked prefill) then reads its cache buffer in key blocks of this size too,
  # skipping those after the last new position. None: the materialised form above, and the
  # whole buffer at once when serving.
  mla_key_block: int | None = None
  # The trainer's MTP loss runs the MTP layer on all T positions (the last a masked stand-in,
  # `K3Model(mtp_full=True)`), sharded over `context` like the trunk; False: on the T−1 real
  # ones, which no context axis divides, so every context chip holds the whole row's MTP
  # activations (at 1M on 128 chips: 371 GiB of temporaries a chip, docs/results.md).
  mtp_full_length: bool = True
  # The trainer's cross-entropy (and the MTP layer's) over the vocabulary in this many strided
  # token chunks (token t in chunk t mod n; each chunk's logits recomputed in the backward):
  # [B, T/n, vocab] logits at a time instead of [B, T, vocab]. None: all at once. T (and, with
  # the MTP layer, mtp_full_length) must allow it; the loss is the same sum in another order.
  ce_chunks: int | None = None
  # Capacity per expert = ceil(capacity_factor * tokens * k / num_experts); None = dropless.
  moe_capacity_factor: float | None = None
  # The backward pass releases a MoE layer's input gradient only together with its expert
  # weights' gradients (`ops.moe.tie_gradients`): XLA's scheduler otherwise defers every
  # layer's expert weight gradients (and their reduce-scatter) to the end of the backward, so
  # each layer's dispatched rows, gate/up activations and output gradients stay live until
  # then (~5 GB a MoE layer a chip at k3's 1M working set, docs/notes/long_context.md).
  # Numerics are the same; it only orders the work.
  expert_grad_barrier: bool = False

  # --- routed experts: storage and QAT (docs/notes/moe.md, docs/notes/qat.md)
  #   "bf16"  unquantised, in `param_dtype` (trainable; the name follows the release's
  #           vocabulary for "not MXFP4" — with param_dtype="float32" they are fp32 masters);
  #   "mxfp4" the release's bytes: `experts/{w1,w3,w2}/weight_packed` uint8 (two E2M1 codes a
  #           byte) + `weight_scale` uint8 (E8M0, one per 32 inputs), dequantised inside the
  #           expert matmul; not trainable (the optimizer refuses them unless experts are frozen).
  expert_format: Literal["bf16", "mxfp4"] = "bf16"
  #   None           experts compute in the dtype they are stored in;
  #   "mxfp4_mxfp8"  every routed expert matmul sees MXFP4 weights (the exporter's codes:
  #                  float masters fake-quantised, or packed "mxfp4" experts as they are) and
  #                  MXFP8 (E4M3, 32-value blocks) inputs — the input of w1/w3 and of w2 —
  #                  with straight-through gradients (k3jax/quant/qat.py). Set it both to train
  #                  (bf16 experts) and to serve (mxfp4 experts): the served path is then the
  #                  trained forward.
  expert_qat: Literal["mxfp4_mxfp8"] | None = None

  # --- LoRA adapters (docs/notes/lora.md): y = x·W + (lora_alpha / lora_rank)·(x·A)·B on the
  # projections named by `lora_targets` (LORA_TARGETS), A [in, r] and B [r, out] (B zero at
  # init) in the Flax collection "lora"; the base weights stay untouched (and may be packed
  # MXFP4 experts: QLoRA). lora_rank 0: no adapters, the plain model.
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = ("q", "k", "v", "o")

  # --- EAGLE-3 draft (§10, §13; docs/notes/eagle.md): the MTP layer's feature input is
  # `draft_fuse`([B_j for j in eagle_blocks]) instead of the final hidden state, B_j being the
  # AttnRes representation of layer block j (0: the embeddings, 1 … num_attn_res_blocks: the
  # blocks' sums in order, the last one being the running sum at the end of the stack; −1
  # names the last). K3 served with (1, 4, −1). None: the plain MTP layer.
  eagle_blocks: tuple[int, ...] | None = None

  # --- Quantile Balancing statistics sown by MoE layers (§7)
  qb_num_bins: int = 1000
  qb_range: tuple[float, float] = (-2.0, 2.0)

  def __post_init__(self):
    self.validate()

  def replace(self, **overrides: Any) -> "RunModes":
    return dataclasses.replace(self, **overrides)

  def validate(self) -> None:
    def bad(field: str, msg: str):
      _bad(MODES, field, msg)

    _check_ints(MODES, self, ("kda_chunk_size", "qb_num_bins"), ())
    if self.kda_chunk_size % 16:
      bad("kda_chunk_size", f"must be a multiple of the 16-token tile, found {self.kda_chunk_size}")
    if self.mla_query_block is not None and (
        not isinstance(self.mla_query_block, int) or self.mla_query_block <= 0):
      bad("mla_query_block", f"expected a positive int or None, found {self.mla_query_block!r}")
    if self.mla_key_block is not None and (
        not isinstance(self.mla_key_block, int) or isinstance(self.mla_key_block, bool)
        or self.mla_key_block <= 0):
      bad("mla_key_block", f"expected a positive int or None, found {self.mla_key_block!r}")
    if self.ce_chunks is not None and (not isinstance(self.ce_chunks, int)
                                       or isinstance(self.ce_chunks, bool) or self.ce_chunks <= 0):
      bad("ce_chunks", f"expected a positive int or None, found {self.ce_chunks!r}")
    if self.remat_offload and not self.remat:
      bad("remat_offload", "offloads what remat keeps: set remat=True too")
    if self.kernel_backend not in ("xla", "pallas", "auto"):
      bad("kernel_backend", f"expected 'xla', 'pallas' or 'auto', found {self.kernel_backend!r}")
    if self.expert_format not in ("bf16", "mxfp4"):
      bad("expert_format", f"expected 'bf16' or 'mxfp4', found {self.expert_format!r}")
    if self.expert_qat not in (None, "mxfp4_mxfp8"):
      bad("expert_qat", f"expected None or 'mxfp4_mxfp8', found {self.expert_qat!r}")
    for f in ("dtype", "param_dtype"):
      if getattr(self, f) not in ("float32", "bfloat16", "float16"):
        bad(f, f"expected 'float32', 'bfloat16' or 'float16', found {getattr(self, f)!r}")
    lo, hi = self.qb_range
    if not lo < hi:
      bad("qb_range", f"expected (low, high) with low < high, found {self.qb_range}")
    if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
      bad("moe_capacity_factor", f"expected None or > 0, found {self.moe_capacity_factor}")
    r = self.lora_rank
    if not isinstance(r, int) or isinstance(r, bool) or r < 0:
      bad("lora_rank", f"expected a non-negative int (0: no adapters), found {r!r}")
    if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, (int, float)) or (
        not self.lora_alpha > 0):
      bad("lora_alpha", f"expected a number > 0, found {self.lora_alpha!r}")
    t = self.lora_targets
    if not isinstance(t, tuple) or not all(isinstance(x, str) for x in t):
      bad("lora_targets", f"expected a tuple of names from {LORA_TARGETS}, found {t!r}")
    unknown = [x for x in t if x not in LORA_TARGETS]
    if unknown:
      bad("lora_targets", f"unknown target(s) {unknown}; expected names from {LORA_TARGETS}")
    if len(set(t)) != len(t):
      bad("lora_targets", f"duplicate names in {t}")
    if r and not t:
      bad("lora_targets", f"lora_rank={r} needs at least one target from {LORA_TARGETS}")
    e = self.eagle_blocks
    if e is not None and (not isinstance(e, tuple) or not e or not all(
        isinstance(j, int) and not isinstance(j, bool) for j in e)):
      bad("eagle_blocks", f"expected None or a non-empty tuple of block indices, found {e!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Kimi K3 / Kimi Linear style model: what it is (`text`, `vision`) and how it runs
  (`modes`), each a validated record, and the checks that span them.

  `preset(name, **overrides)` and `replace(**overrides)` take any field of the records by its
  own name (the names are unique across `TextConfig` and `RunModes`):
  `preset("tiny", num_layers=4, dtype="bfloat16")` sets text.num_layers and modes.dtype.
  """

  name: str = "custom"
  text: TextConfig = TextConfig()
  # --- Native vision (§11): the tower + projector, or None for a text-only model. The
  # projector's outputs replace the embeddings at `media_placeholder_token_id` positions.
  vision: VisionConfig | None = None
  media_placeholder_token_id: int | None = None
  modes: RunModes = RunModes()

  def __post_init__(self):
    self.validate()

  def replace(self, **overrides: Any) -> "ModelConfig":
    """This config with `overrides`: top-level fields (`name`, `text`, `vision`,
    `media_placeholder_token_id`, `modes`) or any field of `TextConfig` / `RunModes` by its
    own name."""
    top, text, modes = _route(overrides)
    if text:
      top["text"] = top.get("text", self.text).replace(**text)
    if modes:
      top["modes"] = top.get("modes", self.modes).replace(**modes)
    return dataclasses.replace(self, **top)

  def for_inference(self) -> "ModelConfig":
    """This config for generation and scoring: dropless MoE. A capacity factor is a
    training-time layout choice; with the few tokens of a decode step it would drop tokens
    that pick the same expert."""
    return self.replace(moe_capacity_factor=None)

  def eagle_block_indices(self) -> tuple[int, ...]:
    """modes.eagle_blocks with −1 resolved to text.num_attn_res_blocks (the last block)."""
    n = self.text.num_attn_res_blocks
    return tuple(n if j == -1 else j for j in self.modes.eagle_blocks or ())

  def lora_on(self, target: str) -> bool:
    """Whether projections of LoRA target `target` (LORA_TARGETS) carry adapters."""
    if target not in LORA_TARGETS:
      raise ValueError(f"lora target: unknown name {target!r}; expected one of {LORA_TARGETS}")
    return self.modes.lora_rank > 0 and target in self.modes.lora_targets

  @property
  def lora_scale(self) -> float:
    """alpha / r, the factor of the adapter path (0 without adapters)."""
    m = self.modes
    return m.lora_alpha / m.lora_rank if m.lora_rank else 0.0

  # ------------------------------------------------------------------ validation
  def validate(self) -> None:
    """The checks that span the records (each record checks its own fields)."""
    def bad(field: str, msg: str):
      _bad("ModelConfig", field, msg)

    for name, cls in (("text", TextConfig), ("modes", RunModes)):
      if not isinstance(getattr(self, name), cls):
        bad(name, f"expected a {cls.__name__}, found {type(getattr(self, name)).__name__}")
    t, m = self.text, self.modes
    for f in ("expert_format", "expert_qat"):
      on = m.expert_format == "mxfp4" if f == "expert_format" else m.expert_qat is not None
      if on and t.num_experts and (t.expert_in_dim % 32 or t.moe_intermediate_size % 32):
        # MX blocks run 32 values along every expert matmul's input axis (ℓ or d, and F).
        bad(f"modes.{f}", f"{getattr(m, f)!r} needs expert widths divisible by 32, found "
            f"in={t.expert_in_dim}, moe_intermediate_size={t.moe_intermediate_size}")
    if m.eagle_blocks is not None:
      if not t.num_mtp_layers:
        bad("modes.eagle_blocks", "the EAGLE-3 draft is the MTP layer: needs num_mtp_layers=1, "
            "found 0")
      if t.attn_res_block_size is None:
        bad("modes.eagle_blocks", "needs Block AttnRes (attn_res_block_size), found None")
      n = t.num_attn_res_blocks
      out = [j for j in m.eagle_blocks if not (-1 <= j <= n)]
      if out:
        bad("modes.eagle_blocks",
            f"indices {out} out of range: 0 … {n} (num_attn_res_blocks) or -1")
    pid = self.media_placeholder_token_id
    if self.vision is None:
      if pid is not None:
        bad("media_placeholder_token_id", f"{pid} is set but vision is None (a text-only "
            "model has no media to place)")
      return
    if not isinstance(self.vision, VisionConfig):
      bad("vision", f"expected a VisionConfig or None, found {type(self.vision).__name__}")
    if self.vision.text_hidden_size != t.d_model:
      bad("vision", f"the projector's text_hidden_size {self.vision.text_hidden_size} must "
          f"equal d_model={t.d_model}")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 <= pid < t.vocab_size:
      bad("media_placeholder_token_id", f"a model with vision needs a token id in "
          f"[0, vocab_size={t.vocab_size}), found {pid!r}")


TEXT_FIELDS = tuple(f.name for f in dataclasses.fields(TextConfig))
MODE_FIELDS = tuple(f.name for f in dataclasses.fields(RunModes))
TOP_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
assert not set(TEXT_FIELDS) & set(MODE_FIELDS) and not (
    set(TEXT_FIELDS) | set(MODE_FIELDS)) & set(TOP_FIELDS), "field names must be unique"


def _route(fields: dict) -> tuple[dict, dict, dict]:
  """Flat field names → (ModelConfig's own, TextConfig's, RunModes'); unknown names are a
  ValueError naming them."""
  top, text, modes, unknown = {}, {}, {}, []
  for k, v in fields.items():
    if k in TOP_FIELDS:
      top[k] = v
    elif k in TEXT_FIELDS:
      text[k] = v
    elif k in MODE_FIELDS:
      modes[k] = v
    else:
      unknown.append(k)
  if unknown:
    raise ValueError(f"unknown ModelConfig field(s) {sorted(unknown)}")
  return top, text, modes


# ---------------------------------------------------------------------- presets
# Presets are flat {field: value} dicts (any record's field by its own name); the dataclass
# defaults are K3's text model (Table 1).
def _k3() -> dict:
  # The release carries MoonViT-V2 (§11).
  return dict(name="k3", vision=vision_preset("moonvit_v2"), media_placeholder_token_id=163605)


def _kimi_linear_48b() -> dict:
  return dict(
      name="kimi_linear_48b", vocab_size=163840, d_model=2304, num_layers=27,
      mla_every=4, mla_last=True, first_dense_layers=1,
      kda_num_heads=32, kda_head_dim=128, kda_lower_bound=None, kda_gate_rank=128,
      full_rank_gates=False,
      num_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
      qk_rope_head_dim=64, v_head_dim=128, mla_output_gate=False,
      activation="swiglu", dense_intermediate_size=9216, num_experts=256, experts_per_token=8,
      num_shared_experts=1, moe_intermediate_size=1024, latent_moe_dim=None,
      routed_scaling_factor=2.446, attn_res_block_size=None, num_mtp_layers=0,
  )


def _small() -> dict:
  # ~100M total parameters (mostly experts); trains on a 2-core CPU in minutes.
  return dict(
      name="small", vocab_size=512, d_model=512, num_layers=8,
      kda_num_heads=4, kda_head_dim=64, kda_gate_rank=64,
      num_heads=4, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
      v_head_dim=64,
      dense_intermediate_size=1536, num_experts=64, experts_per_token=8, num_shared_experts=2,
      moe_intermediate_size=256, latent_moe_dim=256, attn_res_block_size=4,
  )


def _tiny() -> dict:
  # Seconds per test. 13 layers: prefix 0–3, two scanned groups 4–11, suffix 12 (MLA);
  # AttnRes blocks of 4 so blocks are appended inside the scanned body too.
  return dict(
      name="tiny", vocab_size=256 + 16, d_model=64, num_layers=13,
      kda_num_heads=2, kda_head_dim=16, kda_gate_rank=16, kda_chunk_size=16,
      num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
      v_head_dim=16,
      dense_intermediate_size=128, num_experts=8, experts_per_token=2, num_shared_experts=1,
      moe_intermediate_size=32, latent_moe_dim=32, attn_res_block_size=4,
  )


def _tiny_multimodal() -> dict:
  # tiny + a 2-layer MoonViT-V2 tower; id 260 is the byte tokenizer's <media> placeholder.
  return {**_tiny(), **dict(name="tiny_multimodal", media_placeholder_token_id=260,
                            vision=vision_preset("tiny_moonvit_v2", text_hidden_size=64))}


def _tiny_kimi_linear() -> dict:
  return {**_kimi_linear_48b(), **dict(
      name="tiny_kimi_linear", vocab_size=256 + 16, d_model=64, num_layers=6,
      kda_num_heads=2, kda_head_dim=16, kda_gate_rank=16, kda_chunk_size=16,
      num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
      dense_intermediate_size=128, num_experts=8, experts_per_token=2, num_shared_experts=1,
      moe_intermediate_size=32, routed_scaling_factor=1.0)}


PRESETS = {
    "k3": _k3,
    "kimi_linear_48b": _kimi_linear_48b,
    "small": _small,
    "tiny": _tiny,
    "tiny_multimodal": _tiny_multimodal,
    "tiny_kimi_linear": _tiny_kimi_linear,
}


def model_config_from_flat(fields: dict) -> ModelConfig:
  """A ModelConfig from flat {field: value} (any record's field by its own name; lists become
  tuples, a vision dict or preset name a VisionConfig; unknown names are a ValueError)."""
  fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
  top, text, modes = _route(fields)
  if "vision" in top:
    top["vision"] = as_vision_config(top["vision"])
  # A record given whole takes the loose fields of its kind on top.
  top["text"] = top["text"].replace(**text) if "text" in top else TextConfig(**text)
  top["modes"] = top["modes"].replace(**modes) if "modes" in top else RunModes(**modes)
  return ModelConfig(**top)


def preset(name: str, **overrides: Any) -> ModelConfig:
  """A validated preset, with `overrides` applied: any field of ModelConfig, TextConfig or
  RunModes by its own name (unknown fields raise ValueError)."""
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
  return model_config_from_flat({**PRESETS[name](), **overrides})


# ---------------------------------------------------------------------- as JSON (checkpoints)
def _jsonable(x):
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items()}
  return list(x) if isinstance(x, tuple) else x


def config_to_dict(config: ModelConfig) -> dict:
  """The config as a JSON-ready nested dict (what checkpoints store)."""
  return _jsonable(dataclasses.asdict(config))


def flat_fields(config: ModelConfig) -> dict:
  """{field: value} of every field of every record, flat (the vision tower as its dict)."""
  d = config_to_dict(config)
  return {**{k: v for k, v in d.items() if k not in ("text", "modes")}, **d["text"],
          **d["modes"]}


def config_from_dict(d: dict) -> ModelConfig:
  """`config_to_dict`'s inverse. Also reads the flat form checkpoints written before the
  records were grouped (every field at the top). Unknown fields are a ValueError naming them."""
  d = dict(d)
  for rec in ("text", "modes"):
    d.update(d.pop(rec, None) or {})
  try:
    return model_config_from_flat(d)
  except ValueError as e:
    raise ValueError(f"model_config: {e} in checkpoint") from None


def config_diff(a: ModelConfig, b: ModelConfig) -> dict:
  """{field: (a value, b value)} of the fields that differ (flat names)."""
  da, db = flat_fields(a), flat_fields(b)
  return {k: (da.get(k), db.get(k)) for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k)}


def dtype_of(name: str):
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


__all__ = ["ModelConfig", "TextConfig", "RunModes", "VisionConfig", "preset", "vision_preset",
           "as_vision_config", "model_config_from_flat", "flat_fields", "config_to_dict",
           "config_from_dict", "config_diff", "dtype_of", "PRESETS", "VISION_PRESETS",
           "DEFAULT_BUCKETS", "KDA", "MLA", "DENSE", "MOE", "LORA_TARGETS"]
