"""The tensor map PyTorch (Moonshot / Hugging Face names) ⇄ k3jax parameter tree.

`leaves(config, arch, expert_format)` lists every leaf of our variables (collection, Flax path,
full shape incl. the scanned [G] axis and the [E] expert axis) with the PyTorch tensor(s) that
fill each slice and how (`kind`). Everything is derived from the config alone, so the
converter can validate a checkpoint (names, shapes, dtypes) before reading a single tensor.

Kinds (PyTorch → ours, for one slice):
  linear     W [out, in] → W.T reshaped to our kernel slice ([in axes…, out axes…])
  copy       same values, reshaped (norm weights, dt_bias [H·K] → [H,K], A_log [1,1,H,1] → [H],
             K3's A_log [K] read per key channel → [K])
  conv       [C, 1, W] → [W, H, K] (tap W−1 multiplies the current token on both sides)
  a_log_pad  K3's A_log [P ≥ H] read per head: the first H entries → [H] (the rest is padding;
             `pipeline.resolve_a_log` decides the reading and reports any non-zero entry dropped)
  patch_conv the vision tower's patch conv [D, C, P, P] → [C·P·P, D]
  +mx        MXFP4 `weight_packed` [out, in/2] + `weight_scale` [out, in/32] decoded first
  u8         bytes kept as they are: with ModelConfig.modes.expert_format="mxfp4" each MXFP4 expert
             leaf becomes `…/experts/<w>/weight_packed` + `weight_scale` (k3jax/quant/mx.py),
             one release tensor per expert slot, never decoded

With `config.vision` set, the vision tower and projector (docs/k3.md §11, `k3jax.convert.vision_names`) are
leaves too: top-level `params/vision_tower/…` and `params/mm_projector/…`, released names
`vision_tower.*` / `mm_projector.*` without a prefix; their fused wqkv [3·H·Dh, D] and wo
[D, H·Dh] are `linear` (a transpose and a reshape), biases and norms `copy`.

Facts: docs/k3.md §9; parameter tree: docs/contracts.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import DENSE, KDA, MLA, MOE, ModelConfig
from k3jax.convert import vision_names as vnames
from k3jax.convert.dtypes import export_dtype
from k3jax.model import K3Model
from k3jax.quant import mx

# K3 stores A_log with 128 entries for 96 heads (§12): read per head, the first 96 (the rest
# zero padding, re-padded on export); read per key channel (kda_a_log_axis="channel"), all
# kda_head_dim = 128 of them.
A_LOG_PAD = 128
ARCHS = ("kimi_linear", "kimi_k3")
# Text tensors are `{prefix}model.*` + `{prefix}lm_head.weight` with one of these prefixes
# (§12): the release's multimodal spelling, or the bare text-only one (what a text-only
# exporter writes and serving engines' KimiLinear loaders read).
MULTIMODAL_PREFIX = "language_model."
TEXT_PREFIXES = (MULTIMODAL_PREFIX, "")
# The release holds no MTP tensors (§12). A k3jax MTP layer is written only on request, under
# this k3jax-specific prefix (outside every released name, so no loader mistakes it for one):
# k3jax_mtp.{enorm,hnorm,norm}.weight, k3jax_mtp.eh_proj.weight, k3jax_mtp.layer.<MLA+MoE
# layer names as in model.layers.N.>.
MTP_PREFIX = "k3jax_mtp."


@dataclasses.dataclass(frozen=True)
class Slot:
  """One PyTorch tensor (or packed+scale pair) filling `leaf[index]`."""
  index: tuple[int, ...]
  names: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]   # "float" (any float dtype) or "uint8"


@dataclasses.dataclass(frozen=True)
class Leaf:
  collection: str                 # "params" | "balance"
  path: tuple[str, ...]           # Flax path inside the collection
  shape: tuple[int, ...]          # full shape
  kind: str                       # linear | copy | conv | a_log_pad | patch_conv | u8
  mx: bool                        # slots are MXFP4 (packed, scale) pairs
  fp32: bool                      # always stored float32 (vectors, router, decay params)
  slots: tuple[Slot, ...]

  @property
  def lead(self) -> int:
    return len(self.slots[0].index)

  @property
  def slice_shape(self) -> tuple[int, ...]:
    return self.shape[self.lead:]


# ---------------------------------------------------------------------- per-layer map
def _layer_items(c: ModelConfig, mixer: str, mlp: str, attn_res: bool, expert_format: str):
  """(collection, local path, local shape, kind, fp32, torch suffix, torch shape, per_expert)."""
  d, eps = c.text.d_model, []
  add = lambda *a: eps.append(a)  # noqa: E731
  add("params", ("input_layernorm", "weight"), (d,), "copy", True, "input_layernorm.weight", (d,))
  add("params", ("post_attention_layernorm", "weight"), (d,), "copy", True,
      "post_attention_layernorm.weight", (d,))
  if attn_res:
    for ours, theirs in (("self_attention_res", "self_attention_res"), ("mlp_res", "mlp_res")):
      add("params", (ours, "proj"), (d,), "copy", True, f"{theirs}_proj.weight", (1, d))
      add("params", (ours, "norm"), (d,), "copy", True, f"{theirs}_norm.weight", (d,))
  a = "self_attn"
  if mixer == KDA:
    h, k, r, w = c.text.kda_num_heads, c.text.kda_head_dim, c.text.kda_gate_rank, c.text.kda_conv_size
    hk = h * k
    for p in ("q", "k", "v"):
      add("params", (a, f"{p}_proj", "kernel"), (d, h, k), "linear", False,
          f"{a}.{p}_proj.weight", (hk, d))
      add("params", (a, f"{p}_conv1d"), (w, h, k), "conv", True,
          f"{a}.{p}_conv1d.weight", (hk, 1, w))
    add("params", (a, "f_a_proj", "kernel"), (d, r), "linear", False, f"{a}.f_a_proj.weight", (r, d))
    add("params", (a, "f_b_proj", "kernel"), (r, h, k), "linear", False,
        f"{a}.f_b_proj.weight", (hk, r))
    add("params", (a, "b_proj", "kernel"), (d, h), "linear", False, f"{a}.b_proj.weight", (h, d))
    if c.text.full_rank_gates:
      add("params", (a, "g_proj", "kernel"), (d, h, k), "linear", False,
          f"{a}.g_proj.weight", (hk, d))
    else:
      add("params", (a, "g_a_proj", "kernel"), (d, r), "linear", False,
          f"{a}.g_a_proj.weight", (r, d))
      add("params", (a, "g_b_proj", "kernel"), (r, h, k), "linear", False,
          f"{a}.g_b_proj.weight", (hk, r))
    if c.text.kda_a_log_axis == "channel":   # one rate per key channel, shared by the heads
      add("params", (a, "A_log"), (k,), "copy", True, f"{a}.A_log", (k,))
    elif c.text.kda_lower_bound is None:     # Kimi Linear: A_log [1,1,H,1]
      add("params", (a, "A_log"), (h,), "copy", True, f"{a}.A_log", (1, 1, h, 1))
    else:                               # K3 per head: A_log padded to 128 entries
      add("params", (a, "A_log"), (h,), "a_log_pad", True, f"{a}.A_log", (max(A_LOG_PAD, h),))
    add("params", (a, "dt_bias"), (h, k), "copy", True, f"{a}.dt_bias", (hk,))
    add("params", (a, "o_norm"), (k,), "copy", True, f"{a}.o_norm.weight", (k,))
    add("params", (a, "o_proj", "kernel"), (h, k, d), "linear", False, f"{a}.o_proj.weight", (d, hk))
  else:
    h, dqk, nope, v = c.text.num_heads, c.text.qk_head_dim, c.text.qk_nope_head_dim, c.text.v_head_dim
    if c.text.q_lora_rank is None:
      add("params", (a, "q_proj", "kernel"), (d, h, dqk), "linear", False,
          f"{a}.q_proj.weight", (h * dqk, d))
    else:
      q = c.text.q_lora_rank
      add("params", (a, "q_a_proj", "kernel"), (d, q), "linear", False, f"{a}.q_a_proj.weight", (q, d))
      add("params", (a, "q_a_layernorm", "weight"), (q,), "copy", True,
          f"{a}.q_a_layernorm.weight", (q,))
      add("params", (a, "q_b_proj", "kernel"), (q, h, dqk), "linear", False,
          f"{a}.q_b_proj.weight", (h * dqk, q))
    kv = c.text.kv_lora_rank + c.text.qk_rope_head_dim
    add("params", (a, "kv_a_proj_with_mqa", "kernel"), (d, kv), "linear", False,
        f"{a}.kv_a_proj_with_mqa.weight", (kv, d))
    add("params", (a, "kv_a_layernorm", "weight"), (c.text.kv_lora_rank,), "copy", True,
        f"{a}.kv_a_layernorm.weight", (c.text.kv_lora_rank,))
    add("params", (a, "kv_b_proj", "kernel"), (c.text.kv_lora_rank, h, nope + v), "linear", False,
        f"{a}.kv_b_proj.weight", (h * (nope + v), c.text.kv_lora_rank))
    if c.text.mla_output_gate:
      add("params", (a, "g_proj", "kernel"), (d, h, v), "linear", False,
          f"{a}.g_proj.weight", (h * v, d))
    add("params", (a, "o_proj", "kernel"), (h, v, d), "linear", False, f"{a}.o_proj.weight", (d, h * v))
  if mlp == DENSE:
    f = c.text.dense_intermediate_size
    for p in ("gate", "up"):
      add("params", ("mlp", f"{p}_proj", "kernel"), (d, f), "linear", False,
          f"mlp.{p}_proj.weight", (f, d))
    add("params", ("mlp", "down_proj", "kernel"), (f, d), "linear", False,
        "mlp.down_proj.weight", (d, f))
  else:
    m, e = "block_sparse_moe", c.text.num_experts
    add("params", (m, "gate", "kernel"), (d, e), "linear", True, f"{m}.gate.weight", (e, d))
    add("balance", (m, "gate", "e_score_correction_bias"), (e,), "copy", True,
        f"{m}.gate.e_score_correction_bias", (e,))
    if c.text.latent_moe_dim is not None:
      l = c.text.latent_moe_dim
      add("params", (m, "routed_expert_down_proj", "kernel"), (d, l), "linear", False,
          f"{m}.routed_expert_down_proj.weight", (l, d))
      add("params", (m, "routed_expert_norm", "weight"), (l,), "copy", True,
          f"{m}.routed_expert_norm.weight", (l,))
      add("params", (m, "routed_expert_up_proj", "kernel"), (l, d), "linear", False,
          f"{m}.routed_expert_up_proj.weight", (d, l))
    if c.text.num_shared_experts:
      fs = c.text.shared_intermediate_size
      for p in ("gate", "up"):
        add("params", (m, "shared_experts", f"{p}_proj", "kernel"), (d, fs), "linear", False,
            f"{m}.shared_experts.{p}_proj.weight", (fs, d))
      add("params", (m, "shared_experts", "down_proj", "kernel"), (fs, d), "linear", False,
          f"{m}.shared_experts.down_proj.weight", (d, fs))
    dim = c.text.latent_moe_dim or d
    f = c.text.moe_intermediate_size
    for wn, ours_shape, torch_shape in (("w1", (dim, f), (f, dim)), ("w3", (dim, f), (f, dim)),
                                        ("w2", (f, dim), (dim, f))):
      add("params", (m, "experts", wn), ours_shape, "linear", False,
          f"{m}.experts.{{e}}.{wn}", torch_shape, True)
  return eps


def _slots_for(suffix, torch_shape, per_expert, index, prefix, num_experts, expert_format):
  if not per_expert:
    return [Slot(index, (prefix + suffix,), (torch_shape,), ("float",))]
  out = []
  for e in range(num_experts):
    base = prefix + suffix.format(e=e)
    if expert_format == "mxfp4":
      out_, in_ = torch_shape
      if in_ % mx.BLOCK:
        raise ValueError(f"expert_format='mxfp4': expert input width {in_} is not a multiple of "
                         f"{mx.BLOCK}")
      out.append(Slot(index + (e,), (base + ".weight_packed", base + ".weight_scale"),
                      ((out_, in_ // 2), (out_, in_ // mx.BLOCK)), ("uint8", "uint8")))
    else:
      out.append(Slot(index + (e,), (base + ".weight",), (torch_shape,), ("float",)))
  return out


def default_text_prefix(c: ModelConfig) -> str:
  """The spelling an exporter writes (§12): `language_model.` with a vision tower, bare
  otherwise."""
  return MULTIMODAL_PREFIX if c.vision is not None else ""


def detect_text_prefix(names) -> str:
  """The text prefix a checkpoint's tensor names use: 'language_model.' or '' (bare).

  ValueError when both spellings are present (two copies of the text model, or a mix that no
  exporter writes) or neither is.
  """
  multi = bare = None
  for n in names:
    if multi is None and n.startswith(("language_model.model.", "language_model.lm_head.")):
      multi = n
    elif bare is None and n.startswith(("model.", "lm_head.")):
      bare = n
    if multi and bare:
      raise ValueError(f"the checkpoint spells its text tensors both ways: {multi!r} "
                       f"(language_model.model.*) and {bare!r} (bare model.*); expected one")
  if multi is None and bare is None:
    raise ValueError("the checkpoint has no text tensors: no name starts with "
                     "'language_model.model.' or 'model.'")
  return MULTIMODAL_PREFIX if multi else ""


def leaves(c: ModelConfig, arch: str, expert_format: str | None = None,
           text_prefix: str | None = None, mtp: bool = True) -> list[Leaf]:
  """Every variable leaf of a K3Model with `c`, and the PyTorch tensors that fill it.

  text_prefix: 'language_model.' or '' (None: `default_text_prefix(c)`). mtp: include the MTP
  layer's leaves (names under MTP_PREFIX) when the config has one; the release has none.
  """
  if arch not in ARCHS:
    raise ValueError(f"arch: expected one of {list(ARCHS)}, found {arch!r}")
  expert_format = expert_format or ("mxfp4" if arch == "kimi_k3" else "bf16")
  if expert_format not in ("mxfp4", "bf16"):
    raise ValueError(f"expert_format: expected 'mxfp4' or 'bf16', found {expert_format!r}")
  if arch == "kimi_linear" and expert_format == "mxfp4":
    raise ValueError("expert_format: Kimi Linear checkpoints store experts unquantised ('bf16')")
  if arch == "kimi_linear" and c.text.kda_a_log_axis != "head":
    raise ValueError(f"kda_a_log_axis: Kimi Linear stores A_log per head ([1,1,H,1]); "
                     f"{c.text.kda_a_log_axis!r} needs the K3 layout (arch 'kimi_k3')")
  text_prefix = default_text_prefix(c) if text_prefix is None else text_prefix
  if text_prefix not in TEXT_PREFIXES:
    raise ValueError(f"text_prefix: expected one of {list(TEXT_PREFIXES)}, found {text_prefix!r}")
  model_prefix, head_name = f"{text_prefix}model.", f"{text_prefix}lm_head.weight"
  types = c.text.layer_types()
  attn_res = c.text.attn_res_block_size is not None
  pre, groups, suf = c.text.stack_layout()
  out: list[Leaf] = []

  def add_layer(i: int, path: tuple, items, index=(), lead=(), prefix=None):
    for coll, local, shape, kind, fp32, suffix, tshape, *pe in items:
      per_expert = bool(pe and pe[0])
      full = lead + ((c.text.num_experts,) if per_expert else ()) + shape
      slots = _slots_for(suffix, tshape, per_expert, index,
                         prefix or f"{model_prefix}layers.{i}.", c.text.num_experts, expert_format)
      out.append(Leaf(coll, path + local, full, kind, per_expert and expert_format == "mxfp4",
                      fp32, tuple(slots)))

  def single(path, shape, kind, fp32, name, tshape):
    out.append(Leaf("params", path, shape, kind, False, fp32,
                    (Slot((), (name,), (tshape,), ("float",)),)))

  d, v = c.text.d_model, c.text.vocab_size
  single(("embed_tokens", "embedding"), (v, d), "copy", False,
         model_prefix + "embed_tokens.weight", (v, d))
  for i in list(range(pre)) + list(range(c.text.num_layers - suf, c.text.num_layers)):
    add_layer(i, (f"layers_{i}",), _layer_items(c, *types[i], attn_res, expert_format))
  if groups:
    # Scanned body: one leaf per group-local layer j, stacked over the groups g.
    for j in range(c.text.mla_every):
      items = _layer_items(c, *types[pre + j], attn_res, expert_format)
      for item in items:
        coll, local, shape, kind, fp32, suffix, tshape, *pe = item
        per_expert = bool(pe and pe[0])
        slots = []
        for g in range(groups):
          i = pre + g * c.text.mla_every + j
          slots += _slots_for(suffix, tshape, per_expert, (g,), f"{model_prefix}layers.{i}.",
                              c.text.num_experts, expert_format)
        full = (groups,) + ((c.text.num_experts,) if per_expert else ()) + shape
        out.append(Leaf(coll, ("body", f"layers_{j}") + local, full, kind,
                        per_expert and expert_format == "mxfp4", fp32, tuple(slots)))
  if attn_res:
    single(("output_attn_res", "proj"), (d,), "copy", True,
           model_prefix + "output_attn_res_proj.weight", (1, d))
    single(("output_attn_res", "norm"), (d,), "copy", True,
           model_prefix + "output_attn_res_norm.weight", (d,))
  single(("norm", "weight"), (d,), "copy", True, model_prefix + "norm.weight", (d,))
  if not c.text.tie_word_embeddings:
    single(("lm_head", "kernel"), (d, v), "linear", False, head_name, (v, d))
  if c.text.num_mtp_layers and mtp:
    p = MTP_PREFIX
    for name in ("enorm", "hnorm"):
      single(("mtp", name, "weight"), (d,), "copy", True, p + f"{name}.weight", (d,))
    single(("mtp", "eh_proj", "kernel"), (2 * d, d), "linear", False, p + "eh_proj.weight",
           (d, 2 * d))
    add_layer(c.text.num_layers, ("mtp", "layer"), _layer_items(c, MLA, MOE, False, expert_format),
              prefix=p + "layer.")
    single(("mtp", "norm", "weight"), (d,), "copy", True, p + "norm.weight", (d,))
  if c.vision is not None:
    out += vision_leaves(c.vision)
  if c.modes.expert_format == "mxfp4":
    if expert_format != "mxfp4":
      raise ValueError(f"expert_format: a model with packed MXFP4 experts "
                       f"(ModelConfig.modes.expert_format='mxfp4') maps to MXFP4 checkpoint tensors, "
                       f"not {expert_format!r}")
    out = [part for leaf in out for part in (_split_packed(leaf) if leaf.mx else (leaf,))]
  return out


def a_log_names(c: ModelConfig, text_prefix: str) -> list[str]:
  """The K3 A_log tensors of `c`'s KDA layers in the per-head layout (kind `a_log_pad`: [P ≥ H],
  P = 128 for the release), whose values decide how they are read; [] when A_log is Kimi
  Linear's [1,1,H,1]. Only the per-layer map is built (the full `leaves` of the release takes
  seconds)."""
  items = _layer_items(c.replace(kda_a_log_axis="head"), KDA, MOE, False, "bf16")
  if next(it[3] for it in items if it[1] == ("self_attn", "A_log")) != "a_log_pad":
    return []
  return [f"{text_prefix}model.layers.{i}.self_attn.A_log"
          for i, (mixer, _) in enumerate(c.text.layer_types()) if mixer == KDA]


def _split_packed(leaf: Leaf) -> tuple[Leaf, Leaf]:
  """An MXFP4 expert leaf (slots = (weight_packed, weight_scale) pairs, decoded on import) →
  the two uint8 leaves of ModelConfig.modes.expert_format="mxfp4" (k3jax/quant/mx.py):
  `<experts>/<w>/weight_packed` [..., E, out, in/2] and `weight_scale` [..., E, out, in/32],
  each slot one release tensor copied byte for byte (kind "u8")."""
  parts = []
  for k, suffix in enumerate((mx.PACKED, mx.SCALE)):
    slots = tuple(Slot(s.index, (s.names[k],), (s.shapes[k],), ("uint8",)) for s in leaf.slots)
    parts.append(Leaf(leaf.collection, leaf.path + (suffix,),
                      leaf.shape[:leaf.lead] + slots[0].shapes[0], "u8", False, False, slots))
  return tuple(parts)


def vision_leaves(vc) -> list[Leaf]:
  """One leaf per released vision tensor of VisionConfig `vc` (168 for MoonViT-V2), in release
  order. Stored in the conversion's dtype like the text matmuls (the release's are all bf16)."""
  kinds = {"linear": "linear", "qkv": "linear", "wo": "linear", "conv": "patch_conv",
           "copy": "copy"}
  out = []
  for s in vnames.tensor_specs(vc):
    # k3jax shape from the map itself, on a zero-stride view (nothing allocated).
    shape = vnames.to_k3jax(vc, s, np.broadcast_to(np.float32(0), s.shape)).shape
    kind = "copy" if s.kind == "qkv" and len(s.shape) == 1 else kinds[s.kind]
    out.append(Leaf("params", s.path, tuple(shape), kind, False, False,
                    (Slot((), (s.name,), (s.shape,), ("float",)),)))
  return out


def check_paths(leaves_: list[Leaf], paths: dict[tuple[str, ...], tuple[int, ...]]) -> None:
  """The tensor map must build exactly the model's variables (`paths`: (collection, *path) →
  shape, from `model_paths`) with their shapes: ValueError listing every difference."""
  ours = {(l.collection,) + l.path: tuple(l.shape) for l in leaves_}
  unmatched = sorted("/".join(p) for p in set(ours) - set(paths))
  extra = sorted("/".join(p) for p in set(paths) - set(ours))
  wrong = sorted(f"{'/'.join(p)}: map {list(ours[p])}, model {list(paths[p])}"
                 for p in set(ours) & set(paths) if ours[p] != tuple(paths[p]))
  if unmatched or extra or wrong:
    raise ValueError("the converter's tensor map and the model's variables differ:"
                     + (f"\n  not in the model: {unmatched[:20]}" if unmatched else "")
                     + (f"\n  not converted: {extra[:20]}" if extra else "")
                     + (f"\n  shapes differ: {wrong[:20]}" if wrong else ""))


@functools.lru_cache(maxsize=8)
def model_paths(c: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
  """(collection, *path) → shape of every variable of K3Model(c), from jax.eval_shape."""
  tree = jax.eval_shape(lambda: K3Model(c).init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32)))
  tree = nn.unbox(tree)
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    key = tuple(str(getattr(k, "key", k)) for k in path)
    if key[0] in ("params", "balance"):
      out[key] = tuple(x.shape)
  return out


def is_mtp(leaf: Leaf) -> bool:
  return leaf.collection in ("params", "balance") and leaf.path[:1] == ("mtp",)


def _natural_key(name: str):
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def tensor_plan(leaves_: list[Leaf], store) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
  """[(name, dtype, shape)] of every tensor export writes for `leaves_`, in natural name
  order (layers.2 before layers.10); dtypes from the release's table (`dtypes.export_dtype`:
  uint8 MXFP4 bytes, the fp32 vectors, the rest in `store`). Nothing is allocated."""
  plan = [(name, export_dtype(name, store), tuple(shape))
          for leaf in leaves_ for slot in leaf.slots
          for name, shape in zip(slot.names, slot.shapes)]
  plan.sort(key=lambda e: _natural_key(e[0]))
  return plan


# ---------------------------------------------------------------------- slice transforms
def to_ours(leaf: Leaf, arrays: list[np.ndarray], dtype=np.float32) -> np.ndarray:
  """One slot's PyTorch array(s) → slice of shape leaf.slice_shape in `dtype`.

  The layout change happens in the source dtype and the cast last, so a bf16 tensor stored as
  bf16 costs one extra copy of itself (not two float32 ones): peak ≈ 2× the tensor.
  K3's A_log [P] read per head keeps its first H entries: the converter has decided that
  reading, and reported any non-zero entry it drops, before a slot is converted
  (`pipeline.resolve_a_log`, §12).
  """
  w = mx.mxfp4_unpack(arrays[0], arrays[1], np.float32) if leaf.mx else np.asarray(arrays[0])
  shape = leaf.slice_shape
  if leaf.kind == "linear":
    w = w.T.reshape(shape)
  elif leaf.kind == "copy":
    w = w.reshape(shape)
  elif leaf.kind == "conv":
    w = w[:, 0, :].T.reshape(shape)
  elif leaf.kind == "a_log_pad":
    w = w[:shape[0]]
  elif leaf.kind == "patch_conv":
    w = w.reshape(w.shape[0], -1).T
  elif leaf.kind == "u8":
    return w.reshape(shape)   # packed MXFP4 bytes: kept as they are
  else:
    raise ValueError(f"unknown kind {leaf.kind!r}")
  return w.astype(dtype, copy=False)


@functools.lru_cache(maxsize=1)
def _mxfp4_tables() -> tuple[np.ndarray, np.ndarray]:
  """(float32 [256, 2]: the two E2M1 values of every packed byte, low nibble first;
  float32 [256]: the value of every E8M0 scale byte, NaN for 255), both taken from the
  reference codec `mx.mxfp4_unpack` so that the fast decoder below is bit-identical to it."""
  packed = np.arange(256, dtype=np.uint8).reshape(16, 16)
  pairs = mx.mxfp4_unpack(packed, np.full((16, 1), mx.SCALE_BIAS, np.uint8)).reshape(256, 2)
  one = np.full((256, 16), 0x22, np.uint8)               # every value 1.0 (code 2)
  scales = mx.mxfp4_unpack(one, np.arange(256, dtype=np.uint8)[:, None])[:, 0]
  return np.ascontiguousarray(pairs, np.float32), np.asarray(scales, np.float32)


def decode_mxfp4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """MXFP4 packed uint8 [..., n/2] + scales uint8 [..., n/32] → float32 [..., n], bit-identical
  to `mx.mxfp4_unpack` (a value times a power of two is exact in float32, NaN for scale byte
  255) by two table lookups: ≈ 30× faster than the reference codec, which decodes through int32
  codes and ldexp (0.034 s vs 1.1 s for one 3072×3584 expert matrix)."""
  pairs, scale_values = _mxfp4_tables()
  n = packed.shape[-1] * 2
  if scales.shape != (*packed.shape[:-1], n // mx.BLOCK):
    raise ValueError(f"scales: expected shape {(*packed.shape[:-1], n // mx.BLOCK)} for {n} "
                     f"values, found {tuple(scales.shape)}")
  # Each byte's two float32 values as one 8-byte word: a 1-D gather of uint64 is ~4× faster
  # than gathering rows of a [256, 2] table.
  words = pairs.view(np.uint64).reshape(256)
  vals = words[packed].view(np.float32).reshape(*packed.shape[:-1], n // mx.BLOCK, mx.BLOCK)
  with np.errstate(over="ignore"):   # ±inf where the reference's ldexp overflows too
    vals *= scale_values[scales][..., None]
  return vals.reshape(*packed.shape[:-1], n)


TRANSPOSE_TILE = 256


def transpose_into(dest: np.ndarray, src: np.ndarray, tile: int = TRANSPOSE_TILE) -> None:
  """dest[...] = src.T (cast to dest.dtype) for 2-D arrays, in tiles of `tile`×`tile`: numpy
  copies a whole transposed matrix with one strided pass that misses the cache on every source
  row; tiles that fit in cache are about 2× faster (measured on bf16 4096×8192)."""
  n, m = src.shape
  if dest.shape != (m, n):
    raise ValueError(f"transpose_into: dest {dest.shape} is not the transpose of {src.shape}")
  if dest.dtype != src.dtype:
    # Cast contiguously first (one fast pass), then move same-size elements: 2.2× faster than
    # casting inside the strided tiles (float32 3072×3584 → bf16).
    src = src.astype(dest.dtype)
  if dest.dtype.itemsize == 2:
    dest, src = dest.view(np.uint16), src.view(np.uint16)   # plain moves, no float casts
  for i in range(0, n, tile):
    for j in range(0, m, tile):
      np.copyto(dest[j:j + tile, i:i + tile], src[i:i + tile, j:j + tile].T, casting="unsafe")


def to_ours_into(dest: np.ndarray, leaf: Leaf, arrays: list[np.ndarray]) -> None:
  """`to_ours` written straight into `dest` (a C-contiguous view of shape leaf.slice_shape):
  a Linear weight [out, in] is transposed and cast in one tiled pass (`transpose_into`), an
  MXFP4 one decoded by table lookups (`decode_mxfp4`) first; no other intermediate copy."""
  if leaf.kind == "linear" and dest.flags.c_contiguous:
    w = decode_mxfp4(arrays[0], arrays[1]) if leaf.mx else np.asarray(arrays[0])
    transpose_into(dest.reshape(w.shape[1], w.shape[0]), w)
  elif leaf.kind in ("copy", "u8") and dest.flags.c_contiguous:
    np.copyto(dest.reshape(-1), np.asarray(arrays[0]).reshape(-1), casting="unsafe")
  else:
    dest[...] = to_ours(leaf, arrays, dest.dtype)


def from_ours(leaf: Leaf, slot: Slot, x: np.ndarray, dtype) -> list[np.ndarray]:
  """One slice of ours → the PyTorch array(s) of `slot`: packed + scale bytes for MXFP4, else
  one array in `dtype` (the slot's export dtype, `tensor_plan`)."""
  if leaf.kind == "u8":
    return [np.ascontiguousarray(np.asarray(x).reshape(slot.shapes[0]))]
  x = np.asarray(x, np.float32)
  tshape = slot.shapes[0]
  if leaf.mx:
    out_, in_ = tshape[0], tshape[1] * 2
    w = x.reshape(in_, out_).T
    packed, scale = mx.mxfp4_pack(np.ascontiguousarray(w))
    return [packed, scale]
  if leaf.kind == "linear":
    w = x.reshape(tshape[1], tshape[0]).T
  elif leaf.kind == "copy":
    w = x.reshape(tshape)
  elif leaf.kind == "conv":
    w = x.reshape(tshape[2], tshape[0]).T[:, None, :]
  elif leaf.kind == "a_log_pad":
    w = np.zeros(tshape, np.float32)
    w[:x.shape[0]] = x
  elif leaf.kind == "patch_conv":
    w = x.T.reshape(tshape)
  elif leaf.kind == "u8":
    return [np.ascontiguousarray(np.asarray(x).reshape(tshape))]
  else:
    raise ValueError(f"unknown kind {leaf.kind!r}")
  return [np.ascontiguousarray(w.astype(dtype))]


def slot_nbytes(slot: Slot) -> int:
  return sum(math.prod(s) for s in slot.shapes)


__all__ = ["Leaf", "Slot", "leaves", "a_log_names", "vision_leaves", "check_paths", "model_paths",
           "to_ours", "from_ours", "A_LOG_PAD", "ARCHS", "TEXT_PREFIXES", "MULTIMODAL_PREFIX",
           "MTP_PREFIX", "default_text_prefix", "detect_text_prefix", "is_mtp", "tensor_plan"]
