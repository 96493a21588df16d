"""Mixture-of-experts math: SiTU-GLU, sigmoid-router selection, dispatch → experts → combine.

Spec §6. Pure `jnp`; no parameters. The public entry points:

- `situ_glu(a, b)` / `swiglu(a, b)`: the gated activations (computed in fp32).
- `route(scores, bias, k)`: top-k selection on biased scores, weights from unbiased scores,
  and the (k+1)-th biased score (the Quantile Balancing cutoff, docs/k3.md §7).
- `capacity(num_tokens, k, num_experts, capacity_factor)`: static rows per expert.
- `expert_mlp(x, weights, indices, w1, w3, w2, ..., gmm=None)`: the routed experts, computed
  one of two ways chosen by the caller (k3jax/layers/backend.py picks for the model):
    gmm=None     (token, slot) pairs sorted by expert into one of two static layouts
                 (`sort_layout`): a capacity-padded [E, C, D] buffer (batched dense einsums;
                 the fast XLA path) or, when dropless makes that buffer E/k times too big,
                 expert-aligned T-row tiles scanned with each tile's expert weights; moved
                 there and back by `gather_rows` (gathers in both directions);
    gmm=fn       expert-sorted rows (`permute`) through three calls of a grouped matmul
                 `fn(lhs, rhs, group_sizes)` (`GroupedMatmul`): `ragged_gmm` here
                 (`jax.lax.ragged_dot`) or a kernel such as `pallas_kernels.moe_gmm.gmm`.
  This module never imports a kernel: an op that can run one takes it as an argument.
- `expert_mlp_reference(...)`: every expert on every token, combined with a dense [N, E]
  weight matrix (slow, E/k times the needed FLOPs, obviously correct); tests and benchmarks.
- `input_quant="mxfp8"` (every entry point): each expert matmul's input — x before w1/w3 and
  the gated activation before w2 — fake-quantised to MXFP8 along its last axis with a
  straight-through gradient (`quantized_inputs`, k3jax/quant/qat.py), in every path: the
  quantiser acts per row and per 32-value block, so where a row sits (buffer, tile, sorted
  rows, every expert at once) cannot change it. Quantisation-aware training (docs/k3.md §13) adds
  MXFP4 weights, which the caller passes (fake-quantised floats or `MXFP4Weight`s).
- `MXFP4Weight(packed, scale)`: an expert matrix kept as the release's MXFP4 bytes
  (`ModelConfig.modes.expert_format="mxfp4"`). Every w1/w3/w2 argument above may be one: the sorted
  path and `batched_experts` dequantise it inside the computation, a chunk of experts (or one
  tile's expert) at a time (`DEQUANT_CHUNK_ELEMENTS`), so all experts never exist in bf16 at
  once; the reference dequantises everything first. A `gmm` takes packed weights only when it
  says so (`gmm.takes_mxfp4`: `pallas_kernels.moe_gmm.gmm` dequantises tiles in its kernel).
- `ops.lora.LoRAExperts(base, a, b)`: an expert matrix (array or MXFP4Weight) with a per-expert
  adapter; every path computes x·W_e + (x·A_e)·b_e in factored form (grouped: two more `gmm`
  calls), packed bases dequantised a chunk at a time as above (QLoRA); the reference merges
  W_e + A_e·b_e first.

Dropping rule (all paths agree): pairs are ranked inside each expert by their flat index
n·k + j (token-major, earlier tokens first); a pair whose rank is ≥ `capacity` is dropped (its
contribution is zero) and counted in `dropped`. With `capacity=None` nothing is dropped.
"""

from __future__ import annotations

import math
from typing import Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from k3jax.ops.lora import LoRAExperts, expert_einsum, is_lora, merge_experts
from k3jax.quant import mx
from k3jax.quant.qat import fake_mxfp8

Array = jax.Array
# gmm(lhs [M, K] rows sorted by group, rhs [G, K, N], group_sizes [G] int32) -> [M, N]: rows
# [o_g, o_g + group_sizes[g]) use rhs[g] (o_g = Σ_{h<g} group_sizes[h]); rows past Σ sizes → 0.
GroupedMatmul = Callable[[Array, Array, Array], Array]


# --------------------------------------------------------------------------- packed weights
# Upper bound on the elements of one dequantised chunk of experts (w1 + w3 + w2 of the chunk):
# 2^22 elements = 8 MiB in bf16. k3's single expert is 33M elements, so it runs one at a time.
DEQUANT_CHUNK_ELEMENTS = 1 << 22
# Checkpoint name of the expert matmuls' outputs: in a dequantising chunk, the only values its
# backward keeps (everything else, the dequantised weights above all, is recomputed).
EXPERT_MATMULS = "expert_matmuls"


