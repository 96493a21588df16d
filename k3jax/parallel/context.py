"""Context parallelism: the sequence axis sharded over the mesh axis `context` (docs/k3.md §3, §4).

KDA (`kda_context_parallel`). The delta-rule state update is affine in the state, and every
column of S ∈ R^{K×V} evolves independently (S[:, j] += β k (v_j − S[:, j]·k) after decay), so
over one shard
    S_end = P · S_start + S0,        o_t = o0_t + S_startᵀ q̃_t
where (o0, S0) is the shard run from a zero state and (q̃, P) the same run with v = 0 from
S_start = I (P ∈ R^{K×K}; q̃_t = scale·P_tᵀ q_t). Both come from ONE call of the chunked op with
the value columns [v | 0] and initial state [0 | I]. The shards' affine maps (P, S0) are
composed in order by a parallel prefix over `context` (⌈log2 n⌉ `ppermute` doubling steps;
`_compose_shards`), giving each shard its true start state without any shard holding every
shard's maps; its outputs are then corrected with one einsum. Document packing: inside a shard the op
resets the state itself (so P = 0 after a boundary); a boundary at a shard's first token is
applied by zeroing the carried-in state (the previous shard's last segment id arrives by
`ppermute`).

Short convolutions (`causal_conv_context_parallel`): each shard receives the last W−1 inputs of
the previous shard by `ppermute` (zeros for the first shard).

MLA (`mla_attention_context_parallel`): keys/values are all-gathered over `context`; queries
keep their shard and the causal mask uses global positions. For long rows
(`mla_latent_context_parallel`, RunModes.mla_key_block) the *latents* are gathered instead —
L + R numbers a token (576 for k3, 1152 bytes in bf16: 1.1 GiB a layer at 1M tokens) where the
expanded keys and values are H·(Dk + V) (30720 for k3: 61 GiB at 1M) — and expanded one key
block at a time inside the attention loop (k3jax/ops/mla_blockwise.py). Gathered, not passed
round a ring: the gathered latents fit easily at 1M, one collective replaces context − 1
dependent hops, and each shard then skips the key blocks after its last query by itself.
A length the context axis does not divide (the MTP layer's T−1 positions) is padded at the end
to the next multiple: the causal mask hides the padded keys from every real query, and padded
queries are left out of the max logit and sliced off the output.

All functions here are meant to be called *inside* `jax.shard_map` with `context` among the
manual axes (the `*_sharded` wrappers build that shard_map from a mesh). The `maybe_*` wrappers
are what the layers use (through k3jax/layers/backend.py): called while a model is traced under
a mesh (JAX's own: `jax.set_mesh` around the jitted call, read back here with
`jax.sharding.get_abstract_mesh()`) with context > 1, they run KDA, the short convs and MLA
attention as above over global arrays; otherwise they return the single-device function
unchanged.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax import sharding
from k3jax.ops.kda import kda_chunked
from k3jax.ops.mla_blockwise import mla_latent_attention

Array = jax.Array
CONTEXT = "context"


# ------------------------------------------------------------------------------ helpers
def _axis_size(axis_name: str) -> int:
  return jax.lax.axis_size(axis_name)


def from_previous_shard(x: Array, axis_name: str = CONTEXT) -> Array:
  """Value of `x` on the previous shard along `axis_name` (zeros on the first shard)."""
  n = _axis_size(axis_name)
  if n == 1:
    return jnp.zeros_like(x)
  return jax.lax.ppermute(x, axis_name, [(i, i + 1) for i in range(n - 1)])


# ------------------------------------------------------------------------------ KDA
def _default_kda():
  return kda_chunked


def kda_context_parallel(
    q: Array, k: Array, v: Array, g: Array, beta: Array, *, scale: float,
    initial_state: Array | None = None, chunk_size: int = 64,
    segment_ids: Array | None = None, axis_name: str = CONTEXT,
    kda_fn: Callable | None = None) -> tuple[Array, Array]:
  """KDA over a sequence sharded along `axis_name`; call inside shard_map.

  Args (local shards; T_l = T / context):
    q, k: [B, T_l, H, K]; v: [B, T_l, H, V]; g: [B, T_l, H, K] log-decay (fp32);
    beta: [B, T_l, H]; scale: query scale; chunk_size: passed to `kda_fn`.
    initial_state: [B, H, K, V] state before the *global* first token (used by shard 0 only;
      must be the same on every shard), or None for zeros.
    segment_ids: [B, T_l] int32 document ids (global ids: equal ids on both sides of a shard
      boundary mean the same document), or None.
    kda_fn: the chunked op, `kda_chunked(q, k, v, g, beta, *, scale, initial_state,
      chunk_size, segment_ids) -> (o, final_state)`; default `k3jax.ops.kda.kda_chunked`.

  Returns:
    o [B, T_l, H, V] (this shard's outputs, equal to the unsharded op's), and the global final
    state [B, H, K, V] fp32 (identical on every shard).
  """
  kda_fn = _default_kda() if kda_fn is None else kda_fn
  b, _, h, dk = k.shape
  dv = v.shape[-1]
  idx = jax.lax.axis_index(axis_name)
  f32 = jnp.float32

  # One call: columns [v | 0] from state [0 | I] give (o0 | q̃) and (S0 | P).
  eye = jnp.broadcast_to(jnp.eye(dk, dtype=f32), (b, h, dk, dk))
  v_ext = jnp.concatenate([v, jnp.zeros((*v.shape[:-1], dk), v.dtype)], axis=-1)
  s_ext = jnp.concatenate([jnp.zeros((b, h, dk, dv), f32), eye], axis=-1)
  kw = dict(scale=scale, initial_state=s_ext, chunk_size=chunk_size)
  if segment_ids is not None:
    kw["segment_ids"] = segment_ids
  o_ext, st_ext = kda_fn(q, k, v_ext, g, beta, **kw)
  o0, q_t = o_ext[..., :dv], o_ext[..., dv:].astype(f32)
  s0, p = st_ext[..., :dv].astype(f32), st_ext[..., dv:].astype(f32)

  # keep[b] = 0 where this shard starts a new document (its carried-in state is dropped).
  if segment_ids is None:
    keep = jnp.ones((b,), f32)
  else:
    prev_last = from_previous_shard(segment_ids[:, -1], axis_name)
    keep = jnp.where((idx == 0) | (prev_last == segment_ids[:, 0]), 1.0, 0.0).astype(f32)

  init = (jnp.zeros((b, h, dk, dv), f32) if initial_state is None
          else initial_state.astype(f32))
  start, final = _compose_shards(p, s0, keep, init, idx, axis_name)
  corr = jnp.einsum("bthk,bhkv->bthv", q_t, start, precision="highest")
  o = (o0.astype(f32) + corr).astype(o0.dtype)
  return o, final


def _compose_shards(p: Array, s0: Array, keep: Array, init: Array, idx: Array,
                    axis_name: str) -> tuple[Array, Array]:
  """Each shard's start state and the global final state from the shards' affine maps.

  Shard j maps the state it is handed, x, to  P_j (keep_j x) + S0_j. The maps are composed
  in order by a parallel prefix over the axis (⌈log2 n⌉ doubling steps, each one `ppermute`
  of a [B, H, K, K+V] map): a shard holds only its own running composition and the one it
  receives, never every shard's (P, S0) — at 128 shards and k3's 96 heads of 128 × 128 an
  all-gather of them would be 1.5 GiB a layer a chip, live through the layer's backward.
  Returns start [B, H, K, V] (keep_j · the previous shard's end; shard 0: keep_0 · init) and
  the final state (the last shard's end, on every shard)."""
  n = _axis_size(axis_name)
  dk = p.shape[-1]
  a = p * keep[:, None, None, None]                 # x ↦ a x + c, the shard's own map
  m = jnp.concatenate([a, s0], axis=-1)             # [B, H, K, K + V]
  d = 1
  while d < n:   # inclusive prefix: m_j ← m_j ∘ m_{j−d} (the older map applied first)
    older = jax.lax.ppermute(m, axis_name, [(i, i + d) for i in range(n - d)])
    both = jnp.einsum("bhij,bhjv->bhiv", m[..., :dk], older, precision="highest")
    both = both.at[..., dk:].add(m[..., dk:])     # [a_j a_o | a_j c_o + c_j]
    m = jnp.where(idx >= d, both, m)
    d *= 2
  end = jnp.einsum("bhij,bhjv->bhiv", m[..., :dk], init, precision="highest") + m[..., dk:]
  prev_end = jnp.where(idx == 0, init, from_previous_shard(end, axis_name))
  start = prev_end * keep[:, None, None, None]
  final = jax.lax.psum(jnp.where(idx == n - 1, end, 0.0), axis_name) if n > 1 else end
  return start, final


def kda_context_parallel_sharded(
    mesh, q, k, v, g, beta, *, scale, initial_state=None, chunk_size=64, segment_ids=None,
    kda_fn=None):
  """`kda_context_parallel` under a shard_map built from `mesh` (global arrays in and out).

  Batch over `sharding.BATCH_AXES`, length over `context`, heads over `tensor`.
  """
  bt = P(sharding.BATCH_AXES, CONTEXT, "tensor")
  st = P(sharding.BATCH_AXES, "tensor")
  args = [q, k, v, g, beta]
  specs = [bt, bt, bt, bt, bt]
  has_init = initial_state is not None
  has_seg = segment_ids is not None
  if has_init:
    args.append(initial_state)
    specs.append(st)
  if has_seg:
    args.append(segment_ids)
    specs.append(P(sharding.BATCH_AXES, CONTEXT))

  def body(*a):
    q_, k_, v_, g_, b_ = a[:5]
    rest = list(a[5:])
    init = rest.pop(0) if has_init else None
    seg = rest.pop(0) if has_seg else None
    return kda_context_parallel(q_, k_, v_, g_, b_, scale=scale, initial_state=init,
                                chunk_size=chunk_size, segment_ids=seg, kda_fn=kda_fn)

  fn = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=(bt, st),
                     check_vma=False)
  return fn(*args)


# ------------------------------------------------------------------------------ short conv
def causal_conv_context_parallel(x: Array, kernel: Array, *, axis_name: str = CONTEXT,
                                 segment_ids: Array | None = None) -> Array:
  """Causal depthwise convolution of a sequence sharded along `axis_name`; inside shard_map.

  Args:
    x: [B, T_l, ...C] local inputs; kernel: [W, ...C], taps in time order (tap W−1 multiplies
      the current token). segment_ids: [B, T_l] or None; when given, taps never reach into an
      earlier document (inputs of other documents count as zeros).
  Returns [B, T_l, ...C] (no activation), equal to the unsharded convolution.
  """
  w = kernel.shape[0]
  t = x.shape[1]
  if w > 1 and t < w - 1:
    raise ValueError(f"x: local sequence length {t} is shorter than the conv halo {w - 1}")
  halo = from_previous_shard(x[:, t - (w - 1):], axis_name) if w > 1 else x[:, :0]
  xe = jnp.concatenate([halo, x], axis=1)                           # [B, T_l + W − 1, ...]
  if segment_ids is not None:
    seg_halo = from_previous_shard(segment_ids[:, t - (w - 1):], axis_name) if w > 1 else (
        segment_ids[:, :0])
    sege = jnp.concatenate([seg_halo, segment_ids], axis=1)
  out = jnp.zeros(x.shape, jnp.float32)
  for j in range(w):  # tap j reads the token W−1−j steps back
    src = xe[:, j:j + t].astype(jnp.float32)
    if segment_ids is not None:
      same = (sege[:, j:j + t] == segment_ids)
      src = src * same.reshape(same.shape + (1,) * (x.ndim - 2))
    out = out + src * kernel[j].astype(jnp.float32)
  return out.astype(x.dtype)


# ------------------------------------------------------------------------------ MLA
def all_gather_sequence(x: Array, axis_name: str = CONTEXT) -> Array:
  """[B, T_l, ...] → [B, T, ...]: the whole sequence on every shard (in shard order)."""
  return jax.lax.all_gather(x, axis_name, axis=1, tiled=True)


def mla_attention_context_parallel(
    q: Array, k: Array, v: Array, *, scale: float, segment_ids: Array | None = None,
    axis_name: str = CONTEXT, length: int | None = None) -> tuple[Array, Array]:
  """Causal softmax attention with queries sharded and keys/values gathered; inside shard_map.

  Args:
    q: [B, T_l, H, Dk] local queries; k: [B, T_l, H, Dk], v: [B, T_l, H, Dv] local keys
      and values (gathered here; gather the latents instead and expand after, to move
      kv_rank+rope numbers per token rather than H·(Dk+Dv)); segment_ids [B, T_l] or None.
    length: global positions ≥ `length` are padding: their queries are left out of
      `max_logit` (their keys come after every real query, so the causal mask already hides
      them). None: no padding.
  Returns (o [B, T_l, H, Dv] fp32 (docs/k3.md §4: attention output in fp32), max_logit [H]: the
  largest unmasked logit per head over this shard's batch rows and the whole sequence).
  """
  t_l = q.shape[1]
  idx = jax.lax.axis_index(axis_name)
  kg, vg = all_gather_sequence(k, axis_name), all_gather_sequence(v, axis_name)
  qpos = idx * t_l + jnp.arange(t_l)
  kpos = jnp.arange(kg.shape[1])
  mask = (kpos[None, :] <= qpos[:, None])[None]                      # [1, T_l, T]
  if segment_ids is not None:
    segg = all_gather_sequence(segment_ids, axis_name)
    mask = mask & (segment_ids[:, :, None] == segg[:, None, :])
  logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kg.astype(jnp.float32),
                      precision="highest") * scale
  logits = jnp.where(mask[:, None], logits, -jnp.inf)
  stat = logits if length is None else jnp.where(
      (qpos < length)[None, None, :, None], logits, -jnp.inf)
  # A statistic for QK-Clip, never differentiated (pmax has no transpose rule).
  max_logit = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(stat, axis=(0, 2, 3))), axis_name)
  probs = jax.nn.softmax(logits, axis=-1)
  o = jnp.einsum("bhqk,bkhd->bqhd", probs, vg.astype(jnp.float32), precision="highest")
  return o, max_logit


