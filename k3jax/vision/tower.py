"""MoonViT tower and projector as thin Flax modules over `k3jax.vision.ops` (docs/k3.md §11).

Parameter paths mirror the released checkpoint's tensor names (`k3jax.convert.vision_names` is the
map): `vision_tower/patch_embed/proj`, `vision_tower/patch_embed/pos_emb/weight`,
`vision_tower/encoder/blocks_N/{norm0,norm1,wqkv,wo,mlp/fc0,mlp/fc1}`,
`vision_tower/encoder/final_layernorm`, `mm_projector/{pre_norm,proj_0,proj_2,post_norm}`.
Norms hold `weight` (and `bias` for LayerNorm) like PyTorch; Linear kernels are
[in…, out…] (PyTorch's [out, in] transposed, q/k/v split into (3, heads, head_dim)).

The tower runs on packed streams: patches [B, L, C·P·P] plus the per-patch metadata of
`k3jax.vision.packing` as arrays [B, L]. `encode` is the host-level entry point.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import numpy as np

from k3jax.config import dtype_of
from k3jax.layers.linear import default_kernel_init, param
from k3jax.layers.norms import rms_norm
from k3jax.parallel import vision as parallel_vision
from k3jax.vision import ops
from k3jax.config import VisionConfig
from k3jax.vision.media import dummy_media, media_from_pixels

STAGES = ("encoded", "merged", "projected")


def _dense(cfg: VisionConfig, features, names: Sequence, *, name: str, axis=-1):
  """A DenseGeneral with the config's bias switch; `names` are the kernel's logical axes
  (inputs then outputs); the bias takes the output axes' names."""
  n_out = len(features) if isinstance(features, tuple) else 1
  return nn.DenseGeneral(
      features=features, axis=axis, use_bias=cfg.use_bias, name=name,
      dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype),
      kernel_init=nn.with_logical_partitioning(default_kernel_init, tuple(names)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, tuple(names[-n_out:])))


class Norm(nn.Module):
  """RMSNorm (`weight`) or LayerNorm (`weight`, `bias`) over the last axis, fp32 statistics;
  output cast back to x.dtype."""
  kind: str
  eps: float
  use_bias: bool = False

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    w = param(self, "weight", nn.initializers.ones, (d,), ("embed",))
    if self.kind == "rmsnorm":
      y = rms_norm(x, w, self.eps)
    else:
      b = param(self, "bias", nn.initializers.zeros, (d,), ("embed",)) if self.use_bias else None
      y = ops.layer_norm(x, w, b, self.eps)
    return y.astype(x.dtype)


def _norm(cfg: VisionConfig, name: str) -> Norm:
  # LayerNorm towers (K2.5) carry a bias in every norm, as nn.LayerNorm does.
  return Norm(kind=cfg.norm, eps=cfg.norm_eps, use_bias=cfg.norm == "layernorm", name=name)


class PosEmb(nn.Module):
  """Divided-fixed position embedding. Param `weight` [pos_emb_height, pos_emb_width, hidden].
  meta arrays [B, L] → [B, L, hidden] fp32."""
  config: VisionConfig

  @nn.compact
  def __call__(self, meta):
    cfg = self.config
    table = param(self, "weight", nn.initializers.normal(0.02),
                  (cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size), (None, None, "embed"))
    return ops.divided_fixed_pos_emb(
        table, meta["rows"], meta["cols"], meta["frames"], meta["heights"], meta["widths"],
        meta["num_frames"], mode=cfg.pos_emb_interpolation, max_frames=cfg.max_frames)


class PatchEmbed(nn.Module):
  """patches [B, L, C·P·P] → [B, L, hidden]: `proj` (the conv as a matmul) + `pos_emb`."""
  config: VisionConfig

  @nn.compact
  def __call__(self, patches, meta):
    cfg = self.config
    x = _dense(cfg, cfg.hidden_size, (None, "embed"), name="proj")(patches)
    return (x + PosEmb(cfg, name="pos_emb")(meta)).astype(x.dtype)


class VisionMLP(nn.Module):
  """fc1(gelu_tanh(fc0(x))). x [..., hidden] → [..., hidden]."""
  config: VisionConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    h = _dense(cfg, cfg.intermediate_size, ("embed", "mlp"), name="fc0")(x)
    h = ops.gelu(h, approximate=True).astype(x.dtype)
    return _dense(cfg, cfg.hidden_size, ("mlp", "embed"), name="fc1")(h)


