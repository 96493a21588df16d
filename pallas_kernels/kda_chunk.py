"""Bounded-decay KDA chunk kernel (Pallas): forward and backward, same results as
`k3jax.ops.kda.kda_chunked`.

Facts: docs/k3.md §3. Recurrence per head, state S [K, V], read after the update:
  S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T ;  o_t = S_t^T q_t.

One chunk of C tokens (C = `chunk_size`, a multiple of 16) is `_chunk_step`, pure jnp on
values so the same code runs inside both kernels and in interpret mode:
  * G = inclusive cumulative log-decay of the chunk, fp32 (a matmul with a ones lower
    triangle: no scan inside the kernel).
  * A_kk[i, j] = b_i sum_d k_i k_j exp(G_i - G_j) (j < i) and A_qk (j <= i) as dense matmuls in
    16-token tiles. Diagonal tiles factor exp(G_i - G_j) around the tile's own reference point,
    G after its 8th token: both factors lie in [e^-40, e^40] because g >= -5 (a reference at
    the tile's start would give [e^-80, e^80]: no overflow either, but e^-80 * |q| falls into
    the subnormal range that CPUs and GPUs flush to zero, costing ~1e-4 relative accuracy).
    Off-diagonal tiles (row tile after column tile J) factor around G at the last token of J,
    so both factors are <= 1 (an underflow then only hides a product that is smaller still).
  * WY/UT: T = (I + A_kk)^-1 by dense products only: the 16x16 diagonal blocks are inverted
    as (I - N)(I + N^2)(I + N^4)(I + N^8) (N is nilpotent of order 16), the block-lower rest
    by the same doubling on M = Td N_off (nilpotent of order C/16). No per-position loop.
  * w = T (b k e^G), u = T (b v); v' = u - w S; o = (q e^G) S + A_qk v';
    S' = e^{G_C} S + (k e^{G_C - G})^T v'.
The state is fp32 everywhere; matmul operands use the input dtype (fp32 inputs: HIGHEST).

One chunk splits in two (`_chunk_step` = `_state_step` after `_chunk_intra`): everything that
needs no state (A, T, w, u, the decay factors: `_chunk_a`, `_chunk_wy`) and the state pass.
Five kernels, so that no program holds a chunk's whole vjp (one fused backward kernel spilled
thousands of bytes of registers per thread on sm_90):
  * `kda_intra_fwd`, grid (BH, NC), every chunk independent: w, qg, kdec, a_qk (input dtype),
    u and the decay column (fp32) to HBM.
  * `kda_state_fwd`, grid (BH, nV): chunks in order carrying the fp32 state [K, block_v]; writes
    o, the final state and every chunk's initial state (fp32 [BH, NC, K, V]: the backward's
    residual, so it never re-runs the recurrence; the intermediates are recomputed).
  * `kda_state_bwd`: chunks last to first carrying dS (fp32), `_state_step_vjp` (the vjp written
    out, each cotangent stored as soon as it is known); V blocks give per-block partials of the
    intermediates' cotangents, summed by XLA.
  * `kda_wy_bwd`, `kda_a_bwd`, grid (BH, NC): back through `_chunk_wy` (`_chunk_wy_vjp`, written
    out, inputs loaded where first needed) to dA_kk and partial input cotangents, then through
    `_chunk_a` (`jax.vjp` inside the kernel: the exact transpose of the forward maths; its dots
    use a custom vjp that casts the fp32 cotangent to the operand dtype, as the MXU/Triton
    want; the unbounded gate's pairwise tiles recompute each pass in their vjp).
Every written-out vjp has a test holding it to `jax.vjp` of its forward function.
Two launch forms of the state kernels:
  * "grid" (TPU, interpret): grid (BH, nV, NC), blocks of one chunk, state in a VMEM scratch
    carried across the "arbitrary" chunk axis.
  * "loop" (GPU, Triton lowering): grid (BH, nV), a `fori_loop` over chunks inside the kernel
    with the state as loop carry (Triton runs grid steps in parallel: no scratch carry there).
On CUDA the kernels are lowered with Triton (`pallas.triton.CompilerParams`), not Mosaic GPU
(whose lowering on jax 0.10 rejects the plain dots used here).

Registers and shared memory on GPU (sm_90: 255 registers per thread, 232448 bytes of shared
memory per block): every kernel compiles without spills and within the shared memory at
chunk 16 (`GPU_MAX_CHUNK`), 8 warps, block_v 64 for bf16 inputs and 16 for fp32
(`GPU_BLOCK_V`; fp32 dots run on FMA units, whose operands take more registers); measured
without a GPU in docs/results/sm90_kernels.json, which tests/pallas_kernels/test_sm90_report.py
holds to the kernels' current IR. Chunking is exact, so only rounding differs from a larger chunk.

Packed documents (`segment_ids`): the kernels take each token's segment number within its
chunk (`sc`, the count of segment starts up to it, fp32 [BH, Tp, 1], made by XLA outside) and
mask the chunk: A_kk and A_qk to pairs of one segment (T is then block-diagonal by segment),
the state read (o's and w's e^G terms) to the segment carried in (sc = 0), the state update to
the chunk's last segment, and the old state is dropped when a segment starts in the chunk. A
pair of one segment only spans its own gates, so the rescale bounds above still hold.

Unbounded gates (Kimi Linear's softplus decay, `lower_bound=None`): the diagonal tiles are
formed pair by pair, exp(sum of g over j < t <= i) for i >= j, so every exponent is <= 0
whatever the gate (`_diagonal_tiles_pairwise`: 16 passes, one per position in a tile, each two
0/1 matmuls and [C, K] elementwise work, a loop rather than unrolled). Every other exponent
(off-diagonal rows and keys, the state update's suffix) is likewise summed over exactly its
own gates: with large gates a difference of two cumulative sums loses digits (2.5e-4 relative
at gates of -300).

Limits: the bounded form needs g >= lower_bound >= -5 (see kda_chunked_pallas for how a
violation is reported); chunk_size a power of 2 >= 16 (Triton needs power-of-2 blocks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

_SQ = getattr(pl, "squeezed", None)   # a squeezed block dim (None on older jax)
# Sizes on the Triton (GPU) target, where every kernel must fit an sm_90 block's registers
# (no spills) and shared memory: docs/results/sm90_kernels.json, measured for these sizes.
GPU_MAX_CHUNK = 16              # chunk 32 spilled in the per-chunk kernels (pallas_kda.md)
GPU_BLOCK_V = {2: 64, 4: 16}    # state columns per program, by input itemsize (fp32 dots use
                                # FMA, not tensor cores: 4x the registers per operand)
SUB = 16            # token tile of the inverse-decay rescale
_LOG2_SUB = 4
MAX_EXP = 40.0      # largest |exponent| of a diagonal-tile rescale: -lower_bound * SUB / 2


# ------------------------------------------------------------------------- chunk math (values)
def _dot_raw(a, b, ca, cb):
  prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=prec,
                         preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dot_same(a, b, ca, cb):
  """2-D a·b (same dtype operands) contracting dim ca of a with dim cb of b, fp32 result.
  Its vjp casts the fp32 cotangent to the operand dtype first: the default transpose would
  mix fp32 and bf16 operands in one dot, which the Triton lowering rejects."""
  return _dot_raw(a, b, ca, cb)


def _dot_same_fwd(a, b, ca, cb):
  return _dot_raw(a, b, ca, cb), (a, b)


def _dot_same_bwd(ca, cb, res, ct):
  a, b = res
  ct = ct.astype(a.dtype)
  if (ca, cb) == (1, 0):      # a @ b
    da, db = _dot_raw(ct, b, 1, 1), _dot_raw(a, ct, 0, 0)
  elif (ca, cb) == (1, 1):    # a @ b.T
    da, db = _dot_raw(ct, b, 1, 0), _dot_raw(ct, a, 0, 0)
  else:                       # a.T @ b
    da, db = _dot_raw(b, ct, 1, 1), _dot_raw(a, ct, 1, 0)
  return da.astype(a.dtype), db.astype(b.dtype)


_dot_same.defvjp(_dot_same_fwd, _dot_same_bwd)


def _dot(a, b, ca, cb, cd):
  """a·b contracting dim ca of a with dim cb of b; operands cast to cd, fp32 result
  (fp32 operands: HIGHEST precision, so no TF32 / single-pass bf16)."""
  return _dot_raw(a.astype(cd), b.astype(cd), ca, cb)


def _dot_vjp(a, b, ca, cb, cd):
  """`_dot` with the same-dtype vjp (for the recompute inside the backward kernel; the forward
  kernel uses `_dot`: custom_vjp_call itself has no Triton lowering rule)."""
  return _dot_same(a.astype(cd), b.astype(cd), ca, cb)


def _mm(a, b, cd=jnp.float32, dot=_dot):      # a @ b
  return dot(a, b, 1, 0, cd)


def _mm_t(a, b, cd=jnp.float32, dot=_dot):    # a @ b.T
  return dot(a, b, 1, 1, cd)


def _t_mm(a, b, cd=jnp.float32, dot=_dot):    # a.T @ b
  return dot(a, b, 0, 0, cd)


def _tile(idx):
  """Tile index of a non-negative int32 position array (a shift: `//` lowers to sign ops that
  Mosaic TPU cannot lower without a device)."""
  return lax.shift_right_logical(idx, jnp.full(idx.shape, _LOG2_SUB, jnp.int32))


def _row(x, i):
  """Row i (static) of x [R, N] as [1, N], by a masked sum (exact; no value slicing, which
  Triton cannot lower)."""
  rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
  return jnp.sum(jnp.where(rows == i, x, 0.0), axis=0, keepdims=True)


def _nonpos(x):
  """min(x, 0) whose gradient is 1 wherever x <= 0 (ties included) and 0 where x > 0."""
  return jnp.where(x <= 0.0, x, 0.0)


def _unit_lower_inverse(n, ident, tiles, dot):
  """(I + n)^-1 for n strictly lower nilpotent of order <= `tiles`, by doubling:
  (I - n)(I + n^2)(I + n^4)... (log2(tiles) products, all dense)."""
  p = -n
  r = ident + p
  span = 2
  while span < tiles:
    p = _mm(p, p, dot=dot)
    r = _mm(r, ident + p, dot=dot)
    span *= 2
  return r


def _transpose_col(x, n):
  """[n, 1] column -> [1, n] row (exact; select on the identity, then a column sum)."""
  eye = lax.broadcasted_iota(jnp.int32, (n, n), 0) == lax.broadcasted_iota(jnp.int32, (n, n), 1)
  return jnp.sum(jnp.where(eye, jnp.broadcast_to(x, (n, n)), 0.0), axis=0, keepdims=True)


def _pair_pass(p, kf, g):
  """Pass p of `_diagonal_tiles_pairwise`: for every row i, j = the p-th token of i's tile.
  Returns sel [C, C] (entry (i, j)), the two 0/1 matrices (span: j < t <= i; pick: t = j),
  e [C, K] = exp(Σ_{j<t<=i} g_t) and ref_k [C, K] = k_j."""
  c = kf.shape[0]
  row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
  col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
  j = row - jnp.bitwise_and(row, SUB - 1) + p               # p-th token of row i's tile
  span = jnp.where((col > j) & (col <= row), 1.0, 0.0)
  pick = jnp.where(col == j, 1.0, 0.0)
  return col == j, span, pick, jnp.exp(_mm(span, g)), _mm(pick, kf)


def _diagonal_tiles_pairwise(qf, kf, g):
  """A_kk and A_qk's diagonal 16-token tiles for any gate (Kimi Linear's unbounded decay):
  entry (i, j) = Σ_d x_i k_j exp(Σ_{j<t<=i} g_t), the exponent summed over exactly the pair's
  gates (never a difference of two cumulative sums, which loses digits once those are large,
  nor a rescale). One pass per position p of a tile (`_pair_pass`): all tiles advance
  together, 16 passes whatever the chunk, each two 0/1 matmuls (exact) and [C, K]
  elementwise work, as a loop (not unrolled: the passes' [C, K] temporaries would all be live
  at once). Rows before j get exponent 0 and are masked by the caller. Returns [C, C] x2."""
  c = qf.shape[0]

  def body(p, acc):
    sel, _, _, e, ref_k = _pair_pass(p, kf, g)
    pair = e * ref_k                                         # [C, K] k_j exp(Σ_{j<t<=i} g_t)
    return (acc[0] + jnp.where(sel, jnp.sum(kf * pair, axis=1, keepdims=True), 0.0),
            acc[1] + jnp.where(sel, jnp.sum(qf * pair, axis=1, keepdims=True), 0.0))
  zero = jnp.zeros((c, c), jnp.float32)
  return lax.fori_loop(0, SUB, body, (zero, zero))


@jax.custom_vjp
def _diagonal_tiles_pairwise_vjp(qf, kf, g):
  """`_diagonal_tiles_pairwise` whose vjp recomputes each pass instead of keeping 16 passes'
  [C, K] residuals (for the backward kernel; a kernel's forward calls the plain function:
  custom_vjp_call has no Triton lowering rule)."""
  return _diagonal_tiles_pairwise(qf, kf, g)


def _pairwise_fwd(qf, kf, g):
  return _diagonal_tiles_pairwise(qf, kf, g), (qf, kf, g)


def _pairwise_bwd(res, cts):
  """Per pass, with c_kk, c_qk [C, 1] the cotangents of row i's entry (i, j): pair = e k_j;
  dk_i += c_kk pair; dq_i += c_qk pair; d pair = c_kk k_i + c_qk q_i; dk_j += pick^T (d pair e);
  dg += span^T (d pair * pair)."""
  qf, kf, g = res
  dd_kk, dd_qk = cts

  def body(p, acc):
    dq, dk, dg = acc
    sel, span, pick, e, ref_k = _pair_pass(p, kf, g)
    pair = e * ref_k
    c_kk = jnp.sum(jnp.where(sel, dd_kk, 0.0), axis=1, keepdims=True)
    c_qk = jnp.sum(jnp.where(sel, dd_qk, 0.0), axis=1, keepdims=True)
    dpair = c_kk * kf + c_qk * qf
    return (dq + c_qk * pair, dk + c_kk * pair + _t_mm(pick, dpair * e),
            dg + _t_mm(span, dpair * pair))
  zero = jnp.zeros_like(kf)
  return lax.fori_loop(0, SUB, body, (zero, zero, zero))


_diagonal_tiles_pairwise_vjp.defvjp(_pairwise_fwd, _pairwise_bwd)


def _chunk_masks(c):
  """Position masks of a chunk of c tokens: (row, col, same tile, later tile, identity)."""
  row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
  col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
  return (row, col, _tile(row) == _tile(col), _tile(row) > _tile(col),
          (row == col).astype(jnp.float32))


def _segment_masks(sc):
  """Packed documents: from sc [C, 1] (segment number within the chunk) the [C, 1] masks of
  tokens that read the carried-in state and of tokens of the chunk's last segment (they write
  the state), and keeps [1, 1]: 1 when no segment starts in the chunk (the old state decays
  on), 0 when one does (it is dropped)."""
  c = sc.shape[0]
  last = _row(sc, c - 1)                                    # [1, 1]
  return (jnp.where(sc == 0.0, 1.0, 0.0), jnp.where(sc == last, 1.0, 0.0),
          jnp.where(last == 0.0, 1.0, 0.0))


def _chunk_a(q, k, g, beta, sc=None, dot=_dot, bounded=True, cd=None):
  """A_kk and A_qk of one chunk: A_kk[i, j] = b_i Σ_d k_i k_j e^(G_i - G_j) (j < i), A_qk the
  same with q_i and without b (j <= i), in 16-token tiles; pairs of one segment only when sc
  is given. Arguments as `_chunk_intra`; cd: the matmul operand dtype (default q's; the
  backward kernels pass fp32 copies of bf16 inputs, so their cotangents come out fp32).
  Returns a_kk, a_qk [C, C] fp32."""
  f32 = jnp.float32
  cd = cd or q.dtype
  c, dk = q.shape
  nt = c // SUB
  g = g.astype(f32)
  qf, kf = q.astype(f32), k.astype(f32)
  row, col, same, later, _ = _chunk_masks(c)

  # Cumulative log-decay in fp32 (sums as matmuls with 0/+-1 matrices, HIGHEST precision):
  # gc = G over the chunk.
  gc = _cumulative(g, dot)
  if bounded:
    # gt = G minus G at the middle of the row's 16-token tile (after its 8th token), the
    # diagonal tiles' reference point: gt in [-8*5, 7*5] for g >= -5. exp(gt), exp(-gt) in
    # [e^-40, e^40]: far from overflow (e^88.7) and from the subnormal range (e^-87.3) that
    # CPUs/GPUs flush to zero (a reference at the tile's start would put e^-80 * |q| there).
    mid = jnp.bitwise_and(col, SUB - 1) < SUB // 2
    gt = _mm(jnp.where(same, jnp.where(col <= row, 1.0, 0.0) - jnp.where(mid, 1.0, 0.0), 0.0),
             g, dot=dot)
    e_row = jnp.exp(gt)
    k_col = kf * jnp.exp(-gt)
    d_kk = _mm_t(kf * e_row, k_col, cd, dot=dot)
    d_qk = _mm_t(qf * e_row, k_col, cd, dot=dot)
  else:
    pairwise = _diagonal_tiles_pairwise_vjp if dot is _dot_vjp else _diagonal_tiles_pairwise
    d_kk, d_qk = pairwise(qf, kf, g)
    # Unbounded gates make the cumulative sums large, so each exponent below is summed over
    # its own gates: a key's suffix within its tile.
    key_suffix = _mm(jnp.where(same & (col > row), 1.0, 0.0), g, dot=dot)   # Σ_{j<t<=end J}
  # Off-diagonal tiles, one column tile J at a time, reference G at J's last token. The
  # exponents are clamped at 0 so rows that the mask drops stay finite (no inf * 0 in the vjp).
  # The clamp is a select that keeps x at x == 0 (`_nonpos`), not jnp.minimum: the exponent is
  # exactly 0 wherever g == 0 on the tokens between the reference and the row (a gate whose
  # sigmoid underflows, padding), where minimum's vjp would give each side half the cotangent
  # (half those terms of dg).
  rows_k = lax.broadcasted_iota(jnp.int32, (c, dk), 0)
  o_kk = jnp.zeros((c, c), f32)
  o_qk = jnp.zeros((c, c), f32)
  for j in range(nt - 1):
    if bounded:
      ref = _row(gc, SUB * j + SUB - 1)
      kj = jnp.where(_tile(rows_k) == j, kf * jnp.exp(_nonpos(ref - gc)), 0.0)
      ej = jnp.exp(_nonpos(gc - ref))
    else:   # Σ over the gates after J's last token up to the row (rows after J; else 0)
      end = SUB * j + SUB - 1
      kj = jnp.where(_tile(rows_k) == j, kf * jnp.exp(key_suffix), 0.0)
      ej = jnp.exp(_mm(jnp.where((col > end) & (col <= row), 1.0, 0.0), g, dot=dot))
    o_kk = o_kk + _mm_t(kf * ej, kj, cd, dot=dot)
    o_qk = o_qk + _mm_t(qf * ej, kj, cd, dot=dot)
  a_kk = beta.astype(f32) * jnp.where(later, o_kk, jnp.where(same & (col < row), d_kk, 0.0))
  a_qk = jnp.where(later, o_qk, jnp.where(same & (col <= row), d_qk, 0.0))
  if sc is not None:   # packed: pairs of one segment only
    one_seg = sc == _transpose_col(sc, c)                   # [C, C]
    a_kk = jnp.where(one_seg, a_kk, 0.0)
    a_qk = jnp.where(one_seg, a_qk, 0.0)
  return a_kk, a_qk


def _wy_inverse(a_kk, dot=_dot):
  """T = (I + A_kk)^-1 for a_kk [C, C] strictly lower, blockwise by dense doubling products
  (fp32): the 16x16 diagonal blocks first, then the block-lower rest."""
  c = a_kk.shape[0]
  _, _, same, later, ident = _chunk_masks(c)
  t_diag = _unit_lower_inverse(jnp.where(same, a_kk, 0.0), ident, SUB, dot)
  m = _mm(t_diag, jnp.where(later, a_kk, 0.0), dot=dot)
  return _mm(_unit_lower_inverse(m, ident, c // SUB, dot), t_diag, dot=dot)


def _first_col(x):
  """x [N, SUB] -> its first column [N, 1] (a masked row sum: exact)."""
  first = lax.broadcasted_iota(jnp.int32, x.shape, 1) == 0
  return jnp.sum(jnp.where(first, x, 0.0), axis=1, keepdims=True)


def _col_to_rows(x, c):
  """x [K, 1] -> [c, K], every row x^T: a matmul with a first-column indicator (one nonzero
  term per entry: exact), so no [K, K] transpose is formed."""
  e0 = jnp.where(lax.broadcasted_iota(jnp.int32, (c, SUB), 1) == 0, 1.0, 0.0)
  return _mm_t(e0, jnp.broadcast_to(x, (x.shape[0], SUB)))


def _cumulative(g, dot=_dot):
  """G [C, K]: the inclusive cumulative log-decay of a chunk (a matmul with a ones lower
  triangle, fp32)."""
  row, col, _, _, _ = _chunk_masks(g.shape[0])
  return _mm(jnp.where(col <= row, 1.0, 0.0), g, dot=dot)


def _decay_in(g, sc, dot=_dot):
  """eg [C, K] = e^G for the tokens that read the carried-in state, 0 for the others."""
  eg = jnp.exp(_cumulative(g, dot))                    # <= 1
  return eg if sc is None else eg * _segment_masks(sc)[0]


def _decay_out(g, sc, bounded, dot=_dot):
  """ek [C, K] = e^(G_C - G) for the tokens that write the state out (0 for the others) and
  decay [K, 1] = e^(G_C), 0 when a segment starts in the chunk. G_C - G is summed over its own
  gates when the gate is unbounded (a difference of two large sums loses digits); G_C = Σ_t g_t
  comes out as a column (a matmul with ones, first column kept), so the state pass scales the
  state's rows without a [K, K] transpose."""
  c = g.shape[0]
  row, col, _, _, _ = _chunk_masks(c)
  decay = jnp.exp(_first_col(_t_mm(g, jnp.ones((c, SUB), jnp.float32), dot=dot)))
  if bounded:
    gc = _cumulative(g, dot)
    ek = jnp.exp(_row(gc, c - 1) - gc)
  else:
    ek = jnp.exp(_mm(jnp.where(col > row, 1.0, 0.0), g, dot=dot))
  if sc is not None:
    _, writes, keeps = _segment_masks(sc)
    ek, decay = ek * writes, decay * keeps
  return ek, decay


