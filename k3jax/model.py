"""K3Model: embedding → hybrid KDA/MLA stack with Block AttnRes → final norm → head (+ MTP).

Layer layout comes from `config.text.stack_layout()` = (prefix, num_groups, suffix): the prefix and
suffix layers are unrolled modules `layers_{i}` (global index i); the body is ONE `nn.scan`
over `num_groups` identical groups (module `body` holding `layers_0 … layers_{mla_every-1}`,
params stacked on a leading "layers" axis). `scan_layers=False` keeps exactly the same
parameter tree and only unrolls that loop.

Block AttnRes (docs/k3.md §5), when `attn_res_block_size` is set, carries a fixed-size buffer
`blocks` [num_attn_res_blocks, B, T, d] (compute dtype) and the running `partial` [B, T, d]
(fp32). The number of
finished blocks before layer i is a function of i alone (`blocks_before(i)`), so the scanned
body needs no counter: the mixers mask unused buffer slots with `valid`.
At layer i: h = mix(blocks + partial) (skipped while blocks is empty); if i % block == 0:
append partial, partial = 0; partial += attn(norm(h)); h = mix(blocks + partial);
partial += mlp(norm(h)). End: output mixer over blocks + partial. Without AttnRes: plain
pre-norm residuals.

MTP (one layer, DeepSeek-V3 style): position t combines hnorm(h_t) (the main model's final
hidden state *before* the final norm; with `eagle_blocks`, the EAGLE-3 feature
draft_fuse(concat of the chosen AttnRes blocks' representations) instead) and
enorm(embed(token t+1)) through eh_proj, runs one MLA+MoE decoder layer with plain residuals
(`mtp_document_ids`: a position whose two tokens lie in different documents is a document of
its own), a norm, and the shared lm_head:
`mtp_logits[:, t]` predicts token t+2; shape [B, T−1, vocab] (no padding). With `mtp_full`
the layer runs on all T positions — the last on a stand-in next token (its own), in a document
of its own, so nothing sees it and it sees nothing — and returns [B, T, vocab], whose last
position the caller masks: T divides over the `context` axis where T−1 never does, so the MTP
layer shards like the trunk (the trainer's loss, `RunModes.mtp_full_length`).

Packing: `segment_ids` become document indices (`document_ids`: a new document wherever the id
changes), and a document's logits are bit-for-bit independent of the other documents (every
layer masks with exact zeros; tests/test_model.py), with dropless MoE — with a capacity
factor, the tokens of a batch compete for an expert's rows by design.

Media (docs/k3.md §11, when `config.vision` is set): the vision tower `vision_tower` and projector
`mm_projector` (top-level params, the release's names) encode a `k3jax.vision.media.Media`;
the projected tokens replace the embeddings at `media_placeholder_token_id`, in order.

Decoding goes through the same layers: `K3Model.extend(tokens, cache, num_new)` feeds T new
tokens per row on top of a `k3jax.cache.Cache` (from `init_cache`); every token mixer extends
its own cache (the scanned groups carry theirs as scan inputs and outputs, so a decode step
compiles one group, not every layer), and `draft` runs the MTP layer on its own cache.

Residual stream, norms' statistics, mixers, attention outputs and logits are fp32; matmuls
run in `config.modes.dtype`; params are fp32 masters with logical axes (docs/contracts.md).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from k3jax import sharding
from k3jax.cache import Cache
from k3jax.config import DENSE, KDA, MLA, MOE, ModelConfig, dtype_of
from k3jax.layers.attnres import AttnResMixer
from k3jax.layers.feed import Feed
from k3jax.layers.kda import KDA as KDALayer
from k3jax.layers.linear import linear
from k3jax.layers.mla import MLA as MLALayer
from k3jax.layers.mlp import MLP
from k3jax.layers.moe import StableLatentMoE
from k3jax.layers.norms import RMSNorm
from k3jax.ops.attnres import attn_res_source_counts, blocks_before
from k3jax.vision.media import (Media, MediaEmbeddings, check_placeholders, dummy_media,
                                place_media)
from k3jax.vision.tower import Projector, VisionTower, merge


class DecoderLayer(nn.Module):
  """One layer: token mixer (KDA | MLA) and MLP (dense | MoE), pre-norm.

  __call__(state, layer_index, segment_ids, cache=None, feed=None) → state, or (state, the
  token mixer's updated cache) with `cache`. With AttnRes, state = (blocks, partial) and
  `layer_index` (python int, or a traced int in the scanned body) drives the block schedule;
  otherwise state = h [B,T,d].
  """
  config: ModelConfig
  mixer: str
  mlp: str
  attn_res: bool = True

  @nn.compact
  def __call__(self, state, layer_index, segment_ids=None, cache=None, feed=None):
    # The residual stream (h, or the AttnRes blocks and partial sum) enters and leaves every
    # layer batch-sharded (and sequence-sharded over `context`) under an active mesh.
    state = sharding.constrain_activations(state)
    cfg = self.config
    if cfg.modes.remat_offload and cache is None:
      # What a rematerialised layer keeps for its backward: named, and moved to host memory
      # by `_maybe_remat`'s policy.
      state = jax.tree.map(lambda a: checkpoint_name(a, LAYER_INPUT), state)
    eps = cfg.text.rms_norm_eps
    attn = (KDALayer if self.mixer == KDA else MLALayer)(cfg, name="self_attn")
    if self.mlp == DENSE:
      mlp = MLP(cfg, cfg.text.dense_intermediate_size, name="mlp")
    else:
      mlp = StableLatentMoE(cfg, name="block_sparse_moe")
    input_norm = RMSNorm(eps=eps, name="input_layernorm")
    post_norm = RMSNorm(eps=eps, name="post_attention_layernorm")

    def mix(h):   # the token mixer, extending its cache when decoding
      if cache is None:
        return attn(input_norm(h), segment_ids)
      nonlocal new_cache
      out, new_cache = attn(input_norm(h), segment_ids, cache, feed)
      return out

    new_cache = None
    if not self.attn_res:
      h = state
      h = h + mix(h).astype(h.dtype)
      h = sharding.constrain_activations(h + mlp(post_norm(h)).astype(h.dtype))
      return h if cache is None else (h, new_cache)

    bs = cfg.text.attn_res_block_size
    blocks, partial = state
    nb = blocks.shape[0]
    slots = jnp.arange(nb)
    attn_mixer = AttnResMixer(cfg, name="self_attention_res")
    mlp_mixer = AttnResMixer(cfg, name="mlp_res")
    count = blocks_before(layer_index, bs)
    static = isinstance(layer_index, int)

    if static and count == 0:
      h = partial  # no finished block yet: the mixer is skipped (its params still exist)
      if self.is_initializing():
        attn_mixer(None, partial)
    else:
      h = attn_mixer(blocks, partial, slots < count)

    if static:
      if layer_index % bs == 0:
        blocks = blocks.at[count].set(partial.astype(blocks.dtype))
        partial = jnp.zeros_like(partial)
    else:
      append = layer_index % bs == 0
      idx = jnp.minimum(count, nb - 1)
      slot = jnp.where(append, partial.astype(blocks.dtype),
                       jax.lax.dynamic_index_in_dim(blocks, idx, 0, False))
      blocks = jax.lax.dynamic_update_index_in_dim(blocks, slot, idx, 0)
      partial = jnp.where(append, jnp.zeros_like(partial), partial)

    partial = partial + mix(h).astype(partial.dtype)
    h = mlp_mixer(blocks, partial, slots < blocks_before(layer_index + 1, bs))
    partial = partial + mlp(post_norm(h)).astype(partial.dtype)
    state = sharding.constrain_activations((blocks, partial))
    return state if cache is None else (state, new_cache)


class LayerGroup(nn.Module):
  """One scanned group: layers_0 … layers_{p-1} = [KDA]*(p-1) + [MLA], all MoE.

  __call__(state, group_index, segment_ids, cache=None, feed=None) → (state, the group's
  updated caches {"layers_j": cache} or None); global layer index of layers_j is
  first_layer + group_index·p + j.
  """
  config: ModelConfig
  first_layer: int

  @nn.compact
  def __call__(self, state, group_index, segment_ids, cache=None, feed=None):
    p = self.config.text.mla_every
    new = {}
    for j in range(p):
      mixer = MLA if j == p - 1 else KDA
      layer = DecoderLayer(self.config, mixer, MOE, self.config.text.attn_res_block_size is not None,
                           name=f"layers_{j}")
      index = self.first_layer + group_index * p + j
      if cache is None:
        state = layer(state, index, segment_ids)
      else:
        state, new[f"layers_{j}"] = layer(state, index, segment_ids, cache[f"layers_{j}"], feed)
    return state, (new if cache is not None else None)


LAYER_INPUT = "layer_input"   # the checkpoint name of a layer's input (remat_offload)


def _remat_policy(cfg: ModelConfig):
  """None (keep nothing but the remat'd function's inputs), or with `remat_offload` the
  layers' inputs (LAYER_INPUT) saved in pinned host memory: device memory then holds one
  layer's activations at a time, host memory every layer's input."""
  if not cfg.modes.remat_offload:
    return None
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=(), names_which_can_be_offloaded=(LAYER_INPUT,),
      offload_src="device", offload_dst="pinned_host")


def _maybe_remat(cls, cfg: ModelConfig, static_argnums=(), scanned: bool = False):
  """`cls` rematerialised in the backward pass when `cfg.modes.remat` — the one remat policy of the
  model, for the scanned groups and for the unrolled prefix / suffix / MTP layers alike
  (otherwise the unrolled layers' saved residuals stay live until the backward pass; the k3
  memory figures are in docs/notes/sharding.md). `static_argnums` count self as 0.

  CSE is prevented unless `scanned` (the body of a rolled `nn.scan`, where a loop already keeps
  the backward's recomputation apart): outside a loop XLA would merge the recomputation with
  the forward's identical ops and keep the forward's values alive until the backward — remat
  in name only (k3 QLoRA: each unrolled layer's KDA chunk states and MoE dispatch buffers,
  1.3 GB a chip; docs/notes/lora.md)."""
  if not cfg.modes.remat:
    return cls
  return nn.remat(cls, prevent_cse=not (scanned and cfg.modes.scan_layers),
                  static_argnums=static_argnums, policy=_remat_policy(cfg))


def _layer_cls(cfg: ModelConfig):
  """DecoderLayer under `_maybe_remat`; its argument 2 (the layer index) is a python int."""
  return _maybe_remat(DecoderLayer, cfg, static_argnums=(2,))


class MTP(nn.Module):
  """Multi-token prediction module: (h [B,S,d], next_emb [B,S,d]) → (normed hidden, hidden
  before the norm) [B,S,d] each; with `cache` (its layer's MLACache) and `feed` → (normed,
  pre-norm, updated cache). The pre-norm hidden is what a chained draft feeds back as the next
  position's h (k3jax/posttrain/eagle.py)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, h, next_emb, segment_ids=None, cache=None, feed=None):
    cfg = self.config
    eps = cfg.text.rms_norm_eps
    x = jnp.concatenate([RMSNorm(eps=eps, name="enorm")(next_emb),
                         RMSNorm(eps=eps, name="hnorm")(h)], axis=-1)
    x = linear(cfg, cfg.text.d_model, (None, "embed"), name="eh_proj")(x).astype(jnp.float32)
    layer = _layer_cls(cfg)(cfg, MLA, MOE, attn_res=False, name="layer")
    norm = RMSNorm(eps=eps, name="norm")
    if cache is None:
      x = layer(x, 0, segment_ids)
      return norm(x), x
    x, cache = layer(x, 0, segment_ids, cache, feed)
    return norm(x), x, cache


def _check_tokens(tokens, vocab_size: int, segment_ids):
  if not hasattr(tokens, "ndim") or tokens.ndim != 2:
    raise ValueError(f"K3Model: tokens must be an int array [B,T], found "
                     f"{getattr(tokens, 'shape', type(tokens))}")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"K3Model: tokens must have an integer dtype, found {tokens.dtype}")
  if segment_ids is not None and (segment_ids.shape != tokens.shape
                                  or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
    raise ValueError(f"K3Model: segment_ids must be int {tokens.shape}, found "
                     f"{segment_ids.dtype} {segment_ids.shape}")
  try:  # concrete inputs only; under jit/eval_shape the ids cannot be inspected
    ids = np.asarray(tokens)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return
  if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
    raise ValueError(f"K3Model: token ids must be in [0, vocab_size={vocab_size}), found "
                     f"[{ids.min()}, {ids.max()}]")


def _check_feed(method: str, tokens, lengths, num_new) -> None:
  """Shapes of a decode call: tokens [B,T] int, the cache's lengths [B], num_new [B]."""
  _check_tokens(tokens, 2**31 - 1, None)
  b = tokens.shape[0]
  if getattr(num_new, "shape", None) != (b,) or lengths.shape != (b,):
    raise ValueError(f"K3Model.{method}: num_new and the cache's lengths must be [B]=[{b}], "
                     f"found {getattr(num_new, 'shape', type(num_new))} and {lengths.shape}")


def document_ids(segment_ids):
  """[B,T] int → the document index of each token: 0 for a row's first run of equal ids, +1
  wherever the id changes. KDA resets its state where the id changes while MLA and the short
  convolutions compare ids for equality; on document indices the two agree whatever ids the
  caller used (an id that comes back later in the row starts a new document)."""
  change = jnp.concatenate(
      [jnp.zeros_like(segment_ids[:, :1]), (segment_ids[:, 1:] != segment_ids[:, :-1])
       .astype(segment_ids.dtype)], axis=1)
  return jnp.cumsum(change, axis=1).astype(jnp.int32)


def mtp_document_ids(doc_ids, stand_in_last: bool = False):
  """Document indices [B,T] → those of the T−1 MTP positions [B,T−1]. Position t reads h_t and
  token t+1, so it belongs to the pair (document of t, document of t+1); a position whose two
  tokens lie in different documents is a document of its own (it sees no other position, and
  no position of either neighbour sees it). The pair changes between t−1 and t exactly when
  the document changes at t or at t+1. `stand_in_last`: [B,T], position T−1 (whose next
  token is a stand-in, `K3Model(mtp_full=True)`) a document of its own."""
  change = doc_ids[:, 1:] != doc_ids[:, :-1]                      # [B,T−1]: at tokens 1..T−1
  starts = change | jnp.pad(change[:, :-1], ((0, 0), (1, 0)))      # at t+1, or at t
  starts = starts.at[:, 0].set(False)
  if stand_in_last:
    starts = jnp.concatenate([starts, jnp.ones_like(starts[:, :1])], axis=1)
  return jnp.cumsum(starts, axis=1).astype(jnp.int32)


class K3Model(nn.Module):
  """The language model. See the module docstring.

  __call__(tokens [B,T] int, *, segment_ids [B,T] int | None, return_mtp=False, media=None,
    mtp_full=False) → logits fp32 [B,T,vocab], or (logits, mtp_logits fp32 [B,T−1,vocab])
    with return_mtp ([B,T,vocab] with mtp_full: the last position is a stand-in, to mask);
    return_hidden: the head's inputs (fp32 [B,T,d], after the final norm) in place of logits.
  extend(tokens [B,T], cache, num_new [B], media=None) → (logits, hidden [B,T,d] fp32 (the
    draft's feature input), cache): decoding.
  draft(hidden [B,T,d], next_tokens [B,T], cache, num_new [B], return_hidden=False) → (MTP
    logits, cache), or (MTP logits, the draft's pre-norm hidden, cache).
  draft_inputs(tokens [B,T], segment_ids=None) → (logits, hidden [B,T,d] fp32): the target's
    logits and the draft's feature input at every position (EAGLE-3 training).
  init_cache(batch, max_len) → a zero `Cache` (needs no variables).
  """
  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.embed_tokens = nn.Embed(
        cfg.text.vocab_size, cfg.text.d_model, dtype=jnp.float32, param_dtype=dtype_of(cfg.modes.param_dtype),
        embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(1.0), ("vocab", "embed")))
    attn_res = cfg.text.attn_res_block_size is not None
    types = cfg.text.layer_types()
    prefix, groups, _ = cfg.text.stack_layout()
    layer_cls = _layer_cls(cfg)
    self.layers = {i: layer_cls(cfg, *types[i], attn_res) for i in self._unrolled()}
    if groups:
      self.body = nn.scan(
          _maybe_remat(LayerGroup, cfg, scanned=True),
          variable_axes={"params": 0, "balance": 0, "lora": 0, "stats": 0,
                         "rewind": 0},
          split_rngs={"params": True}, in_axes=(0, nn.broadcast, 0, nn.broadcast),
          length=groups, unroll=1 if cfg.modes.scan_layers else groups,
          metadata_params={nn.PARTITION_NAME: "layers"})(cfg, prefix)
    if attn_res:
      self.output_attn_res = AttnResMixer(cfg)
    self.norm = RMSNorm(eps=cfg.text.rms_norm_eps)
    if not cfg.text.tie_word_embeddings:
      self.lm_head = linear(cfg, cfg.text.vocab_size, ("embed", "vocab"), name="lm_head")
    if cfg.text.num_mtp_layers:
      self.mtp = MTP(cfg)
    if cfg.modes.eagle_blocks is not None:
      self.draft_fuse = linear(cfg, cfg.text.d_model, (None, "embed"), name="draft_fuse")
    if cfg.vision is not None:
      self.vision_tower = VisionTower(cfg.vision)
      self.mm_projector = Projector(cfg.vision)

  def _unrolled(self) -> list[int]:
    prefix, groups, _ = self.config.text.stack_layout()
    return [*range(prefix), *range(prefix + groups * self.config.text.mla_every,
                                   self.config.text.num_layers)]

  def __call__(self, tokens, *, segment_ids=None, return_mtp: bool = False,
               media: Media | None = None, mtp_full: bool = False,
               return_hidden: bool = False):
    cfg = self.config
    _check_tokens(tokens, cfg.text.vocab_size, segment_ids)
    if segment_ids is not None:
      segment_ids = document_ids(segment_ids)
    if return_mtp and not cfg.text.num_mtp_layers:
      raise ValueError("K3Model: return_mtp=True needs config.text.num_mtp_layers=1, found 0")
    x = self._embed(tokens, media)
    h, _, feats = self._stack(x, segment_ids)
    # return_hidden: the head's inputs (after the final norm) instead of its logits, for a
    # loss that applies the head a chunk of tokens at a time (train/step.py, ce_chunks).
    def head(y, normed=False):
      if not return_hidden:
        return self._head(y, normed)
      return y if normed else self.norm(y)

    logits = head(h)
    if cfg.text.num_mtp_layers and (return_mtp or self.is_initializing()):
      if return_mtp and mtp_full:
        # All T positions, sharded over context like the trunk (module doc).
        docs = jnp.zeros_like(tokens) if segment_ids is None else segment_ids
        nxt = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
        mtp_in = sharding.constrain_activations(
            (self._draft_input(h, feats), self.embed_tokens(nxt)))
        seg = mtp_document_ids(docs, stand_in_last=True)
        return logits, head(self.mtp(*mtp_in, seg)[0], normed=True)
      if return_mtp:
        seg = None if segment_ids is None else mtp_document_ids(segment_ids)
        # T−1 positions: batch-sharded only (a context axis > 1 that divides T never divides
        # T−1); the context-parallel attention and the expert dispatch pad them to a multiple
        # of their axes themselves (k3jax/parallel/): the results equal the single-device run.
        mtp_in = sharding.constrain_activations(
            (self._draft_input(h, feats)[:, :-1], self.embed_tokens(tokens[:, 1:])),
            context=False)
        return logits, head(self.mtp(*mtp_in, seg)[0], normed=True)
      self.mtp(self._draft_input(h, feats), x, segment_ids)  # init: the MTP params for any T
    return logits

  def draft_inputs(self, tokens, segment_ids=None, media: Media | None = None):
    """(logits fp32 [B,T,vocab], the draft's feature input fp32 [B,T,d]) of a forward pass:
    the targets and the step-0 inputs of EAGLE-3 training (k3jax/posttrain/eagle.py)."""
    cfg = self.config
    _check_tokens(tokens, cfg.text.vocab_size, segment_ids)
    if not cfg.text.num_mtp_layers:
      raise ValueError("K3Model.draft_inputs: needs config.text.num_mtp_layers=1, found 0")
    if segment_ids is not None:
      segment_ids = document_ids(segment_ids)
    h, _, feats = self._stack(self._embed(tokens, media), segment_ids)
    return self._head(h), self._draft_input(h, feats)

  def extend(self, tokens, cache: Cache, num_new, media: Media | None = None):
    """Feed tokens [B,T] (the first num_new[b] of row b are real) on top of `cache`; `media`
    fills the placeholders among them (a prompt's images, at prefill): a `Media` (run through
    the tower here) or `MediaEmbeddings` (encoded already).

    Returns (logits fp32 [B,T,vocab], hidden fp32 [B,T,d] (the MTP layer's feature input:
    before the final norm, or the EAGLE-3 fusion), cache with every layer's cache extended
    and lengths + num_new). Outputs past num_new[b] are meaningless. With the "rewind"
    collection mutable, the KDA layers also sow what `k3jax.serve.speculative.rewind` needs
    to keep only a prefix of the tokens.
    """
    _check_feed("extend", tokens, cache.lengths, num_new)
    feed = Feed(cache.lengths, num_new)
    h, stack, feats = self._stack(self._embed(tokens, media, "K3Model.extend"), None,
                                  cache.stack, feed)
    cache = cache.replace(lengths=cache.lengths + num_new, stack=stack)
    return self._head(h), self._draft_input(h, feats), cache

  def draft(self, hidden, next_tokens, cache: Cache, num_new, return_hidden: bool = False):
    """The MTP layer over new positions: hidden [B,T,d] (the main model's `extend` output at
    positions i, or a chained draft's own pre-norm hidden) and next_tokens [B,T] (token i+1),
    appended to `cache.mtp` at cache.mtp_lengths. Returns (logits fp32 [B,T,vocab] predicting
    token i+2, cache), with `return_hidden` (logits, pre-norm hidden fp32 [B,T,d], cache)."""
    if not self.config.text.num_mtp_layers:
      raise ValueError("K3Model.draft: needs config.text.num_mtp_layers=1, found 0")
    _check_feed("draft", next_tokens, cache.mtp_lengths, num_new)
    want = tuple(next_tokens.shape) + (self.config.text.d_model,)
    if hidden.shape != want:
      raise ValueError(f"K3Model.draft: hidden must be [B,T,d]={want}, found {hidden.shape}")
    y, pre, mtp = self.mtp(hidden, self.embed_tokens(next_tokens), None, cache.mtp,
                           Feed(cache.mtp_lengths, num_new))
    cache = cache.replace(mtp=mtp, mtp_lengths=cache.mtp_lengths + num_new)
    if return_hidden:
      return self._head(y, normed=True), pre.astype(jnp.float32), cache
    return self._head(y, normed=True), cache

  def init_cache(self, batch: int, max_len: int) -> Cache:
    """A zero cache for `batch` sequences of up to `max_len` tokens (see k3jax/cache.py)."""
    return Cache.zeros(self.config, batch, max_len)

  def _embed(self, tokens, media: Media | None, where: str = "K3Model"):
    """Token embeddings fp32 [B,T,d], the media's projected tokens at the placeholders."""
    cfg = self.config
    x = self.embed_tokens(tokens)
    if cfg.vision is None:
      if media is not None:
        raise ValueError(f"{where}: media given but config.vision is None (a text-only model)")
      return x
    if media is None:
      if self.is_initializing():  # create the tower's params whatever the inputs are
        self.encode_media(dummy_media(cfg.vision))
      return x
    check_placeholders(tokens, media, cfg.media_placeholder_token_id, where)
    if isinstance(media, MediaEmbeddings):   # encoded already (a serving engine's pieces)
      if self.is_initializing():
        self.encode_media(dummy_media(cfg.vision))
      return place_media(x, tokens, media.features, media.num_merged,
                         cfg.media_placeholder_token_id)
    return place_media(x, tokens, self.encode_media(media), media.num_merged,
                       cfg.media_placeholder_token_id)

  def encode_media(self, media: Media):
    """Vision tower → sd2_tpool merger → projector: media [S streams of L patches] →
    [S, L/4, d] fp32 (stream s's first num_merged[s] rows are its merged tokens, in order)."""
    cfg = self.config.vision
    if media.patches.ndim != 3 or media.patches.shape[-1] != cfg.patch_dim:
      raise ValueError(f"media.patches: expected [S, L, {cfg.patch_dim}], found "
                       f"{media.patches.shape}")
    merged = merge(self.vision_tower(media.patches, media.meta), media.meta)
    return self.mm_projector(merged).astype(jnp.float32)

  def _draft_input(self, h, feats):
    """The MTP layer's feature input: h, or draft_fuse(feats) with `eagle_blocks`."""
    if feats is None:
      return h
    return self.draft_fuse(feats).astype(jnp.float32)

  def _stack(self, x, segment_ids=None, cache=None, feed=None):
    """Embeddings x [B,T,d] fp32 through every layer → (h [B,T,d] fp32 before the final norm,
    the layers' updated caches, laid out like `Cache.stack`, or None without `cache`, and
    with `eagle_blocks` the chosen AttnRes block representations concatenated
    [B,T,len(eagle_blocks)·d] fp32, else None)."""
    cfg = self.config
    b, t, d = x.shape
    attn_res = cfg.text.attn_res_block_size is not None
    # Finished AttnRes blocks are frozen sums, stored in the compute dtype (bf16 halves the
    # largest activations a scanned stack saves for the backward); the running partial sum,
    # which every layer adds to, stays fp32.
    blocks0 = jnp.zeros((cfg.text.num_attn_res_blocks, b, t, d), dtype_of(cfg.modes.dtype))
    state = (blocks0, x) if attn_res else x
    new = None if cache is None else {}
    prefix, groups, _ = cfg.text.stack_layout()

    def unrolled(i, state):
      if cache is None:
        return self.layers[i](state, i, segment_ids)
      state, new[f"layers_{i}"] = self.layers[i](state, i, segment_ids, cache[f"layers_{i}"],
                                                 feed)
      return state

    for i in range(prefix):
      state = unrolled(i, state)
    if groups:
      state, body = self.body(state, jnp.arange(groups), segment_ids,
                              None if cache is None else cache["body"], feed)
      if cache is not None:
        new["body"] = body
    for i in self._unrolled()[prefix:]:
      state = unrolled(i, state)
    if not attn_res:
      return state, new, None
    feats = None
    if cfg.modes.eagle_blocks is not None:
      blocks, partial = state   # blocks[j]: block j (0: the embeddings); block nb: partial
      nb = blocks.shape[0]
      feats = jnp.concatenate([(blocks[j] if j < nb else partial).astype(jnp.float32)
                               for j in cfg.eagle_block_indices()], axis=-1)
    return self.output_attn_res(*state), new, feats

  def _head(self, h, normed: bool = False):
    """fp32 logits [B,T,vocab] from hidden states (final norm unless `normed`; tied:
    embed.attend; else lm_head)."""
    if not normed:
      h = self.norm(h)
    if self.config.text.tie_word_embeddings:
      return self.embed_tokens.attend(h.astype(dtype_of(self.config.modes.dtype))).astype(jnp.float32)
    return self.lm_head(h).astype(jnp.float32)


def layer_kinds(config: ModelConfig) -> dict:
  """Counts and positions of the layer kinds (pure python; used by tests and tools)."""
  types = config.text.layer_types()
  return {
      "kda": [i for i, (m, _) in enumerate(types) if m == KDA],
      "mla": [i for i, (m, _) in enumerate(types) if m == MLA],
      "dense": [i for i, (_, f) in enumerate(types) if f == DENSE],
      "moe": [i for i, (_, f) in enumerate(types) if f == MOE],
  }


def source_counts(config: ModelConfig) -> dict:
  """AttnRes sources per mixer for `config` (see ops.attnres.attn_res_source_counts)."""
  return attn_res_source_counts(config.text.num_layers, config.text.attn_res_block_size)


def abstract_variables(config: ModelConfig) -> dict:
  """Every collection of `K3Model(config)` as `jax.ShapeDtypeStruct`s, boxed with their logical
  axis names (`jax.eval_shape` of the init: nothing is allocated). The shardings of a state and
  of a restored checkpoint are derived from it."""
  return jax.eval_shape(K3Model(config).init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))


__all__ = ["K3Model", "DecoderLayer", "LayerGroup", "MTP", "abstract_variables", "document_ids",
           "layer_kinds", "mtp_document_ids", "source_counts"]