class EncoderBlock(nn.Module):
  """Pre-norm block: x += wo(attn(norm0(x))); x += mlp(norm1(x)). x [B, L, hidden].

  `wqkv` kernel [hidden, 3, heads, head_dim] (q, k, v outermost as in the fused checkpoint
  tensor); `wo` kernel [heads, head_dim, hidden]. 2-D RoPE on q and k; attention is
  block-diagonal over `segment_ids`, scale head_dim^−½.
  """
  config: VisionConfig
  query_block: int | None = None

  @nn.compact
  def __call__(self, x, angles, segment_ids):
    cfg = self.config
    h = _norm(cfg, "norm0")(x)
    qkv = _dense(cfg, (3, cfg.num_heads, cfg.head_dim), ("embed", None, "heads", None),
                 name="wqkv")(h)
    q, k, v = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
    q = ops.apply_rope(q, angles).astype(x.dtype)
    k = ops.apply_rope(k, angles).astype(x.dtype)
    # Under a mesh with context > 1: this shard's queries against the gathered keys/values.
    attend = parallel_vision.maybe_context_parallel_packed_attention(ops.packed_attention)
    o = attend(q, k, v, segment_ids, query_block=self.query_block).astype(x.dtype)
    x = x + _dense(cfg, cfg.hidden_size, ("heads", None, "embed"), axis=(-2, -1), name="wo")(o)
    return x + VisionMLP(cfg, name="mlp")(_norm(cfg, "norm1")(x))


class Encoder(nn.Module):
  """`blocks_0 … blocks_{N−1}` then `final_layernorm`. x [B, L, hidden] → same."""
  config: VisionConfig
  query_block: int | None = None

  @nn.compact
  def __call__(self, x, meta):
    cfg = self.config
    angles = ops.rope_angles(meta["rows"], meta["cols"], cfg.head_dim, theta=cfg.rope_theta,
                             layout=cfg.rope_layout)
    angles = parallel_vision.shard_stream(angles)
    for i in range(cfg.num_layers):
      x = EncoderBlock(cfg, self.query_block, name=f"blocks_{i}")(x, angles, meta["segment_ids"])
      x = parallel_vision.shard_stream(x)   # the residual stream stays on the stream's shards
    return _norm(cfg, "final_layernorm")(x)


class VisionTower(nn.Module):
  """`patch_embed` → `encoder`. patches [B, L, C·P·P], meta [B, L] each → [B, L, hidden].

  Under a mesh (`jax.set_mesh`) the stream is sharded as `k3jax.parallel.vision` lays it out:
  B over the batch axes, L over `context` (which must divide L), attention context-parallel.
  """
  config: VisionConfig
  query_block: int | None = None

  @nn.compact
  def __call__(self, patches, meta):
    patches, meta = parallel_vision.shard_stream((patches, meta))
    x = PatchEmbed(self.config, name="patch_embed")(patches.astype(dtype_of(self.config.dtype)),
                                                    meta)
    return Encoder(self.config, self.query_block, name="encoder")(x, meta)


class Projector(nn.Module):
  """`mm_projector`: merged [..., 4, hidden] → [..., text_hidden].

  post (K3 `patchmergerv2`): proj_2(gelu_erf(proj_0(flatten(x)))) then RMSNorm `post_norm`.
  pre (K2.5): LayerNorm `pre_norm` over each hidden slot first, then the same two Linears.
  """
  config: VisionConfig

  @nn.compact
  def __call__(self, merged):
    cfg = self.config
    x = merged.astype(dtype_of(cfg.dtype))
    if cfg.projector_norm == "pre":
      x = Norm("layernorm", cfg.projector_norm_eps, use_bias=True, name="pre_norm")(x)
    x = x.reshape(*x.shape[:-2], cfg.merged_dim)
    x = _dense(cfg, cfg.merged_dim, (None, "mlp"), name="proj_0")(x)
    x = ops.gelu(x, approximate=False).astype(dtype_of(cfg.dtype))
    x = _dense(cfg, cfg.text_hidden_size, ("mlp", "embed"), name="proj_2")(x)
    if cfg.projector_norm == "post":
      x = Norm("rmsnorm", cfg.projector_norm_eps, name="post_norm")(x)
    return x