def _chunk_wy(q, k, v, g, beta, a_kk, sc=None, dot=_dot, bounded=True):
  """The WY/UT transform of one chunk and the state pass's decay factors: T = (I + A_kk)^-1
  (`_wy_inverse`), w = T (b k e^G) and qg = q e^G (the tokens that read the state), u = T (b v),
  kdec = k e^(G_C - G) (the tokens that write it), decay = e^(G_C) (`_decay_in`,
  `_decay_out`). Arguments as `_chunk_intra`, a_kk from `_chunk_a`. Returns w [C, K],
  u [C, V], qg [C, K], kdec [C, K], decay [K, 1], fp32."""
  f32 = jnp.float32
  cd = q.dtype
  g, beta = g.astype(f32), beta.astype(f32)
  qf, kf, vf = q.astype(f32), k.astype(f32), v.astype(f32)
  t = _wy_inverse(a_kk, dot)
  eg = _decay_in(g, sc, dot)
  ek, decay = _decay_out(g, sc, bounded, dot)
  w = _mm(t, beta * kf * eg, cd, dot=dot)             # [C, K]
  u = _mm(t, beta * vf, cd, dot=dot)                  # [C, V]
  return w, u, qf * eg, kf * ek, decay


def _chunk_wy_vjp(get, put, sc=None, bounded=True):
  """The vjp of `_chunk_wy` written out, so the backward kernel holds no autodiff residuals
  and loads each input where it is first needed: get(name) -> the value of "q", "k", "v",
  "g", "beta", "a_kk" (as for `_chunk_wy`) or of the cotangents "dw", "du", "dqg", "dkdec",
  "ddecay" (fp32); put(name, value) receives "a_kk" (dA_kk, strictly lower), "v" (dv), then
  "beta", "q", "k", "g" (fp32 partials of dbeta, dq, dk, dg; `_chunk_a`'s vjp adds the rest),
  each as soon as it is known. dT comes first, before T: its two [C, K]·[K, C] products are
  the widest (on sm_90 this order is what keeps the fp32 kernel out of spills). With
  B = b k e^G:
    dT = du (b v)^T + dw B^T;  dA_kk = -T^T dT T^T;  d(b v) = T^T du;  dB = T^T dw;
    dG = (dB b k + dqg q) e^G - dkdec kdec (bounded; the unbounded form sums its suffixes);
    dg = L^T dG + the terms of G_C = Σ_t g_t (decay, and kdec's bounded reference).
  Matmul operands in the input dtype as in the forward (T^T dT T^T in fp32).
  `tests/pallas_kernels/test_kda_chunk.py` holds it to jax.vjp of `_chunk_wy`."""
  f32 = jnp.float32
  cd = get("q").dtype
  g, beta = get("g").astype(f32), get("beta").astype(f32)
  c = g.shape[0]
  row, col, _, _, _ = _chunk_masks(c)
  eg = _decay_in(g, sc)
  kf, dw = get("k").astype(f32), get("dw")
  dt = _mm_t(dw, beta * kf * eg, cd)                             # [C, C]
  vf, du = get("v").astype(f32), get("du")
  dt = dt + _mm_t(du, beta * vf, cd)
  t = _wy_inverse(get("a_kk"))
  put("a_kk", jnp.where(col < row, -_mm_t(_t_mm(t, dt), t), 0.0))
  dbv = _t_mm(t, du, cd)                                         # [C, V] d(b v)
  put("v", dbv * beta)
  dbeta = jnp.sum(dbv * vf, axis=1, keepdims=True)
  dbk = _t_mm(t, dw, cd) * eg                                    # [C, K] d(b k) e^G
  put("beta", dbeta + jnp.sum(dbk * kf, axis=1, keepdims=True))
  qf, dqg = get("q").astype(f32), get("dqg")
  put("q", dqg * eg)
  dgc = dbk * beta * kf + dqg * qf * eg                         # d(G) through e^G
  dkdec = get("dkdec")
  ek, decay = _decay_out(g, sc, bounded)
  put("k", dbk * beta + dkdec * ek)
  z = dkdec * kf * ek                                            # d(exponent of ek)
  every = _col_to_rows(get("ddecay") * decay, c)                 # G_C = Σ_t g_t: every row
  lower = jnp.where(col <= row, 1.0, 0.0)
  if bounded:   # ek = e^(G_C - G)
    dg = _t_mm(lower, dgc - z) + every + jnp.sum(z, 0, keepdims=True)
  else:         # ek = e^(Σ_{t>i} g_t)
    dg = _t_mm(lower, dgc) + _t_mm(jnp.where(col > row, 1.0, 0.0), z) + every
  put("g", dg)