class MXFP4Weight(NamedTuple):
  """One expert matrix stored as MXFP4 (k3jax/quant/mx.py, "packed expert params").

  packed: uint8 [E, out, in/2] (two E2M1 codes a byte, low nibble first);
  scale: uint8 [E, out, in/32] (E8M0). Logically the kernel [E, in, out] (`shape`); each
  expert's bytes are the release's `weight_packed` / `weight_scale`. A pytree (NamedTuple):
  it slices, scans and shards like a pair of arrays along the expert axis.
  """
  packed: Array
  scale: Array

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical kernel shape (..., E, in, out)."""
    *lead, out, half = self.packed.shape
    return (*lead, half * 2, out)

  @property
  def well_formed(self) -> bool:
    """uint8 bytes with one scale per 32 elements: scale [..., out, in/32] beside packed
    [..., out, in/2]."""
    return (self.packed.dtype == jnp.uint8 and self.scale.dtype == jnp.uint8
            and self.scale.shape == (*self.packed.shape[:-1], self.packed.shape[-1] // 16))

  def dequantize(self, dtype) -> Array:
    """The kernel [..., E, in, out] in `dtype` (exact: E2M1 × 2^k fits bf16)."""
    return mx.unpack_expert(self.packed, self.scale, dtype)


def is_packed(w) -> bool:
  """An `MXFP4Weight`, or a `LoRAExperts` whose base is one."""
  return isinstance(w, MXFP4Weight) or (is_lora(w) and isinstance(w.base, MXFP4Weight))


def dense_experts(w, dtype):
  """An expert kernel (array or `MXFP4Weight`) as an array [..., E, in, out] of `dtype`; a
  `LoRAExperts` as one with a dense base and adapters of `dtype`."""
  if is_lora(w):
    return LoRAExperts(dense_experts(w.base, dtype), w.a.astype(dtype), w.b.astype(dtype))
  if is_packed(w):
    return w.dequantize(dtype)
  return w.astype(dtype)


def cast_experts(w, dtype):
  """Expert weights in the matmul dtype: arrays (and adapters) cast; packed bytes as they are
  (dequantised where used)."""
  if is_lora(w):
    return LoRAExperts(cast_experts(w.base, dtype), w.a.astype(dtype), w.b.astype(dtype))
  return w if is_packed(w) else w.astype(dtype)


def _take_expert(w, e, keepdims: bool = False):
  """Expert `e` (traced int) of w: [in, out] array (or [1, in, out] with `keepdims`), or an
  MXFP4Weight of that one expert ([1, …] leaves with `keepdims`)."""
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, e, keepdims=keepdims), w)


def _dequant_chunk(num_experts: int, per_expert: int) -> int:
  """Experts per dequantised chunk: the largest divisor of E whose chunk holds at most
  `DEQUANT_CHUNK_ELEMENTS` (at least 1)."""
  best = 1
  for c in range(1, num_experts + 1):
    if num_experts % c == 0 and c * per_expert <= DEQUANT_CHUNK_ELEMENTS:
      best = c
  return best


def _no_dequant_residuals(fn, in_scan: bool):
  """`fn` whose backward keeps only the expert matmuls' outputs (named `EXPERT_MATMULS`) and
  recomputes the rest: the dequantised weights, and anything made of them alone (w1‖w3
  concatenated, a cast), are frozen-weight values, which a policy that saves all but the
  dequantiser's output keeps — stacked over a layer's chunks that is the layer's whole bf16
  w1‖w3 again (the k3 QLoRA compile: docs/notes/lora.md). Outside a scan, CSE would merge the
  backward's dequantisation with the forward's (keeping it alive in between), so it is
  prevented there."""
  policy = jax.checkpoint_policies.save_only_these_names(EXPERT_MATMULS)
  return jax.checkpoint(fn, policy=policy, prevent_cse=not in_scan)


@jax.custom_vjp
def tie_gradients(*xs):
  """The identity on xs, whose backward pass hands back every cotangent at once (through one
  `optimization_barrier`): whatever consumes one of them — the input gradient, which the
  earlier layers' backward needs — waits until all are computed. A MoE layer ties its latent
  input to its expert weights (`RunModes.expert_grad_barrier`), so each layer's weight
  gradients are made, and reduce-scattered, inside that layer's backward rather than whenever
  the scheduler likes (which keeps their operands live)."""
  return xs


def _tie_fwd(*xs):
  return xs, None


def _tie_bwd(_, cotangents):
  return tuple(jax.lax.optimization_barrier(tuple(cotangents)))


tie_gradients.defvjp(_tie_fwd, _tie_bwd)


def batched_experts(rows: Array, w1, w3, w2, act) -> Array:
  """Expert e's MLP on rows[e]: rows [E, C, D] → [E, C, D] in rows.dtype.

  w1, w3 [E, D, F], w2 [E, F, D] as arrays (one batched einsum each, w1‖w3 fused) or
  `MXFP4Weight`s (a scan over chunks of experts, each chunk dequantised inside its step:
  the dequantised temporaries are one chunk's, `DEQUANT_CHUNK_ELEMENTS`).
  """
  dt = rows.dtype
  f = w1.shape[-1]

  def mlp(r, a1, a3, a2):
    if is_lora(a1) or is_lora(a3):   # adapters: each matrix with its own (x·A)·b
      h = act(checkpoint_name(expert_einsum("ecd,edf->ecf", r, a1), EXPERT_MATMULS),
              checkpoint_name(expert_einsum("ecd,edf->ecf", r, a3), EXPERT_MATMULS))
    else:
      a = jnp.einsum("ecd,edf->ecf", r, jnp.concatenate([a1, a3], axis=-1))
      a = checkpoint_name(a, EXPERT_MATMULS)
      h = act(a[..., :f], a[..., f:])
    return expert_einsum("ecf,efd->ecd", h.astype(dt), a2)

  if not any(map(is_packed, (w1, w3, w2))):
    return mlp(rows, *(cast_experts(w, dt) for w in (w1, w3, w2)))
  e, c, d = rows.shape
  ec = _dequant_chunk(e, 3 * d * f)

  def dequantised_mlp(r, a1, a3, a2):
    return mlp(r, dense_experts(a1, dt), dense_experts(a3, dt), dense_experts(a2, dt))

  chunk = _no_dequant_residuals(dequantised_mlp, in_scan=ec < e)

  if ec == e:
    return chunk(rows, w1, w3, w2)
  split = lambda a: a.reshape(e // ec, ec, *a.shape[1:])
  xs = jax.tree.map(split, (rows, w1, w3, w2))
  _, out = jax.lax.scan(lambda _, xs_: (None, chunk(*xs_)), None, xs)
  return out.reshape(e, c, d)


# --------------------------------------------------------------------------- activations
def situ_glu(a: Array, b: Array, beta1: float = 4.0, beta2: float = 25.0) -> Array:
  """SiTU-GLU: [β1·tanh(a/β1)·σ(a)] · [β2·tanh(b/β2)], |f| ≤ β1·β2, computed in fp32.

  a, b: same shape; returns their (promoted) dtype. Near 0 it is ≈ silu(a)·b (SwiGLU).
  """
  if a.shape != b.shape:
    raise ValueError(f"situ_glu: a and b must have the same shape, found {a.shape} and {b.shape}")
  out_dtype = jnp.result_type(a, b)
  a32 = a.astype(jnp.float32)
  b32 = b.astype(jnp.float32)
  gate = beta1 * jnp.tanh(a32 / beta1) * jax.nn.sigmoid(a32)
  lin = beta2 * jnp.tanh(b32 / beta2)
  return (gate * lin).astype(out_dtype)


def swiglu(a: Array, b: Array) -> Array:
  """SwiGLU: silu(a)·b, computed in fp32, returned in the inputs' dtype."""
  if a.shape != b.shape:
    raise ValueError(f"swiglu: a and b must have the same shape, found {a.shape} and {b.shape}")
  out_dtype = jnp.result_type(a, b)
  return (jax.nn.silu(a.astype(jnp.float32)) * b.astype(jnp.float32)).astype(out_dtype)


def activation_fn(activation: str, beta1: float = 4.0, beta2: float = 25.0):
  """The gated activation `act(a, b)` named by `activation` ("situ" with β1, β2, or "swiglu")."""
  if activation == "situ":
    return lambda a, b: situ_glu(a, b, beta1, beta2)
  if activation == "swiglu":
    return swiglu
  raise ValueError(f"activation: expected 'situ' or 'swiglu', found {activation!r}")


def quantized_inputs(x: Array, act, input_quant: str | None):
  """(x, act) with the expert matmul inputs fake-quantised: x [N, D] along D, and the gated
  activation's output (the input of w2) along F. input_quant: None (unchanged) or "mxfp8"."""
  if input_quant is None:
    return x, act
  if input_quant != "mxfp8":
    raise ValueError(f"input_quant: expected None or 'mxfp8', found {input_quant!r}")
  return fake_mxfp8(x), lambda a, b: fake_mxfp8(act(a, b))


# --------------------------------------------------------------------------- routing
def route(scores: Array, bias: Array, k: int) -> tuple[Array, Array, Array]:
  """Top-k selection on `scores + bias`; weights from the unbiased scores.

  Args:
    scores: [N, E] router scores (sigmoid of the fp32 logits).
    bias: [E] selection-only bias (Quantile Balancing, docs/k3.md §7).
    k: experts per token, 1 ≤ k < E (the (k+1)-th value is needed for the cutoff).

  Returns:
    weights [N, k] fp32: scores at the chosen experts / (their sum + 1e-20);
    indices [N, k] int32: chosen experts, best biased score first;
    cutoff [N] fp32: the (k+1)-th largest biased score of each token (no gradient).
  The bias only changes *which* experts are chosen, never the weight a chosen expert gets.
  """
  if scores.ndim != 2:
    raise ValueError(f"route: scores must be [N, E], found shape {scores.shape}")
  num_experts = scores.shape[1]
  if bias.shape != (num_experts,):
    raise ValueError(f"route: bias must be [E]=[{num_experts}], found shape {bias.shape}")
  if not isinstance(k, int) or not 1 <= k < num_experts:
    raise ValueError(f"route: k must be an int in [1, E={num_experts}), found {k!r}")
  s32 = scores.astype(jnp.float32)
  biased = jax.lax.stop_gradient(s32) + jax.lax.stop_gradient(bias.astype(jnp.float32))
  top_vals, top_idx = jax.lax.top_k(biased, k + 1)
  indices = top_idx[:, :k].astype(jnp.int32)
  cutoff = top_vals[:, k]
  chosen = jnp.take_along_axis(s32, indices, axis=1)
  weights = chosen / (jnp.sum(chosen, axis=1, keepdims=True) + 1e-20)
  return weights, indices, cutoff


def capacity(num_tokens: int, k: int, num_experts: int,
             capacity_factor: float | None) -> int:
  """Static rows per expert of the dispatch buffer.

  `None` → dropless: an expert is chosen at most once per token (top-k picks distinct experts),
  so `num_tokens` rows always suffice; that is the tight static bound (any smaller bound can be
  exceeded by some routing). Otherwise ceil(capacity_factor · num_tokens · k / num_experts),
  clamped to [1, num_tokens].
  """
  for name, v in (("num_tokens", num_tokens), ("k", k), ("num_experts", num_experts)):
    if not isinstance(v, int) or v < 1:
      raise ValueError(f"capacity: {name} must be a positive int, found {v!r}")
  if capacity_factor is None:
    return num_tokens
  if capacity_factor <= 0:
    raise ValueError(f"capacity: capacity_factor must be > 0 or None, found {capacity_factor}")
  c = math.ceil(capacity_factor * num_tokens * k / num_experts)
  return max(1, min(num_tokens, c))


# --------------------------------------------------------------------------- dispatch helpers
def sort_pairs(indices: Array, num_experts: int) -> dict[str, Array]:
  """Sort the N·k (token, slot) pairs by expert (stable: flat pair index breaks ties).

  Returns a dict of int32 arrays:
    order [P]: flat pair index (n·k + j) of each sorted row (P = N·k);
    position [P]: sorted row of each flat pair (the inverse permutation of `order`);
    expert [P]: expert of each sorted row (non-decreasing);
    token [P]: token of each sorted row;
    group_sizes [E]: rows per expert; group_starts [E]: first sorted row of each expert;
    rank [P]: rank of each sorted row inside its expert (0 = first).
  The inverse permutation is a second sort, not a scatter (scatters are slow on XLA:CPU).
  """
  n, k = indices.shape
  flat = indices.reshape(-1).astype(jnp.int32)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  position = jnp.argsort(order).astype(jnp.int32)
  expert = flat[order]
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  group_starts = (jnp.cumsum(group_sizes) - group_sizes).astype(jnp.int32)
  rank = jnp.arange(n * k, dtype=jnp.int32) - group_starts[expert]
  return dict(order=order, position=position, expert=expert, token=order // k,
              group_sizes=group_sizes, group_starts=group_starts, rank=rank)


def weighted_rows(weights: Array, rows: Array) -> Array:
  """The combine's terms weights · rows (broadcasting), multiplied in the rows' dtype and
  returned in fp32 for an fp32 sum. With bf16 rows the weights are rounded to bf16 like any
  matmul input; with fp32 products XLA:TPU kept an fp32 copy of every gathered row per MoE
  layer (~0.9 GiB per chip each for k3 on 2048 chips; docs/notes/sharding.md)."""
  return (weights.astype(rows.dtype) * rows).astype(jnp.float32)


@jax.custom_vjp
def gather_rows(src: Array, index: Array, valid: Array, inv_index: Array,
                inv_valid: Array) -> Array:
  """Row gather whose transpose is a gather too (autodiff would emit a scatter-add).

  out[r] = src[index[r]] where valid[r], else 0. src [S, D]; index, valid [R].
  inv_index, inv_valid [S, m]: the (at most m) output rows that read source row s, so that
  d src[s] = Σ_j inv_valid[s, j] · d out[inv_index[s, j]]. The caller guarantees the two maps
  describe the same bipartite relation (every valid output row listed exactly once).
  """
  return jnp.where(valid[:, None], src[index], jnp.zeros((), src.dtype))


def _gather_rows_fwd(src, index, valid, inv_index, inv_valid):
  # Only the inverse map is needed backwards (the forward map is not kept as a residual).
  return gather_rows(src, index, valid, inv_index, inv_valid), (inv_index, inv_valid)


def _gather_rows_bwd(res, g):
  inv_index, inv_valid = res
  d_src = jnp.sum(jnp.where(inv_valid[..., None], g[inv_index], jnp.zeros((), g.dtype)), axis=1)
  return d_src, None, None, None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _validate(x, weights, indices, w1, w3, w2, capacity_, gmm=None):
  if x.ndim != 2:
    raise ValueError(f"expert_mlp: x must be [N, D], found shape {x.shape}")
  n, d = x.shape
  if len(w1.shape) != 3:
    raise ValueError(f"expert_mlp: w1 must be [E, D, F], found shape {w1.shape}")
  e, d1, f = w1.shape
  if d1 != d:
    raise ValueError(f"expert_mlp: w1 must be [E, D={d}, F], found shape {w1.shape}")
  if w3.shape != (e, d, f):
    raise ValueError(f"expert_mlp: w3 must be [E, D, F]={(e, d, f)}, found shape {w3.shape}")
  if w2.shape != (e, f, d):
    raise ValueError(f"expert_mlp: w2 must be [E, F, D]={(e, f, d)}, found shape {w2.shape}")
  if indices.ndim != 2 or indices.shape[0] != n:
    raise ValueError(f"expert_mlp: indices must be [N={n}, k], found shape {indices.shape}")
  if not jnp.issubdtype(indices.dtype, jnp.integer):
    raise ValueError(f"expert_mlp: indices must be an integer array, found {indices.dtype}")
  if weights.shape != indices.shape:
    raise ValueError(
        f"expert_mlp: weights must be [N, k]={indices.shape}, found shape {weights.shape}")
  if gmm is not None and not callable(gmm):
    raise ValueError(f"expert_mlp: gmm must be a grouped matmul function or None, found {gmm!r}")
  if (gmm is not None and any(map(is_packed, (w1, w3, w2)))
      and not getattr(gmm, "takes_mxfp4", False)):
    raise ValueError("expert_mlp: this grouped matmul (gmm) takes dense weights, found "
                     "MXFP4Weight experts; pass gmm=None (the sorted path dequantises them in "
                     "chunks) or a gmm with `takes_mxfp4` (pallas_kernels.moe_gmm.gmm)")
  for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
    if is_lora(w):
      e_, din, dout = w.shape
      r = w.a.shape[-1]
      if w.a.shape != (e_, din, r) or w.b.shape != (e_, r, dout):
        raise ValueError(f"expert_mlp: {name} LoRA adapters must be A [E, in, r] = "
                         f"{(e_, din, r)} and B [E, r, out] = {(e_, r, dout)}, found "
                         f"{w.a.shape} and {w.b.shape}")
      w = w.base
    if is_packed(w) and not w.well_formed:
      raise ValueError(f"expert_mlp: {name} MXFP4Weight must be uint8 packed [E, out, in/2] + "
                       f"uint8 scale [E, out, in/32], found {w.packed.dtype} "
                       f"{w.packed.shape} + {w.scale.dtype} {w.scale.shape}")
  if capacity_ is not None and (not isinstance(capacity_, int) or capacity_ < 1):
    raise ValueError(f"expert_mlp: capacity must be a positive int or None, found {capacity_!r}")


# --------------------------------------------------------------------------- expert MLP
def _prepare(x, weights, indices, w1, w3, w2, activation, beta1, beta2):
  """The activation function and the operands in the dtypes every path computes in."""
  cdt = x.dtype
  cast = lambda w: cast_experts(w, cdt)   # packed: dequantised where used
  return (activation_fn(activation, beta1, beta2), weights.astype(jnp.float32),
          indices.astype(jnp.int32), cast(w1), cast(w3), cast(w2))


def expert_mlp(x: Array, weights: Array, indices: Array, w1: Array, w3: Array, w2: Array, *,
               activation: Literal["situ", "swiglu"] = "situ", beta1: float = 4.0,
               beta2: float = 25.0, capacity: int | None = None,
               gmm: GroupedMatmul | None = None,
               input_quant: str | None = None) -> tuple[Array, Array]:
  """Routed experts: y_i = Σ_j weights_ij · w2[e](act(x_i w1[e], x_i w3[e])), e = indices_ij.

  Args:
    x: [N, D] tokens (the latent z for Stable LatentMoE); its dtype is the matmul dtype.
    weights: [N, k] combine weights (fp32). indices: [N, k] int expert ids in [0, E).
    w1, w3: [E, D, F]; w2: [E, F, D] expert weights (cast to x.dtype for the matmuls), or
      `MXFP4Weight`s of those logical shapes (dequantised to x.dtype a chunk at a time).
    activation: "situ" (β1, β2) or "swiglu", evaluated in fp32.
    capacity: rows per expert (see `capacity()`); None = dropless.
    gmm: None → the sorted dense-einsum path; a `GroupedMatmul` → expert-sorted rows through
      it (module docstring). Both compute the same function.
    input_quant: None, or "mxfp8": both expert matmul inputs fake-quantised (module docstring).

  Returns:
    y [N, D] in x.dtype (combine: products in x.dtype, summed in fp32); dropped: int32
    scalar, pairs over capacity.
  Differentiable in x, weights, w1, w3, w2 (through `gmm`'s own VJP when given).
  """
  _validate(x, weights, indices, w1, w3, w2, capacity, gmm)
  act, weights, indices, w1, w3, w2 = _prepare(x, weights, indices, w1, w3, w2, activation,
                                               beta1, beta2)
  x, act = quantized_inputs(x, act, input_quant)
  if (gmm is None and capacity is None and indices.size < w1.shape[0]
      and all(isinstance(w, MXFP4Weight) for w in (w1, w3, w2))):
    return _expert_mlp_pairs(x, weights, indices, w1, w3, w2, act)
  if gmm is None:
    return _expert_mlp_sort(x, weights, indices, w1, w3, w2, act, capacity)
  return _expert_mlp_grouped(x, weights, indices, w1, w3, w2, act, capacity, gmm)


def expert_mlp_reference(x: Array, weights: Array, indices: Array, w1: Array, w3: Array,
                         w2: Array, *, activation: Literal["situ", "swiglu"] = "situ",
                         beta1: float = 4.0, beta2: float = 25.0,
                         capacity: int | None = None,
                         input_quant: str | None = None) -> tuple[Array, Array]:
  """`expert_mlp`'s function computed the obvious way: every expert on every token, then a
  dense [N, E] combine (E/k times the needed FLOPs). Same arguments and results; MXFP4Weight
  experts are dequantised whole first (the slow, obviously correct reading of the packed form)."""
  _validate(x, weights, indices, w1, w3, w2, capacity)
  w1, w3, w2 = (dense_experts(w, x.dtype) for w in (w1, w3, w2))
  w1, w3, w2 = (merge_experts(w) if is_lora(w) else w for w in (w1, w3, w2))
  act, weights, indices, w1, w3, w2 = _prepare(x, weights, indices, w1, w3, w2, activation,
                                               beta1, beta2)
  x, act = quantized_inputs(x, act, input_quant)
  return _expert_mlp_reference(x, weights, indices, w1, w3, w2, act, capacity)


def ragged_gmm(lhs: Array, rhs: Array, group_sizes: Array) -> Array:
  """The XLA `GroupedMatmul`: `jax.lax.ragged_dot` (lhs [M, K], rhs [G, K, N] → [M, N])."""
  return jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32))