def mla_latent_context_parallel(
    q: Array, c: Array, k_rope: Array, w_kv: Array, *, scale: float, key_block: int,
    segment_ids: Array | None = None, axis_name: str = CONTEXT, length: int | None = None,
    query_block: int | None = None) -> tuple[Array, Array]:
  """Causal attention of this shard's queries over the whole sequence's *latents*; inside
  shard_map.

  Args (local shards; T_l = T / context):
    q [B,T_l,H,Dk]; c [B,T_l,L] and k_rope [B,T_l,R] this shard's latents (all-gathered
    here: L + R numbers a token — 576 for k3 — where the expanded keys and values would be
    H·(Dk + V)); w_kv [L,H,nope+V] kv_b (the heads this shard holds); segment_ids [B,T_l] or
    None; length: global positions ≥ `length` are padding (left out of `max_logit`).
  The keys are expanded one block of `key_block` at a time (`ops.mla_blockwise`); a shard
  (each of its `query_block`s of queries) visits only the key blocks up to its last query.
  Returns (o fp32 [B,T_l,H,V], max_logit [H] over this shard's rows and every shard's
  queries).
  """
  t_l = q.shape[1]
  idx = jax.lax.axis_index(axis_name)
  cg, krg = all_gather_sequence(c, axis_name), all_gather_sequence(k_rope, axis_name)
  segg = None if segment_ids is None else all_gather_sequence(segment_ids, axis_name)
  qpos = idx * t_l + jnp.arange(t_l)
  o, max_logit = mla_latent_attention(
      q, cg, krg, w_kv, scale=scale, key_block=key_block, segment_ids=segg,
      q_segment_ids=(jnp.zeros(q.shape[:2], jnp.int32) if segment_ids is None
                     else segment_ids),
      q_start=idx * t_l, q_valid=None if length is None else qpos < length,
      query_block=query_block)
  return o, jax.lax.pmax(max_logit, axis_name)