def _chunk_intra(q, k, v, g, beta, sc=None, dot=_dot, bounded=True):
  """The state-free part of one chunk of the delta rule (everything but the state pass).

  q, k [C, K] (q already scaled), v [C, V] (input dtype); g [C, K] fp32 log-decay (>= -5 when
  `bounded`; any value <= 0 otherwise); beta [C, 1] fp32; sc [C, 1] fp32 or None: each token's
  segment number within the chunk (0 = the segment carried in; packed documents). bounded: the
  diagonal tiles as two matmuls around a mid-tile reference (needs g >= -5), else pair by pair
  (`_diagonal_tiles_pairwise`).
  Returns, all fp32, what `_state_step` needs: w [C, K], u [C, V], qg [C, K], a_qk [C, C],
  kdec [C, K], decay [K, 1] (`_chunk_a`, `_chunk_wy`).
  """
  a_kk, a_qk = _chunk_a(q, k, g, beta, sc, dot, bounded)
  w, u, qg, kdec, decay = _chunk_wy(q, k, v, g, beta, a_kk, sc, dot, bounded)
  return w, u, qg, a_qk, kdec, decay


def _state_step(w, u, qg, a_qk, kdec, decay, s, cd, dot=_dot):
  """The state pass of one chunk: `_chunk_intra`'s outputs and the state s [K, V] fp32 before
  the chunk -> o [C, V] fp32 and the state after it [K, V] fp32. Matmul operands in cd (the
  input dtype), so w, qg, a_qk and kdec may be stored in cd without changing a bit; u and the
  state stay fp32. v' = u - w S; o = qg S + A_qk v'; S' = decay S + kdec^T v'."""
  v_new = u - _mm(w, s, cd, dot=dot)
  o = _mm(qg, s, cd, dot=dot) + _mm(a_qk, v_new, cd, dot=dot)
  s_new = decay * s + _t_mm(kdec, v_new, cd, dot=dot)
  return o, s_new


