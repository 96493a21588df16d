"""Kimi Delta Attention (KDA): gate, recurrent reference, chunked (XLA) form, one decode step.

Facts: docs/k3.md §3. Per head, with state S ∈ R^{K×V} and per-channel log-decay g_t ∈ R^K:

    S ← Diag(exp(g_t)) S                      (decay)
    S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ            (delta-rule write, with the decayed S)
    o_t = Sᵀ (scale · q_t)                     (read after the update)

Layouts: q, k, g `[B,T,H,K]`; v `[B,T,H,V]`; beta `[B,T,H]`; state `[B,H,K,V]` (fp32).
The decay parameter A_log enters through `kda_gate` alone: per head `[H]` or per key channel
`[K]` (`a_log_axis`, the two readings of the release's A_log), the ops below see only g.
`scale` defaults to K^-0.5 and multiplies q; nothing is normalised here (callers L2-normalise
q and k). g is a log-decay: it is expected to be ≤ 0 (what `kda_gate` returns).

Document packing (`segment_ids` `[B,T]` int): where `segment_ids[:, t] != segment_ids[:, t-1]`
the state is reset to zero before token t is processed, so tokens never see other documents.
`initial_state` applies to the first segment only. The final state is that of the last segment.
The isolation is bitwise: a document's outputs and the gradients of its inputs do not depend,
not even by rounding, on what the other documents hold. The recurrence resets with a `where`;
the chunked form restarts its in-tile cumulative gate sums at segment starts and takes each
segment's own reference point (below), so another document's values enter a document's
arithmetic only as exact zeros of the masks; packed inputs without a promised `lower_bound`
always take the pairwise diagonal form (a `lax.cond` on all gates would let one document pick
another's arithmetic).

Dtypes: every computation runs in fp32 (decays, states, matmuls); `o` is returned in q's dtype
(so bf16 in, bf16 out) and the final state is always fp32.

Chunked form (`kda_chunked`), per chunk of C tokens with start state S0 and inclusive
within-chunk cumulative log-decay G_t = Σ_{s≤t} g_s (Γ_t = exp(G_t)):

    A[t,i] = β_t Σ_c k_t[c] k_i[c] exp(G_t[c] − G_i[c])      i < t
    P[t,i] =     Σ_c q̃_t[c] k_i[c] exp(G_t[c] − G_i[c])      i ≤ t
    (I + A) [W_v | W_k] = [β⊙V | β⊙Γ⊙K]                       (the WY/UT transform)
    U   = W_v − W_k S0                                         (the deltas u_t of all tokens)
    O   = (Γ⊙Q̃) S0 + P U
    S_C = Diag(Γ_C) S0 + (exp(G_C − G)⊙K)ᵀ U

Decay factors (every exp is bounded; nothing can overflow, for bounded *and* unbounded decay):
  * off-diagonal tiles (row tile a after column tile b): the rescale is done relative to tile
    a's own reference point (the position just before tile a): the row factor is
    exp(Σ_{start(a)≤s≤t} g_s) ≤ 1 and the column factor exp(Σ_{i<s<start(a)} g_s) ≤ 1 (both
    direct sums of g, so no cancellation), and their product is exp(G_t − G_i); these tiles are
    plain dense matmuls;
  * diagonal 16-token tiles, fast form (used when both 8-token halves of every tile have
    Σg ≥ _FAST_MIN_TILE_DECAY = −40 per channel — always true for a gate bounded below by −5,
    K3's): the reference point of row tile a moves to the middle of the tile (after its 8th
    token), so row factors exp(G_t − G_ref) and the diagonal tile's column factors
    exp(G_ref − G_i) are ≤ e^{40} (products for t ≥ i stay ≤ 1), off-diagonal column factors
    ≤ 1; the diagonal tile is part of the same matmul;
  * diagonal tiles, pairwise form (otherwise, e.g. Kimi Linear's unbounded softplus decay):
    exp(G_t − G_i) formed pairwise, for t ≥ i only (masked), from the tile-local prefix sums,
    then contracted over channels (`_diag_scores`, hand-written backward); no exponent > 0;
  * Γ_t = exp(G_t) and exp(G_C − G_i) are direct sums, ≤ 1.
  * packed rows: the in-tile prefix sums run over the token's own segment only (restarting at
    its start), and the fast form's reference point is per segment — token j's is its own
    segment's gate sum over tile a's first half (0 if the segment is not there) — so a pair
    (t, i) of one segment shares it, and the bounds above hold for every pair.
The choice is static when the caller promises `lower_bound` ≥ −5 (the layers pass the
config's bound) or when the rows are packed (pairwise), otherwise one `lax.cond` on the inputs
around the whole computation (both forms are compiled). A scan step handles `_GROUP_TOKENS`
tokens: the state-independent work of its chunks is vectorised (`_intra`, with the UT transform as an explicit matrix T, `_ut_matrix`), then an
inner scan passes the state through them (`_state_pass`: only U and the state recurrence are
sequential, the outputs and most of the backward are batched matmuls); the step is
rematerialised in the backward pass.
Gradients are hand-written where autodiff's were slow on XLA:CPU: the UT matrix, the state
pass and the pairwise diagonal tiles (β's and Γ_C's gradients are row sums that autodiff
emits as a multiply-and-reduce, which XLA:CPU's YNNPACK fusion ran ~30x slower than a dot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

_TILE = 16  # tile size of the overflow-safe decay rescale (docs/k3.md §3)
_GROUP_TOKENS = 1024  # tokens per scan step of kda_chunked (chunks of a step are vectorised)
# Diagonal tiles use dense matmuls (mid-tile reference point, largest factor e^{-half total})
# when both halves of every 16-token tile have Σg ≥ this per channel; otherwise the pairwise
# form (`_diag_scores`), which never exponentiates a positive number. Factors up to e^{80}
# would be overflow-safe, but then the gradient w.r.t. g lost ~5% (cancellation between
# e^{±80}-scaled terms); at e^{40} it matches the pairwise form (tests/ops/test_kda.py).
_FAST_MIN_TILE_DECAY = -40.0


# ----------------------------------------------------------------------------- validation


def _fmt(shape) -> str:
  return "[" + ",".join(str(int(s)) for s in shape) + "]"


def _check_float(fn: str, name: str, x) -> None:
  if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
    raise ValueError(f"{fn}: {name} must have a floating dtype, found {jnp.asarray(x).dtype}")


def _check_shape(fn: str, name: str, x, spec: str, expected, like: str = "") -> None:
  """Raises ValueError unless `x.shape == expected`; `spec` names the axes, e.g. "[B,T,H,K]"."""
  shape = tuple(jnp.shape(x))
  if shape != tuple(expected):
    suffix = f" like {like}" if like else ""
    raise ValueError(
        f"{fn}: {name} must be {spec}={_fmt(expected)}{suffix}, found {_fmt(shape)}")


def _validate_sequence_inputs(fn, q, k, v, g, beta, initial_state, segment_ids):
  """Checks the [B,T,H,*] inputs of the sequence ops; returns (B, T, H, K, V)."""
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
    _check_float(fn, name, x)
  if jnp.ndim(q) != 4:
    raise ValueError(f"{fn}: q must be rank 4 [B,T,H,K], found shape {_fmt(jnp.shape(q))}")
  b, t, h, dk = q.shape
  _check_shape(fn, "k", k, "[B,T,H,K]", (b, t, h, dk), like="q")
  _check_shape(fn, "g", g, "[B,T,H,K]", (b, t, h, dk), like="q")
  if jnp.ndim(v) != 4 or tuple(v.shape[:3]) != (b, t, h):
    raise ValueError(
        f"{fn}: v must be [B,T,H,V] with [B,T,H]={_fmt((b, t, h))} like q, found "
        f"{_fmt(jnp.shape(v))}")
  dv = v.shape[3]
  _check_shape(fn, "beta", beta, "[B,T,H]", (b, t, h), like="q")
  if initial_state is not None:
    _check_float(fn, "initial_state", initial_state)
    _check_shape(fn, "initial_state", initial_state, "[B,H,K,V]", (b, h, dk, dv))
  if segment_ids is not None:
    _check_shape(fn, "segment_ids", segment_ids, "[B,T]", (b, t))
    if not jnp.issubdtype(jnp.asarray(segment_ids).dtype, jnp.integer):
      raise ValueError(
          f"{fn}: segment_ids must have an integer dtype, found {jnp.asarray(segment_ids).dtype}")
  if t == 0:
    raise ValueError(f"{fn}: q must have at least one token (T >= 1), found T=0")
  return b, t, h, dk, dv


def _default_scale(scale, dk):
  return dk ** -0.5 if scale is None else scale


# ----------------------------------------------------------------------------- gate


A_LOG_AXES = ("head", "channel")


def kda_gate(z, A_log, dt_bias, lower_bound: float | None = None, a_log_axis: str = "head"):
  """Per-channel log-decay g (fp32) from the decay logits z.

  Args:
    z: `[B,T,H,K]` decay logits (f_b(f_a(x))).
    A_log: the log rate: `[H]`, one per head (a_log_axis "head", the spec's form), or `[K]`,
      one per key channel shared by the heads ("channel"; `ModelConfig.text.kda_a_log_axis`).
    dt_bias: `[H,K]` per-channel bias.
    lower_bound: K3's bounded form when set (−5.0): `lower_bound·sigmoid(exp(A_log)·(z+dt_bias))`
      ∈ (lower_bound, 0); None gives Kimi Linear's `−exp(A_log)·softplus(z+dt_bias)`.
    a_log_axis: "head" | "channel", the axis A_log runs along (explicit: with H == K its
      shape alone could not tell).

  Returns:
    g `[B,T,H,K]` float32, ≤ 0. Everything downstream (the chunked and recurrent ops, the
    Pallas kernel, the decode step) consumes g only, so both readings of A_log run through them
    unchanged.
  """
  fn = "kda_gate"
  for name, x in (("z", z), ("A_log", A_log), ("dt_bias", dt_bias)):
    _check_float(fn, name, x)
  if jnp.ndim(z) != 4:
    raise ValueError(f"{fn}: z must be rank 4 [B,T,H,K], found shape {_fmt(jnp.shape(z))}")
  _, _, h, dk = z.shape
  if a_log_axis not in A_LOG_AXES:
    raise ValueError(f"{fn}: a_log_axis must be one of {A_LOG_AXES}, found {a_log_axis!r}")
  if a_log_axis == "head":
    _check_shape(fn, "A_log", A_log, "[H]", (h,))
  else:
    _check_shape(fn, "A_log", A_log, "[K]", (dk,))
  _check_shape(fn, "dt_bias", dt_bias, "[H,K]", (h, dk))
  if lower_bound is not None and not lower_bound < 0:
    raise ValueError(f"{fn}: lower_bound must be negative (e.g. -5.0) or None, found {lower_bound}")
  x = z.astype(jnp.float32) + dt_bias.astype(jnp.float32)
  rate = jnp.exp(A_log.astype(jnp.float32))
  # [H,1]: one rate per head, broadcast over its channels; [1,K]: one per channel, over heads.
  rate = rate[:, None] if a_log_axis == "head" else rate[None, :]
  if lower_bound is None:
    return -rate * jax.nn.softplus(x)
  return lower_bound * jax.nn.sigmoid(rate * x)


# ----------------------------------------------------------------------------- one step


def _step(state, q, k, v, g, beta):
  """One recurrence step on fp32 arrays. q,k,g [B,H,K] (q already scaled), v [B,H,V], beta [B,H]."""
  state = state * jnp.exp(g)[..., None]
  kv = jnp.einsum("bhk,bhkv->bhv", k, state)
  delta = beta[..., None] * (v - kv)
  state = state + k[..., :, None] * delta[..., None, :]
  o = jnp.einsum("bhk,bhkv->bhv", q, state)
  return state, o


def kda_step(q, k, v, g, beta, state, *, scale=None):
  """One decode token.

  Args:
    q, k, g: `[B,H,K]`; v: `[B,H,V]`; beta: `[B,H]`; state: `[B,H,K,V]`.
    scale: multiplies q; default K^-0.5.

  Returns:
    (o `[B,H,V]` in q's dtype, new_state `[B,H,K,V]` float32).
  """
  fn = "kda_step"
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
    _check_float(fn, name, x)
  if jnp.ndim(q) != 3:
    raise ValueError(f"{fn}: q must be rank 3 [B,H,K], found shape {_fmt(jnp.shape(q))}")
  b, h, dk = q.shape
  _check_shape(fn, "k", k, "[B,H,K]", (b, h, dk), like="q")
  _check_shape(fn, "g", g, "[B,H,K]", (b, h, dk), like="q")
  if jnp.ndim(v) != 3 or tuple(v.shape[:2]) != (b, h):
    raise ValueError(
        f"{fn}: v must be [B,H,V] with [B,H]={_fmt((b, h))} like q, found {_fmt(jnp.shape(v))}")
  _check_shape(fn, "beta", beta, "[B,H]", (b, h), like="q")
  _check_shape(fn, "state", state, "[B,H,K,V]", (b, h, dk, v.shape[2]))
  f32 = lambda x: x.astype(jnp.float32)
  new_state, o = _step(
      f32(state), f32(q) * _default_scale(scale, dk), f32(k), f32(v), f32(g), f32(beta))
  return o.astype(q.dtype), new_state


# ----------------------------------------------------------------------------- recurrent


def kda_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None):
  """The obviously-correct reference: a `lax.scan` over time of `kda_step`'s update.

  Args:
    q, k, g: `[B,T,H,K]`; v: `[B,T,H,V]`; beta: `[B,T,H]`.
    scale: multiplies q; default K^-0.5.
    initial_state: `[B,H,K,V]` or None (zeros).
    segment_ids: `[B,T]` int or None; the state resets to zero where the id changes.

  Returns:
    (o `[B,T,H,V]` in q's dtype, final_state `[B,H,K,V]` float32).
  """
  b, t, h, dk, dv = _validate_sequence_inputs(
      "kda_recurrent", q, k, v, g, beta, initial_state, segment_ids)
  scale = _default_scale(scale, dk)
  time_major = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)
  xs = (time_major(q) * scale, time_major(k), time_major(v), time_major(g), time_major(beta))
  if segment_ids is None:
    reset = jnp.zeros((t, b), bool)
  else:
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    reset = jnp.moveaxis(jnp.pad(changed, ((0, 0), (1, 0))), 1, 0)  # no reset before token 0
  state0 = (jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None
            else initial_state.astype(jnp.float32))

  def body(state, x):
    reset_t, (q_t, k_t, v_t, g_t, beta_t) = x
    state = jnp.where(reset_t[:, None, None, None], 0.0, state)
    return _step(state, q_t, k_t, v_t, g_t, beta_t)

  final_state, o = lax.scan(body, state0, (reset, xs))
  return jnp.moveaxis(o, 0, 1).astype(q.dtype), final_state


# ----------------------------------------------------------------------------- chunked


def _tile_masks(num_tiles: int):
  """Constant tile-level masks of the chunk's decay computation."""
  a_idx = jnp.arange(num_tiles)
  return dict(
      # [a, b, c]: b < c < a (tiles strictly between b and a)
      between=((a_idx[None, None, :] > a_idx[None, :, None])
               & (a_idx[None, None, :] < a_idx[:, None, None])).astype(jnp.float32),
      # [b, c]: c > b (tiles after b)
      later=(a_idx[None, :] > a_idx[:, None]).astype(jnp.float32),
  )


def _unit_lower_inverse(n):
  """(I + n)^-1 for strictly lower-triangular n [..., m, m] (exact in exact arithmetic):
  n is nilpotent (n^m = 0), so (I + n)^-1 = Σ_j (−n)^j = (I − n)(I + n²)(I + n⁴)··· —
  ⌈log2 m⌉ factors, 2 small batched matmuls each (XLA:CPU ran the m−1 sequential
  forward-substitution steps, each a small update-slice, slower)."""
  m = n.shape[-1]
  eye = jnp.eye(m, dtype=n.dtype)
  mm = lambda a, b: jnp.einsum("...ij,...jk->...ik", a, b)
  x = eye - n
  power = n
  span = 2
  while span < m:
    power = mm(power, power)                                      # n^(2^i)
    x = mm(x, eye + power)
    span *= 2
  return x


def _intra(q, k, v, g, beta, packed_masks, *, tile: int, fast: bool):
  """Everything of a chunk that does not depend on its start state, for many chunks at once.

  q (scaled), k, g `[...,C,K]`, v `[...,C,V]`, beta `[...,C]` fp32 (leading dims e.g. [B,H,G]).
  fast: True when both halves of every tile have Σg (per channel) ≥ _FAST_MIN_TILE_DECAY: the
  diagonal tiles are then dense matmuls too, relative to a mid-tile reference point; False:
  pairwise diagonal tiles (`_diag_scores`).
  packed_masks: None or (same [...,C,C], m [...,C,1], f [...,C,1]) (see `_group`).
  Returns a dict: w_v [...,C,V], w_k [...,C,K] (U = w_v − w_k S0), q_gamma [...,C,K],
  p_mat [...,C,C] (O = q_gamma S0 + p_mat U), k_last [...,C,K] and decay [...,K]
  (S_C = decay ⊙ S0 + k_lastᵀ U).
  """
  *lead, c, dk = k.shape
  nt = c // tile
  half = max(tile // 2, 1)
  mk = _tile_masks(nt)
  tiles = lambda x: x.reshape(*x.shape[:-2], nt, tile, x.shape[-1])
  qt, kt, gt = tiles(q), tiles(k), tiles(g)                        # [...,nt,ts,K]
  same = None if packed_masks is None else packed_masks[0]

  # Direct sums of g (all ≤ 0, so no cancellation and every exp ≤ 1). Packed, the in-tile
  # prefix sums restart where a segment starts: a token's sums then hold only its own
  # document's gates, so no other document's values enter its arithmetic (bitwise isolation).
  if same is None:
    pre = jnp.cumsum(gt, axis=-2)                                  # Σ_{start(a)≤s≤t}
  else:
    same_tiles = _diag_blocks(same.reshape(*same.shape[:-2], nt, tile, nt, tile))  # [...,a,t,s]
    pre = _masked_tile_sums(same_tiles * jnp.tri(tile, dtype=same.dtype), gt)  # Σ_{…, seg(s)=seg(t)}
  # Tile totals [...,nt,K] (packed: the tile's last segment's; they enter only pairs whose
  # segment covers whole tiles, where the two agree).
  tot = pre[..., -1, :]
  suf = jnp.concatenate(                                           # Σ_{i<s≤end(b)}
      [lax.cumsum(gt, axis=gt.ndim - 2, reverse=True)[..., 1:, :],
       jnp.zeros_like(gt[..., :1, :])], -2)
  offset = jnp.concatenate(                                        # Σ over tiles before a
      [jnp.zeros_like(tot[..., :1, :]), jnp.cumsum(tot, axis=-2)[..., :-1, :]], -2)
  between = jnp.einsum("abc,...ck->...abk", mk["between"], tot)    # Σ over tiles b<·<a
  later = jnp.einsum("bc,...ck->...bk", mk["later"], tot)          # Σ over tiles after b
  gamma = jnp.exp(offset[..., None, :] + pre)                      # Γ_t = exp(G_t)
  k_last = kt * jnp.exp(suf + later[..., None, :])                 # k_i·exp(G_C − G_i)
  decay = jnp.exp(jnp.sum(g, axis=-2))                             # Γ_C [...,K]

  # Scores A (k·k) and P (q·k), one row tile a at a time (only its columns i < end(a) are
  # computed), relative to a reference point in tile a: row factor exp(G_t − G_ref) times
  # column factor exp(G_ref − G_i). Column tiles b < a: exp(G_ref − G_i) = exp(suf_i +
  # between_ab + ref_a) ≤ 1 (a direct sum of g). Fast form: the reference point is tile a's
  # middle, ref_a = Σ over its first half (≥ −40): row factors ≤ e^{40} and the diagonal tile
  # is part of the same matmul (column factors ≤ e^{40}); otherwise the reference point is
  # the tile start (ref_a = 0, row factors ≤ 1) and the diagonal tile is pairwise.
  # (A loop over the nt row tiles: the equivalent [a, b, i, K] broadcast product made the
  # backward pass ~10x slower on XLA:CPU, its reductions running over non-minor axes.)
  # Packed (fast form), the reference point is per segment: row t's is the sum of its own
  # segment's gates over tile a's first half, ref[a, t] (0 when its segment is not there), so
  # a pair in one segment shares it and no other segment's gates enter either factor.
  # Columns of earlier tiles pair with tile a's rows only when their segment reaches tile a,
  # i.e. is the segment of tile a's first token: they take that token's reference point (the
  # others' pairs are masked; any finite factor ≤ 1 serves them).
  if fast and same is not None:
    ref = _masked_tile_sums(same_tiles * (jnp.arange(tile) < half), gt)  # [...,a,ts,K]
    ref_rows = lambda a: ref[..., a, :, :]                         # [...,ts,K]
    ref_cols = lambda a: ref[..., a, None, :1, :]                  # [...,1,1,K]
  else:
    ref = pre[..., half - 1, :] if fast else jnp.zeros_like(tot)   # [...,a,K]
    ref_rows = lambda a: ref[..., a, None, :]                      # [...,1,K]
    ref_cols = lambda a: ref[..., a, None, None, :]                # [...,1,1,K]
  if not fast:
    a_diag, p_diag = _diag_scores(pre, kt, qt)                     # [...,a,ts,ts] each
  a_rows, p_rows = [], []
  for a in range(nt):
    ref_a = ref_rows(a)
    row = jnp.exp(pre[..., a, :, :] - ref_a)
    cols = []
    if a:
      colfac = jnp.exp(suf[..., :a, :, :] + jnp.minimum(between[..., a, :a, :], 0.0)[..., None, :]
                       + ref_cols(a))
      cols.append((kt[..., :a, :, :] * colfac).reshape(*lead, a * tile, dk))
    if fast:
      cols.append(kt[..., a, :, :] * jnp.exp(ref_a - pre[..., a, :, :]))
    cols = jnp.concatenate(cols, axis=-2) if cols else None        # [...,i,K], i < end(a)
    for out, x, diag in ((a_rows, kt, None if fast else a_diag),
                         (p_rows, qt, None if fast else p_diag)):
      parts_a = []
      if cols is not None:
        parts_a.append(jnp.einsum("...tk,...ik->...ti", x[..., a, :, :] * row, cols))
      if diag is not None:
        parts_a.append(diag[..., a, :, :])
      s_a = jnp.concatenate(parts_a, axis=-1) if len(parts_a) > 1 else parts_a[0]
      out.append(jnp.pad(s_a, [(0, 0)] * (s_a.ndim - 1) + [(0, c - (a + 1) * tile)]))
  a_mat = jnp.where(jnp.tri(c, k=-1, dtype=bool), jnp.concatenate(a_rows, axis=-2), 0.0)
  p_mat = jnp.where(jnp.tri(c, dtype=bool), jnp.concatenate(p_rows, axis=-2), 0.0)

  gamma = gamma.reshape(*lead, c, dk)
  k_last = k_last.reshape(*lead, c, dk)
  k_gamma = k * gamma
  q_gamma = q * gamma
  if packed_masks is not None:
    _, m, f = packed_masks
    a_mat = a_mat * same
    p_mat = p_mat * same
    k_gamma = k_gamma * m
    q_gamma = q_gamma * m
    k_last = k_last * f
    decay = decay * m[..., -1, :]

  # WY/UT transform: (I + diag(β) A) [W_v | W_k] = β ⊙ [V | Γ⊙K], A strictly lower, as
  # T = (I + diag(β) A)^-1 diag(β) times each right-hand side (two dense matmuls).
  t_mat = _ut_matrix(a_mat, beta, tile)
  return dict(w_v=jnp.einsum("...ti,...iv->...tv", t_mat, v),
              w_k=jnp.einsum("...ti,...ik->...tk", t_mat, k_gamma),
              q_gamma=q_gamma, p_mat=p_mat, k_last=k_last, decay=decay)



def _masked_tile_sums(mask, gt):
  """Σ_s mask[..., a, t, s] · gt[..., a, s, :] → [...,a,ts,K]: per-token sums of g over a 0/1
  set of its tile's tokens. Tokens outside the set enter only as exact zeros (bitwise
  isolation of packed documents); HIGHEST keeps the fp32 gates fp32 on TPU."""
  return jnp.einsum("...ats,...ask->...atk", mask, gt, precision=lax.Precision.HIGHEST)


def _diag_decay(pre):
  """exp(pre_t − pre_j) for t ≥ j, else 0: [...,a,t,j,K] from tile-local prefix sums [...,a,t,K].

  A difference of the tile-local prefix sums (|pre| ≤ 16·max|g|, so its rounding is ~1e-5
  relative for bounded decay; a cumsum per pair would be exact but is ~20x slower on XLA:CPU).
  min(·, 0) keeps the masked (t < j) entries finite.
  """
  tile = pre.shape[-2]
  incl = jnp.arange(tile)[:, None] >= jnp.arange(tile)[None, :]   # [t, j]
  diff = pre[..., :, None, :] - pre[..., None, :, :]
  return jnp.exp(jnp.minimum(diff, 0.0)) * incl[:, :, None].astype(pre.dtype)


@jax.custom_vjp
def _diag_scores(pre, kt, qt):
  """Diagonal-tile scores: A[t,j] = Σ_c k_t k_j e^{G_t−G_j} (t > j), P[t,j] = Σ_c q_t k_j e^{…}
  (t ≥ j). pre, kt, qt [...,a,ts,K] → two [...,a,ts,ts].

  Hand-written backward: every reduction is written as a dot (XLA:CPU runs the fused
  broadcast-multiply-reduce that autodiff produces here 10-50x slower).
  """
  return _diag_scores_fwd(pre, kt, qt)[0]


def _diag_scores_fwd(pre, kt, qt):
  kp = _diag_decay(pre) * kt[..., None, :, :]                      # k_j·e^{G_t−G_j} [..,t,j,K]
  strict = jnp.tri(pre.shape[-2], k=-1, dtype=pre.dtype)           # [t, j]: t > j
  a = jnp.einsum("...tjk,...tk->...tj", kp, kt) * strict
  p = jnp.einsum("...tjk,...tk->...tj", kp, qt)
  return (a, p), (pre, kt, qt)


def _diag_scores_bwd(res, cts):
  pre, kt, qt = res
  da, dp = cts
  da = da * jnp.tri(pre.shape[-2], k=-1, dtype=pre.dtype)
  e = _diag_decay(pre)
  kp = e * kt[..., None, :, :]
  d_row = (jnp.einsum("...tj,...tjk->...tk", da, kp),             # dk (row side), dq
           jnp.einsum("...tj,...tjk->...tk", dp, kp))
  dkp = da[..., None] * kt[..., :, None, :] + dp[..., None] * qt[..., :, None, :]
  w = dkp * e
  ones = jnp.ones((pre.shape[-2],), pre.dtype)
  dk_col = jnp.einsum("...tjk,t->...jk", w, ones)                  # Σ_t
  dd = w * kt[..., None, :, :]                                     # d(G_t − G_j)
  dpre = jnp.einsum("...tjk,j->...tk", dd, ones) - jnp.einsum("...tjk,t->...jk", dd, ones)
  return dpre, d_row[0] + dk_col, d_row[1]


_diag_scores.defvjp(_diag_scores_fwd, _diag_scores_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ut_matrix(a_mat, beta, tile: int):
  """The UT transform's matrix T = (I + N)^-1 diag(β), N = diag(β) A, for strictly
  lower-triangular A `[...,C,C]` and beta `[...,C]` (then W = T x for a right-hand side x).

  The inverse by block forward substitution over `tile`-row tiles (diagonal blocks inverted
  by `_unit_lower_inverse`): row tile a of inv = (I + N)^-1 is −inv_aa N[a, :a] inv[:a, :a]
  next to inv_aa. Hand-written backward: dN = −(I + N)^-T dT (I + N)^-T on the strictly lower triangle;
  β's gradients (row and column scalings) as einsums — the multiply-and-reduce that autodiff
  makes of a broadcast β ran ~30x slower on XLA:CPU (its YNNPACK reduce fusion).
  """
  return _ut_matrix_fwd(a_mat, beta, tile)[0]


def _ut_matrix_fwd(a_mat, beta, tile):
  c = a_mat.shape[-1]
  nt = c // tile
  n_mat = beta[..., None] * a_mat
  inv_diag = _unit_lower_inverse(_diag_blocks(
      n_mat.reshape(*n_mat.shape[:-2], nt, tile, nt, tile)))       # [...,nt,ts,ts]
  inv = inv_diag[..., 0, :, :]                                     # (I + N)^-1, first a tiles
  for a in range(1, nt):
    inv_aa = inv_diag[..., a, :, :]
    n_row = n_mat[..., a * tile:(a + 1) * tile, :a * tile]
    row = -jnp.einsum("...ts,...si->...ti", inv_aa, jnp.einsum("...tj,...ji->...ti", n_row, inv))
    inv = jnp.concatenate([
        jnp.pad(inv, [(0, 0)] * (inv.ndim - 1) + [(0, tile)]),
        jnp.concatenate([row, inv_aa], axis=-1)], axis=-2)
  return inv * beta[..., None, :], (a_mat, beta, inv)


def _ut_matrix_bwd(tile, res, dt):
  a_mat, beta, inv = res
  c = a_mat.shape[-1]
  d_beta = jnp.einsum("...ti,...ti->...i", dt, inv)                # column scaling diag(β)
  dt = dt * beta[..., None, :]
  d_n = -jnp.einsum("...jt,...ji->...ti", inv, jnp.einsum("...jk,...ik->...ji", dt, inv))
  d_n = jnp.where(jnp.tri(c, k=-1, dtype=bool), d_n, 0.0)          # −invᵀ dT invᵀ
  d_beta = d_beta + jnp.einsum("...ti,...ti->...t", d_n, a_mat)    # row scaling of N
  return beta[..., None] * d_n, d_beta


_ut_matrix.defvjp(_ut_matrix_fwd, _ut_matrix_bwd)


def _diag_blocks(n_tiles):
  """[..., nt, ts, nt, ts] -> the nt diagonal blocks [..., nt, ts, ts]."""
  nt = n_tiles.shape[-2]
  return jnp.stack([n_tiles[..., a, :, a, :] for a in range(nt)], axis=-3)


@jax.custom_vjp
def _state_pass(state, w_v, w_k, q_gamma, p_mat, k_last, decay):
  """The state passing through G chunks, chunk axis first: per-chunk tensors `[G,...,C,·]`
  (`_intra`'s outputs), decay `[G,...,K]`, state `[...,K,V]` fp32.

  Only the recurrence is sequential (a scan over the chunks): U_n = W_v − W_k S_n,
  S_{n+1} = Γ_C ⊙ S_n + k_lastᵀ U_n. The reads O_n = (Γ⊙Q̃) S_n + P U_n of all chunks are then
  batched matmuls. The hand-written backward runs the reverse recurrence
  (dU_n = Pᵀ dO_n + k_last dS_{n+1}, dS_n = Γ_C ⊙ dS_{n+1} + (Γ⊙Q̃)ᵀ dO_n − W_kᵀ dU_n) and, in the
  same reverse scan, the two gradients that need dS_{n+1} (d k_last, d Γ_C; cheaper than
  stacking every dS_{n+1}); the others are batched matmuls before / after it. (Autodiff through
  the scan took Γ_C's gradient as a multiply-and-reduce that XLA:CPU runs many times slower
  than the equivalent dot.)
  Returns (final state, O `[G,...,C,V]`). Without differentiation the reads stay inside the
  scan (nothing per chunk is stored; faster for the forward alone).
  """
  def step(s, x):
    w_v, w_k, q_gamma, p_mat, k_last, decay = x
    new_s, u = _chunk_recurrence(s, w_v, w_k, k_last, decay)
    return new_s, _chunk_read(q_gamma, p_mat, s, u)

  return lax.scan(step, state, (w_v, w_k, q_gamma, p_mat, k_last, decay))


def _chunk_recurrence(s, w_v, w_k, k_last, decay):
  """One chunk: its deltas U = W_v − W_k S and the next state Γ_C ⊙ S + k_lastᵀ U."""
  u = w_v - jnp.einsum("...ck,...kv->...cv", w_k, s)
  return decay[..., None] * s + jnp.einsum("...ck,...cv->...kv", k_last, u), u


def _chunk_read(q_gamma, p_mat, s, u):
  """A chunk's outputs O = (Γ⊙Q̃) S + P U."""
  return jnp.einsum("...ck,...kv->...cv", q_gamma, s) + jnp.einsum("...ci,...iv->...cv", p_mat, u)


def _state_pass_fwd(state, w_v, w_k, q_gamma, p_mat, k_last, decay):
  def step(s, x):
    new_s, u = _chunk_recurrence(s, *x)
    return new_s, (s, u)

  final, (starts, u) = lax.scan(step, state, (w_v, w_k, k_last, decay))
  return ((final, _chunk_read(q_gamma, p_mat, starts, u)),
          (w_k, q_gamma, p_mat, k_last, decay, starts, u))


def _state_pass_bwd(res, cts):
  w_k, q_gamma, p_mat, k_last, decay, starts, u = res
  d_final, do = cts
  pt_do = jnp.einsum("...ci,...cv->...iv", p_mat, do)              # Pᵀ dO  [G,...,C,V]
  qt_do = jnp.einsum("...ck,...cv->...kv", q_gamma, do)            # (Γ⊙Q̃)ᵀ dO [G,...,K,V]

  def step(ds_next, x):                                            # reverse: dS_{n+1} -> dS_n
    pt_do, qt_do, w_k, k_last, decay, u_n, s_n = x
    du = pt_do + jnp.einsum("...ck,...kv->...cv", k_last, ds_next)
    ds = decay[..., None] * ds_next + qt_do - jnp.einsum("...ck,...cv->...kv", w_k, du)
    # d k_last and d Γ_C need dS_{n+1}: taken here rather than stacking every dS_{n+1}
    # (a [G,...,K,V] buffer) for batched matmuls after the scan.
    return ds, (du, jnp.einsum("...cv,...kv->...ck", u_n, ds_next),
                jnp.einsum("...kv,...kv->...k", ds_next, s_n))

  d_state, (du, d_k_last, d_decay) = lax.scan(
      step, d_final, (pt_do, qt_do, w_k, k_last, decay, u, starts), reverse=True)
  return (d_state, du,
          -jnp.einsum("...cv,...kv->...ck", du, starts),           # d W_k
          jnp.einsum("...cv,...kv->...ck", do, starts),            # d (Γ⊙Q̃)
          jnp.einsum("...cv,...iv->...ci", do, u),                 # d P
          d_k_last, d_decay)


_state_pass.defvjp(_state_pass_fwd, _state_pass_bwd)


def _group(state, xs, *, tile: int, packed: bool, fast: bool, scale):
  """One scan step: G chunks. xs = (q, k, v, g, beta[, same, m, f]) fp32 in the token-major
  layout [B,G,C,H,·] (beta [B,G,C,H]; masks [G,B,1,…]: `same` token pairs in one segment, `m`
  tokens in the segment carried in from the previous chunk, `f` tokens in the chunk's last
  segment). The chunk- and head-major copies [G,B,H,C,·] are made here, per step
  (cache-sized), not for the whole sequence. Returns (state after the G chunks,
  o [B,G,C,H,V])."""
  q, k, v, g = (jnp.transpose(x, (1, 0, 3, 2, 4)) for x in xs[:4])
  beta = jnp.transpose(xs[4], (1, 0, 3, 2))
  parts = _intra(q * scale, k, v, g, beta, xs[5:] if packed else None, tile=tile, fast=fast)
  state, o = _state_pass(state, *(parts[n] for n in (
      "w_v", "w_k", "q_gamma", "p_mat", "k_last", "decay")))
  return state, jnp.transpose(o, (1, 0, 3, 2, 4))                 # [G,B,H,C,V] -> [B,G,C,H,V]


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size: int = 64,
                segment_ids=None, lower_bound: float | None = None):
  """Chunkwise KDA (WY/UT form, dense matmuls); same results as `kda_recurrent`.

  A `lax.scan` carries the fp32 state over groups of chunks (about `_GROUP_TOKENS` tokens a
  step: the state-independent work of a group is vectorised, then the state passes through its
  chunks). The step function is rematerialised (`jax.checkpoint`), so the backward pass keeps
  only the group-boundary states, not one per token. Any T: the sequence is padded internally
  with g=0, beta=0, q=k=v=0 (which leave the state unchanged). Decay factors are overflow-safe
  for any g ≤ 0 (see the module docstring).

  Args:
    q, k, g: `[B,T,H,K]`; v: `[B,T,H,V]`; beta: `[B,T,H]`.
    scale: multiplies q; default K^-0.5.
    initial_state: `[B,H,K,V]` or None (zeros).
    chunk_size: tokens per chunk; ≤ 16, or a multiple of 16 (16-token tiles inside a chunk).
      Shortened to T rounded up to the tile when T is smaller.
    segment_ids: `[B,T]` int or None; the state resets to zero where the id changes.
    lower_bound: None, or the caller's promise that g ≥ lower_bound everywhere (the bounded
      gate's −5, docs/k3.md §3). With lower_bound ≥ −5 the dense diagonal-tile form is chosen at
      trace time; otherwise, packed, the pairwise form, and unpacked, one `lax.cond` on g
      (module docstring).

  Returns:
    (o `[B,T,H,V]` in q's dtype, final_state `[B,H,K,V]` float32).
  """
  fn = "kda_chunked"
  b, t, h, dk, dv = _validate_sequence_inputs(fn, q, k, v, g, beta, initial_state, segment_ids)
  if not isinstance(chunk_size, int) or chunk_size < 1 or (
      chunk_size > _TILE and chunk_size % _TILE):
    raise ValueError(
        f"{fn}: chunk_size must be a positive int, <= {_TILE} or a multiple of {_TILE}, "
        f"found {chunk_size!r}")
  if lower_bound is not None and not (isinstance(lower_bound, (int, float))
                                      and lower_bound < 0):
    raise ValueError(f"{fn}: lower_bound must be None or a negative number, found "
                     f"{lower_bound!r}")
  tile = min(_TILE, chunk_size)
  half = max(tile // 2, 1)
  impl = lambda fast, *args: _chunked(
      *args, scale=_default_scale(scale, dk), chunk_size=chunk_size, tile=tile, fast=fast)
  args = (q, k, v, g, beta, initial_state, segment_ids)
  # Dense diagonal tiles (fast) when both halves of every tile have Σg ≥ _FAST_MIN_TILE_DECAY
  # per channel: known at trace time from a promised lower bound (8 · (−5) = −40), else one
  # cond on the raw inputs around the whole computation (XLA:CPU ran a cond inside the scan
  # body, or on the grouped arrays, much slower; the cond itself still costs 10–30%).
  if lower_bound is not None and lower_bound * max(half, tile - half) >= _FAST_MIN_TILE_DECAY:
    return impl(True, *args)
  if segment_ids is not None:
    # A cond on every document's gates would let one document choose another's arithmetic:
    # packed rows without a promised bound always take the pairwise form.
    return impl(False, *args)
  n_pad = -(-t // tile) * tile - t
  g_pad = jnp.pad(g.astype(jnp.float32), ((0, 0), (0, n_pad), (0, 0), (0, 0)))
  g_tiles = g_pad.reshape(b, -1, tile, h, dk)
  first = jnp.sum(g_tiles[:, :, :half], axis=2)
  second = jnp.sum(g_tiles[:, :, half:], axis=2)
  fast_ok = jnp.all(jnp.minimum(first, second) >= _FAST_MIN_TILE_DECAY)
  return lax.cond(fast_ok, functools.partial(impl, True), functools.partial(impl, False), *args)


def _chunked(q, k, v, g, beta, initial_state, segment_ids, *, scale, chunk_size: int, tile: int,
             fast: bool):
  """kda_chunked after validation; `fast` selects the diagonal-tile form (see `_intra`)."""
  b, t, h, dk = q.shape
  dv = v.shape[3]
  chunk = min(chunk_size, -(-t // tile) * tile)
  n = -(-t // chunk)                                    # chunks
  steps = -(-n // max(1, _GROUP_TOKENS // chunk))       # scan steps
  group = -(-n // steps)                                # chunks per step
  pad = steps * group * chunk - t

  def to_groups(x):  # [B,T,H,D] -> [S,B,G,C,H,D] fp32, zero-padded (a bitcast when B=1)
    x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    x = x.reshape(b, steps, group, chunk, *x.shape[2:])
    # B=1: a reshape keeps the row-major layout (moveaxis would leave a transposed layout
    # that XLA copies before the scan).
    return x.reshape(steps, 1, *x.shape[2:]) if b == 1 else jnp.moveaxis(x, 1, 0)

  xs = (to_groups(q), to_groups(k), to_groups(v), to_groups(g), to_groups(beta))
  packed = segment_ids is not None
  if packed:
    # Document indices (+1 wherever the id changes): the masks below compare for equality, and
    # an id that comes back later in the row (0, 1, 0) starts a new document, as in the scan.
    changed = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)
    seg = jnp.cumsum(jnp.pad(changed, ((0, 0), (1, 0))), axis=1)
    seg = jnp.pad(seg, ((0, 0), (0, pad)), mode="edge").reshape(b, steps * group, chunk)
    prev = jnp.concatenate([seg[:, :1, 0], seg[:, :-1, -1]], axis=1)   # id before each chunk
    same = (seg[..., :, None] == seg[..., None, :]).astype(jnp.float32)  # [B,N,C,C]
    m = (seg == prev[..., None]).astype(jnp.float32)[..., None]         # [B,N,C,1]
    f = (seg == seg[..., -1:]).astype(jnp.float32)[..., None]
    lead = lambda x: jnp.moveaxis(x.reshape(b, steps, group, *x.shape[2:]), (1, 2), (0, 1))
    xs = xs + tuple(lead(x)[:, :, :, None] for x in (same, m, f))      # [S,G,B,1,...]

  state0 = (jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None
            else initial_state.astype(jnp.float32))
  body = jax.checkpoint(
      functools.partial(_group, tile=tile, packed=packed, fast=fast, scale=scale),
      prevent_cse=False)
  final_state, o = lax.scan(body, state0, xs)          # o [S,B,G,C,H,V]
  o = (o if b == 1 else jnp.moveaxis(o, 0, 1)).reshape(b, steps * group * chunk, h, dv)[:, :t]
  return o.astype(q.dtype), final_state
