"""`config.json` (Hugging Face / Moonshot layout) ⇄ `ModelConfig`.

Two source layouts (docs/k3.md §9):
- Kimi Linear (`model_type: "kimi_linear"`, flat): softplus decay, rank-r output gate,
  `q_lora_rank: null`, classic MoE, SwiGLU, no AttnRes.
- Kimi K3 (`model_type: "kimi_k3"`): the language model under `text_config` (itself
  `model_type: "kimi_linear"`) with the K3 additions (`gate_lower_bound`, `use_full_rank_gate`,
  `routed_expert_hidden_size`, `attn_res_block_size`, SiTU, MLA output gate), and beside it
  the vision tower's `vision_config` and `media_placeholder_token_id` (§11) when present.

`from_hf_config` refuses what our model cannot reproduce (grouped top-k that actually restricts
groups, non-sigmoid routers, no renormalisation, RoPE, biases, a layer layout other than
"MLA every N (+ last)") with a ValueError naming the key, rather than silently converting into a
different network. Keys it accepts although they ask for something our model does not do,
because no weight depends on them, are listed by `ignored_keys` (the converter prints them):
`num_key_value_heads` != `num_attention_heads` is one (MLA has no GQA).
"""

from __future__ import annotations

import re
from typing import Any

from k3jax.config import ModelConfig, model_config_from_flat
from k3jax.config import VisionConfig, vision_preset

K3_MODEL_TYPE = "kimi_k3"
KIMI_LINEAR_MODEL_TYPE = "kimi_linear"


def _bad(key: str, expected: str, found: Any):
  raise ValueError(f"config.json key {key!r}: expected {expected}, found {found!r}")


def text_config(d: dict) -> dict:
  """The language-model part of a config dict (K3 nests it under `text_config`)."""
  if not isinstance(d, dict):
    _bad("<root>", "a JSON object", type(d).__name__)
  if d.get("model_type") == K3_MODEL_TYPE or "text_config" in d:
    tc = d.get("text_config")
    if not isinstance(tc, dict):
      _bad("text_config", "an object (model_type kimi_k3 keeps the language model there)", tc)
    return tc
  return d


def detect_arch(d: dict) -> str:
  """'kimi_k3' or 'kimi_linear' from a config dict."""
  if d.get("model_type") == K3_MODEL_TYPE or "text_config" in d:
    return "kimi_k3"
  if d.get("model_type") in (KIMI_LINEAR_MODEL_TYPE, None):
    return "kimi_linear"
  _bad("model_type", "'kimi_linear' or 'kimi_k3'", d.get("model_type"))


# k3jax's own `linear_attn_config` key saying how A_log is read (ModelConfig.text.kda_a_log_axis):
# true for one rate per key channel. The release's config.json does not say (§12), so the
# exporter writes the key only for the per-channel reading: a per-head export reads like the
# release, a per-channel one converts back without the `--a_log` flag.
A_LOG_PER_CHANNEL = "a_log_per_channel"


def declared_a_log_axis(d: dict) -> str | None:
  """"channel" or "head" when a config dict's linear_attn_config says how to read A_log
  (`a_log_per_channel`), None when it does not (the release)."""
  lac = text_config(d).get("linear_attn_config") or {}
  if A_LOG_PER_CHANNEL not in lac:
    return None
  v = lac[A_LOG_PER_CHANNEL]
  if not isinstance(v, bool):
    _bad(f"linear_attn_config.{A_LOG_PER_CHANNEL}", "true or false", v)
  return "channel" if v else "head"


def _first(d: dict, *keys, default=None):
  for k in keys:
    if k in d:
      return d[k]
  return default