def _state_step_vjp(w, u, qg, a_qk, kdec, decay, s, do, ds, cd, put):
  """The vjp of `_state_step` written out (arguments as there; do [C, V], ds [K, V] the
  cotangents of o and of the state after the chunk): put(name, value) for "qg", "a_qk",
  "kdec", "decay", "u", "w" (fp32), each as soon as it is known (a kernel stores it and frees
  its registers); returns dS_before [K, V]. dqg = do S^T; dA_qk = do v'^T; dkdec = v' dS^T;
  ddecay = Σ_V S * dS; dv' = A_qk^T do + kdec dS (= du); dw = -dv' S^T;
  dS_before = decay dS + qg^T do - w^T dv'. Cotangents enter each dot cast to cd, as the
  forward's operands do. `tests/pallas_kernels/test_kda_chunk.py` holds it to jax.vjp."""
  do = do.astype(jnp.float32)
  v_new = u - _mm(w, s, cd)
  put("qg", _mm_t(do, s, cd))
  put("a_qk", _mm_t(do, v_new, cd))
  put("kdec", _mm_t(v_new, ds, cd))
  put("decay", jnp.sum(s * ds, axis=1, keepdims=True))
  dv = _t_mm(a_qk, do, cd) + _mm(kdec, ds, cd)
  put("u", dv)
  put("w", -_mm_t(dv, s, cd))
  return decay * ds + _t_mm(qg, do, cd) - _t_mm(w, dv, cd)


