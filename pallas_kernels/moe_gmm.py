"""Grouped matmul (GMM) over expert-sorted rows, in Pallas, with a custom VJP.

  gmm(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]
      rows are sorted by group: rows [o_g, o_g + group_sizes[g]) use rhs[g]
      (o_g = Σ_{h<g} group_sizes[h]); rows at or past Σ group_sizes give zeros.
  gmm(lhs [M, K], MXFP4Weight(packed [G, N, K/2], scale [G, N, K/32]), group_sizes) -> [M, N]
      the same product with the experts kept as the release's MXFP4 bytes, dequantised tile
      by tile inside the kernel (never widened in memory); `k3jax.quant.mx.unpack_expert`'s
      values exactly, the products summed in another order.
  tgmm(lhs [M, K], grad [M, N], group_sizes [G]) -> [G, K, N]
      the weight gradient: out[g] = lhs[rows of g]ᵀ · grad[rows of g] (zero for empty groups).

The backward pass of `gmm` is d lhs = gmm(d out, rhs with K and N swapped) and d rhs = tgmm(lhs,
d out). `gmm` is a `k3jax.ops.moe.GroupedMatmul`: `expert_mlp(..., gmm=gmm)` runs it three
times between `permute` / `unpermute` (re-exported here), which move (token, slot) pairs into
expert-sorted rows and back; `k3jax.layers.backend` passes it for kernel_backend="pallas".

Kernel layout (one design for every platform). The grid covers output tiles only, and every
reduction runs as a loop *inside* the kernel, so no two grid points ever write the same output
block (Triton runs grid points concurrently; TPU would allow revisiting, Triton would race).
  gmm:  grid (M/bm, N/bn). A row tile is sorted, so it touches groups lo..hi only (read from its
        per-row group ids); loop over those groups and over K in bk chunks, masking rows of other
        groups to zero: the wasted work is one extra masked product per group boundary.
  tgmm: grid (G, K/bk, N/bn); loop over the row tiles [o_g, o_g + size_g) of group g only.
  gmm on MXFP4: grid (M/bm, N/bn) as gmm; the K loop runs over 32-element MX blocks (one E8M0
        scale per output column). Two E2M1 codes share a byte (element 2i low nibble, 2i+1
        high), so the lhs comes in as its even and odd columns (split by XLA) and each block
        is two dots of width 16: lhs_even · lo-nibbles + lhs_odd · hi-nibbles, no interleave in
        the kernel. Its backward (d lhs) dequantises in XLA and runs the dense gmm; the packed
        bytes take no gradient (a frozen base).
All dims are padded to the tile sizes (powers of two, ≥ 16, as Triton's `dot` needs); products
accumulate in fp32 and results are cast to the input dtype.
Limits (not done): full-extent row/K/N operands are passed whole (memory space = the default
VMEM/global), which is fine for GPUs (global memory) but bounds the sizes on TPU VMEM; a
production TPU kernel would fetch blocks by scalar-prefetched group metadata (megablox style).

Lowering per platform (checked by tests/pallas_kernels/test_moe_gmm.py with `jax.export`):
  CPU: `interpret=True` (the default there: `interpret=None` → True on CPU).
  TPU: Mosaic TPU (Pallas default).
  CUDA: Triton. On a GPU backend the kernels pass `pallas.triton.CompilerParams` (GPU_NUM_WARPS,
        GPU_NUM_STAGES), so every jax version lowers them with Triton (jax 0.10 would default to
        Mosaic GPU, which rejects a plain `dot`; jax 0.11 dropped `jax_pallas_use_mosaic_gpu`).
        Exporting from a CPU host on jax 0.10 needs that flag set to False while tracing.
        Serialising the Triton custom call needs `disabled_checks=[jax.export.DisabledSafetyCheck
        .custom_call("__gpu$xla.gpu.triton")]`.

Shared memory on GPU (sm_90: 232448 bytes per block) sets GPU_TILING and GPU_NUM_STAGES: the
tiles are independent of M, K, N and G (reductions loop inside the kernel), so the footprint is
set by (bm, bk, bn), dtype, num_warps and num_stages alone; the measured footprints are in
docs/notes/pallas_kda.md ("Shared memory on the Triton target"). TPU keeps DEFAULT_TILING.
The gmm kernel masks the rows of each product rather than of the lhs tile: the same result
(row r of a·b depends on row r of a only), and it avoids a boolean [bm, 1] broadcast in the
dot-operand layout that Triton 3.6 fails to lower with one pipeline stage.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from k3jax.ops import moe as moe_ops

Array = jax.Array
DEFAULT_TILING = (128, 128, 128)  # (bm, bk, bn): TPU and interpret mode
# GPU (Triton): tiles and pipeline depth chosen for shared memory (module docstring, "Shared
# memory on GPU"): at most ~98 KiB per kernel in fp32 for any M, K, N, G.
GPU_TILING = (64, 64, 128)
GPU_NUM_WARPS = 4
GPU_NUM_STAGES = 2
MX_BLOCK = 32   # MXFP4: elements per E8M0 scale along the contraction axis (K)


def _pow2_at_least(n: int, lo: int = 16) -> int:
  return max(lo, 1 << max(0, (n - 1).bit_length()))


def _tile(n: int, t: int) -> int:
  """Tile for a dim of size n: the requested t, or smaller when n is small (powers of two)."""
  return min(_pow2_at_least(t), _pow2_at_least(n))


def _pad_to(x: Array, axis: int, size: int) -> Array:
  if x.shape[axis] == size:
    return x
  pads = [(0, 0)] * x.ndim
  pads[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pads)


def _round_up(n: int, t: int) -> int:
  return -(-n // t) * t


def _resolve_interpret(interpret):
  return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def _on_gpu(interpret: bool) -> bool:
  return not interpret and jax.default_backend() in ("gpu", "cuda", "rocm")


def _resolve_tiling(tiling, interpret: bool) -> tuple[int, int, int]:
  if tiling is None:
    return GPU_TILING if _on_gpu(interpret) else DEFAULT_TILING
  return tuple(tiling)


def _compiler_params(interpret: bool):
  """Triton parameters on a GPU backend (explicit, so the lowering is Triton on every jax
  version: jax 0.10 defaults to Mosaic GPU, 0.11 to Triton with 3 pipeline stages); None
  elsewhere (TPU: Mosaic defaults; interpret mode: unused)."""
  if not _on_gpu(interpret):
    return None
  return pltriton.CompilerParams(num_warps=GPU_NUM_WARPS, num_stages=GPU_NUM_STAGES)


def _row_groups(group_sizes: Array, m_pad: int) -> Array:
  """[m_pad, 1] int32 group of every row; rows past Σ sizes get G (matches no group)."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  rows = jnp.arange(m_pad, dtype=jnp.int32)
  return jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)[:, None]


