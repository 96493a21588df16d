"""Vision tower + projector alone: PyTorch checkpoint ⇄ k3jax (docs/k3.md §11; `--only vision`).

convert_vision(src, dst, arch): reads the `vision_tower.*` / `mm_projector.*` tensors of a
checkpoint directory (the text model's tensors are not read) and writes

    DST/vision_config.json        {"vision_config": VisionConfig fields,
                                   "media_placeholder_token_id": int | null}
    DST/vision_params.safetensors one tensor per k3jax leaf, named by its path under the
                                   variables ("params/vision_tower/encoder/blocks_0/wqkv/kernel")

which `k3jax.vision.load_vision(DST)` reads back as (VisionConfig, {'params': {...}})
(`k3jax.vision.load` owns that layout).

Source spellings (`arch`):
  kimi_k3   K3's release (`k3jax.convert.vision_names`): 168 tensors for MoonViT-V2, moonvit_v2 family.
  kimi_k25  Kimi K2.5/K2.6, moonvit_k25 family, in any of three spellings, tensor by tensor:
            - the original release (`k3jax.convert.vision_names`: fused `wqkv` in adjacent-pair RoPE order);
            - `transformers`' `save_pretrained` (5.x): the release's names except
              `vision_tower.encoder.patch_embed.proj.*` and `model.mm_projector.pre_norm.*`
              (it re-fuses q/k/v and undoes its RoPE permutation on save);
            - `transformers`' module names (a raw `state_dict()`): `model.vision_tower.layers.N.`
              `{norm1,norm2,attn.{q,k,v}_proj,attn.proj,mlp.fc1,mlp.fc2}`, `…pos_emb.position_`
              `embeddings`, `model.mm_projector.{pre_norm,in_proj,out_proj}`; q and k rows in
              rotate-half order, re-ordered with `names.rope_half_to_pairs` and fused.
Every tensor is checked (name, shape, float dtype) before anything is written; a vision-prefixed
name that no expected tensor uses (an unknown name, or a second spelling of one tensor) is an
error naming it. Output goes to a temporary directory renamed to DST when complete.

export_vision(src, dst): the inverse, in the release spelling (`model.safetensors` +
config.json: K3's `kimi_k3` layout for the moonvit_v2 family, a `kimi_k25` one for moonvit_k25).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.convert.checkpoint import load_pretrained
from k3jax.convert.output import STORE, check_dst, progress_bar, staged_dir
from k3jax.convert.safetensors_io import ShardedWriter, Source, read_config
from k3jax.convert import vision_names as vnames
from k3jax.hf_config import vision_config_from_hf, vision_config_to_hf
from k3jax.config import VisionConfig, as_vision_config

# ---------------------------------------------------------------------- the vision-only layout
# What `convert_from_pytorch --only vision` writes (k3jax.convert.vision.convert_vision).
CONFIG_FILE = "vision_config.json"     # {"vision_config": {VisionConfig fields},
                                       #  "media_placeholder_token_id": int | null}
PARAMS_FILE = "vision_params.safetensors"   # one tensor per leaf, named by path_name(path)


def path_name(path: tuple[str, ...]) -> str:
  """A leaf's tensor name in PARAMS_FILE: its path under the variables, '/'-joined
  ("params/vision_tower/encoder/blocks_0/wqkv/kernel")."""
  return "/".join(("params",) + tuple(path))


def read_vision_dir(path: pathlib.Path) -> tuple[VisionConfig, dict, int | None]:
  """(VisionConfig, {'params': nested numpy leaves}, placeholder id) of a `convert_vision`
  output. Every leaf is checked against the config (missing / unexpected / wrong shape)."""
  d = json.loads((path / CONFIG_FILE).read_text())
  cfg = as_vision_config(d["vision_config"])
  f = path / PARAMS_FILE
  if not f.exists():
    raise ValueError(f"{str(path)!r}: {PARAMS_FILE} is missing")
  source = Source(path)
  want = {}
  for s in vnames.tensor_specs(cfg):
    want[path_name(s.path)] = (s, vnames.to_k3jax(cfg, s, np.broadcast_to(np.float32(0),
                                                                           s.shape)).shape)
  have = source.infos
  missing = sorted(set(want) - set(have))
  extra = sorted(set(have) - set(want))
  wrong = sorted(f"{n}: expected {list(want[n][1])}, found {list(have[n].shape)}"
                 for n in set(want) & set(have) if tuple(have[n].shape) != tuple(want[n][1]))
  if missing or extra or wrong:
    raise ValueError(f"{str(f)!r} does not match its {CONFIG_FILE} ({cfg.name}):"
                     + (f"\n missing: {missing[:10]}" if missing else "")
                     + (f"\n unexpected: {extra[:10]}" if extra else "")
                     + (f"\n wrong shape: {wrong[:10]}" if wrong else ""))
  params: dict = {}
  for n, (s, _) in want.items():
    node = params
    for k in s.path[:-1]:
      node = node.setdefault(k, {})
    node[s.path[-1]] = source.get(n)
  return cfg, {"params": params}, d.get("media_placeholder_token_id")




def load_vision(path: str | os.PathLike) -> tuple[VisionConfig, dict]:
  """(vision_config, variables) from a vision-only conversion or a full k3jax checkpoint.

  Leaves are jnp arrays in their stored dtype. A full checkpoint without a vision tower, or
  without the `vision_tower` / `mm_projector` params its config implies, raises ValueError.
  """
  p = pathlib.Path(path)
  if not p.exists():
    raise ValueError(f"load_vision: path {str(p)!r} does not exist")
  if (p / CONFIG_FILE).exists():
    cfg, variables, _ = read_vision_dir(p)
    return cfg, jax.tree.map(jnp.asarray, variables)
  config, variables = load_pretrained(p)
  if config.vision is None:
    raise ValueError(f"load_vision: the checkpoint at {str(p)!r} has no vision tower "
                     f"(its config.vision is None)")
  params = variables.get("params", {})
  missing = [k for k in ("vision_tower", "mm_projector") if k not in params]
  if missing:
    raise ValueError(f"load_vision: the checkpoint at {str(p)!r} has config.vision set but "
                     f"no params {missing}")
  return config.vision, {"params": {k: params[k] for k in ("vision_tower", "mm_projector")}}


ARCHS = ("kimi_k3", "kimi_k25")
VISION_PREFIXES = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")
_VISION_MODEL_TYPE = {"kimi_k3": "kimi_k3_vision", "kimi_k25": "kimi_k25_vision"}


# ---------------------------------------------------------------------- config
def vision_config_of(d: dict, arch: str) -> tuple[VisionConfig, int | None]:
  """(VisionConfig, media placeholder id) from a checkpoint's config.json dict.

  The projector's output width is text_config.hidden_size (K3's vision_config also names it as
  `text_hidden_size`); K2.5's projector eps is the top-level `projection_layer_norm_eps` and
  its pre-norm width `projection_hidden_size` must be the tower's hidden size.
  """
  if arch not in ARCHS:
    raise ValueError(f"--arch: vision conversion reads {list(ARCHS)}, found {arch!r}")
  vc = d.get("vision_config")
  if not isinstance(vc, dict):
    raise ValueError("config.json: no vision_config object (not a multimodal checkpoint)")
  want = _VISION_MODEL_TYPE[arch]
  if vc.get("model_type") != want:
    raise ValueError(f"--arch {arch}: expected vision_config.model_type {want!r}, found "
                     f"{vc.get('model_type')!r}")
  tc = d.get("text_config") if isinstance(d.get("text_config"), dict) else {}
  width = tc.get("hidden_size")
  if arch == "kimi_k3":
    cfg = vision_config_from_hf(vc, text_hidden_size=width)
    return cfg, d.get("media_placeholder_token_id")
  if width is None:
    raise ValueError("config.json: text_config.hidden_size missing (the K2.5 projector's "
                     "output width)")
  cfg = vision_config_from_hf(vc, text_hidden_size=int(width),
                              projector_norm_eps=d.get("projection_layer_norm_eps"))
  ph = d.get("projection_hidden_size", cfg.hidden_size)
  if ph != cfg.hidden_size:
    raise ValueError(f"config.json: projection_hidden_size {ph} must equal vision_config."
                     f"hidden_size {cfg.hidden_size} (the projector's pre-norm width)")
  return cfg, d.get("media_placeholder_token_id", d.get("image_token_id"))


def k25_config_to_hf(cfg: VisionConfig, media_placeholder_token_id: int | None = None) -> dict:
  """A moonvit_k25-family VisionConfig → a `kimi_k25` config.json dict (vision part and the
  top-level projector keys; text_config holds only hidden_size). Refuses fields the
  `kimi_k25_vision` keys cannot express (naming them)."""
  vc = {"model_type": "kimi_k25_vision", "patch_size": cfg.patch_size,
        "pos_emb_height": cfg.pos_emb_height, "pos_emb_width": cfg.pos_emb_width,
        "pos_emb_time": cfg.max_frames, "num_attention_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "hidden_act": "gelu_pytorch_tanh",
        "merge_kernel_size": list(cfg.merge_kernel),
        "rope_parameters": {"rope_type": "axial", "rope_theta": cfg.rope_theta}}
  out = {"model_type": "kimi_k25", "architectures": ["Kimi_K25ForConditionalGeneration"],
         "vision_config": vc, "projection_hidden_size": cfg.hidden_size,
         "projection_layer_norm_eps": cfg.projector_norm_eps,
         "text_config": {"hidden_size": cfg.text_hidden_size}}
  if media_placeholder_token_id is not None:
    out["image_token_id"] = media_placeholder_token_id
  back, _ = vision_config_of(out, "kimi_k25")
  diff = sorted(f.name for f in dataclasses.fields(VisionConfig)
                if f.name not in ("name", "pack_buckets", "dtype", "param_dtype",
                                  "max_grid_side", "max_patches_per_frame")
                and getattr(back, f.name) != getattr(cfg, f.name))
  if diff:
    raise ValueError(f"VisionConfig {cfg.name!r}: field(s) {diff} have no kimi_k25 config.json key")
  return out


# ---------------------------------------------------------------------- source spellings
@dataclasses.dataclass(frozen=True)
class SourceSpelling:
  """How one released tensor is read: from `names` (one, or q/k/v split), with these shapes."""
  spec: vnames.TensorSpec
  names: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  split_qkv: bool = False


_K25_BLOCK = re.compile(r"^vision_tower\.encoder\.blocks\.(\d+)\.(.+)$")
_K25_MODULE_BLOCK = {"norm0": "norm1", "norm1": "norm2", "wo": "attn.proj",
                     "mlp.fc0": "mlp.fc1", "mlp.fc1": "mlp.fc2"}
_K25_MODULE_TOP = {"vision_tower.patch_embed.proj": "model.vision_tower.patch_embed.proj",
                   "vision_tower.encoder.final_layernorm": "model.vision_tower.final_layernorm",
                   "mm_projector.pre_norm": "model.mm_projector.pre_norm",
                   "mm_projector.proj.0": "model.mm_projector.in_proj",
                   "mm_projector.proj.2": "model.mm_projector.out_proj"}


def _alternatives(cfg: VisionConfig, spec: vnames.TensorSpec, arch: str) -> list[SourceSpelling]:
  """The spellings one released tensor may have in a source of `arch`, most canonical first."""
  alts = [SourceSpelling(spec, (spec.name,), (spec.shape,))]
  if arch != "kimi_k25":
    return alts
  name = spec.name
  module, _, leaf = name.rpartition(".")                    # e.g. (…wqkv, weight)
  # transformers' save_pretrained (5.x) spelling
  if module == "vision_tower.patch_embed.proj":
    alts.append(SourceSpelling(spec, (f"vision_tower.encoder.patch_embed.proj.{leaf}",), (spec.shape,)))
  if module == "mm_projector.pre_norm":
    alts.append(SourceSpelling(spec, (f"model.mm_projector.pre_norm.{leaf}",), (spec.shape,)))
  # transformers' module (state_dict) spelling
  if name == "vision_tower.patch_embed.pos_emb.weight":
    alts.append(SourceSpelling(spec, ("model.vision_tower.patch_embed.pos_emb.position_embeddings",),
                       (spec.shape,)))
  elif module in _K25_MODULE_TOP:
    alts.append(SourceSpelling(spec, (f"{_K25_MODULE_TOP[module]}.{leaf}",), (spec.shape,)))
  m = _K25_BLOCK.match(module)
  if m:
    i, sub = m.groups()
    base = f"model.vision_tower.layers.{i}."
    if sub == "wqkv":
      part = (spec.shape[0] // 3,) + spec.shape[1:]
      alts.append(SourceSpelling(spec, tuple(f"{base}attn.{p}_proj.{leaf}" for p in "qkv"),
                         (part,) * 3, split_qkv=True))
    elif sub in _K25_MODULE_BLOCK:
      alts.append(SourceSpelling(spec, (f"{base}{_K25_MODULE_BLOCK[sub]}.{leaf}",), (spec.shape,)))
  return alts


def _is_float(info) -> bool:
  return info.dtype.kind == "f" or info.dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def plan_vision(source: Source, cfg: VisionConfig, arch: str) -> list[SourceSpelling]:
  """One SourceSpelling per released tensor of `cfg`, after checking every vision tensor of `source`.

  Raises ValueError listing missing tensors (by released name, with the spellings looked
  for), wrong shapes and non-float dtypes (by source name), and vision-prefixed source names
  that nothing uses (unknown names, or a second spelling of a tensor already found).
  """
  have = source.infos
  recipes, missing, wrong = [], [], []
  for spec in vnames.tensor_specs(cfg):
    alts = _alternatives(cfg, spec, arch)
    found = next((r for r in alts if all(n in have for n in r.names)), None)
    if found is None:
      tried = " | ".join("+".join(r.names) for r in alts)
      missing.append(f"{spec.name} (looked for {tried})")
      continue
    for n, shape in zip(found.names, found.shapes):
      info = have[n]
      if tuple(info.shape) != tuple(shape):
        wrong.append(f"{n}: config.json implies shape {list(shape)}, found {list(info.shape)}")
      elif not _is_float(info):
        wrong.append(f"{n}: expected a float dtype, found {info.dtype}")
    recipes.append(found)
  used = {n for r in recipes for n in r.names}
  unknown = sorted(n for n in have if n.startswith(VISION_PREFIXES) and n not in used)
  problems = []
  for title, items in (("missing vision tensor(s)", missing),
                       ("vision tensor(s) disagree with config.json", wrong),
                       ("unexpected vision tensor(s) (unknown name, or a second spelling)",
                        unknown)):
    if items:
      more = f"\n  … and {len(items) - 20} more" if len(items) > 20 else ""
      problems.append(f"{len(items)} {title}:\n  " + "\n  ".join(items[:20]) + more)
  if problems:
    raise ValueError(f"checkpoint {str(source.dir)!r} ({arch}, vision {cfg.name!r}):\n"
                     + "\n".join(problems))
  return recipes


def read_release(source: Source, cfg: VisionConfig, recipe: SourceSpelling) -> np.ndarray:
  """One released tensor (release layout, source dtype) as the recipe reads it."""
  if not recipe.split_qkv:
    return source.get(recipe.names[0])
  q, k, v = (source.get(n) for n in recipe.names)
  perm = vnames.rope_half_to_pairs(cfg.head_dim)
  return np.concatenate([vnames.permute_heads(q, cfg.num_heads, perm),
                         vnames.permute_heads(k, cfg.num_heads, perm), v])


# ---------------------------------------------------------------------- convert / export
def convert_vision(src: str | os.PathLike, dst: str | os.PathLike, arch: str = "kimi_k3",
                   dtype: str = "float32", allow_torch_pickle: bool = False,
                   progress: bool = True, log: Callable[[str], None] = print) -> pathlib.Path:
  """Convert the vision tower + projector of the checkpoint at `src` into `dst` (see the module
  docstring for both layouts). dtype: storage of every vision leaf. Returns `dst`."""
  src, dst = pathlib.Path(src), pathlib.Path(dst)
  if dtype not in STORE:
    raise ValueError(f"--dtype: expected one of {sorted(STORE)}, found {dtype!r}")
  check_dst(dst)
  cfg, placeholder = vision_config_of(read_config(src), arch)
  source = Source(src, allow_torch_pickle=allow_torch_pickle)
  recipes = plan_vision(source, cfg, arch)
  renamed = [r for r in recipes if r.names != (r.spec.name,)]
  if renamed:
    split = sum(r.split_qkv for r in renamed)
    log(f"read {len(renamed)} vision tensor(s) under transformers' names (e.g. "
        f"{renamed[0].names[0]} as {renamed[0].spec.name})"
        + (f"; {split} wqkv fused from split q/k/v in rotate-half order" if split else ""))
  store = STORE[dtype]
  shapes = {r.spec.name: vnames.to_k3jax(cfg, r.spec, np.broadcast_to(np.float32(0),
                                                                       r.spec.shape)).shape
            for r in recipes}
  plan = [(path_name(r.spec.path), store, shapes[r.spec.name]) for r in recipes]
  with staged_dir(dst) as tmp:
    writer = ShardedWriter(tmp, plan, max_shard_bytes=1 << 62)
    total = sum(source.infos[n].nbytes for r in recipes for n in r.names)
    with progress_bar(total, "convert vision", progress) as bar:
      for i, r in enumerate(recipes):
        x = read_release(source, cfg, r)
        writer.write(plan[i][0], np.ascontiguousarray(
            vnames.to_k3jax(cfg, r.spec, x).astype(store, copy=False)))
        bar.update(x.nbytes)
        bar.set_postfix_str(f"{i + 1}/{len(recipes)} tensors", refresh=False)
    writer.close()
    (tmp / writer.files[0]).rename(tmp / PARAMS_FILE)
    (tmp / CONFIG_FILE).write_text(json.dumps(
        {"vision_config": _config_dict(cfg.replace(param_dtype=dtype)),
         "media_placeholder_token_id": placeholder}, indent=2))
  log(f"converted {len(recipes)} vision tensors ({cfg.name}, {cfg.num_layers} layers)")
  return dst


def _config_dict(cfg: VisionConfig) -> dict:
  d = dataclasses.asdict(cfg)
  return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def export_vision(src: str | os.PathLike | None, dst: str | os.PathLike,
                  dtype: str = "bfloat16", progress: bool = True,
                  loaded: tuple[VisionConfig, dict] | None = None,
                  media_placeholder_token_id: int | None = None) -> pathlib.Path:
  """Write a vision tower + projector (`src`: what `load_vision` reads, or `loaded`
  (VisionConfig, {'params': {'vision_tower', 'mm_projector'}})) in the release spelling:
  `model.safetensors` (every tensor in `dtype`, bf16 like the release) + config.json."""
  dst = pathlib.Path(dst)
  if dtype not in STORE:
    raise ValueError(f"--dtype: expected one of {sorted(STORE)}, found {dtype!r}")
  check_dst(dst)
  if loaded is None:
    p = pathlib.Path(src)
    if (p / CONFIG_FILE).exists():
      cfg, variables, media_placeholder_token_id = read_vision_dir(p)
    else:
      cfg, variables = load_vision(p)
  else:
    cfg, variables = loaded
  if cfg.norm == "rmsnorm":
    hf = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
          "vision_config": vision_config_to_hf(cfg),
          "text_config": {"hidden_size": cfg.text_hidden_size}}
    if media_placeholder_token_id is not None:
      hf["media_placeholder_token_id"] = media_placeholder_token_id
  else:
    hf = k25_config_to_hf(cfg, media_placeholder_token_id)
  store = STORE[dtype]
  specs = vnames.tensor_specs(cfg)
  plan = [(s.name, store, s.shape) for s in specs]
  with staged_dir(dst) as tmp:
    writer = ShardedWriter(tmp, plan, max_shard_bytes=1 << 62)
    with progress_bar(writer.total_bytes, "export vision", progress) as bar:
      for s in specs:
        node = variables["params"]
        for k in s.path:
          if not isinstance(node, dict) or k not in node:
            raise ValueError(f"{s.name}: k3jax parameter {'/'.join(s.path)} is missing")
          node = node[k]
        a = vnames.to_release(cfg, s, np.asarray(node, np.float32)).astype(store)
        writer.write(s.name, np.ascontiguousarray(a))
        bar.update(a.nbytes)
    writer.close()
    hf["torch_dtype"] = dtype
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
  return dst


__all__ = ["convert_vision", "export_vision", "plan_vision", "read_release", "read_vision_dir",
           "load_vision", "path_name", "CONFIG_FILE", "PARAMS_FILE",
           "vision_config_of", "k25_config_to_hf", "SourceSpelling", "ARCHS", "VISION_PREFIXES"]
