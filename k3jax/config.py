"""Model configuration: one frozen dataclass and the named presets.

`ModelConfig` is data only: every architectural switch of the Kimi family is a field, and
`validate()` (run by the constructor) rejects combinations the model cannot build, naming the
field. Layer layout is derived, never stored: `layer_types()` gives the token mixer and MLP kind
of every layer, and `stack_layout()` splits the stack into an unrolled prefix, a repeating body
of identical groups (scanned with `nn.scan` when `scan_layers=True`) and an unrolled suffix.
`config.json` ⇄ `ModelConfig` is `k3jax.hf_config.from_hf_config` / `to_hf_config` (that module
imports this one, never the reverse).

Spec references: K3_SPEC.md §1 (Table 1), §2 (layout), §3–6 (components), §9 (HF config keys).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal

from k3jax.presets import from_presets

if TYPE_CHECKING:
  from k3jax.vision.config import VisionConfig

KDA = "kda"
MLA = "mla"
DENSE = "dense"
MOE = "moe"

# LoRA target names (ModelConfig.lora_targets) → the projections they adapt:
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


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a Kimi K3 / Kimi Linear style model.

  Dimensions follow the spec's names: `d_model` is d, `latent_moe_dim` is ℓ.
  """

  name: str = "custom"
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
  kda_chunk_size: int = 64

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
  # Training/prefill attention over more queries than this runs in query blocks of this size,
  # each rematerialised in the backward pass (temporaries [B,H,block,S] instead of [B,H,T,S]);
  # None: all queries at once. Numerics are the same.
  mla_query_block: int | None = 512

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
  # Capacity per expert = ceil(capacity_factor * tokens * k / num_experts); None = dropless.
  moe_capacity_factor: float | None = None

  # --- Block Attention Residuals (§5); None = plain pre-norm residuals
  attn_res_block_size: int | None = 12

  # --- Multi-token prediction (one extra layer predicting token t+2)
  num_mtp_layers: int = 1

  # --- Native vision (§11): the tower + projector, or None for a text-only model. The
  # projector's outputs replace the embeddings at `media_placeholder_token_id` positions.
  vision: VisionConfig | None = None
  media_placeholder_token_id: int | None = None

  # --- Quantile Balancing statistics sown by MoE layers (§7)
  qb_num_bins: int = 1000
  qb_range: tuple[float, float] = (-2.0, 2.0)

  # --- numerics and compilation
  dtype: str = "float32"           # compute dtype for matmuls ("bfloat16" on accelerators)
  param_dtype: str = "float32"     # Linear + expert kernels (fp32 masters; "bfloat16" halves
                                   # them; vectors, norms, convs and the router stay fp32)
  scan_layers: bool = True         # nn.scan over the repeating body (fast compile of 93 layers)
  remat: bool = False              # rematerialise each layer (scanned group) in the backward
  kernel_backend: Literal["xla", "pallas", "auto"] = "xla"
  # Routed expert weights' storage (docs/notes/moe.md, "Packed MXFP4 experts"):
  #   "bf16"  unquantised, in `param_dtype` (trainable; the name follows the release's
  #           vocabulary for "not MXFP4" — with param_dtype="float32" they are fp32 masters);
  #   "mxfp4" the release's bytes: `experts/{w1,w3,w2}/weight_packed` uint8 (two E2M1 codes a
  #           byte) + `weight_scale` uint8 (E8M0, one per 32 inputs), dequantised inside the
  #           expert matmul; not trainable (the optimizer refuses them unless experts are frozen).
  expert_format: Literal["bf16", "mxfp4"] = "bf16"
  # Quantisation-aware training of the routed experts (spec §13, docs/notes/qat.md):
  #   None           experts compute in the dtype they are stored in;
  #   "mxfp4_mxfp8"  every routed expert matmul sees MXFP4 weights (the exporter's codes:
  #                  float masters fake-quantised, or packed "mxfp4" experts as they are) and
  #                  MXFP8 (E4M3, 32-value blocks) inputs — the input of w1/w3 and of w2 —
  #                  with straight-through gradients (k3jax/quant/qat.py). Set it both to train
  #                  (bf16 experts) and to serve (mxfp4 experts): the served path is then the
  #                  trained forward. A k3jax-only field: the release's config.json stores no
  #                  activation quantisation (§12), so hf_config neither reads nor writes it.
  expert_qat: Literal["mxfp4_mxfp8"] | None = None

  # --- LoRA adapters (docs/notes/lora.md): y = x·W + (lora_alpha / lora_rank)·(x·A)·B on the
  # projections named by `lora_targets` (LORA_TARGETS), A [in, r] and B [r, out] (B zero at
  # init) in the Flax collection "lora"; the base weights stay untouched (and may be packed
  # MXFP4 experts: QLoRA). lora_rank 0: no adapters, the plain model.
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = ("q", "k", "v", "o")

  # --- EAGLE-3 draft (spec §10, §13; docs/notes/eagle.md): the MTP layer's feature input is
  # `draft_fuse`([B_j for j in eagle_blocks]) instead of the final hidden state, B_j being the
  # AttnRes representation of layer block j (0: the embeddings, 1 … num_attn_res_blocks: the
  # blocks' sums in order, the last one being the running sum at the end of the stack; −1
  # names the last). K3 served with (1, 4, −1). None: the plain MTP layer.
  eagle_blocks: tuple[int, ...] | None = None

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

  def replace(self, **overrides: Any) -> "ModelConfig":
    return dataclasses.replace(self, **overrides)

  def for_inference(self) -> "ModelConfig":
    """This config for generation and scoring: dropless MoE. A capacity factor is a
    training-time layout choice; with the few tokens of a decode step it would drop tokens
    that pick the same expert."""
    return self.replace(moe_capacity_factor=None)

  # ------------------------------------------------------------------ validation
  def validate(self) -> None:
    def bad(field: str, msg: str):
      raise ValueError(f"ModelConfig.{field}: {msg}")

    for f in ("vocab_size", "d_model", "num_layers", "mla_every", "kda_num_heads", "kda_head_dim",
              "kda_conv_size", "kda_gate_rank", "kda_chunk_size", "num_heads", "kv_lora_rank",
              "qk_nope_head_dim", "v_head_dim", "dense_intermediate_size",
              "moe_intermediate_size", "qb_num_bins"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        bad(f, f"expected a positive int, found {v!r}")
    for f in ("qk_rope_head_dim", "first_dense_layers", "num_experts", "experts_per_token",
              "num_shared_experts", "num_mtp_layers"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        bad(f, f"expected a non-negative int, found {v!r}")
    if self.first_dense_layers > self.num_layers:
      bad("first_dense_layers", f"{self.first_dense_layers} > num_layers={self.num_layers}")
    if self.first_dense_layers < self.num_layers:  # some MoE layers exist
      if self.num_experts < 1:
        bad("num_experts", "MoE layers need at least one expert")
      if not 1 <= self.experts_per_token <= self.num_experts:
        bad("experts_per_token",
            f"must be in [1, num_experts={self.num_experts}], found {self.experts_per_token}")
      if self.experts_per_token == self.num_experts:
        bad("experts_per_token", "must be < num_experts: Quantile Balancing reads the "
            "(k+1)-th score as the routing cutoff")
    if self.q_lora_rank is not None and self.q_lora_rank <= 0:
      bad("q_lora_rank", f"expected a positive int or None, found {self.q_lora_rank!r}")
    if self.mla_query_block is not None and (
        not isinstance(self.mla_query_block, int) or self.mla_query_block <= 0):
      bad("mla_query_block", f"expected a positive int or None, found {self.mla_query_block!r}")
    if self.latent_moe_dim is not None and self.latent_moe_dim <= 0:
      bad("latent_moe_dim", f"expected a positive int or None, found {self.latent_moe_dim!r}")
    if self.kda_lower_bound is not None and not (
        -88.0 / 16 <= self.kda_lower_bound < 0):
      # The chunked form rescales by exp(-cumulative decay) inside 16-token tiles:
      # |lower_bound| * 16 must stay below ln(fp32 max) ≈ 88.7 (§3).
      bad("kda_lower_bound", f"expected None or a value in [-5.5, 0), found {self.kda_lower_bound}")
    if self.kda_a_log_axis not in ("head", "channel"):
      bad("kda_a_log_axis", f"expected 'head' (A_log [H]) or 'channel' (A_log [K], shared by "
          f"the heads), found {self.kda_a_log_axis!r}")
    if self.kda_chunk_size % 16:
      bad("kda_chunk_size", f"must be a multiple of the 16-token tile, found {self.kda_chunk_size}")
    if self.activation not in ("situ", "swiglu"):
      bad("activation", f"expected 'situ' or 'swiglu', found {self.activation!r}")
    if self.attn_res_block_size is not None and self.attn_res_block_size <= 0:
      bad("attn_res_block_size", f"expected a positive int or None, found {self.attn_res_block_size}")
    if self.mla_last and not self.is_mla(self.num_layers - 1):
      bad("mla_last", "internal: last layer is not MLA")
    if self.kernel_backend not in ("xla", "pallas", "auto"):
      bad("kernel_backend", f"expected 'xla', 'pallas' or 'auto', found {self.kernel_backend!r}")
    if self.expert_format not in ("bf16", "mxfp4"):
      bad("expert_format", f"expected 'bf16' or 'mxfp4', found {self.expert_format!r}")
    if self.expert_format == "mxfp4" and self.num_experts and (
        (self.latent_moe_dim or self.d_model) % 32 or self.moe_intermediate_size % 32):
      # MXFP4 blocks run 32 values along each expert matrix's input axis (ℓ or d, and F).
      bad("expert_format", f"'mxfp4' needs expert widths divisible by 32, found "
          f"in={self.latent_moe_dim or self.d_model}, moe_intermediate_size="
          f"{self.moe_intermediate_size}")
    if self.expert_qat not in (None, "mxfp4_mxfp8"):
      bad("expert_qat", f"expected None or 'mxfp4_mxfp8', found {self.expert_qat!r}")
    if self.expert_qat is not None and self.num_experts and (
        (self.latent_moe_dim or self.d_model) % 32 or self.moe_intermediate_size % 32):
      # MX blocks run 32 values along every expert matmul's input axis (ℓ or d, and F).
      bad("expert_qat", f"{self.expert_qat!r} needs expert widths divisible by 32, found "
          f"in={self.latent_moe_dim or self.d_model}, moe_intermediate_size="
          f"{self.moe_intermediate_size}")
    for f in ("dtype", "param_dtype"):
      if getattr(self, f) not in ("float32", "bfloat16", "float16"):
        bad(f, f"expected 'float32', 'bfloat16' or 'float16', found {getattr(self, f)!r}")
    lo, hi = self.qb_range
    if not lo < hi:
      bad("qb_range", f"expected (low, high) with low < high, found {self.qb_range}")
    if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
      bad("moe_capacity_factor", f"expected None or > 0, found {self.moe_capacity_factor}")
    if self.num_mtp_layers > 1:
      bad("num_mtp_layers", f"0 or 1 supported, found {self.num_mtp_layers}")
    # The hybrid needs global attention at the end of the stack (K3 and Kimi Linear both end
    # on MLA): a stack without any MLA layer, or a spec preset missing the final MLA, is wrong.
    if not any(self.is_mla(i) for i in range(self.num_layers)):
      bad("num_layers", f"{self.num_layers} layers with mla_every={self.mla_every} and "
          "mla_last=False leave no MLA layer")
    self._validate_lora(bad)
    self._validate_vision(bad)
    self._validate_eagle(bad)

  def _validate_eagle(self, bad) -> None:
    e = self.eagle_blocks
    if e is None:
      return
    if not isinstance(e, tuple) or not e or not all(
        isinstance(j, int) and not isinstance(j, bool) for j in e):
      bad("eagle_blocks", f"expected None or a non-empty tuple of block indices, found {e!r}")
    if not self.num_mtp_layers:
      bad("eagle_blocks", "the EAGLE-3 draft is the MTP layer: needs num_mtp_layers=1, found 0")
    if self.attn_res_block_size is None:
      bad("eagle_blocks", "needs Block AttnRes (attn_res_block_size), found None")
    n = self.num_attn_res_blocks
    out = [j for j in e if not (-1 <= j <= n)]
    if out:
      bad("eagle_blocks", f"indices {out} out of range: 0 … {n} (num_attn_res_blocks) or -1")

  def eagle_block_indices(self) -> tuple[int, ...]:
    """eagle_blocks with −1 resolved to num_attn_res_blocks (the last block)."""
    n = self.num_attn_res_blocks
    return tuple(n if j == -1 else j for j in self.eagle_blocks or ())

  def _validate_lora(self, bad) -> None:
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

  def lora_on(self, target: str) -> bool:
    """Whether projections of LoRA target `target` (LORA_TARGETS) carry adapters."""
    if target not in LORA_TARGETS:
      raise ValueError(f"lora target: unknown name {target!r}; expected one of {LORA_TARGETS}")
    return self.lora_rank > 0 and target in self.lora_targets

  @property
  def lora_scale(self) -> float:
    """alpha / r, the factor of the adapter path (0 without adapters)."""
    return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

  def _validate_vision(self, bad) -> None:
    pid = self.media_placeholder_token_id
    if self.vision is None:
      if pid is not None:
        bad("media_placeholder_token_id", f"{pid} is set but vision is None (a text-only model "
            "has no media to place)")
      return
    from k3jax.vision.config import VisionConfig  # the vision package imports this module
    if not isinstance(self.vision, VisionConfig):
      bad("vision", f"expected a VisionConfig or None, found {type(self.vision).__name__}")
    if self.vision.text_hidden_size != self.d_model:
      bad("vision", f"the projector's text_hidden_size {self.vision.text_hidden_size} must "
          f"equal d_model={self.d_model}")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 <= pid < self.vocab_size:
      bad("media_placeholder_token_id", f"a model with vision needs a token id in "
          f"[0, vocab_size={self.vocab_size}), found {pid!r}")


# ---------------------------------------------------------------------- presets
def _k3() -> dict:
  # The dataclass defaults are K3's text model (Table 1); the release carries MoonViT-V2 (§11).
  from k3jax.vision.config import vision_preset  # the vision package imports this module
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
  from k3jax.vision.config import vision_preset  # the vision package imports this module
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


def preset(name: str, **overrides: Any) -> ModelConfig:
  """A validated preset, with `overrides` applied (unknown fields raise ValueError)."""
  return from_presets(ModelConfig, PRESETS, name, overrides)


def dtype_of(name: str):
  import jax.numpy as jnp
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


__all__ = ["ModelConfig", "preset", "PRESETS", "dtype_of", "KDA", "MLA", "DENSE", "MOE",
           "LORA_TARGETS"]