def _layer_kinds(tc: dict, n: int) -> list[str]:
  """'kda' / 'mla' per 0-based layer from linear_attn_config (1-based lists) or layer_types."""
  lac = tc.get("linear_attn_config") or {}
  if "full_attn_layers" in lac:
    full = lac["full_attn_layers"]
    kda = lac.get("kda_layers", [i for i in range(1, n + 1) if i not in full])
    kinds = [None] * n
    for i in full:
      if not 1 <= i <= n:
        _bad("linear_attn_config.full_attn_layers", f"1-based layer indices in [1, {n}]", i)
      kinds[i - 1] = "mla"
    for i in kda:
      if not 1 <= i <= n:
        _bad("linear_attn_config.kda_layers", f"1-based layer indices in [1, {n}]", i)
      if kinds[i - 1] is not None:
        _bad("linear_attn_config.kda_layers", "layers disjoint from full_attn_layers", i)
      kinds[i - 1] = "kda"
    if None in kinds:
      _bad("linear_attn_config", f"every layer 1..{n} in kda_layers or full_attn_layers",
           [i + 1 for i, k in enumerate(kinds) if k is None])
    return kinds
  if tc.get("layer_types") is not None:
    names = {"full_attention": "mla", "linear_attention": "kda"}
    lt = tc["layer_types"]
    if len(lt) != n or any(t not in names for t in lt):
      _bad("layer_types", f"{n} entries of {sorted(names)}", lt)
    return [names[t] for t in lt]
  _bad("linear_attn_config.full_attn_layers", "the list of MLA layers (or layer_types)", None)


def _layout_from_kinds(kinds: list[str]) -> tuple[int, bool]:
  """(mla_every, mla_last) reproducing `kinds` exactly, or ValueError."""
  n = len(kinds)
  mla = [i for i, k in enumerate(kinds) if k == "mla"]
  if not mla:
    _bad("linear_attn_config.full_attn_layers", "at least one MLA layer", [])
  for every in range(1, n + 1):
    for last in (True, False):   # equivalent when the last layer is MLA anyway: prefer True
      want = ["mla" if (i % every == every - 1 or (last and i == n - 1)) else "kda"
              for i in range(n)]
      if want == kinds:
        return every, last
  _bad("linear_attn_config.full_attn_layers",
       "MLA every N layers (1-based N, 2N, …) and optionally the last layer",
       [i + 1 for i in mla])