class VisionModel(nn.Module):
  """`vision_tower` + merger + `mm_projector` over packed streams.

  patches [B, L, C·P·P], meta arrays [B, L] (packing.META_FIELDS) →
    stage "encoded": [B, L, hidden] (after final_layernorm);
    stage "merged": [B, L/4, 4, hidden] fp32 (sd2_tpool; rows past a stream's tokens are 0);
    stage "projected": [B, L/4, text_hidden].
  `init` with stage="projected" creates every parameter. Under a mesh (`jax.set_mesh`) the
  streams are split over the batch axes (those that divide B) and `context` (which must
  divide L): see `k3jax.parallel.vision`.
  """
  config: VisionConfig
  query_block: int | None = None

  @nn.compact
  def __call__(self, patches, meta, stage: str = "projected"):
    if stage not in STAGES:
      raise ValueError(f"stage: expected one of {STAGES}, found {stage!r}")
    x = VisionTower(self.config, self.query_block, name="vision_tower")(patches, meta)
    if stage == "encoded":
      return x
    merged = merge(x, meta)
    if stage == "merged":
      return merged
    return Projector(self.config, name="mm_projector")(merged)


def merge(x, meta):
  """The `sd2_tpool` merger over packed streams: x [B, L, hidden] (the tower's output) →
  [B, L/4, 4, hidden] fp32 (rows past a stream's merged tokens are 0). Under a mesh the merged
  tokens are split over `context` too (where it divides L/4), so that each shard projects its
  own share rather than all of them."""
  n = x.shape[1] // 4
  merged = jax.vmap(lambda a, i, w: ops.sd2_tpool_packed(a, i, w, n))(
      x, meta["merge_index"], meta["merge_weight"])
  return parallel_vision.shard_stream(merged, strict=False)


def init_vision(config: VisionConfig, key, *, length: int | None = None):
  """Fresh variables {'params': {'vision_tower', 'mm_projector'}} (logically partitioned
  boxes unwrapped), initialised on a dummy stream of `length` patches (default: the
  smallest bucket; parameter shapes do not depend on it)."""
  m = dummy_media(config, length)
  return nn.unbox(VisionModel(config).init(key, m.patches, m.meta))


def _run(config: VisionConfig, stage: str, query_block, variables, patches, meta):
  return VisionModel(config, query_block).apply(variables, patches, meta, stage)


_run_jit = jax.jit(_run, static_argnums=(0, 1, 2))


def encode(vision_config: VisionConfig, variables, pixel_values, grid_thw, *,
           stage: str = "projected", query_block: int | None = None):
  """Encode a batch of images/videos given as concatenated patches.

  pixel_values [L, C, P, P] (= [L, 3, 14, 14]): the patches of all samples concatenated, each
    sample's patches in (t, row, col) order, as `transformers`' image processor produces them.
  grid_thw [n, 3] int (host values): (t, h, w) of each sample, Σ t·h·w = L; h, w even;
    t ≤ max_frames; h, w ≤ max_grid_side.
  Returns, samples in input order:
    stage "merged": [N, 4, hidden] fp32, N = Σ (h/2)(w/2) (the sd2_tpool merger's output);
    stage "projected": [N, text_hidden] (after the projector);
    stage "encoded": [L, hidden] (the tower's per-patch output, after final_layernorm).
  The samples are packed into one stream padded to a bucket of `pack_buckets`, so `jit`
  compiles once per (bucket, stage), not once per image size.

  Under a mesh — called inside `with jax.set_mesh(mesh):` (`k3jax.sharding.make_mesh`) — the
  stream is split over `context` along its patches (the context axis size must divide the
  bucket length; a ValueError names both otherwise), attention gathers keys/values over it
  (`k3jax.parallel.vision`), and the result equals the unsharded call's. Nothing else
  changes: the same arguments, one compile per (bucket, stage, mesh); `variables` may be
  replicated or laid out with `sharding.param_shardings`.
  """
  cfg = vision_config
  if stage not in STAGES:
    raise ValueError(f"stage: expected one of {STAGES}, found {stage!r}")
  m = media_from_pixels(cfg, pixel_values, grid_thw)
  out = _run_jit(cfg, stage, query_block, variables, m.patches, m.meta)[0]
  if stage == "encoded":
    return out[:int(np.prod(np.asarray(grid_thw), axis=1).sum())]
  return out[:int(m.num_merged[0])]


__all__ = ["VisionModel", "VisionTower", "Encoder", "EncoderBlock", "PatchEmbed", "PosEmb",
           "VisionMLP", "Projector", "Norm", "merge", "init_vision", "encode", "STAGES"]
