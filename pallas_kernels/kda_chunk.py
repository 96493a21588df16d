"""Bounded-decay KDA chunk kernel (Pallas): forward and backward, same results as
`k3jax.ops.kda.kda_chunked`.

Spec: K3_SPEC.md §3. Recurrence per head, state S [K, V], read after the update:
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

Kernels (programs over batch*heads and V blocks; chunks visited in order inside a program):
  * `kda_chunk_fwd` writes the outputs, the final state and every chunk's initial state
    (fp32 [BH, NC, K, V]: the residual the backward needs, so it never re-runs the recurrence).
  * `kda_chunk_bwd` walks the chunks backwards carrying dS (fp32) and, per chunk, recomputes
    `_chunk_step` from its stored initial state and applies `jax.vjp` of it *inside the kernel*:
    the backward is the exact transpose of the forward math, one Pallas kernel (its dots use
    a custom vjp that casts the fp32 cotangent to the operand dtype, as the MXU/Triton want).
  * V blocks (`block_v`): state columns are independent, so each V block is its own program;
    dq, dk, dg, dbeta come out as per-block partials summed by XLA.
Two launch forms of the same body:
  * "grid" (TPU, interpret): grid (BH, nV, NC), blocks of one chunk, state in a VMEM scratch
    carried across the "arbitrary" chunk axis.
  * "loop" (GPU, Triton lowering): grid (BH, nV), a `fori_loop` over chunks inside the kernel
    with the state as loop carry (Triton runs grid steps in parallel: no scratch carry there).
On CUDA the kernels are lowered with Triton (`pallas.triton.CompilerParams`), not Mosaic GPU
(whose lowering on jax 0.10 rejects the plain dots used here).

Shared memory on GPU (sm_90: 232448 bytes per block). The backward's footprint grows with C
and K (the fp32 [C, K], [C, C] operands of its many dots and the [K, block_v] state), hardly
with block_v; at chunk 64 it exceeds the limit even for K = V = 16. On the Triton target the
chunk is therefore capped (GPU_MAX_CHUNK: 16 for fp32 inputs, 32 for bf16/fp16); chunking is
exact, so only rounding differs from a larger chunk. The measured footprints behind the cap
are in docs/notes/pallas_kda.md ("Shared memory on the Triton target").

Packed documents (`segment_ids`): the kernels take each token's segment number within its
chunk (`sc`, the count of segment starts up to it, fp32 [BH, Tp, 1], made by XLA outside) and
mask the chunk: A_kk and A_qk to pairs of one segment (T is then block-diagonal by segment),
the state read (o's and w's e^G terms) to the segment carried in (sc = 0), the state update to
the chunk's last segment, and the old state is dropped when a segment starts in the chunk. A
pair of one segment only spans its own gates, so the rescale bounds above still hold.

Unbounded gates (Kimi Linear's softplus decay, `lower_bound=None`): the diagonal tiles are
formed pair by pair, exp(sum of g over j < t <= i) for i >= j, so every exponent is <= 0
whatever the gate (`_diagonal_tiles_pairwise`: 16 passes, one per position in a tile, each two
0/1 matmuls and [C, K] elementwise work). Every other exponent (off-diagonal rows and keys,
the state update's suffix) is likewise summed over exactly its own gates: with large gates a
difference of two cumulative sums loses digits (2.5e-4 relative at gates of -300).

Limits: the bounded form needs g >= lower_bound >= -5 (see kda_chunked_pallas for how a
violation is reported); chunk_size a power of 2 >= 16 (Triton needs power-of-2 blocks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

_SQ = getattr(pl, "squeezed", None)   # a squeezed block dim (None on older jax)
# Largest chunk on the Triton (GPU) target, by input itemsize: shared memory (module docstring).
GPU_MAX_CHUNK = {4: 16, 2: 32}
GPU_MAX_CHUNK_UNBOUNDED = 16   # the pairwise diagonal tiles (unbounded gate): 180 KiB fwd at 32
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


def _col(r, n):
  """[1, n] row vector -> [n, 1] column (exact; select on the identity, then a row sum)."""
  eye = lax.broadcasted_iota(jnp.int32, (n, n), 0) == lax.broadcasted_iota(jnp.int32, (n, n), 1)
  return jnp.sum(jnp.where(eye, jnp.broadcast_to(r, (n, n)), 0.0), axis=1, keepdims=True)


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


def _diagonal_tiles_pairwise(qf, kf, g, dot):
  """A_kk and A_qk's diagonal 16-token tiles for any gate (Kimi Linear's unbounded decay):
  entry (i, j) = Σ_d x_i k_j exp(Σ_{j<t<=i} g_t), the exponent summed over exactly the pair's
  gates (never a difference of two cumulative sums, which loses digits once those are large,
  nor a rescale). One pass per position p of a tile: for every row i, j is the p-th token of
  i's own tile, so all tiles advance together: 16 passes whatever the chunk, each two 0/1
  matmuls (exact) and [C, K] elementwise work. Rows before j get exponent 0 and are masked
  by the caller. Returns [C, C] x2."""
  c = qf.shape[0]
  row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
  col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
  start = row - jnp.bitwise_and(row, SUB - 1)               # first token of row i's tile
  d_kk = jnp.zeros((c, c), jnp.float32)
  d_qk = jnp.zeros((c, c), jnp.float32)
  for p in range(SUB):
    sel = col == start + p                                   # [C, C]: j = start + p
    span = _mm(jnp.where((col > start + p) & (col <= row), 1.0, 0.0), g, dot=dot)
    ref_k = _mm(jnp.where(sel, 1.0, 0.0), kf, dot=dot)      # k_j for every row i
    pair = jnp.exp(span) * ref_k                             # [C, K] k_j exp(Σ_{j<t<=i} g_t)
    d_kk = d_kk + jnp.where(sel, jnp.sum(kf * pair, axis=1, keepdims=True), 0.0)
    d_qk = d_qk + jnp.where(sel, jnp.sum(qf * pair, axis=1, keepdims=True), 0.0)
  return d_kk, d_qk


def _chunk_step(q, k, v, g, beta, s, sc=None, dot=_dot, bounded=True):
  """One chunk of the delta rule.

  q, k [C, K] (q already scaled), v [C, V] (input dtype); g [C, K] fp32 log-decay (>= -5 when
  `bounded`; any value ≤ 0 otherwise); beta [C, 1] fp32; s [K, V] fp32 state before the chunk;
  sc [C, 1] fp32 or None: each token's segment number within the chunk (0 = the segment
  carried in; packed documents). bounded: the diagonal tiles as two matmuls around a mid-tile
  reference (needs g >= -5), else pair by pair (`_diagonal_tiles_pairwise`).
  Returns o [C, V] fp32 and the state after the chunk [K, V] fp32.
  """
  f32 = jnp.float32
  cd = q.dtype
  c, dk = q.shape
  nt = c // SUB
  g = g.astype(f32)
  beta = beta.astype(f32)
  qf, kf, vf = q.astype(f32), k.astype(f32), v.astype(f32)
  row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
  col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
  same = _tile(row) == _tile(col)
  later = _tile(row) > _tile(col)
  ident = (row == col).astype(f32)

  # Cumulative log-decay in fp32 (sums as matmuls with 0/+-1 matrices, HIGHEST precision):
  # gc = G over the chunk.
  gc = _mm(jnp.where(col <= row, 1.0, 0.0), g, dot=dot)
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
    d_kk, d_qk = _diagonal_tiles_pairwise(qf, kf, g, dot)
    # Unbounded gates make the cumulative sums large, so each exponent below is summed over
    # its own gates: a key's suffix within its tile, a chunk suffix for the state update.
    key_suffix = _mm(jnp.where(same & (col > row), 1.0, 0.0), g, dot=dot)   # Σ_{j<t<=end J}
    chunk_suffix = _mm(jnp.where(col > row, 1.0, 0.0), g, dot=dot)         # Σ_{j<t<C}
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
  a_kk = beta * jnp.where(later, o_kk, jnp.where(same & (col < row), d_kk, 0.0))
  a_qk = jnp.where(later, o_qk, jnp.where(same & (col <= row), d_qk, 0.0))
  if sc is not None:   # packed: pairs of one segment only; the state reaches segment 0 only
    one_seg = sc == _transpose_col(sc, c)                   # [C, C]
    a_kk = jnp.where(one_seg, a_kk, 0.0)
    a_qk = jnp.where(one_seg, a_qk, 0.0)
    reads = jnp.where(sc == 0.0, 1.0, 0.0)                  # [C, 1] tokens that see s
    last = _row(sc, c - 1)                                  # [1, 1]
    writes = jnp.where(sc == last, 1.0, 0.0)                # [C, 1] the chunk's last segment
    keeps = jnp.where(last == 0.0, 1.0, 0.0)                # [1, 1] no segment starts here

  # WY/UT transform: T = (I + A_kk)^-1, blockwise by dense doubling products (fp32).
  t_diag = _unit_lower_inverse(jnp.where(same, a_kk, 0.0), ident, SUB, dot)
  m = _mm(t_diag, jnp.where(later, a_kk, 0.0), dot=dot)
  t = _mm(_unit_lower_inverse(m, ident, nt, dot), t_diag, dot=dot)

  eg = jnp.exp(gc)                                     # <= 1
  eg_read = eg if sc is None else eg * reads
  w = _mm(t, beta * kf * eg_read, cd, dot=dot)        # [C, K]
  u = _mm(t, beta * vf, cd, dot=dot)                  # [C, V]
  v_new = u - _mm(w, s, cd, dot=dot)
  o = _mm(qf * eg_read, s, cd, dot=dot) + _mm(a_qk, v_new, cd, dot=dot)
  g_last = _row(gc, c - 1)                             # [1, K]
  decay_s = jnp.exp(g_last)
  k_out = kf * jnp.exp(g_last - gc if bounded else chunk_suffix)
  if sc is not None:
    decay_s, k_out = decay_s * keeps, k_out * writes
  s_new = _col(decay_s, dk) * s + _t_mm(k_out, v_new, cd, dot=dot)
  return o, s_new


# ------------------------------------------------------------------------- kernels
# Grid axes: (batch*heads, V blocks[, chunks]). Columns of the state are independent (A_kk, T
# and w depend on q, k, g, beta only), so a V block is a program of its own: more programs for
# the GPU and a smaller state per program; each V block recomputes the chunk's A and T.
# Kernel refs: the inputs in the order (q, k, v, g, beta, s0 | states, [do, dsf,] [sc]) — sc
# only when `packed` — then the outputs, then the scratch (grid form).
def _split_sc(refs, n_in, packed):
  """(inputs without sc, sc ref or None, the remaining refs)."""
  n = n_in + packed
  return refs[:n_in], (refs[n_in] if packed else None), refs[n:]


def _fwd_grid_kernel(*refs, packed, bounded):
  (q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref), sc_ref, (o_ref, st_ref, sf_ref, s_scr) = \
      _split_sc(refs, 6, packed)
  c = pl.program_id(2)

  @pl.when(c == 0)
  def _():
    s_scr[...] = s0_ref[...].astype(jnp.float32)

  s = s_scr[...]
  st_ref[...] = s
  o, s_new = _chunk_step(q_ref[...], k_ref[...], v_ref[...], g_ref[...], b_ref[...], s,
                         None if sc_ref is None else sc_ref[...], bounded=bounded)
  o_ref[...] = o.astype(o_ref.dtype)
  s_scr[...] = s_new

  @pl.when(c == pl.num_programs(2) - 1)
  def _():
    sf_ref[...] = s_new


def _bwd_grid_kernel(*refs, packed, bounded):
  ins, sc_ref, outs = _split_sc(refs, 8, packed)
  q_ref, k_ref, v_ref, g_ref, b_ref, st_ref, do_ref, dsf_ref = ins
  dq_ref, dk_ref, dv_ref, dg_ref, db_ref, ds0_ref, ds_scr = outs
  c = pl.program_id(2)    # walks chunks NC-1 .. 0 (see the index maps)

  @pl.when(c == 0)
  def _():
    ds_scr[...] = dsf_ref[...].astype(jnp.float32)

  grads = _chunk_vjp(q_ref[...], k_ref[...], v_ref[...], g_ref[...], b_ref[...], st_ref[...],
                     do_ref[...], ds_scr[...], None if sc_ref is None else sc_ref[...],
                     bounded)
  for ref, x in zip((dq_ref, dk_ref, dv_ref, dg_ref, db_ref), grads[:5]):
    ref[...] = x.astype(ref.dtype)
  ds_scr[...] = grads[5]

  @pl.when(c == pl.num_programs(2) - 1)
  def _():
    ds0_ref[...] = grads[5]


def _chunk_vjp(q, k, v, g, b, s, do, ds, sc, bounded):
  """Recompute one chunk and pull (do, dS_after) back to (dq, dk, dv, dg, dbeta, dS_before)."""
  step = functools.partial(_chunk_step, sc=sc, dot=_dot_vjp, bounded=bounded)
  _, pull = jax.vjp(step, q, k, v, g, b, s)
  return pull((do.astype(jnp.float32), ds))


def _fwd_loop_kernel(*refs, packed, bounded, chunk, num_chunks):
  (q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref), sc_ref, (o_ref, st_ref, sf_ref) = \
      _split_sc(refs, 6, packed)

  def body(i, s):
    sl = pl.ds(pl.multiple_of(i * chunk, chunk), chunk)
    st_ref[i] = s
    o, s_new = _chunk_step(q_ref[sl, :], k_ref[sl, :], v_ref[sl, :], g_ref[sl, :],
                           b_ref[sl, :], s, None if sc_ref is None else sc_ref[sl, :],
                           bounded=bounded)
    o_ref[sl, :] = o.astype(o_ref.dtype)
    return s_new

  sf_ref[...] = lax.fori_loop(0, num_chunks, body, s0_ref[...].astype(jnp.float32))


def _bwd_loop_kernel(*refs, packed, bounded, chunk, num_chunks):
  ins, sc_ref, outs = _split_sc(refs, 8, packed)
  q_ref, k_ref, v_ref, g_ref, b_ref, st_ref, do_ref, dsf_ref = ins
  dq_ref, dk_ref, dv_ref, dg_ref, db_ref, ds0_ref = outs

  def body(j, ds):
    i = num_chunks - 1 - j
    sl = pl.ds(pl.multiple_of(i * chunk, chunk), chunk)
    grads = _chunk_vjp(q_ref[sl, :], k_ref[sl, :], v_ref[sl, :], g_ref[sl, :], b_ref[sl, :],
                       st_ref[i], do_ref[sl, :], ds, None if sc_ref is None else sc_ref[sl, :],
                       bounded)
    for ref, x in zip((dq_ref, dk_ref, dv_ref, dg_ref, db_ref), grads[:5]):
      ref[sl, :] = x.astype(ref.dtype)
    return grads[5]

  ds0_ref[...] = lax.fori_loop(0, num_chunks, body, dsf_ref[...].astype(jnp.float32))


def _compiler_params(target, launch):
  if target == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    sem = ("parallel", "parallel") + (("arbitrary",) if launch == "grid" else ())
    return pltpu.CompilerParams(dimension_semantics=sem)
  if target == "gpu":
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=8, num_stages=1)
  return None


class _Layout:
  """BlockSpecs of one launch form. Index maps get (b, j[, c]): b = batch*head, j = V block,
  c = chunk step (visited last to first when `reverse`)."""

  def __init__(self, launch, tp, chunk, reverse):
    self.launch, self.tp, self.chunk = launch, tp, chunk
    self.nc = tp // chunk
    nc = self.nc
    self.c = (lambda c: nc - 1 - c) if reverse else (lambda c: c)

  def tokens(self, width, v_blocked=False):
    """[BH, Tp, width] arrays (width = K, V or 1); a V-blocked one is split along width."""
    sq, tp, ch, cm = _SQ, self.tp, self.chunk, self.c
    jj = (lambda j: j) if v_blocked else (lambda j: 0)
    if self.launch == "loop":
      return pl.BlockSpec((sq, tp, width), lambda b, j: (b, 0, jj(j)))
    return pl.BlockSpec((sq, ch, width), lambda b, j, c: (b, cm(c), jj(j)))

  def partial_tokens(self, width):
    """[BH, nV, Tp, width] per-V-block partial gradients (summed outside the kernel)."""
    sq, tp, ch, cm = _SQ, self.tp, self.chunk, self.c
    if self.launch == "loop":
      return pl.BlockSpec((sq, sq, tp, width), lambda b, j: (b, j, 0, 0))
    return pl.BlockSpec((sq, sq, ch, width), lambda b, j, c: (b, j, cm(c), 0))

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


def _launch(kernel_grid, kernel_loop, lay, bh, nv, bv, dk, out_shape, in_specs, out_specs,
            interpret, target, name, packed, bounded):
  if lay.launch == "loop":
    kernel = functools.partial(kernel_loop, packed=packed, bounded=bounded, chunk=lay.chunk,
                               num_chunks=lay.nc)
    grid, scratch = (bh, nv), ()
  else:
    from jax.experimental.pallas import tpu as pltpu
    kernel = functools.partial(kernel_grid, packed=packed, bounded=bounded)
    grid = (bh, nv, lay.nc)
    scratch = (pltpu.VMEM((dk, bv), jnp.float32),)
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=scratch, interpret=interpret, name=name,
      compiler_params=None if interpret else _compiler_params(target, lay.launch))


def kda_chunk_fwd(q, k, v, g, beta, s0, sc=None, *, chunk, block_v, interpret, target, launch,
                  bounded=True):
  """Forward kernel. q, k, g [BH, Tp, K]; v [BH, Tp, V]; beta [BH, Tp, 1] fp32; s0 [BH, K, V]
  fp32; sc [BH, Tp, 1] fp32 segment numbers within each chunk, or None (one sequence per row);
  Tp a multiple of `chunk`, V of `block_v`; bounded: g >= -5 (`_chunk_step`). Returns
  o [BH, Tp, V] (q.dtype), the
  chunk-initial states [BH, NC, K, V] fp32 and the final state [BH, K, V] fp32."""
  bh, tp, dk = q.shape
  dv = v.shape[-1]
  nv, lay = dv // block_v, _Layout(launch, tp, chunk, reverse=False)
  f32 = jnp.float32
  out_shape = (jax.ShapeDtypeStruct((bh, tp, dv), q.dtype),
               jax.ShapeDtypeStruct((bh, lay.nc, dk, dv), f32),
               jax.ShapeDtypeStruct((bh, dk, dv), f32))
  in_specs = [lay.tokens(dk), lay.tokens(dk), lay.tokens(block_v, True), lay.tokens(dk),
              lay.tokens(1), lay.state(dk, block_v)]
  out_specs = (lay.tokens(block_v, True), lay.states(dk, block_v), lay.state(dk, block_v))
  args = (q, k, v, g, beta, s0) + (() if sc is None else (sc,))
  in_specs += [] if sc is None else [lay.tokens(1)]
  return _launch(_fwd_grid_kernel, _fwd_loop_kernel, lay, bh, nv, block_v, dk, out_shape,
                 in_specs, out_specs, interpret, target, "kda_chunk_fwd", sc is not None,
                 bounded)(*args)


def kda_chunk_bwd(q, k, v, g, beta, states, do, dsf, sc=None, *, chunk, block_v, interpret,
                  target, launch, bounded=True):
  """Backward kernel: cotangents do [BH, Tp, V], dsf [BH, K, V] -> (dq, dk, dv, dg, dbeta, ds0)
  shaped like (q, k, v, g, beta, s0); chunks are visited last to first. dq, dk, dg, dbeta are
  sums of per-V-block partials. sc as for `kda_chunk_fwd`."""
  bh, tp, dk = q.shape
  dv = v.shape[-1]
  nv, lay = dv // block_v, _Layout(launch, tp, chunk, reverse=True)
  f32 = jnp.float32
  part = lambda x: jax.ShapeDtypeStruct((bh, nv) + x.shape[1:], f32 if nv > 1 else x.dtype)
  out_shape = (part(q), part(k), jax.ShapeDtypeStruct(v.shape, v.dtype), part(g), part(beta),
               jax.ShapeDtypeStruct((bh, dk, dv), f32))
  in_specs = [lay.tokens(dk), lay.tokens(dk), lay.tokens(block_v, True), lay.tokens(dk),
              lay.tokens(1), lay.states(dk, block_v), lay.tokens(block_v, True),
              lay.state(dk, block_v)]
  out_specs = (lay.partial_tokens(dk), lay.partial_tokens(dk), lay.tokens(block_v, True),
               lay.partial_tokens(dk), lay.partial_tokens(1), lay.state(dk, block_v))
  args = (q, k, v, g, beta, states, do, dsf) + (() if sc is None else (sc,))
  in_specs += [] if sc is None else [lay.tokens(1)]
  dq, dk_, dv_, dg, db, ds0 = _launch(
      _bwd_grid_kernel, _bwd_loop_kernel, lay, bh, nv, block_v, dk, out_shape, in_specs,
      out_specs, interpret, target, "kda_chunk_bwd", sc is not None, bounded)(*args)
  total = lambda x, like: jnp.sum(x, axis=1).astype(like.dtype)
  return total(dq, q), total(dk_, k), dv_, total(dg, g), total(db, beta), ds0


# ------------------------------------------------------------------------- custom_vjp core
_STATIC = (7, 8, 9, 10, 11, 12)   # chunk, block_v, interpret, target, launch, bounded


@functools.partial(jax.custom_vjp, nondiff_argnums=_STATIC)
def _kda_core(q, k, v, g, beta, s0, sc, chunk, block_v, interpret, target, launch, bounded):
  o, _, sf = kda_chunk_fwd(q, k, v, g, beta, s0, sc, chunk=chunk, block_v=block_v,
                           interpret=interpret, target=target, launch=launch, bounded=bounded)
  return o, sf


def _kda_core_fwd(q, k, v, g, beta, s0, sc, chunk, block_v, interpret, target, launch, bounded):
  o, states, sf = kda_chunk_fwd(q, k, v, g, beta, s0, sc, chunk=chunk, block_v=block_v,
                                interpret=interpret, target=target, launch=launch,
                                bounded=bounded)
  return (o, sf), (q, k, v, g, beta, states, sc)


def _kda_core_bwd(chunk, block_v, interpret, target, launch, bounded, res, cts):
  q, k, v, g, beta, states, sc = res
  do, dsf = cts
  grads = kda_chunk_bwd(q, k, v, g, beta, states, do.astype(q.dtype), dsf.astype(jnp.float32),
                        sc, chunk=chunk, block_v=block_v, interpret=interpret, target=target,
                        launch=launch, bounded=bounded)
  return grads + (None if sc is None else jnp.zeros_like(sc),)   # segment numbers: constants


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
    to prepare for (export tests set it); on "gpu" chunk_size is capped at GPU_MAX_CHUNK (16 for
    fp32, 32 for bf16 inputs; 16 for an unbounded gate) so the Triton kernels fit in shared
    memory. launch: "grid" | "loop" (default: loop on GPU, grid
    otherwise); both give identical results. block_v: V columns per program (default V; 64
    on GPU when V > 64): a power of 2 dividing V.
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
    block_v = min(dv, 64) if target == "gpu" else dv
  if dv % block_v or block_v & (block_v - 1):
    raise ValueError(f"kda_chunked_pallas: block_v must be a power of 2 dividing V={dv}, found "
                     f"{block_v}")
  if target == "gpu":   # shared memory of the Triton kernels (module docstring)
    cap = (GPU_MAX_CHUNK.get(jnp.dtype(q.dtype).itemsize, 16) if bounded
           else GPU_MAX_CHUNK_UNBOUNDED)
    chunk_size = min(chunk_size, cap)
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