def from_hf_config(d: dict, **overrides: Any) -> ModelConfig:
  """ModelConfig of a Kimi Linear or Kimi K3 `config.json` dict.

  `overrides` set fields that config.json does not describe (dtype, scan_layers, name, …).
  """
  arch = detect_arch(d)
  tc = text_config(d)
  lac = tc.get("linear_attn_config") or {}
  if check_quantization_config(d) and arch != "kimi_k3":
    _bad("quantization_config", "absent (Kimi Linear stores its experts unquantised)",
         d.get("quantization_config"))

  def req(key, *aliases):
    v = _first(tc, key, *aliases)
    if v is None:
      _bad(key, "a value", None)
    return v

  n = int(req("num_hidden_layers"))
  kinds = _layer_kinds(tc, n)
  mla_every, mla_last = _layout_from_kinds(kinds)

  mlp_types = tc.get("mlp_layer_types")
  if mlp_types is not None:
    if len(mlp_types) != n or any(t not in ("dense", "sparse") for t in mlp_types):
      _bad("mlp_layer_types", f"{n} entries of 'dense'/'sparse'", mlp_types)
    first_dense = mlp_types.index("sparse") if "sparse" in mlp_types else n
    if mlp_types != ["dense"] * first_dense + ["sparse"] * (n - first_dense):
      _bad("mlp_layer_types", "dense layers first, then MoE layers", mlp_types)
  else:
    first_dense = int(_first(tc, "first_k_dense_replace", default=1))
  if _first(tc, "moe_layer_freq", default=1) != 1:
    _bad("moe_layer_freq", "1 (every layer after the dense ones is MoE)", tc["moe_layer_freq"])

  # --- checks of behaviours our model implements in one way only
  act = _first(tc, "moe_router_activation_func", default="sigmoid")
  if act != "sigmoid":
    _bad("moe_router_activation_func", "'sigmoid'", act)
  if not _first(tc, "moe_renormalize", "norm_topk_prob", default=True):
    _bad("moe_renormalize", "true (top-k weights renormalised)", tc.get("moe_renormalize"))
  groups = int(_first(tc, "num_expert_group", "n_group", default=1) or 1)
  topk_group = int(_first(tc, "topk_group", default=groups) or groups)
  if topk_group != groups:
    # Group-limited selection (DeepSeek-V3 style) only changes routing when topk_group < groups.
    _bad("topk_group", f"== num_expert_group ({groups}); group-limited top-k is not implemented",
         topk_group)
  tm = tc.get("topk_method")
  if tm not in (None, "noaux_tc", "greedy"):
    _bad("topk_method", "'noaux_tc' or absent", tm)
  if tc.get("attention_bias"):
    _bad("attention_bias", "false", True)
  heads = int(req("num_attention_heads"))
  # num_key_value_heads is not read: see ignored_keys.
  if not _first(tc, "mla_use_nope", default=True):
    _bad("mla_use_nope", "true (NoPE MLA; no rotary embedding)", False)
  if tc.get("use_full_rank_gate") is not None and "use_full_rank_gate" not in lac:
    lac = {**lac, "use_full_rank_gate": tc["use_full_rank_gate"]}

  hidden_act = _first(tc, "hidden_act", default="silu")
  acts = {"silu": "swiglu", "swiglu": "swiglu", "situ": "situ"}
  if hidden_act not in acts:
    _bad("hidden_act", f"one of {sorted(acts)}", hidden_act)

  head_dim = int(_first(lac, "head_dim", default=_first(tc, "linear_head_dim", default=128)))
  latent = _first(tc, "routed_expert_hidden_size", default=None)
  if latent is not None and not _first(tc, "latent_moe_use_norm", default=True):
    _bad("latent_moe_use_norm", "true (RMSNorm on the latent expert output)", False)
  mtp = int(_first(tc, "num_nextn_predict_layers", "num_mtp_layers", default=0) or 0)

  kw = dict(
      name=str(overrides.pop("name", f"hf_{arch}")),
      vocab_size=int(req("vocab_size")),
      d_model=int(req("hidden_size")),
      num_layers=n,
      rms_norm_eps=float(_first(tc, "rms_norm_eps", default=1e-5)),
      tie_word_embeddings=bool(_first(tc, "tie_word_embeddings",
                                      default=d.get("tie_word_embeddings", False))),
      mla_every=mla_every, mla_last=mla_last, first_dense_layers=first_dense,
      kda_num_heads=int(_first(lac, "num_heads", default=_first(tc, "linear_num_heads", default=32))),
      kda_head_dim=head_dim,
      kda_conv_size=int(_first(lac, "short_conv_kernel_size",
                               default=_first(tc, "linear_conv_kernel_dim", default=4))),
      kda_lower_bound=_first(lac, "gate_lower_bound", default=None),
      kda_a_log_axis=declared_a_log_axis(d) or "head",
      # Moonshot's f_a / g_a project to head_dim; "gate_rank" is our extension for other ranks.
      kda_gate_rank=int(_first(lac, "gate_rank", default=head_dim)),
      full_rank_gates=bool(_first(lac, "use_full_rank_gate", default=False)),
      num_heads=heads,
      q_lora_rank=_first(tc, "q_lora_rank", default=None),
      kv_lora_rank=int(req("kv_lora_rank")),
      qk_nope_head_dim=int(req("qk_nope_head_dim")),
      qk_rope_head_dim=int(req("qk_rope_head_dim")),
      v_head_dim=int(req("v_head_dim")),
      mla_output_gate=bool(_first(tc, "mla_use_output_gate", default=False)),
      activation=acts[hidden_act],
      situ_beta1=float(_first(tc, "activation_situ_beta", default=4.0)),
      situ_beta2=float(_first(tc, "activation_situ_linear_beta", default=25.0)),
      dense_intermediate_size=int(req("intermediate_size")),
      num_experts=int(_first(tc, "num_experts", "num_local_experts", default=0)),
      experts_per_token=int(_first(tc, "num_experts_per_token", "num_experts_per_tok", default=0)),
      num_shared_experts=int(_first(tc, "num_shared_experts", "n_shared_experts", default=0)),
      moe_intermediate_size=int(req("moe_intermediate_size")),
      latent_moe_dim=None if latent is None else int(latent),
      routed_scaling_factor=float(_first(tc, "routed_scaling_factor", default=1.0)),
      attn_res_block_size=_first(tc, "attn_res_block_size", default=None),
      num_mtp_layers=mtp,
      **_vision_fields(d, int(req("hidden_size"))),
  )
  if kw["kda_lower_bound"] is not None:
    kw["kda_lower_bound"] = float(kw["kda_lower_bound"])
  if kw["q_lora_rank"] is not None:
    kw["q_lora_rank"] = int(kw["q_lora_rank"])
  try:
    return model_config_from_flat({**kw, **overrides})
  except ValueError as e:
    if "unknown ModelConfig field" in str(e):
      raise ValueError(f"overrides: {e}") from None
    raise