def _chunk_step(q, k, v, g, beta, s, sc=None, dot=_dot, bounded=True):
  """One chunk of the delta rule: `_chunk_intra` then `_state_step` (arguments as there; s
  [K, V] fp32 the state before the chunk). Returns o [C, V] fp32 and the state after it."""
  return _state_step(*_chunk_intra(q, k, v, g, beta, sc, dot, bounded), s, q.dtype, dot)


# ------------------------------------------------------------------------- kernels
# Five kernels, none of which holds a whole chunk's vjp (one fused backward spilled registers
# on sm_90 at every size: docs/notes/pallas_kda.md):
#   intra fwd, wy bwd, a bwd: grid (batch*heads, chunks), every program independent;
#   state fwd, state bwd: grid (batch*heads, V blocks[, chunks]), chunks in order.
# State columns are independent (w, qg, a_qk, kdec and decay depend on q, k, g, beta only),
# so a V block is a state program of its own; its cotangents of the shared intermediates are
# per-block partials summed by XLA.
# Kernel refs: inputs, then outputs, then scratch (grid form). The per-chunk kernels take sc
# (segment numbers) after their other inputs when `packed`.
_INTER_NAMES = ("w", "u", "qg", "a_qk", "kdec", "decay")   # `_chunk_intra`'s outputs
_INTER = len(_INTER_NAMES)                                  # (decay: one column per chunk)


def _split_sc(refs, n_in, packed):
  """(inputs without sc, sc ref or None, the remaining refs)."""
  n = n_in + packed
  return refs[:n_in], (refs[n_in] if packed else None), refs[n:]


def _intra_fwd_kernel(*refs, packed, bounded, with_akk):
  """`_chunk_intra` of one chunk (a_qk stored before the WY part starts); with_akk: A_kk too
  (the backward's recompute keeps it for `_wy_bwd_kernel`)."""
  ins, sc_ref, outs = _split_sc(refs, 5, packed)
  q, k, v, g, beta = (r[...] for r in ins)
  sc = None if sc_ref is None else sc_ref[...]
  w_ref, u_ref, qg_ref, aqk_ref, kdec_ref, decay_ref = outs[:_INTER]
  a_kk, a_qk = _chunk_a(q, k, g, beta, sc, bounded=bounded)
  aqk_ref[...] = a_qk.astype(aqk_ref.dtype)
  if with_akk:
    outs[_INTER][...] = a_kk
  for ref, x in zip((w_ref, u_ref, qg_ref, kdec_ref, decay_ref),
                    _chunk_wy(q, k, v, g, beta, a_kk, sc, bounded=bounded)):
    ref[...] = x.astype(ref.dtype)


def _wy_bwd_kernel(*refs, packed, bounded):
  """(dw, du, dqg, dkdec, ddecay) -> dA_kk, dv and the (dq, dk, dbeta, dg) partials
  (`_chunk_wy_vjp`)."""
  ins, sc_ref, rest = _split_sc(refs, 6, packed)
  src = dict(zip(("q", "k", "v", "g", "beta", "a_kk", "dw", "du", "dqg", "dkdec", "ddecay"),
                 ins + rest[:5]))
  out = dict(zip(("q", "k", "v", "g", "beta", "a_kk"), rest[5:]))

  def put(name, x):
    out[name][...] = x.astype(out[name].dtype)

  _chunk_wy_vjp(lambda name: src[name][...], put, None if sc_ref is None else sc_ref[...],
                bounded)


def _a_bwd_kernel(*refs, packed, bounded):
  """(dA_kk, dA_qk) -> (dq, dk, dg, dbeta) partials: jax.vjp of `_chunk_a` at fp32 copies of
  the inputs (the matmul operands still cast to the inputs' dtype, so the cotangents come out
  fp32), the exact transpose of the forward maths (dots through `_dot_vjp`, whose vjp the
  Triton lowering accepts)."""
  f32 = jnp.float32
  ins, sc_ref, rest = _split_sc(refs, 4, packed)     # q, k, g, beta
  step = functools.partial(_chunk_a, sc=None if sc_ref is None else sc_ref[...], dot=_dot_vjp,
                           bounded=bounded, cd=ins[0].dtype)
  _, pull = jax.vjp(step, *(r[...].astype(f32) for r in ins))
  for ref, x in zip(rest[2:], pull(tuple(r[...].astype(f32) for r in rest[:2]))):
    ref[...] = x.astype(ref.dtype)


def _state_fwd_grid_kernel(*refs):
  inter, s0_ref, (o_ref, st_ref, sf_ref, s_scr) = refs[:_INTER], refs[_INTER], refs[_INTER + 1:]
  c = pl.program_id(2)

  @pl.when(c == 0)
  def _():
    s_scr[...] = s0_ref[...].astype(jnp.float32)

  s = s_scr[...]
  st_ref[...] = s
  o, s_new = _state_step(*(r[...] for r in inter), s, inter[0].dtype)
  o_ref[...] = o.astype(o_ref.dtype)
  s_scr[...] = s_new

  @pl.when(c == pl.num_programs(2) - 1)
  def _():
    sf_ref[...] = s_new


def _state_bwd_grid_kernel(*refs):
  inter, (st_ref, do_ref, dsf_ref), outs = refs[:_INTER], refs[_INTER:_INTER + 3], refs[_INTER + 3:]
  d_inter, ds0_ref, ds_scr = outs[:_INTER], outs[_INTER], outs[_INTER + 1]
  c = pl.program_id(2)    # walks chunks NC-1 .. 0 (see the index maps)

  @pl.when(c == 0)
  def _():
    ds_scr[...] = dsf_ref[...].astype(jnp.float32)

  out = dict(zip(_INTER_NAMES, d_inter))

  def put(name, x):
    out[name][...] = x.astype(out[name].dtype)

  ds = _state_step_vjp(*(r[...] for r in inter), st_ref[...], do_ref[...], ds_scr[...],
                       inter[0].dtype, put)
  ds_scr[...] = ds

  @pl.when(c == pl.num_programs(2) - 1)
  def _():
    ds0_ref[...] = ds


def _chunk_ref(ref, n, i, sl):
  """Chunk i's block of intermediate n in the loop form: token-major refs are sliced along
  tokens (sl), the per-chunk decay [NC, K, 1] is indexed."""
  return ref.at[i] if n == _INTER - 1 else ref.at[sl, :]


def _state_fwd_loop_kernel(*refs, chunk, num_chunks):
  inter, s0_ref, (o_ref, st_ref, sf_ref) = refs[:_INTER], refs[_INTER], refs[_INTER + 1:]

  def body(i, s):
    sl = pl.ds(pl.multiple_of(i * chunk, chunk), chunk)
    st_ref[i] = s
    vals = [_chunk_ref(r, n, i, sl)[...] for n, r in enumerate(inter)]
    o, s_new = _state_step(*vals, s, inter[0].dtype)
    o_ref[sl, :] = o.astype(o_ref.dtype)
    return s_new

  sf_ref[...] = lax.fori_loop(0, num_chunks, body, s0_ref[...].astype(jnp.float32))