def _check_divisible(mesh, t: int, what: str) -> None:
  n = sharding.axis_size(mesh, CONTEXT)
  if t % n:
    raise ValueError(f"{what}: sequence length {t} is not divisible by the context axis size {n}")


def _with_segments(args: tuple, specs: tuple, segment_ids, seg_spec) -> tuple[tuple, tuple]:
  """shard_map operands and in_specs, with segment ids appended when there are any; the
  per-shard function takes them as an optional trailing `*seg` (`_segments(seg)`)."""
  if segment_ids is None:
    return args, specs
  return args + (segment_ids,), specs + (seg_spec,)


def _segments(seg: tuple):
  return seg[0] if seg else None


def maybe_context_parallel_conv(conv_fn: Callable) -> Callable:
  """`conv_fn(x [B,T,H,C], kernel [W,H,C], segment_ids=None) → fp32` itself, or — when the
  mesh in context has context > 1 — the same convolution with each shard receiving its W−1
  boundary tokens from the previous shard (`causal_conv_context_parallel`)."""
  mesh = jax.sharding.get_abstract_mesh()
  if sharding.axis_size(mesh, CONTEXT) <= 1:
    return conv_fn
  bt = P(sharding.BATCH_AXES, CONTEXT, "tensor")
  seg_spec = P(sharding.BATCH_AXES, CONTEXT)

  def run(x, kernel, segment_ids=None):
    _check_divisible(mesh, x.shape[1], "short conv x")
    args, specs = _with_segments((x.astype(jnp.float32), kernel), (bt, P(None, "tensor")),
                                 segment_ids, seg_spec)
    fn = jax.shard_map(
        lambda a, w, *sg: causal_conv_context_parallel(a, w, segment_ids=_segments(sg)),
        mesh=mesh, in_specs=specs, out_specs=bt, check_vma=False)
    return fn(*args)

  return run