def grouped_experts(rows: Array, group_sizes: Array, w1: Array, w3: Array, w2: Array, act,
                    gmm: GroupedMatmul) -> Array:
  """The expert MLP on rows sorted by expert: [M, D] → [M, D] in rows.dtype.

  group_sizes [E]: rows per expert (rows past their sum give zeros); w1, w3 [E, D, F],
  w2 [E, F, D] in rows.dtype (or `LoRAExperts` of those: two more calls each); act(a, b) the
  gated activation. Three `gmm` calls.
  """
  def mm(x, w):   # an adapter adds (x·A)·b: two more grouped matmuls of width r
    if is_lora(w):
      return gmm(x, w.base, group_sizes) + gmm(gmm(x, w.a, group_sizes), w.b, group_sizes)
    return gmm(x, w, group_sizes)

  h = act(mm(rows, w1), mm(rows, w3))
  return mm(h.astype(rows.dtype), w2)


def _keep_mask_reference(indices: Array, num_experts: int, capacity_: int | None) -> Array:
  """[N, k] bool: pair kept under the dropping rule, by a cumulative count per expert."""
  n, k = indices.shape
  if capacity_ is None:
    return jnp.ones((n, k), bool)
  onehot = jax.nn.one_hot(indices.reshape(-1), num_experts, dtype=jnp.int32)  # [P, E]
  rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)           # [P]
  return (rank < capacity_).reshape(n, k)


