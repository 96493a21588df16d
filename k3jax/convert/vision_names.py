"""Release tensor names of the vision tower and projector ⇄ k3jax parameter paths (docs/k3.md §11).

The release (PyTorch naming, bf16) spells the K3 tower as
  vision_tower.patch_embed.proj.weight            [D, 3, 14, 14]  conv, no bias
  vision_tower.patch_embed.pos_emb.weight         [64, 64, D]
  vision_tower.encoder.blocks.N.{norm0,norm1}.weight            [D]
  vision_tower.encoder.blocks.N.wqkv.weight       [3·H·Dh, D]    (q, k, v outermost, then heads)
  vision_tower.encoder.blocks.N.wo.weight         [D, H·Dh]
  vision_tower.encoder.blocks.N.mlp.{fc0,fc1}.weight
  vision_tower.encoder.final_layernorm.weight     [D]
  mm_projector.proj.{0,2}.weight, mm_projector.post_norm.weight
— 168 tensors for MoonViT-V2. K2.5's original spelling is the same with a `.bias` beside every
Linear, conv and LayerNorm and `mm_projector.pre_norm` instead of `post_norm`. (`transformers`'
spellings of K2.5 — module paths, split q/k/v in its rotate-half RoPE order — are read by
`k3jax.convert.vision`; `rope_half_to_pairs` below is the row permutation it needs.)

The map is pure: names, shapes and the reshape of each tensor; no file IO. RoPE needs no
permutation between the release and k3jax: both rotate adjacent pairs (x[2i], x[2i+1]).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from k3jax.config import VisionConfig


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """One released tensor: its name, shape there, k3jax path under 'params', and kind.

  kind: "copy" (same layout), "linear" ([out, in] → [in, out]), "conv" ([D, C, P, P] →
  [C·P·P, D]), "qkv" ([3·H·Dh, D] → [D, 3, H, Dh]; its bias [3·H·Dh] → [3, H, Dh]),
  "wo" ([D, H·Dh] → [H, Dh, D]).
  """
  name: str
  shape: tuple[int, ...]
  path: tuple[str, ...]
  kind: str


def tensor_specs(config: VisionConfig) -> list[TensorSpec]:
  """Every released vision tensor of this config, in release order."""
  c = config
  d, h, dh, f, m = c.hidden_size, c.num_heads, c.head_dim, c.intermediate_size, c.merged_dim
  specs: list[TensorSpec] = []

  def lin(name, path, out_shape, in_dim, kind="linear", bias_shape=None):
    specs.append(TensorSpec(f"{name}.weight", (out_shape, *in_dim), (*path, "kernel"), kind))
    if c.use_bias:
      specs.append(TensorSpec(f"{name}.bias", (out_shape,), (*path, "bias"),
                              "qkv" if kind == "qkv" else "copy"))

  def norm(name, path, dim, layernorm):
    specs.append(TensorSpec(f"{name}.weight", (dim,), (*path, "weight"), "copy"))
    if layernorm:
      specs.append(TensorSpec(f"{name}.bias", (dim,), (*path, "bias"), "copy"))

  ln = c.norm == "layernorm"
  vt = ("vision_tower",)
  lin("vision_tower.patch_embed.proj", (*vt, "patch_embed", "proj"), d,
      (c.in_channels, c.patch_size, c.patch_size), kind="conv")
  specs.append(TensorSpec("vision_tower.patch_embed.pos_emb.weight",
                          (c.pos_emb_height, c.pos_emb_width, d),
                          (*vt, "patch_embed", "pos_emb", "weight"), "copy"))
  for i in range(c.num_layers):
    n, p = f"vision_tower.encoder.blocks.{i}", (*vt, "encoder", f"blocks_{i}")
    norm(f"{n}.norm0", (*p, "norm0"), d, ln)
    norm(f"{n}.norm1", (*p, "norm1"), d, ln)
    lin(f"{n}.wqkv", (*p, "wqkv"), 3 * h * dh, (d,), kind="qkv")
    lin(f"{n}.wo", (*p, "wo"), d, (h * dh,), kind="wo")
    lin(f"{n}.mlp.fc0", (*p, "mlp", "fc0"), f, (d,))
    lin(f"{n}.mlp.fc1", (*p, "mlp", "fc1"), d, (f,))
  norm("vision_tower.encoder.final_layernorm", (*vt, "encoder", "final_layernorm"), d, ln)
  mp = ("mm_projector",)
  if c.projector_norm == "pre":
    norm("mm_projector.pre_norm", (*mp, "pre_norm"), d, True)
  lin("mm_projector.proj.0", (*mp, "proj_0"), m, (m,))
  lin("mm_projector.proj.2", (*mp, "proj_2"), c.text_hidden_size, (m,))
  if c.projector_norm == "post":
    norm("mm_projector.post_norm", (*mp, "post_norm"), c.text_hidden_size, False)
  return specs


def name_map(config: VisionConfig) -> dict[str, str]:
  """Released name → k3jax parameter path ('/'-joined, under 'params')."""
  return {s.name: "/".join(s.path) for s in tensor_specs(config)}


def to_k3jax(config: VisionConfig, spec: TensorSpec, x: np.ndarray) -> np.ndarray:
  """A released tensor (shape `spec.shape`) in k3jax layout."""
  x = np.asarray(x)
  if tuple(x.shape) != spec.shape:
    raise ValueError(f"{spec.name}: expected shape {spec.shape}, found {tuple(x.shape)}")
  h, dh = config.num_heads, config.head_dim
  if spec.kind == "linear":
    return x.T
  if spec.kind == "conv":
    return x.reshape(x.shape[0], -1).T
  if spec.kind == "qkv":
    return x.reshape(3, h, dh) if x.ndim == 1 else x.T.reshape(x.shape[1], 3, h, dh)
  if spec.kind == "wo":
    return x.T.reshape(h, dh, x.shape[0])
  return x


def to_release(config: VisionConfig, spec: TensorSpec, y: np.ndarray) -> np.ndarray:
  """The inverse of `to_k3jax`: a k3jax parameter back in the released layout."""
  y = np.asarray(y)
  if spec.kind == "linear":
    out = y.T
  elif spec.kind == "conv":
    out = y.T.reshape(spec.shape)
  elif spec.kind == "qkv":
    out = y.reshape(-1) if y.ndim == 3 else y.reshape(y.shape[0], -1).T
  elif spec.kind == "wo":
    out = y.reshape(-1, y.shape[-1]).T
  else:
    out = y
  if tuple(out.shape) != spec.shape:
    raise ValueError(f"{spec.name}: k3jax parameter {'/'.join(spec.path)} gives shape "
                     f"{tuple(out.shape)}, expected {spec.shape}")
  return out


def from_state_dict(config: VisionConfig, tensors: dict) -> dict:
  """{released name: array} → {'params': nested k3jax tree}. Every expected tensor must be
  present with its shape, and no other `vision_tower.*` / `mm_projector.*` name (errors name
  the tensor); other keys (the text model's) are ignored."""
  specs = tensor_specs(config)
  expected = {s.name for s in specs}
  extra = sorted(k for k in tensors if k.startswith(("vision_tower.", "mm_projector."))
                 and k not in expected)
  missing = sorted(expected - set(tensors))
  if missing or extra:
    raise ValueError(f"vision tensors: missing {missing[:5]}{'…' if len(missing) > 5 else ''}, "
                     f"unexpected {extra[:5]}{'…' if len(extra) > 5 else ''} "
                     f"(config {config.name})")
  params: dict = {}
  for s in specs:
    node = params
    for k in s.path[:-1]:
      node = node.setdefault(k, {})
    node[s.path[-1]] = to_k3jax(config, s, tensors[s.name])
  return {"params": params}


def to_state_dict(config: VisionConfig, variables: dict) -> dict:
  """{'params': k3jax tree} → {released name: array (release layout)}."""
  out = {}
  for s in tensor_specs(config):
    node = variables["params"]
    for k in s.path:
      if k not in node:
        raise ValueError(f"{s.name}: k3jax parameter {'/'.join(s.path)} is missing")
      node = node[k]
    out[s.name] = to_release(config, s, node)
  return out


def rope_half_to_pairs(head_dim: int) -> np.ndarray:
  """Row order taking one head's q/k rows from rotate-half order to adjacent pairs. [head_dim].

  `transformers`' Kimi_K25 vision attention rotates element p with element p + head_dim/2
  (`rotate_half`); the release and `ops.apply_rope` rotate element 2p with 2p+1, by the same
  angle (the p-th pair's). So adjacent-pair row 2p+s is rotate-half row p + s·head_dim/2:
  pairs[e] = half[perm[e]] with perm[2p+s] = p + s·head_dim/2 (s ∈ {0, 1}). This is
  transformers' `PermuteForRope` (view [half, 2] → transpose) read backwards; q·k per head is
  unchanged because q and k get the same permutation. v is not permuted.
  """
  if head_dim % 2:
    raise ValueError(f"head_dim: rotary pairs need an even head_dim, found {head_dim}")
  half = head_dim // 2
  return np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)


def permute_heads(x: np.ndarray, num_heads: int, perm: np.ndarray) -> np.ndarray:
  """Permute the rows inside each head of a q or k weight [H·Dh, in] or bias [H·Dh]:
  out[h·Dh + e] = x[h·Dh + perm[e]]."""
  x = np.asarray(x)
  dh = x.shape[0] // num_heads
  if dh * num_heads != x.shape[0] or perm.shape != (dh,):
    raise ValueError(f"permute_heads: {x.shape[0]} rows are not {num_heads} heads of "
                     f"{perm.shape[0]}")
  return x.reshape(num_heads, dh, *x.shape[1:])[:, perm].reshape(x.shape)


__all__ = ["TensorSpec", "tensor_specs", "name_map", "to_k3jax", "to_release",
           "from_state_dict", "to_state_dict", "rope_half_to_pairs", "permute_heads"]