def _vision_fields(d: dict, d_model: int) -> dict:
  """{vision, media_placeholder_token_id} from the top level of a config dict (§11): both
  absent for a text-only model; a vision_config needs its placeholder id."""
  vc = d.get("vision_config")
  if vc is None:
    return {}
  if not isinstance(vc, dict):
    _bad("vision_config", "an object", vc)
  pid = d.get("media_placeholder_token_id")
  if not isinstance(pid, int) or isinstance(pid, bool):
    _bad("media_placeholder_token_id", "an int token id (a vision_config is present)", pid)
  return dict(vision=vision_config_from_hf(
      vc, text_hidden_size=d_model, projector_norm_eps=d.get("projection_layer_norm_eps")),
      media_placeholder_token_id=pid)


# ---------------------------------------------------------------------- quantization_config
MXFP4_FORMAT = "mxfp4-pack-quantized"
MXFP4_GROUP_SIZE = 32
# Module names (multimodal spelling, no ".weight") that the release's `ignore` list must cover
# (§12: only routed experts are MXFP4), and one it must not.
_MUST_IGNORE = {
    "self_attn": "language_model.model.layers.0.self_attn.q_proj",
    "shared_experts": "language_model.model.layers.1.block_sparse_moe.shared_experts.gate_proj",
    "lm_head": "language_model.lm_head",
    "vision_tower": "vision_tower.encoder.blocks.0.wqkv",
}
_MUST_QUANTIZE = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"


def release_quantization_config() -> dict:
  """The `quantization_config` export writes with MXFP4 routed experts (compressed-tensors
  style, §12): format mxfp4-pack-quantized, weight groups of 32 along the input axis, no input
  activation quantisation, everything but the routed experts ignored."""
  return {
      "quant_method": "compressed-tensors",
      "format": MXFP4_FORMAT,
      "quantization_status": "compressed",
      "config_groups": {"group_0": {
          "targets": ["Linear"], "format": MXFP4_FORMAT,
          "weights": {"num_bits": 4, "type": "float", "strategy": "group",
                      "group_size": MXFP4_GROUP_SIZE, "symmetric": True, "dynamic": False},
          "input_activations": None, "output_activations": None}},
      "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                 r"re:.*\.mlp\.(gate|up|down)_proj$", r"re:.*block_sparse_moe\.gate$",
                 r"re:.*routed_expert_(down|up)_proj$", "re:.*vision_tower.*",
                 "re:.*mm_projector.*"],
  }


def _ignore_matches(entry: str, module: str) -> bool:
  """compressed-tensors' rule: 're:PATTERN' matches by regex from the start, a plain entry is a
  module name (here also matched as a dotted suffix, so 'lm_head' covers
  'language_model.lm_head')."""
  if entry.startswith("re:"):
    return re.match(entry[3:], module) is not None
  return module == entry or module.endswith("." + entry)


def check_quantization_config(d: dict) -> str | None:
  """Validate the `quantization_config` of a config dict (top level, or inside text_config).

  Returns "mxfp4" when it describes the release's MXFP4 routed experts, None when there is
  none; anything else is a ValueError naming the key (format, group size, input activation
  quantisation, an ignore list that leaves a non-expert layer quantised or covers the experts).
  """
  qc = d.get("quantization_config")
  where = "quantization_config"
  if qc is None and isinstance(d.get("text_config"), dict):
    qc, where = d["text_config"].get("quantization_config"), "text_config.quantization_config"
  if qc is None:
    return None
  if not isinstance(qc, dict):
    _bad(where, "an object", qc)
  groups = qc.get("config_groups") or {}
  if not isinstance(groups, dict):
    _bad(f"{where}.config_groups", "an object", groups)
  formats = [(f"{where}.format", qc["format"])] if "format" in qc else []
  formats += [(f"{where}.config_groups.{g}.format", v["format"])
              for g, v in groups.items() if isinstance(v, dict) and "format" in v]
  if not formats:
    _bad(f"{where}.format", repr(MXFP4_FORMAT), None)
  for key, f in formats:
    if f != MXFP4_FORMAT:
      _bad(key, repr(MXFP4_FORMAT), f)
  sizes = [(f"{where}.config_groups.{g}.weights.group_size", (v.get("weights") or {}).get(
      "group_size")) for g, v in groups.items() if isinstance(v, dict)]
  sizes += [(f"{where}.{k}", qc[k]) for k in ("group_size", "weight_group_size") if k in qc]
  sizes = [(k, v) for k, v in sizes if v is not None]
  if not sizes:
    _bad(f"{where}.config_groups.*.weights.group_size", str(MXFP4_GROUP_SIZE), None)
  for key, v in sizes:
    if v != MXFP4_GROUP_SIZE:
      _bad(key, f"{MXFP4_GROUP_SIZE} (MXFP4 blocks share one scale per 32 values)", v)
  for g, v in groups.items():
    if isinstance(v, dict) and v.get("input_activations") is not None:
      _bad(f"{where}.config_groups.{g}.input_activations",
           "null (the file stores no activation quantisation)", v["input_activations"])
  ignore = qc.get("ignore")
  if not isinstance(ignore, list) or not all(isinstance(e, str) for e in ignore):
    _bad(f"{where}.ignore", "a list of module names / 're:' patterns", ignore)

  def covered(module: str) -> bool:
    bare = module.removeprefix("language_model.")
    return any(_ignore_matches(e, m) for e in ignore for m in (module, bare))

  uncovered = [part for part, module in _MUST_IGNORE.items() if not covered(module)]
  if uncovered:
    _bad(f"{where}.ignore", f"entries covering {uncovered} (only routed experts are MXFP4)",
         ignore)
  if covered(_MUST_QUANTIZE):
    _bad(f"{where}.ignore", f"no entry covering the routed experts ({_MUST_QUANTIZE})", ignore)
  return "mxfp4"


