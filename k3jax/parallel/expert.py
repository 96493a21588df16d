"""Expert parallelism: routed experts sharded over the mesh axis `expert` (docs/k3.md §6, §7).

Inside `jax.shard_map`, every device holds its own tokens (batch over data/fsdp/expert, length
over context) and E/ep experts. With **static shapes only** (XLA:CPU has no ragged all-to-all):

  1. each device sorts its (token, slot) pairs by expert into a capacity-padded buffer
     [E, C, D] — C = `capacity(local tokens, k, E, capacity_factor)` rows per expert and
     source device (like MoonEP's fixed token counts; `None` = dropless: C = local tokens);
  2. `all_to_all` over `expert` sends rows of expert e to the device holding e:
     [ep, E/ep, C, D] (destination-major) → [ep, E/ep, C, D] (source-major);
  3. the local experts run on [E/ep, ep·C, D]: batched dense einsums, or — given a grouped
     matmul `gmm` (the kernel `kernel_backend` chose, k3jax/layers/backend.py) — that kernel
     over the E/ep groups of ep·C rows each;
  4. the reverse `all_to_all` brings results home, where they are combined in fp32.

Pairs over capacity are dropped (rank inside an expert counted per source device, token-major)
and counted: `dropped` is summed over every token axis. The shared experts and W_down/W_up never
enter here: they are token-local and run data-parallel outside. `psum_histogram` sums the
Quantile Balancing margin histograms of all token shards with one integer all-reduce.

A token count the token shards do not divide (the MTP layer's B·(T−1) tokens under a context
axis) is padded at the end with zero rows of weight 0, each routed to k distinct experts (so
dropless stays dropless). They come after every real token, so no capacity rank puts one ahead
of a real token, and they are left out of `dropped`; their outputs are sliced off.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax import sharding
from k3jax.ops import moe as moe_ops

Array = jax.Array
EXPERT = "expert"
# Every mesh axis that splits tokens (the sums of `dropped` and of the QB histogram run over them).
TOKEN_AXES = (*sharding.BATCH_AXES, "context")


def _dispatch(x: Array, indices: Array, num_experts: int, cap: int):
  """[N, D] tokens → [E, C, D] capacity-padded buffer; also the per-pair slot and keep mask."""
  n, _ = x.shape
  k = indices.shape[1]
  s = moe_ops.sort_pairs(indices, num_experts)
  r = jnp.arange(cap, dtype=jnp.int32)
  valid = r[None, :] < s["group_sizes"][:, None]                    # [E, C]
  row = jnp.where(valid, s["group_starts"][:, None] + r[None, :], 0)
  buf = jnp.where(valid[..., None], x[s["token"][row]], jnp.zeros((), x.dtype))
  # Rank of every original pair inside its expert (token-major): kept iff < C.
  inv = jnp.zeros((n * k,), jnp.int32).at[s["order"]].set(jnp.arange(n * k, dtype=jnp.int32))
  rank = s["rank"][inv]
  keep = rank < cap
  slot = jnp.where(keep, indices.reshape(-1) * cap + rank, 0)
  return buf, slot, keep


def expert_mlp_local(x: Array, weights: Array, indices: Array, w1: Array, w3: Array, w2: Array,
                     *, num_experts: int, activation: str = "situ", beta1: float = 4.0,
                     beta2: float = 25.0, capacity_factor: float | None = None,
                     capacity: int | None = None, valid: Array | None = None,
                     axis_name: str = EXPERT,
                     gmm: moe_ops.GroupedMatmul | None = None,
                     input_quant: str | None = None) -> tuple[Array, Array]:
  """The expert-parallel routed MLP on one device's tokens; call inside shard_map.

  Args:
    x: [N, D] local tokens (the latent z); weights [N, k] fp32; indices [N, k] global expert
      ids in [0, num_experts).
    w1, w3: [E/ep, D, F]; w2: [E/ep, F, D]: this device's experts (experts e·E/ep … on shard e),
      arrays or `moe_ops.MXFP4Weight`s (the packed bytes are what crosses no wire: each device
      dequantises its own experts, a chunk at a time, `moe_ops.batched_experts`).
    capacity_factor: rows per (source device, expert) = ceil(cf · N · k / E); None = dropless.
    capacity: explicit rows per (source device, expert), overriding `capacity_factor`.
    valid: [N] bool, False on padding rows (not counted in `dropped`); None: all rows real.
    gmm: None → the local experts run as batched einsums; a `moe_ops.GroupedMatmul` → they run
      through it (module docstring, step 3); packed experts always take the einsums.
    input_quant: None, or "mxfp8": both expert matmul inputs fake-quantised
      (`moe_ops.quantized_inputs`, per row, so before dispatch as in the unsharded op).
  Returns:
    y [N, D] in x.dtype (Σ_j weights_ij · E_{indices_ij}(x_i), dropped pairs contribute 0),
    dropped: int32 real pairs over capacity on this device (not yet summed over devices).
  """
  n, d = x.shape
  k = indices.shape[1]
  ep = jax.lax.axis_size(axis_name)
  e_local = w1.shape[0]
  if e_local * ep != num_experts:
    raise ValueError(f"w1: expected {num_experts}/{ep} = {num_experts // max(ep, 1)} local "
                     f"experts, found {e_local}")
  cap = (moe_ops.capacity(n, k, num_experts, capacity_factor) if capacity is None
         else max(1, min(n, capacity)))
  cdt = x.dtype
  x, act = moe_ops.quantized_inputs(x, moe_ops.activation_fn(activation, beta1, beta2),
                                   input_quant)
  buf, slot, keep = _dispatch(x, indices.astype(jnp.int32), num_experts, cap)
  # [E, C, D] = [ep (destination), E/ep, C, D] → all_to_all → [ep (source), E/ep, C, D].
  buf = buf.reshape(ep, e_local, cap, d)
  buf = jax.lax.all_to_all(buf, axis_name, 0, 0, tiled=True)
  rows = buf.transpose(1, 0, 2, 3).reshape(e_local, ep * cap, d)
  if gmm is None or any(map(moe_ops.is_packed, (w1, w3, w2))):
    # Batched einsums; MXFP4 experts dequantised a chunk of local experts at a time.
    out = moe_ops.batched_experts(rows, w1, w3, w2, act)
  else:
    # The rows are already grouped by local expert, ep·C each (unfilled rows are zero and
    # never read back), so the kernel sees equal static group sizes.
    sizes = jnp.full((e_local,), ep * cap, jnp.int32)
    out = moe_ops.grouped_experts(rows.reshape(-1, d), sizes,
                                  *(moe_ops.cast_experts(w, cdt) for w in (w1, w3, w2)),
                                  act, gmm).reshape(e_local, ep * cap, d)
  out = out.reshape(e_local, ep, cap, d).transpose(1, 0, 2, 3)
  out = jax.lax.all_to_all(out, axis_name, 0, 0, tiled=True)    # back: [ep (dest) …] = [E, C, D]
  out = out.reshape(num_experts * cap, d)
  wk = jnp.where(keep.reshape(n, k), weights.astype(jnp.float32), 0.0)
  y = jnp.sum(moe_ops.weighted_rows(wk[..., None], out[slot].reshape(n, k, d)), axis=1)
  lost = ~keep.reshape(n, k)
  if valid is not None:
    lost = lost & valid[:, None]
  return y.astype(cdt), jnp.sum(lost).astype(jnp.int32)


def _token_spec(ndim_lead: int, mesh) -> P:
  """[B, T, ...] leading dims → (batch axes, context); [N, ...] → all token axes on N."""
  axes = tuple(a for a in TOKEN_AXES if a in mesh.shape)
  if ndim_lead == 2:
    return P(tuple(a for a in sharding.BATCH_AXES if a in mesh.shape), "context")
  return P(axes)


def expert_mlp_ep(mesh, x: Array, weights: Array, indices: Array, w1: Array, w3: Array,
                  w2: Array, *, activation: str = "situ", beta1: float = 4.0,
                  beta2: float = 25.0, capacity_factor: float | None = None,
                  capacity: int | None = None, num_valid: int | None = None,
                  gmm: moe_ops.GroupedMatmul | None = None,
                  input_quant: str | None = None) -> tuple[Array, Array]:
  """`ops.moe.expert_mlp` with experts sharded over `expert` (global arrays in and out).

  x: [B, T, D] (batch over data/fsdp/expert, T over context) or [N, D] (N over all of them);
  weights/indices: the same leading dims + [k]; w1, w3 [E, D, F], w2 [E, F, D] (E over expert),
  arrays or `moe_ops.MXFP4Weight`s (both leaves sharded over `expert` on their E axis).
  `capacity` (rows per expert and source device) overrides `capacity_factor`.
  `num_valid` ([N, D] x only): rows from `num_valid` on are padding, left out of `dropped`.
  `gmm`: the grouped matmul the local experts run through (None: batched einsums).
  Returns (y like x, dropped: int32 total over all devices). With `capacity_factor=None` (or
  large enough) it equals the unsharded `expert_mlp` up to float summation order.
  """
  num_experts = w1.shape[0]
  ep = sharding.axis_size(mesh, EXPERT)
  if num_experts % ep:
    raise ValueError(f"w1: {num_experts} experts are not divisible by the expert axis size {ep}")
  lead = x.ndim - 1
  if lead not in (1, 2):
    raise ValueError(f"x: expected [N, D] or [B, T, D], found shape {x.shape}")
  if num_valid is not None and lead != 1:
    raise ValueError(f"num_valid: only for x [N, D], found shape {x.shape}")
  tok = _token_spec(lead, mesh)
  wspec = P(EXPERT)
  sum_axes = tuple(a for a in TOKEN_AXES if a in mesh.shape)

  def body(x_, w_, i_, w1_, w3_, w2_):
    shp = x_.shape
    valid = None
    if num_valid is not None:   # this shard holds global rows first … first + N_l − 1
      first = jax.lax.axis_index(sum_axes) * shp[0]
      valid = first + jnp.arange(shp[0]) < num_valid
    y, dropped = expert_mlp_local(
        x_.reshape(-1, shp[-1]), w_.reshape(-1, w_.shape[-1]), i_.reshape(-1, i_.shape[-1]),
        w1_, w3_, w2_, num_experts=num_experts, activation=activation, beta1=beta1,
        beta2=beta2, capacity_factor=capacity_factor, capacity=capacity, valid=valid, gmm=gmm,
        input_quant=input_quant)
    return y.reshape(shp), jax.lax.psum(dropped, sum_axes)

  fn = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, wspec, wspec, wspec),
                     out_specs=(tok, P()), check_vma=False)
  return fn(x, weights, indices, w1, w3, w2)


def psum_histogram(hist: Array, axes: Sequence[str] = TOKEN_AXES) -> Array:
  """Sum per-device QB margin histograms [E, bins] over the token axes: one int32 all-reduce.

  Call inside shard_map whose manual axes include `axes`.
  """
  return jax.lax.psum(hist.astype(jnp.int32), tuple(axes))


def sharded_histogram(mesh, hist_fn, *args: Array) -> Array:
  """Run `hist_fn(*local_args) -> [E, bins] int` on every device's tokens ([B, T, ...] args
  sharded over batch axes and context) and sum the counts with one integer all-reduce."""
  tok = _token_spec(2, mesh)
  axes = tuple(a for a in TOKEN_AXES if a in mesh.shape)
  fn = jax.shard_map(lambda *a: psum_histogram(hist_fn(*a), axes), mesh=mesh,
                     in_specs=tuple(tok for _ in args), out_specs=P(), check_vma=False)
  return fn(*args)


def maybe_expert_parallel(expert_mlp_fn: Callable,
                          gmm: moe_ops.GroupedMatmul | None = None) -> Callable:
  """`expert_mlp_fn` itself, or — when the mesh in context (`jax.set_mesh`) has expert > 1 —
  a function with its signature (`ops.moe.expert_mlp`'s, less `gmm`) that runs it
  expert-parallel.

  `gmm`: the grouped matmul `expert_mlp_fn` runs (None: its sorted einsum path); the
  expert-parallel form runs the same kernel on each device's local experts (None: batched
  einsums over the static [E/ep, ep·C, D] buffer), so the kernel choice holds on any mesh.
  The global `capacity` (rows per expert for all N tokens, or None = dropless) becomes
  ceil(capacity · N_local / N) rows per expert and source device. N that the token shards do
  not divide is padded (module docstring) and y sliced back to N rows.
  """
  mesh = jax.sharding.get_abstract_mesh()   # JAX's own (jax.set_mesh around the jitted call)
  ep = sharding.axis_size(mesh, EXPERT)
  if ep <= 1:
    return expert_mlp_fn

  def run(x, weights, indices, w1, w3, w2, *, activation="situ", beta1=4.0, beta2=25.0,
          capacity=None, input_quant=None):
    if w1.shape[0] % ep:
      raise ValueError(f"w1: {w1.shape[0]} experts are not divisible by the expert axis "
                       f"size {ep}")
    shards = sharding.axis_size(mesh, TOKEN_AXES)
    local_cap = None if capacity is None else -(-capacity // shards)
    n, k = indices.shape
    pad = -n % shards
    if pad:
      x = jnp.pad(x, ((0, pad), (0, 0)))
      weights = jnp.pad(weights, ((0, pad), (0, 0)))
      indices = jnp.concatenate(
          [indices, jnp.broadcast_to(jnp.arange(k, dtype=indices.dtype), (pad, k))])
    y, dropped = expert_mlp_ep(mesh, x, weights, indices, w1, w3, w2, activation=activation,
                               beta1=beta1, beta2=beta2, capacity=local_cap,
                               num_valid=n if pad else None, gmm=gmm, input_quant=input_quant)
    return (y[:n] if pad else y), dropped

  return run


__all__ = ["TOKEN_AXES", "expert_mlp_local", "expert_mlp_ep", "psum_histogram",
           "sharded_histogram", "maybe_expert_parallel"]