def _expert_mlp_reference(x, weights, indices, w1, w3, w2, act, capacity_):
  """Every expert on every token, then a dense [N, E] combine. Slow; obviously correct."""
  n, _ = x.shape
  e = w1.shape[0]
  keep = _keep_mask_reference(indices, e, capacity_)
  dense_w = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], indices].add(
      jnp.where(keep, weights, 0.0))
  h = act(jnp.einsum("nd,edf->enf", x, w1), jnp.einsum("nd,edf->enf", x, w3))
  out = jnp.einsum("enf,efd->end", h.astype(x.dtype), w2)
  y = jnp.einsum("ne,end->nd", dense_w, out.astype(jnp.float32))
  dropped = jnp.sum(~keep).astype(jnp.int32)
  return y.astype(x.dtype), dropped


def _tile_rows(num_pairs: int, num_experts: int) -> int:
  """Rows per tile of the tiled layout: about a quarter of the mean rows per expert, a power
  of two in [8, 256] (larger tiles waste more padding, smaller ones gather weights more often)."""
  t = max(1, num_pairs // (4 * num_experts))
  return max(8, min(256, 1 << (t.bit_length() - 1)))


def _rows_per_expert(num_tokens: int, capacity_: int | None) -> int:
  """An expert's capacity in rows: `capacity_`, at most the token count (N when dropless)."""
  return num_tokens if capacity_ is None else min(capacity_, num_tokens)


def sort_layout(num_tokens: int, k: int, num_experts: int,
                capacity_: int | None) -> tuple[str, int, int]:
  """Layout of the sorted path (gmm=None): ("buffer", E·C rows, C) or ("tiled", n_tiles·T rows, T).

  A tile scan computes a row ~1.5x slower than the batched einsums of the buffer on CPU (small
  matmuls, a weight-gradient update per step; docs/notes/moe.md), so the buffer is used unless
  it has over twice the rows (dropless, C = N, it has E/k times the needed rows).
  """
  p = num_tokens * k
  c = _rows_per_expert(num_tokens, capacity_)
  t = _tile_rows(p, num_experts)
  num_tiles = (p + num_experts * (t - 1)) // t
  if num_experts * c <= 2 * num_tiles * t:
    return "buffer", num_experts * c, c
  return "tiled", num_tiles * t, t


def _expert_mlp_pairs(x, weights, indices, w1, w3, w2, act):
  """Fewer (token, expert) pairs than experts (a decode step) with packed experts: each pair
  is its own one-row "expert" whose MXFP4 bytes are gathered, so only the N·k routed experts
  are dequantised, not all E (the sorted layouts dequantise every expert a buffer touches).
  Dropless; the same per-row MLP (`batched_experts`) and combine as `_expert_mlp_sort`."""
  n, d = x.shape
  k = indices.shape[1]
  pairs = indices.reshape(-1)                                        # [P], pair p = token p // k
  take = lambda w: MXFP4Weight(w.packed[pairs], w.scale[pairs])
  rows = jnp.repeat(x, k, axis=0)[:, None, :]                        # [P, 1, D]
  out = batched_experts(rows, take(w1), take(w3), take(w2), act).reshape(n, k, d)
  y = jnp.sum(weighted_rows(weights[..., None], out), axis=1)
  return y.astype(x.dtype), jnp.zeros([], jnp.int32)


def _expert_mlp_sort(x, weights, indices, w1, w3, w2, act, capacity_):
  """Sorted dispatch into the cheaper of two static layouts, then dense matmuls.

  "buffer": [E, C, D] capacity-padded (E·C rows; C = N when dropless, which is E/k times the
    needed rows);
  "tiled": each expert's rows padded to a multiple of T rows, tiles [n_tiles, T, D]; a scan
    over tiles multiplies each by its own expert's weights (dynamic index). Static bound
    n_tiles = ⌊(N·k + E·(T−1)) / T⌋ ≥ Σ_e ⌈size_e / T⌉, so it is dropless for any routing.
  Both layouts are a one-to-one map between the kept pairs and the valid buffer rows, so
  dispatch and combine are `gather_rows` both ways (no scatter in the backward pass), and
  w1‖w3 run as one matmul of width 2F.
  """
  n, d = x.shape
  k = indices.shape[1]
  e, _, f = w1.shape
  c = _rows_per_expert(n, capacity_)
  layout, num_rows, t = sort_layout(n, k, e, capacity_)
  num_tiles = num_rows // t
  s = sort_pairs(indices, e)
  pair_expert = indices.reshape(-1)
  pair_rank = s["position"] - s["group_starts"][pair_expert]         # [P] rank in its expert
  keep = pair_rank < c

  if layout == "buffer":
    r = jnp.arange(c, dtype=jnp.int32)
    row_valid = r[None, :] < s["group_sizes"][:, None]               # [E, C]
    row_sorted = s["group_starts"][:, None] + r[None, :]
    slot = pair_expert * c + pair_rank
  else:
    tiles_per = (s["group_sizes"] + t - 1) // t                      # [E]
    tile_end = jnp.cumsum(tiles_per)
    tile_start = tile_end - tiles_per
    tid = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, tid, side="right"), e - 1)
    r = (tid - tile_start[tile_expert])[:, None] * t + jnp.arange(t, dtype=jnp.int32)[None, :]
    row_valid = (r < jnp.minimum(s["group_sizes"][tile_expert], c)[:, None]) & (
        tid < tile_end[-1])[:, None]                                 # [n_tiles, T]
    row_sorted = s["group_starts"][tile_expert][:, None] + r
    slot = tile_start[pair_expert] * t + pair_rank
  row_valid = row_valid.reshape(-1)
  row_pair = s["order"][jnp.where(row_valid, row_sorted.reshape(-1), 0)]   # [rows]
  slot = jnp.where(keep, slot, 0)
  buf = gather_rows(x, row_pair // k, row_valid, slot.reshape(n, k), keep.reshape(n, k))

  if layout == "buffer":
    out = batched_experts(buf.reshape(e, c, d), w1, w3, w2, act).reshape(num_rows, d)
  else:
    # One tile per scan step, its expert's weights read by a dynamic index: materialising
    # w[tile_expert] ([n_tiles, D, F] per weight, and its scatter-add in the backward pass)
    # measured ~1.5x slower on CPU than this loop (docs/notes/moe.md). Packed weights: only
    # the tile's expert is dequantised, inside the step.
    # Packed or adapted experts: the tile's expert through `batched_experts`.
    packed = any(is_packed(w) or is_lora(w) for w in (w1, w3, w2))
    w13 = None if packed else jnp.concatenate([w1, w3], axis=-1)      # [E, D, 2F]

    def tile_mlp(_, inp):
      b, ex = inp
      if packed:
        return None, batched_experts(b[None], *(_take_expert(w, ex, keepdims=True)
                                                for w in (w1, w3, w2)), act)[0]
      a = b @ _take_expert(w13, ex)
      return None, act(a[..., :f], a[..., f:]).astype(x.dtype) @ _take_expert(w2, ex)

    _, out = jax.lax.scan(tile_mlp, None, (buf.reshape(num_tiles, t, d), tile_expert))
    out = out.reshape(num_rows, d)
  # Combine: each kept pair reads its row back, weighted (`weighted_rows`), summed in fp32.
  contrib = gather_rows(out, slot, keep, row_pair[:, None], row_valid[:, None])
  # A multiply-sum (fused elementwise) rather than an einsum: XLA:CPU runs the latter as N tiny
  # [1,k]x[k,D] matmuls.
  y = jnp.sum(weighted_rows(jnp.where(keep.reshape(n, k), weights, 0.0)[..., None],
                            contrib.reshape(n, k, d)), axis=1)
  dropped = jnp.sum(~keep).astype(jnp.int32)
  return y.astype(x.dtype), dropped


def permute(x: Array, indices: Array, num_experts: int) -> tuple[Array, dict[str, Array]]:
  """(token, slot) pairs → expert-sorted rows.

  x [N, D], indices [N, k] → rows [N·k, D] (sorted row r is x[info["token"][r]]) and the sort
  info of `sort_pairs` (its `group_sizes` [E] feed a grouped matmul).
  """
  info = sort_pairs(indices, num_experts)
  return x[info["token"]], info


def unpermute(rows: Array, weights: Array, info: dict[str, Array], num_tokens: int,
              capacity: int | None = None) -> tuple[Array, Array]:
  """Expert-sorted rows [N·k, D] → weighted sum per token [N, D] in fp32, and dropped count.

  weights [N, k] (fp32). Rows whose rank inside their expert is ≥ `capacity` get weight zero.
  """
  keep = info["rank"] < (num_tokens if capacity is None else capacity)
  w_sorted = jnp.where(keep, weights.reshape(-1)[info["order"]].astype(jnp.float32), 0.0)
  y = jax.ops.segment_sum(weighted_rows(w_sorted[:, None], rows), info["token"],
                          num_segments=num_tokens)
  return y, jnp.sum(~keep).astype(jnp.int32)


def _expert_mlp_grouped(x, weights, indices, w1, w3, w2, act, capacity_, gmm):
  """Expert-sorted rows [N·k, D] through the grouped matmul `gmm`.

  Dropless compute; pairs over `capacity` are masked in the combine (same result as the
  sorted path).
  """
  xs, info = permute(x, indices, w1.shape[0])                      # [P, D] expert-sorted
  out = grouped_experts(xs, info["group_sizes"], w1, w3, w2, act, gmm)
  y, dropped = unpermute(out, weights, info, x.shape[0], capacity_)
  return y.astype(x.dtype), dropped
