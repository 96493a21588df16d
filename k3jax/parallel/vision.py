"""The vision tower under a mesh (docs/k3.md §11): packed streams over the batch axes, and one stream
split over `context` along its patches.

A packed stream [B, L, …] (k3jax.vision.packing) is laid out like the text model's residual
stream: B over the batch axes (`sharding.BATCH_AXES`: data, fsdp, expert — those that divide
B), L over `context`, heads over `tensor` where they divide. Everything in the tower but
attention is per patch — the patch embedding, the divided-fixed position embedding and the RoPE
angles (functions of each patch's own metadata: the tables are those of the whole stream, each
shard evaluating its own slice), norms, MLPs — so the SPMD partitioner runs it on the shards as
it is, once the stream and its metadata are constrained to that layout (`shard_stream`).

Attention is the one place a patch reads the others. Each context shard keeps its own queries;
keys, values and their segment ids are all-gathered over `context`
(`packed_attention_context_parallel`, inside `jax.shard_map`), and the op's block-diagonal mask
over the gathered segment ids does the rest: a sample whose patches straddle shard boundaries
still attends to all of them, no sample sees another, padding neither attends nor is attended.
The merger (`sd2_tpool`, a scatter-add into merged tokens: a 2×2 window or a clip's frames may
straddle a shard boundary, so the partitioner reduces the partial sums across `context`) writes
merged tokens [B, L/4, …] that are split over `context` again, so the projector runs on
shards too. The result equals the unsharded tower up to fp32 summation order
(tests/vision/test_sharded.py).

The constraint: the stream length L must be divisible by the context axis size (buckets are
powers of two, so any power-of-two context axis up to the smallest bucket works); otherwise
`check_stream_length` raises a ValueError naming both.

Used by `k3jax.vision.tower` when it is traced under a mesh (JAX's own: `jax.set_mesh` around
the call of the jitted function, read back with `jax.sharding.get_abstract_mesh()`); without
one, or with context = 1, the wrappers return the single-device function itself and the
constraints are no-ops, so the single-device program is unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax import sharding
from k3jax.parallel.context import CONTEXT, all_gather_sequence

Array = jax.Array


# ------------------------------------------------------------------------------ layout
def check_stream_length(length: int, mesh=None) -> None:
  """Raise ValueError when the context axis of `mesh` (default: the active one) does not
  divide a packed stream of `length` patches."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  n = sharding.axis_size(mesh, CONTEXT)
  if length % n:
    raise ValueError(
        f"vision stream: length L = {length} patches is not divisible by the context axis size "
        f"{n}; pick VisionConfig.pack_buckets that are multiples of {n}")


def _batch_axes(mesh, b: int) -> tuple[str, ...] | None:
  """The longest prefix of the batch axes (size > 1) whose product divides B; None if empty.
  A batch the axes do not divide (encode's single stream on a data axis) is replicated over
  the rest: each of those devices computes the same rows."""
  axes = tuple(a for a in sharding.BATCH_AXES if sharding.axis_size(mesh, a) > 1)
  while axes and b % sharding.axis_size(mesh, axes):
    axes = axes[:-1]
  return axes or None


def _context(mesh) -> str | None:
  return CONTEXT if sharding.axis_size(mesh, CONTEXT) > 1 else None


def _heads_axis(mesh, h: int) -> str | None:
  n = sharding.axis_size(mesh, "tensor")
  return "tensor" if n > 1 and h % n == 0 else None


def stream_spec(mesh, shape, *, strict: bool = True) -> P:
  """PartitionSpec of a stream array [B, L, …]: B over the batch axes that divide it, L over
  `context`, the rest replicated. strict: L must be divisible (`check_stream_length`);
  otherwise a length the context axis does not divide is replicated over it."""
  if strict:
    check_stream_length(shape[1], mesh)
  elif shape[1] % sharding.axis_size(mesh, CONTEXT):
    return P(_batch_axes(mesh, shape[0]))
  return P(_batch_axes(mesh, shape[0]), _context(mesh))


def shard_stream(tree: Any, *, strict: bool = True) -> Any:
  """Under a mesh: every array [B, L, …] of `tree` (patches, activations, the per-patch
  metadata, merged tokens [B, L/4, …] with strict=False) constrained to `stream_spec`;
  without one, `tree` unchanged. The constraints pin the per-patch (per-token) work —
  embeddings, position tables, norms, MLPs, the projector — to the stream's shards."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return tree
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, stream_spec(mesh, x.shape, strict=strict))), tree)


# ------------------------------------------------------------------------------ attention
def packed_attention_context_parallel(
    q: Array, k: Array, v: Array, segment_ids: Array, *, attn_fn: Callable,
    scale: float | None = None, query_block: int | None = None,
    axis_name: str = CONTEXT) -> Array:
  """Block-diagonal attention of a stream split along `axis_name`; call inside shard_map.

  q, k [B, L_l, H, Dk], v [B, L_l, H, V], segment_ids [B, L_l] (local shards, L_l = L / context;
  global sample ids, −1 = padding). attn_fn: `k3jax.vision.ops.packed_attention` (or a function
  with its signature, `kv_segment_ids` included). Returns this shard's outputs
  [B, L_l, H, V] fp32, equal to the rows of the unsharded op.
  """
  kg, vg, sg = (all_gather_sequence(x, axis_name) for x in (k, v, segment_ids))
  return attn_fn(q, kg, vg, segment_ids, scale=scale, query_block=query_block,
                 kv_segment_ids=sg)


def maybe_context_parallel_packed_attention(attn_fn: Callable) -> Callable:
  """`attn_fn(q, k, v, segment_ids, *, scale=None, query_block=None)` (ops.packed_attention)
  itself, or — when the mesh in context has context > 1 — the same attention over global
  [B, L, …] arrays with each context shard's queries against the all-gathered keys/values
  (`packed_attention_context_parallel` in a shard_map: batch over the batch axes that divide
  B, L over `context`, heads over `tensor` where they divide H).

  `query_block` then blocks each shard's L / context queries (dropped when it is not smaller;
  it must divide L / context). Decided when traced; call the result under the same mesh.
  """
  mesh = jax.sharding.get_abstract_mesh()
  n = sharding.axis_size(mesh, CONTEXT)
  if n <= 1:
    return attn_fn

  def run(q, k, v, segment_ids, *, scale=None, query_block=None):
    b, length, h, _ = q.shape
    check_stream_length(length, mesh)
    local = length // n
    if query_block is not None and query_block >= local:
      query_block = None
    if query_block is not None and local % query_block:
      raise ValueError(f"query_block: {query_block} must divide the per-shard stream length "
                       f"L / context = {length} / {n} = {local}")
    batch = _batch_axes(mesh, b)
    bt = P(batch, CONTEXT, _heads_axis(mesh, h))
    fn = jax.shard_map(
        functools.partial(packed_attention_context_parallel, attn_fn=attn_fn, scale=scale,
                          query_block=query_block),
        mesh=mesh, in_specs=(bt, bt, bt, P(batch, CONTEXT)), out_specs=bt, check_vma=False)
    return fn(q, k, v, segment_ids)

  return run


__all__ = ["check_stream_length", "stream_spec", "shard_stream",
           "packed_attention_context_parallel", "maybe_context_parallel_packed_attention"]