# --------------------------------------------------------------------------- kernels
def _gmm_kernel(rg_ref, lhs_ref, rhs_ref, out_ref, *, num_groups, bk, num_k):
  rg = rg_ref[...]                                   # [bm, 1] int32 (sorted)
  lo = jnp.min(rg)
  hi = jnp.max(jnp.where(rg < num_groups, rg, -1))   # -1 when the tile is all padding

  def group_body(g, acc):
    mask = rg == g

    def k_body(kk, acc):
      a = lhs_ref[:, pl.ds(kk * bk, bk)]
      b = rhs_ref[g, pl.ds(kk * bk, bk), :]
      # Row r of a·b depends on row r of a only, so masking the product's rows equals masking
      # a's rows; on the [bm, bn] fp32 product the select stays in the accumulator's layout
      # (Triton 3.6 fails to lower a [bm, 1] boolean mask broadcast in a dot-operand layout).
      return acc + jnp.where(mask, jnp.dot(a, b, preferred_element_type=jnp.float32), 0.0)

    return jax.lax.fori_loop(0, num_k, k_body, acc)

  acc = jnp.zeros(out_ref.shape, jnp.float32)
  acc = jax.lax.fori_loop(lo, hi + 1, group_body, acc)
  out_ref[...] = acc.astype(out_ref.dtype)


def _e2m1(codes):
  """E2M1 codes (int32, 0..15) → their values (fp32): sign · (e = 0: m/2; else
  (1 + m/2)·2^(e−1)), by selects only (no table gather, no bit casts: both lowerings take it)."""
  e = jnp.right_shift(codes, 1) & 3
  m = (codes & 1).astype(jnp.float32)
  pow2 = jnp.where(e == 3, 4.0, jnp.where(e == 2, 2.0, 1.0))
  mag = jnp.where(e == 0, 0.5 * m, pow2 * (1.0 + 0.5 * m))
  return jnp.where((jnp.right_shift(codes, 3) & 1) == 1, -mag, mag)