def _state_bwd_loop_kernel(*refs, chunk, num_chunks):
  inter, (st_ref, do_ref, dsf_ref), outs = refs[:_INTER], refs[_INTER:_INTER + 3], refs[_INTER + 3:]
  d_inter, ds0_ref = outs[:_INTER], outs[_INTER]

  def body(j, ds):
    i = num_chunks - 1 - j
    sl = pl.ds(pl.multiple_of(i * chunk, chunk), chunk)
    vals = [_chunk_ref(r, n, i, sl)[...] for n, r in enumerate(inter)]
    out = {name: _chunk_ref(r, n, i, sl) for n, (name, r) in enumerate(zip(_INTER_NAMES, d_inter))}

    def put(name, x):
      out[name][...] = x.astype(out[name].dtype)

    return _state_step_vjp(*vals, st_ref[i], do_ref[sl, :], ds, inter[0].dtype, put)

  ds0_ref[...] = lax.fori_loop(0, num_chunks, body, dsf_ref[...].astype(jnp.float32))


GPU_NUM_WARPS = 8   # every KDA kernel on the Triton target (docs/results/sm90_kernels.json)


def _compiler_params(target, sequential=False):
  """sequential: a grid whose last axis carries the state (the TPU "grid" form)."""
  if target == "tpu":
    sem = ("parallel", "parallel") + (("arbitrary",) if sequential else ())
    return pltpu.CompilerParams(dimension_semantics=sem)
  if target == "gpu":
    return pltriton.CompilerParams(num_warps=GPU_NUM_WARPS, num_stages=1)
  return None


class _Layout:
  """BlockSpecs of the state kernels in one launch form. Index maps get (b, j[, c]): b =
  batch*head, j = V block, c = chunk step (visited last to first when `reverse`)."""

  def __init__(self, launch, tp, chunk, reverse):
    self.launch, self.tp, self.chunk = launch, tp, chunk
    self.nc = tp // chunk
    nc = self.nc
    self.c = (lambda c: nc - 1 - c) if reverse else (lambda c: c)

  def tokens(self, width, v_blocked=False):
    """[BH, Tp, width] arrays (width = K, V or C); a V-blocked one is split along width."""
    sq, tp, ch, cm = _SQ, self.tp, self.chunk, self.c
    jj = (lambda j: j) if v_blocked else (lambda j: 0)
    if self.launch == "loop":
      return pl.BlockSpec((sq, tp, width), lambda b, j: (b, 0, jj(j)))
    return pl.BlockSpec((sq, ch, width), lambda b, j, c: (b, cm(c), jj(j)))

  def partial_tokens(self, width):
    """[BH, nV, Tp, width] per-V-block partial cotangents (summed outside the kernel)."""
    sq, tp, ch, cm = _SQ, self.tp, self.chunk, self.c
    if self.launch == "loop":
      return pl.BlockSpec((sq, sq, tp, width), lambda b, j: (b, j, 0, 0))
    return pl.BlockSpec((sq, sq, ch, width), lambda b, j, c: (b, j, cm(c), 0))

  def decay(self, dk, partial=False):
    """[BH, NC, K, 1] one column per chunk, or its per-V-block partial [BH, nV, NC, K, 1]."""
    sq, nc, cm = _SQ, self.nc, self.c
    if self.launch == "loop":
      if partial:
        return pl.BlockSpec((sq, sq, nc, dk, 1), lambda b, j: (b, j, 0, 0, 0))
      return pl.BlockSpec((sq, nc, dk, 1), lambda b, j: (b, 0, 0, 0))
    if partial:
      return pl.BlockSpec((sq, sq, sq, dk, 1), lambda b, j, c: (b, j, cm(c), 0, 0))
    return pl.BlockSpec((sq, sq, dk, 1), lambda b, j, c: (b, cm(c), 0, 0))

  def state(self, dk, bv):
    """[BH, K, V] state, one V block."""
    sq = _SQ
    if self.launch == "loop":
      return pl.BlockSpec((sq, dk, bv), lambda b, j: (b, 0, j))
    return pl.BlockSpec((sq, dk, bv), lambda b, j, c: (b, 0, j))

  def states(self, dk, bv):
    """[BH, NC, K, V] chunk-initial states: all chunks (loop) or the current one (grid)."""
    sq, nc, cm = _SQ, self.nc, self.c
    if self.launch == "loop":
      return pl.BlockSpec((sq, nc, dk, bv), lambda b, j: (b, 0, 0, j))
    return pl.BlockSpec((sq, sq, dk, bv), lambda b, j, c: (b, cm(c), 0, j))

  def intermediates(self, dk, bv, partial=False):
    """Specs of `_chunk_intra`'s six outputs (w, u V-blocked, qg, a_qk, kdec, decay), or of
    their cotangents (`partial`: per V block, except u's)."""
    tok = self.partial_tokens if partial else self.tokens
    return [tok(dk), self.tokens(bv, True), tok(dk), tok(self.chunk), tok(dk),
            self.decay(dk, partial)]


def _chunk_specs(chunk, widths):
  """Per-chunk kernels: grid (BH, NC), one chunk per program. A width is a [BH, Tp, width]
  array's last dim, or "decay" for the [BH, NC, K, 1] columns."""
  sq = _SQ
  return [pl.BlockSpec((sq, sq, w[1], 1), lambda b, c: (b, c, 0, 0)) if isinstance(w, tuple)
          else pl.BlockSpec((sq, chunk, w), lambda b, c: (b, c, 0)) for w in widths]