def maybe_context_parallel_attention(attn_fn: Callable) -> Callable:
  """`attn_fn(q, k, v, *, scale, segment_ids=None, query_block=None) → (o, max_logit [H])`
  (ops.mla_attention) itself, or — when the mesh in context has context > 1 — the same attention
  with queries sharded over the sequence and keys/values all-gathered
  (`mla_attention_context_parallel`); the max logit is reduced over every shard. A length T
  that the context axis does not divide is padded at the end to the next multiple (zeros; the
  last segment id repeated, so that padded queries attend to something) and the output sliced
  back to T: the real positions' outputs and the max logit are those of the unpadded call."""
  mesh = jax.sharding.get_abstract_mesh()
  n = sharding.axis_size(mesh, CONTEXT)
  if n <= 1:
    return attn_fn
  bt = P(sharding.BATCH_AXES, CONTEXT, "tensor")
  seg_spec = P(sharding.BATCH_AXES, CONTEXT)
  batch_axes = tuple(a for a in sharding.BATCH_AXES if sharding.axis_size(mesh, a) > 1)

  def body(q, k, v, *seg, scale, length):
    o, m = mla_attention_context_parallel(q, k, v, scale=scale, segment_ids=_segments(seg),
                                          length=length)
    return o, (jax.lax.pmax(m, batch_axes) if batch_axes else m)

  def run(q, k, v, *, scale=None, segment_ids=None, query_block=None):
    del query_block  # each shard already holds only T / context queries
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    t = q.shape[1]
    pad = -t % n
    if pad:
      q, k, v = (jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2)) for a in (q, k, v))
      if segment_ids is not None:
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), mode="edge")
    args, specs = _with_segments((q, k, v), (bt, bt, bt), segment_ids, seg_spec)
    fn = jax.shard_map(functools.partial(body, scale=scale, length=t if pad else None),
                       mesh=mesh, in_specs=specs, out_specs=(bt, P("tensor")), check_vma=False)
    o, max_logit = fn(*args)
    return (o[:, :t] if pad else o), max_logit

  return run