def ignored_keys(d: dict) -> dict[str, str]:
  """{key: why} for keys of a config dict that `from_hf_config` accepts and does not use although
  their value asks for something our model does not do. Empty for the configs `to_hf_config`
  writes.

  num_key_value_heads: MLA's keys and values are projected per head from one latent that every
  head shares (`kv_b` has num_attention_heads × (qk_nope + v) outputs), so there are no KV head
  groups to size. transformers' KimiLinearAttention builds the same weights whatever the key
  says; where its forward runs with a value other than num_attention_heads, the logits are
  those of num_attention_heads.
  """
  tc = text_config(d)
  out = {}
  heads, kv_heads = tc.get("num_attention_heads"), tc.get("num_key_value_heads")
  if kv_heads is not None and heads is not None and kv_heads != heads:
    out["num_key_value_heads"] = (
        f"{kv_heads!r} != num_attention_heads ({heads!r}); MLA has one latent KV shared by all "
        f"heads and no GQA, so the model has {heads} query/key/value heads")
  return out


def is_k3_style(c: ModelConfig) -> bool:
  """True when the config needs the K3 checkpoint layout (any K3-only feature)."""
  return (c.text.attn_res_block_size is not None or c.text.latent_moe_dim is not None
          or c.text.full_rank_gates or c.text.kda_lower_bound is not None or c.text.mla_output_gate
          or c.text.kda_a_log_axis == "channel"
          or c.text.activation == "situ" or c.vision is not None)