def _chunk_call(kernel, name, q, chunk, out_shape, in_widths, out_widths, args, interpret,
                target, **kw):
  bh, tp, _ = q.shape
  return pl.pallas_call(
      functools.partial(kernel, **kw), out_shape=out_shape, grid=(bh, tp // chunk),
      in_specs=_chunk_specs(chunk, in_widths), out_specs=_chunk_specs(chunk, out_widths),
      interpret=interpret, name=name,
      compiler_params=None if interpret else _compiler_params(target))(*args)


def kda_intra_fwd(q, k, v, g, beta, sc=None, *, chunk, interpret, target, bounded=True,
                  with_akk=False):
  """Per-chunk kernel of the forward. q, k, g [BH, Tp, K]; v [BH, Tp, V]; beta [BH, Tp, 1]
  fp32; sc [BH, Tp, 1] fp32 segment numbers within each chunk, or None (one sequence per row);
  Tp a multiple of `chunk`. Returns `_chunk_intra`'s outputs for every chunk: w, qg, kdec
  [BH, Tp, K] and a_qk [BH, Tp, C] in q.dtype, u [BH, Tp, V] and decay [BH, NC, K, 1] fp32;
  with_akk: then a_kk [BH, Tp, C] fp32 (for `kda_chunk_bwd`)."""
  bh, tp, dk = q.shape
  dv = v.shape[-1]
  f32, cd, sds = jnp.float32, q.dtype, jax.ShapeDtypeStruct
  shapes = (sds((bh, tp, dk), cd), sds((bh, tp, dv), f32), sds((bh, tp, dk), cd),
            sds((bh, tp, chunk), cd), sds((bh, tp, dk), cd), sds((bh, tp // chunk, dk, 1), f32))
  widths = (dk, dv, dk, chunk, dk, ("decay", dk))
  if with_akk:
    shapes, widths = shapes + (sds((bh, tp, chunk), f32),), widths + (chunk,)
  packed = sc is not None
  return _chunk_call(_intra_fwd_kernel, "kda_intra_fwd", q, chunk, shapes,
                     (dk, dk, dv, dk, 1) + ((1,) if packed else ()), widths,
                     (q, k, v, g, beta) + ((sc,) if packed else ()), interpret, target,
                     packed=packed, bounded=bounded, with_akk=with_akk)


def kda_chunk_bwd(q, k, v, g, beta, sc, a_kk, d_inter, *, chunk, interpret, target,
                  bounded=True):
  """Backward of `kda_intra_fwd`: the cotangents of its six outputs (fp32, shaped like them)
  -> (dq, dk, dv, dg, dbeta) shaped and typed like (q, k, v, g, beta). Two per-chunk kernels:
  `kda_wy_bwd` (through `_chunk_wy`, giving dA_kk) then `kda_a_bwd` (through `_chunk_a`);
  XLA adds their partials."""
  bh, tp, dk = q.shape
  dv = v.shape[-1]
  f32 = jnp.float32
  packed = sc is not None
  scs = (sc,) if packed else ()
  one = (1,) if packed else ()
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, f32)
  dw, du, dqg, da_qk, dkdec, ddecay = d_inter
  dq1, dk1, dv_, dg1, db1, da_kk = _chunk_call(
      _wy_bwd_kernel, "kda_wy_bwd", q, chunk, tuple(sds(x) for x in (q, k, v, g, beta, a_kk)),
      (dk, dk, dv, dk, 1, chunk) + one + (dk, dv, dk, dk, ("decay", dk)),
      (dk, dk, dv, dk, 1, chunk), (q, k, v, g, beta, a_kk) + scs + (dw, du, dqg, dkdec, ddecay),
      interpret, target, packed=packed, bounded=bounded)
  dq2, dk2, dg2, db2 = _chunk_call(
      _a_bwd_kernel, "kda_a_bwd", q, chunk, tuple(sds(x) for x in (q, k, g, beta)),
      (dk, dk, dk, 1) + one + (chunk, chunk), (dk, dk, dk, 1),
      (q, k, g, beta) + scs + (da_kk, da_qk), interpret, target, packed=packed,
      bounded=bounded)
  return ((dq1 + dq2).astype(q.dtype), (dk1 + dk2).astype(k.dtype), dv_.astype(v.dtype),
          (dg1 + dg2).astype(g.dtype), (db1 + db2).astype(beta.dtype))


def _state_call(kernel_grid, kernel_loop, lay, nv, bv, dk, out_shape, in_specs, out_specs,
                args, interpret, target, name):
  bh = args[0].shape[0]
  if lay.launch == "loop":
    kernel = functools.partial(kernel_loop, chunk=lay.chunk, num_chunks=lay.nc)
    grid, scratch = (bh, nv), ()
  else:
    kernel, grid = kernel_grid, (bh, nv, lay.nc)
    scratch = (pltpu.VMEM((dk, bv), jnp.float32),)
  params = None if interpret else _compiler_params(target, lay.launch == "grid")
  return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
                        out_specs=out_specs, scratch_shapes=scratch, interpret=interpret,
                        name=name, compiler_params=params)(*args)


def kda_state_fwd(inter, s0, *, chunk, block_v, interpret, target, launch):
  """State-pass kernel: `kda_intra_fwd`'s outputs and s0 [BH, K, V] fp32 -> o [BH, Tp, V] (the
  input dtype), the chunk-initial states [BH, NC, K, V] fp32 (the backward's residual: it never
  re-runs the recurrence) and the final state [BH, K, V] fp32. V a multiple of `block_v`."""
  bh, tp, dk = inter[0].shape
  dv = inter[1].shape[-1]
  nv, lay = dv // block_v, _Layout(launch, tp, chunk, reverse=False)
  f32 = jnp.float32
  out_shape = (jax.ShapeDtypeStruct((bh, tp, dv), inter[0].dtype),
               jax.ShapeDtypeStruct((bh, lay.nc, dk, dv), f32),
               jax.ShapeDtypeStruct((bh, dk, dv), f32))
  in_specs = lay.intermediates(dk, block_v) + [lay.state(dk, block_v)]
  out_specs = (lay.tokens(block_v, True), lay.states(dk, block_v), lay.state(dk, block_v))
  return _state_call(_state_fwd_grid_kernel, _state_fwd_loop_kernel, lay, nv, block_v, dk,
                     out_shape, in_specs, out_specs, tuple(inter) + (s0,), interpret, target,
                     "kda_state_fwd")


def kda_state_bwd(inter, states, do, dsf, *, chunk, block_v, interpret, target, launch):
  """Backward of `kda_state_fwd`, chunks last to first carrying dS (fp32, `_state_step_vjp`):
  cotangents do [BH, Tp, V], dsf [BH, K, V] -> (the six intermediates' cotangents, fp32 and
  shaped like them; all but u's summed over V blocks), ds0 [BH, K, V])."""
  bh, tp, dk = inter[0].shape
  dv = inter[1].shape[-1]
  nv, lay = dv // block_v, _Layout(launch, tp, chunk, reverse=True)
  f32 = jnp.float32
  out_shape = tuple(jax.ShapeDtypeStruct(x.shape if n == 1 else (bh, nv) + x.shape[1:], f32)
                    for n, x in enumerate(inter)) + (jax.ShapeDtypeStruct((bh, dk, dv), f32),)
  in_specs = lay.intermediates(dk, block_v) + [lay.states(dk, block_v),
                                               lay.tokens(block_v, True), lay.state(dk, block_v)]
  out_specs = tuple(lay.intermediates(dk, block_v, partial=True)) + (lay.state(dk, block_v),)
  *d_inter, ds0 = _state_call(_state_bwd_grid_kernel, _state_bwd_loop_kernel, lay, nv, block_v,
                              dk, out_shape, in_specs, out_specs,
                              tuple(inter) + (states, do, dsf), interpret, target,
                              "kda_state_bwd")
  return [x if n == 1 else jnp.sum(x, axis=1) for n, x in enumerate(d_inter)], ds0


# ------------------------------------------------------------------------- custom_vjp core
_STATIC = (7, 8, 9, 10, 11, 12)   # chunk, block_v, interpret, target, launch, bounded


@functools.partial(jax.custom_vjp, nondiff_argnums=_STATIC)
def _kda_core(q, k, v, g, beta, s0, sc, chunk, block_v, interpret, target, launch, bounded):
  return _kda_core_fwd(q, k, v, g, beta, s0, sc, chunk, block_v, interpret, target, launch,
                       bounded)[0]


def _kda_core_fwd(q, k, v, g, beta, s0, sc, chunk, block_v, interpret, target, launch, bounded):
  inter = kda_intra_fwd(q, k, v, g, beta, sc, chunk=chunk, interpret=interpret, target=target,
                        bounded=bounded)
  o, states, sf = kda_state_fwd(inter, s0, chunk=chunk, block_v=block_v, interpret=interpret,
                                target=target, launch=launch)
  # Residuals: the inputs and one state per chunk; the intermediates are recomputed.
  return (o, sf), (q, k, v, g, beta, states, sc)


def _kda_core_bwd(chunk, block_v, interpret, target, launch, bounded, res, cts):
  q, k, v, g, beta, states, sc = res
  do, dsf = cts
  kw = dict(chunk=chunk, interpret=interpret, target=target)
  *inter, a_kk = kda_intra_fwd(q, k, v, g, beta, sc, bounded=bounded, with_akk=True, **kw)
  d_inter, ds0 = kda_state_bwd(inter, states, do.astype(q.dtype), dsf.astype(jnp.float32),
                               block_v=block_v, launch=launch, **kw)
  grads = kda_chunk_bwd(q, k, v, g, beta, sc, a_kk, d_inter, bounded=bounded, **kw)
  return grads + (ds0, None if sc is None else jnp.zeros_like(sc))   # sc: constants


_kda_core.defvjp(_kda_core_fwd, _kda_core_bwd)


# ------------------------------------------------------------------------- public entry point
def _check(name, x, rank):
  if x.ndim != rank:
    raise ValueError(f"kda_chunked_pallas: {name} must have rank {rank}, found shape {x.shape}")


def kda_chunked_pallas(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size=64,
                       interpret=None, segment_ids=None, lower_bound=-5.0, target=None,
                       launch=None, block_v=None):
  """Chunked KDA with Pallas kernels; same contract as `k3jax.ops.kda.kda_chunked`.

  q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] log-decay; beta [B, T, H];
  initial_state [B, H, K, V] or None (zeros). Returns (o [B, T, H, V] in q.dtype,
  final_state [B, H, K, V] fp32). Differentiable (custom_vjp, backward Pallas kernel).

  lower_bound: the gate's bound (g >= lower_bound, -5 for K3): the diagonal tiles' fast form.
    A concrete g below the bound raises ValueError. Under a trace (jit/grad) g is clamped at
    the bound (so no exp can overflow) and every (batch, head) whose g went below it by more
    than 1e-4 gets NaN outputs and final state: a flag that cannot pass unnoticed, without
    checkify. A bounded gate (`kda_gate(..., lower_bound)`) never trips it.
    None (Kimi Linear's unbounded softplus decay, any g <= 0): the diagonal tiles pair by pair
    (`_diagonal_tiles_pairwise`; more exps, no rescale); a concrete g > 0 raises ValueError.
  interpret: None -> True on CPU. target: "tpu" | "gpu" (default: the platform), the lowering
    to prepare for (export tests set it); on "gpu" chunk_size is capped at GPU_MAX_CHUNK (16)
    so the Triton kernels fit in registers and shared memory. launch: "grid" | "loop"
    (default: loop on GPU, grid otherwise); both give identical results. block_v: V columns
    per state program (default V; on GPU at most GPU_BLOCK_V: 64 for bf16/fp16 inputs, 16 for
    fp32): a power of 2 dividing V.
  segment_ids: `[B, T]` int or None (packed documents): the state resets to zero where the
    id changes; initial_state applies to the first segment, the final state is the last
    segment's (as `kda_chunked`).
  """
  bounded = lower_bound is not None
  if bounded and not -5.0 <= lower_bound <= 0.0:
    raise ValueError(f"kda_chunked_pallas: lower_bound must lie in [-5, 0] so a 16-token "
                     f"rescale stays within e^+-{MAX_EXP:.0f}, or be None (an unbounded gate), "
                     f"found {lower_bound}")
  for name, x, r in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
    _check(name, x, r)
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  if k.shape != q.shape or g.shape != q.shape:
    raise ValueError(f"kda_chunked_pallas: k and g must have q's shape {q.shape}, found "
                     f"k {k.shape}, g {g.shape}")
  if v.shape[:3] != (b, t, h) or beta.shape != (b, t, h):
    raise ValueError(f"kda_chunked_pallas: v must be [{b},{t},{h},V] and beta [{b},{t},{h}], "
                     f"found v {v.shape}, beta {beta.shape}")
  if segment_ids is not None:
    if segment_ids.shape != (b, t):
      raise ValueError(f"kda_chunked_pallas: segment_ids must be [B, T] = {(b, t)}, found "
                       f"{segment_ids.shape}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"kda_chunked_pallas: segment_ids must have an integer dtype, found "
                       f"{segment_ids.dtype}")
  if initial_state is not None and initial_state.shape != (b, h, dk, dv):
    raise ValueError(f"kda_chunked_pallas: initial_state must be {(b, h, dk, dv)}, found "
                     f"{initial_state.shape}")
  if chunk_size % SUB or chunk_size <= 0 or chunk_size & (chunk_size - 1):
    raise ValueError(f"kda_chunked_pallas: chunk_size must be a power of 2 and a multiple of "
                     f"{SUB}, found {chunk_size}")
  try:      # concrete g (eager call): check the bound; under a trace the clamp below holds it
    gmin, gmax = (float(jnp.min(g)), float(jnp.max(g))) if g.size else (0.0, 0.0)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    gmin = gmax = None
  if gmin is not None and bounded and gmin < lower_bound - 1e-6:
    raise ValueError(f"kda_chunked_pallas: g must be >= lower_bound={lower_bound} (a bounded "
                     f"decay gate), found min(g)={gmin}; pass lower_bound=None for an "
                     f"unbounded gate")
  if gmax is not None and not bounded and gmax > 0.0:
    raise ValueError(f"kda_chunked_pallas: g is a log-decay and must be <= 0, found "
                     f"max(g)={gmax}")
  platform = jax.default_backend()
  if interpret is None:
    interpret = platform == "cpu"
  if target is None:
    target = "gpu" if platform in ("gpu", "cuda", "rocm") else "tpu"
  if launch is None:
    launch = "loop" if target == "gpu" and not interpret else "grid"
  if launch not in ("grid", "loop"):
    raise ValueError(f"kda_chunked_pallas: launch must be 'grid' or 'loop', found {launch!r}")
  if block_v is None:
    block_v = min(dv, GPU_BLOCK_V.get(jnp.dtype(q.dtype).itemsize, 16)) if target == "gpu" else dv
  if dv % block_v or block_v & (block_v - 1):
    raise ValueError(f"kda_chunked_pallas: block_v must be a power of 2 dividing V={dv}, found "
                     f"{block_v}")
  if target == "gpu":   # registers and shared memory of the Triton kernels (GPU_MAX_CHUNK)
    chunk_size = min(chunk_size, GPU_MAX_CHUNK)
  if launch == "grid" and target == "gpu" and not interpret:
    raise ValueError("kda_chunked_pallas: launch='grid' carries the state across sequential grid "
                     "steps, which the GPU (Triton) lowering does not run in order; use 'loop'")

  if scale is None:
    scale = dk ** -0.5
  f32 = jnp.float32
  g = g.astype(f32)
  tripped = None
  if bounded:
    tripped = jnp.any(g < lower_bound - 1e-4, axis=(1, 3))              # [B, H]
    g = jnp.where(g < lower_bound, jnp.asarray(lower_bound, f32), g)
  q = q * jnp.asarray(scale, q.dtype)
  tp = -(-t // chunk_size) * chunk_size

  def heads_first(x):   # [B, T, H, D] -> [B*H, Tp, D], zero padded (g = 0, beta = 0: no-op)
    x = jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    return jnp.transpose(x, (0, 2, 1, 3)).reshape(b * h, tp, x.shape[-1])

  s0 = (jnp.zeros((b, h, dk, dv), f32) if initial_state is None
        else initial_state.astype(f32)).reshape(b * h, dk, dv)
  sc = None
  if segment_ids is not None:   # each token's segment number within its chunk (0: carried in)
    starts = jnp.pad((segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32),
                     ((0, 0), (1, tp - t)))     # padding continues the last segment (a no-op)
    sc = jnp.cumsum(starts.reshape(b, tp // chunk_size, chunk_size), axis=-1).astype(f32)
    sc = jnp.broadcast_to(sc.reshape(b, 1, tp, 1), (b, h, tp, 1)).reshape(b * h, tp, 1)
  o, sf = _kda_core(heads_first(q), heads_first(k.astype(q.dtype)), heads_first(v.astype(q.dtype)),
                    heads_first(g), heads_first(beta.astype(f32)[..., None]), s0, sc,
                    chunk_size, block_v, bool(interpret), target, launch, bounded)
  o = jnp.transpose(o.reshape(b, h, tp, dv), (0, 2, 1, 3))[:, :t]
  sf = sf.reshape(b, h, dk, dv)
  if tripped is not None:
    o = jnp.where(tripped[:, None, :, None], jnp.asarray(jnp.nan, o.dtype), o)
    sf = jnp.where(tripped[:, :, None, None], jnp.nan, sf)
  return o, sf