def _e8m0(scale):
  """E8M0 bytes (int32) → 2^(byte − 127) as fp32 (byte 255: NaN), exact: a product of powers of
  two selected bit by bit (no exp2, whose hardware form is approximate). Byte 0 gives 2^−127,
  which the dequantiser on XLA's backends flushes to zero; blocks with byte ≤ 1 hold weights
  under 2^−124 (`k3jax.quant.mx.mxfp4_unpack_fast`)."""
  x = scale - 127
  mag, neg = jnp.abs(x), x < 0
  f = jnp.ones(scale.shape, jnp.float32)
  for bit in range(7):        # |x| ≤ 127: each factor 2^(±2^bit) is a normal fp32
    up, down = float(2.0 ** (1 << bit)), float(2.0 ** -(1 << bit))
    f = f * jnp.where((jnp.right_shift(mag, bit) & 1) == 1, jnp.where(neg, down, up), 1.0)
  return jnp.where(scale == 255, jnp.nan, f)


def _gmm_mxfp4_kernel(rg_ref, even_ref, odd_ref, packed_ref, scale_ref, out_ref, *, num_groups,
                      num_blocks):
  rg = rg_ref[...]                                   # [bm, 1] int32 (sorted)
  lo = jnp.min(rg)
  hi = jnp.max(jnp.where(rg < num_groups, rg, -1))
  half = MX_BLOCK // 2
  dims = (((1,), (1,)), ((), ()))                   # a [bm, 16] · b [bn, 16]ᵀ

  def group_body(g, acc):
    mask = rg == g

    def k_body(kk, acc):
      cols = pl.ds(pl.multiple_of(kk * half, half), half)
      codes = packed_ref[g, :, cols].astype(jnp.int32)           # [bn, 16] two codes a byte
      factor = _e8m0(scale_ref[g, :, pl.ds(kk, 1)].astype(jnp.int32))   # [bn, 1]
      dt = even_ref.dtype
      b_lo = (_e2m1(codes & 15) * factor).astype(dt)             # elements 2i
      b_hi = (_e2m1(jnp.right_shift(codes, 4)) * factor).astype(dt)   # elements 2i + 1
      prod = (jax.lax.dot_general(even_ref[:, cols], b_lo, dims,
                                  preferred_element_type=jnp.float32)
              + jax.lax.dot_general(odd_ref[:, cols], b_hi, dims,
                                    preferred_element_type=jnp.float32))
      return acc + jnp.where(mask, prod, 0.0)

    return jax.lax.fori_loop(0, num_blocks, k_body, acc)

  acc = jnp.zeros(out_ref.shape, jnp.float32)
  acc = jax.lax.fori_loop(lo, hi + 1, group_body, acc)
  out_ref[...] = acc.astype(out_ref.dtype)