def maybe_context_parallel_latent_attention() -> Callable:
  """`ops.mla_blockwise.mla_latent_attention(q, c, k_rope, w_kv, *, scale, key_block,
  segment_ids=None, query_block=None) → (o, max_logit [H])` itself, or — when the mesh in
  context has context > 1 — the same attention with queries sharded over the sequence and the latents all-gathered
  (`mla_latent_context_parallel`); a length T the context axis does not divide (the MTP
  layer's T − 1) is padded at the end as in `maybe_context_parallel_attention`."""
  mesh = jax.sharding.get_abstract_mesh()
  n = sharding.axis_size(mesh, CONTEXT)
  if n <= 1:
    return mla_latent_attention
  bt = P(sharding.BATCH_AXES, CONTEXT, "tensor")
  seq = P(sharding.BATCH_AXES, CONTEXT)
  batch_axes = tuple(a for a in sharding.BATCH_AXES if sharding.axis_size(mesh, a) > 1)

  def body(q, c, kr, w, *seg, scale, key_block, query_block, length):
    o, m = mla_latent_context_parallel(q, c, kr, w, scale=scale, key_block=key_block,
                                       segment_ids=_segments(seg), length=length,
                                       query_block=query_block)
    return o, (jax.lax.pmax(m, batch_axes) if batch_axes else m)

  def run(q, c, k_rope, w_kv, *, scale, key_block, segment_ids=None, query_block=None):
    t = q.shape[1]
    pad = -t % n
    if pad:
      q, c, k_rope = (jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))
                      for a in (q, c, k_rope))
      if segment_ids is not None:
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), mode="edge")
    args, specs = _with_segments((q, c, k_rope, w_kv), (bt, seq, seq, P(None, "tensor")),
                                 segment_ids, seq)
    fn = jax.shard_map(functools.partial(body, scale=scale, key_block=key_block,
                                         query_block=query_block, length=t if pad else None),
                       mesh=mesh, in_specs=specs, out_specs=(bt, P("tensor")), check_vma=False)
    o, max_logit = fn(*args)
    return (o[:, :t] if pad else o), max_logit

  return run