def to_hf_config(c: ModelConfig, arch: str | None = None,
                 expert_format: str | None = None) -> dict:
  """config.json dict for `c`: Kimi Linear (flat) or Kimi K3 (text_config nested).

  `arch` None picks 'kimi_k3' when `c` uses any K3-only feature. Kimi Linear cannot express
  K3 features: asking for it then is a ValueError naming the field. expert_format "mxfp4"
  (K3 only) adds the release's top-level `quantization_config`.
  """
  arch = arch or ("kimi_k3" if is_k3_style(c) else "kimi_linear")
  if arch not in ("kimi_linear", "kimi_k3"):
    raise ValueError(f"arch: expected 'kimi_linear' or 'kimi_k3', found {arch!r}")
  if arch == "kimi_linear":
    t = c.text
    for f, value, ok in (("vision", c.vision, c.vision is None),
                         ("text.attn_res_block_size", t.attn_res_block_size,
                          t.attn_res_block_size is None),
                         ("text.latent_moe_dim", t.latent_moe_dim, t.latent_moe_dim is None),
                         ("text.full_rank_gates", t.full_rank_gates, not t.full_rank_gates),
                         ("text.kda_lower_bound", t.kda_lower_bound, t.kda_lower_bound is None),
                         ("text.kda_a_log_axis", t.kda_a_log_axis, t.kda_a_log_axis == "head"),
                         ("text.mla_output_gate", t.mla_output_gate, not t.mla_output_gate),
                         ("text.activation", t.activation, t.activation == "swiglu")):
      if not ok:
        raise ValueError(f"ModelConfig.{f}: {value!r} has no Kimi Linear "
                         "config.json form; export with arch='kimi_k3'")
  n = c.text.num_layers
  kinds = [t for t, _ in c.text.layer_types()]
  lac = dict(
      head_dim=c.text.kda_head_dim, num_heads=c.text.kda_num_heads, short_conv_kernel_size=c.text.kda_conv_size,
      kda_layers=[i + 1 for i in range(n) if kinds[i] == "kda"],
      full_attn_layers=[i + 1 for i in range(n) if kinds[i] == "mla"],
  )
  if c.text.kda_gate_rank != c.text.kda_head_dim:
    lac["gate_rank"] = c.text.kda_gate_rank
  tc = dict(
      model_type=KIMI_LINEAR_MODEL_TYPE,
      architectures=["KimiLinearForCausalLM"],
      vocab_size=c.text.vocab_size, hidden_size=c.text.d_model, num_hidden_layers=n,
      rms_norm_eps=c.text.rms_norm_eps, tie_word_embeddings=c.text.tie_word_embeddings,
      num_attention_heads=c.text.num_heads, num_key_value_heads=c.text.num_heads,
      q_lora_rank=c.text.q_lora_rank, kv_lora_rank=c.text.kv_lora_rank,
      qk_nope_head_dim=c.text.qk_nope_head_dim, qk_rope_head_dim=c.text.qk_rope_head_dim,
      v_head_dim=c.text.v_head_dim, mla_use_nope=True, attention_bias=False,
      hidden_act="silu" if c.text.activation == "swiglu" else "situ",
      intermediate_size=c.text.dense_intermediate_size,
      moe_intermediate_size=c.text.moe_intermediate_size,
      num_experts=c.text.num_experts, num_experts_per_token=c.text.experts_per_token,
      num_shared_experts=c.text.num_shared_experts, first_k_dense_replace=c.text.first_dense_layers,
      moe_layer_freq=1, moe_router_activation_func="sigmoid", moe_renormalize=True,
      routed_scaling_factor=c.text.routed_scaling_factor, topk_method="noaux_tc",
      num_expert_group=1, topk_group=1, num_nextn_predict_layers=c.text.num_mtp_layers,
      linear_attn_config=lac,
      layer_types=["full_attention" if k == "mla" else "linear_attention" for k in kinds],
      mlp_layer_types=["dense" if i < c.text.first_dense_layers else "sparse" for i in range(n)],
      torch_dtype="float32" if c.modes.param_dtype == "float32" else c.modes.param_dtype,
  )
  if arch == "kimi_linear":
    if expert_format == "mxfp4":
      raise ValueError("expert_format 'mxfp4': Kimi Linear's config.json has no "
                       "quantization_config form (its experts are unquantised)")
    return tc
  lac.update(use_full_rank_gate=c.text.full_rank_gates)
  if c.text.kda_lower_bound is not None:
    lac["gate_lower_bound"] = c.text.kda_lower_bound
  if c.text.kda_a_log_axis == "channel":
    lac[A_LOG_PER_CHANNEL] = True
  tc.update(
      mla_use_output_gate=c.text.mla_output_gate,
      activation_situ_beta=c.text.situ_beta1, activation_situ_linear_beta=c.text.situ_beta2,
  )
  if c.text.latent_moe_dim is not None:
    tc.update(routed_expert_hidden_size=c.text.latent_moe_dim, latent_moe_use_norm=True)
  if c.text.attn_res_block_size is not None:
    tc["attn_res_block_size"] = c.text.attn_res_block_size
  out = dict(model_type=K3_MODEL_TYPE, architectures=["KimiK3ForConditionalGeneration"],
             tie_word_embeddings=c.text.tie_word_embeddings, text_config=tc)
  if c.vision is not None:
    out.update(vision_config=vision_config_to_hf(c.vision),
               media_placeholder_token_id=c.media_placeholder_token_id)
  if expert_format == "mxfp4":
    out["quantization_config"] = release_quantization_config()
  return out


# ---------------------------------------------------------------------- vision_config
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


__all__ = ["from_hf_config", "to_hf_config", "ignored_keys", "detect_arch", "text_config",
           "is_k3_style", "check_quantization_config", "release_quantization_config",
           "vision_config_from_hf", "vision_config_to_hf", "declared_a_log_axis",
           "A_LOG_PER_CHANNEL", "MXFP4_FORMAT", "MXFP4_GROUP_SIZE"]