def _tgmm_kernel(rg_ref, lhs_ref, grad_ref, out_ref, *, bm):
  g = pl.program_id(0)
  rg = rg_ref[...]                                   # [M_pad, 1] int32 (sorted)
  # Rows of group g are [start, end): counted from the sorted ids (no scalar memory needed).
  start = jnp.sum((rg < g).astype(jnp.int32))
  end = jnp.sum((rg <= g).astype(jnp.int32))

  def m_body(i, acc):
    r0 = pl.multiple_of(i * bm, bm)
    a = lhs_ref[pl.ds(r0, bm), :]
    a = jnp.where(rg_ref[pl.ds(r0, bm), :] == g, a, jnp.zeros_like(a))
    gr = grad_ref[pl.ds(r0, bm), :]
    return acc + jax.lax.dot_general(a, gr, (((0,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)

  acc = jnp.zeros(out_ref.shape[-2:], jnp.float32)
  # lax.div (truncating) rather than //: both are ≥ 0, and floor division on TPU needs `sign`,
  # whose Mosaic lowering asks for the TPU generation (unavailable when exporting from CPU).
  acc = jax.lax.fori_loop(jax.lax.div(start, bm), jax.lax.div(end + bm - 1, bm), m_body, acc)
  out_ref[...] = acc.astype(out_ref.dtype)[None]


def _gmm_call(lhs, rhs, group_sizes, interpret, tiling):
  m, k = lhs.shape
  g, _, n = rhs.shape
  bm, bk, bn = _tile(m, tiling[0]), _tile(k, tiling[1]), _tile(n, tiling[2])
  mp, kp, np_ = _round_up(m, bm), _round_up(k, bk), _round_up(n, bn)
  lhs_p = _pad_to(_pad_to(lhs, 0, mp), 1, kp)
  rhs_p = _pad_to(_pad_to(rhs, 1, kp), 2, np_)
  rg = _row_groups(group_sizes, mp)
  kernel = functools.partial(_gmm_kernel, num_groups=g, bk=bk, num_k=kp // bk)
  out = pl.pallas_call(
      kernel,
      grid=(mp // bm, np_ // bn),
      in_specs=[pl.BlockSpec((bm, 1), lambda i, j: (i, 0)),
                pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
                pl.BlockSpec((g, kp, bn), lambda i, j: (0, 0, j))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((mp, np_), lhs.dtype),
      interpret=interpret,
      compiler_params=_compiler_params(interpret),
  )(rg, lhs_p, rhs_p)
  return out[:m, :n]


def _gmm_mxfp4_call(lhs, packed, scale, group_sizes, interpret, tiling):
  m, k = lhs.shape
  g, n, _ = packed.shape
  bm, bn = _tile(m, tiling[0]), _tile(n, tiling[2])
  mp, np_ = _round_up(m, bm), _round_up(n, bn)
  lhs_p = _pad_to(lhs, 0, mp)
  even, odd = lhs_p[:, 0::2], lhs_p[:, 1::2]          # [Mp, K/2] each
  packed_p = _pad_to(packed, 1, np_)                  # padded columns: code 0, scale 0 → 0
  scale_p = _pad_to(scale, 1, np_)
  rg = _row_groups(group_sizes, mp)
  kernel = functools.partial(_gmm_mxfp4_kernel, num_groups=g, num_blocks=k // MX_BLOCK)
  out = pl.pallas_call(
      kernel,
      grid=(mp // bm, np_ // bn),
      in_specs=[pl.BlockSpec((bm, 1), lambda i, j: (i, 0)),
                pl.BlockSpec((bm, k // 2), lambda i, j: (i, 0)),
                pl.BlockSpec((bm, k // 2), lambda i, j: (i, 0)),
                pl.BlockSpec((g, bn, k // 2), lambda i, j: (0, j, 0)),
                pl.BlockSpec((g, bn, k // MX_BLOCK), lambda i, j: (0, j, 0))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((mp, np_), lhs.dtype),
      interpret=interpret,
      compiler_params=_compiler_params(interpret),
  )(rg, even, odd, packed_p, scale_p)
  return out[:m, :n]


def _tgmm_call(lhs, grad, group_sizes, interpret, tiling):
  m, k = lhs.shape
  n = grad.shape[1]
  g = group_sizes.shape[0]
  bm, bk, bn = _tile(m, tiling[0]), _tile(k, tiling[1]), _tile(n, tiling[2])
  mp, kp, np_ = _round_up(m, bm), _round_up(k, bk), _round_up(n, bn)
  lhs_p = _pad_to(_pad_to(lhs, 0, mp), 1, kp)
  grad_p = _pad_to(_pad_to(grad, 0, mp), 1, np_)
  rg = _row_groups(group_sizes, mp)
  rg = jnp.where(jnp.arange(mp)[:, None] < m, rg, g)  # rows past M do not exist
  kernel = functools.partial(_tgmm_kernel, bm=bm)
  out = pl.pallas_call(
      kernel,
      grid=(g, kp // bk, np_ // bn),
      in_specs=[pl.BlockSpec((mp, 1), lambda e, a, b: (0, 0)),
                pl.BlockSpec((mp, bk), lambda e, a, b: (0, a)),
                pl.BlockSpec((mp, bn), lambda e, a, b: (0, b))],
      out_specs=pl.BlockSpec((1, bk, bn), lambda e, a, b: (e, a, b)),
      out_shape=jax.ShapeDtypeStruct((g, kp, np_), lhs.dtype),
      interpret=interpret,
      compiler_params=_compiler_params(interpret),
  )(rg, lhs_p, grad_p)
  return out[:, :k, :n]


# --------------------------------------------------------------------------- public API
def _check(lhs, rhs_or_grad, group_sizes, name):
  if lhs.ndim != 2:
    raise ValueError(f"{name}: lhs must be [M, K], found shape {lhs.shape}")
  if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"{name}: group_sizes must be a 1-D integer array, found "
                     f"shape {group_sizes.shape} dtype {group_sizes.dtype}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(lhs, rhs, group_sizes, interpret, tiling):
  return _gmm_call(lhs, rhs, group_sizes, interpret, tiling)


def _gmm_fwd(lhs, rhs, group_sizes, interpret, tiling):
  return _gmm_call(lhs, rhs, group_sizes, interpret, tiling), (lhs, rhs, group_sizes)


def _gmm_bwd(interpret, tiling, res, d_out):
  lhs, rhs, group_sizes = res
  d_out = d_out.astype(lhs.dtype)
  d_lhs = _gmm_call(d_out, jnp.swapaxes(rhs, 1, 2), group_sizes, interpret, tiling)
  d_rhs = _tgmm_call(lhs, d_out, group_sizes, interpret, tiling)
  return d_lhs, d_rhs.astype(rhs.dtype), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _gmm_mxfp4(lhs, packed, scale, group_sizes, interpret, tiling):
  return _gmm_mxfp4_call(lhs, packed, scale, group_sizes, interpret, tiling)


def _gmm_mxfp4_fwd(lhs, packed, scale, group_sizes, interpret, tiling):
  out = _gmm_mxfp4_call(lhs, packed, scale, group_sizes, interpret, tiling)
  return out, (packed, scale, group_sizes)


def _gmm_mxfp4_bwd(interpret, tiling, res, d_out):
  packed, scale, group_sizes = res
  dtype = d_out.dtype                                # the output's dtype = lhs's
  # d lhs = d out · Wᵀ with W [G, K, N] dequantised by XLA (the backward of a frozen base).
  w_t = moe_ops.MXFP4Weight(packed, scale).dequantize(dtype)      # [G, K, N]
  d_lhs = _gmm_call(d_out.astype(dtype), jnp.swapaxes(w_t, 1, 2), group_sizes, interpret,
                    tiling)
  return d_lhs, None, None, None


_gmm_mxfp4.defvjp(_gmm_mxfp4_fwd, _gmm_mxfp4_bwd)


def gmm(lhs: Array, rhs: Array, group_sizes: Array, *, interpret: bool | None = None,
        tiling: tuple[int, int, int] | None = None) -> Array:
  """Grouped matmul: [M, K] rows sorted by group × rhs [G, K, N] → [M, N] (module docstring).

  rhs may be a `k3jax.ops.moe.MXFP4Weight` (packed [G, N, K/2], scale [G, N, K/32], logically
  [G, K, N]): dequantised inside the kernel; differentiable in lhs only.
  `interpret=None` → interpreted on CPU, compiled elsewhere. `tiling` = (bm, bk, bn), rounded
  to powers of two and shrunk for small dims; None → GPU_TILING when compiled for a GPU,
  DEFAULT_TILING otherwise (bk unused on MXFP4: the K step is one 32-element block).
  Differentiable in lhs and rhs.
  """
  _check(lhs, rhs, group_sizes, "gmm")
  if isinstance(rhs, moe_ops.MXFP4Weight):
    g, n, half = rhs.packed.shape if rhs.packed.ndim == 3 else (None, None, None)
    if g is None or half * 2 != lhs.shape[1] or not rhs.well_formed:
      raise ValueError(f"gmm: an MXFP4Weight rhs must be uint8 packed [G, N, K/2 = "
                       f"{lhs.shape[1] // 2}] + uint8 scale [G, N, K/32], found "
                       f"{rhs.packed.dtype} {rhs.packed.shape} + {rhs.scale.dtype} "
                       f"{rhs.scale.shape}")
    if group_sizes.shape[0] != g:
      raise ValueError(f"gmm: group_sizes must be [G={g}], found {group_sizes.shape}")
    interp = _resolve_interpret(interpret)
    return _gmm_mxfp4(lhs, rhs.packed, rhs.scale, group_sizes.astype(jnp.int32), interp,
                      _resolve_tiling(tiling, interp))
  if rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
    raise ValueError(f"gmm: rhs must be [G, K={lhs.shape[1]}, N], found shape {rhs.shape}")
  if group_sizes.shape[0] != rhs.shape[0]:
    raise ValueError(f"gmm: group_sizes must be [G={rhs.shape[0]}], found {group_sizes.shape}")
  rhs = rhs.astype(lhs.dtype)
  interp = _resolve_interpret(interpret)
  return _gmm(lhs, rhs, group_sizes.astype(jnp.int32), interp, _resolve_tiling(tiling, interp))


def tgmm(lhs: Array, grad: Array, group_sizes: Array, *, interpret: bool | None = None,
         tiling: tuple[int, int, int] | None = None) -> Array:
  """Transposed grouped matmul: out[g] = lhs[rows of g]ᵀ grad[rows of g] → [G, K, N]."""
  _check(lhs, grad, group_sizes, "tgmm")
  if grad.ndim != 2 or grad.shape[0] != lhs.shape[0]:
    raise ValueError(f"tgmm: grad must be [M={lhs.shape[0]}, N], found shape {grad.shape}")
  interp = _resolve_interpret(interpret)
  return _tgmm_call(lhs, grad.astype(lhs.dtype), group_sizes.astype(jnp.int32), interp,
                    _resolve_tiling(tiling, interp))


# `expert_mlp` passes MXFP4Weight experts to a grouped matmul that says it takes them.
gmm.takes_mxfp4 = True

# The permute / unpermute pair around the grouped matmuls lives with the op (kernels build on
# ops); re-exported here so kernel users find it beside `gmm`.
permute = moe_ops.permute
unpermute = moe_ops.unpermute