def maybe_context_parallel(kda_fn: Callable) -> Callable:
  """`kda_fn` itself, or — when the mesh in context (`jax.set_mesh`) has context > 1 — a
  function with the same signature that runs it context-parallel over global arrays.

  The layers obtain their chunked KDA through `k3jax.layers.backend.kda_chunked_fn`, which
  wraps it here; the decision is taken when the model is traced, and the returned function
  must be called under the same mesh.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if sharding.axis_size(mesh, CONTEXT) <= 1:
    return kda_fn

  def run(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size=64,
          segment_ids=None):
    if scale is None:
      scale = k.shape[-1] ** -0.5
    _check_divisible(mesh, q.shape[1], "q")
    return kda_context_parallel_sharded(
        mesh, q, k, v, g, beta, scale=scale, initial_state=initial_state,
        chunk_size=chunk_size, segment_ids=segment_ids, kda_fn=kda_fn)

  return run


__all__ = [
    "from_previous_shard", "kda_context_parallel", "kda_context_parallel_sharded",
    "causal_conv_context_parallel", "all_gather_sequence", "mla_attention_context_parallel",
    "mla_latent_context_parallel", "maybe_context_parallel", "maybe_context_parallel_conv",
    "maybe_context_parallel_attention", "maybe_context_parallel_latent_attention",
]
