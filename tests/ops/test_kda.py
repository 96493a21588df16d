"""KDA ops: gate formulas, recurrent vs a float64 loop, chunked vs recurrent, decode step, grads,
document packing, extreme gates and input validation. Small shapes: compile time dominates."""

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from isolation import assert_isolated
from k3jax.ops import kda

F32_TOL = 1e-4  # max abs error relative to the output scale (issue 2)


def _inputs(seed, b, t, h, dk, dv, *, bounded=True, rate=-2.0, bias=-2.0):
  """Realistic inputs: L2-normalised q,k, gate from kda_gate with mild decay, sigmoid beta."""
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
  q = unit(rng.standard_normal((b, t, h, dk)))
  k = unit(rng.standard_normal((b, t, h, dk)))
  v = rng.standard_normal((b, t, h, dv))
  z = rng.standard_normal((b, t, h, dk))
  a_log = rate + 0.5 * rng.standard_normal((h,))
  dt_bias = bias + 0.5 * rng.standard_normal((h, dk))
  g = kda.kda_gate(jnp.asarray(z, jnp.float32), jnp.asarray(a_log, jnp.float32),
                   jnp.asarray(dt_bias, jnp.float32), -5.0 if bounded else None)
  beta = 1 / (1 + np.exp(-rng.standard_normal((b, t, h))))
  s0 = rng.standard_normal((b, h, dk, dv))
  f = lambda x: jnp.asarray(x, jnp.float32)
  return f(q), f(k), f(v), g, f(beta), f(s0)


def _numpy_loop(q, k, v, g, beta, s0, seg, scale):
  """Float64 per-token loop of the spec's recurrence (decay, delta write, read)."""
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
  b, t, h, _ = q.shape
  s = np.zeros((b, h, q.shape[-1], v.shape[-1])) if s0 is None else np.array(s0, np.float64)
  o = np.zeros(v.shape)
  for bi in range(b):
    for hi in range(h):
      st_ = s[bi, hi].copy()
      for ti in range(t):
        if seg is not None and ti > 0 and seg[bi, ti] != seg[bi, ti - 1]:
          st_[:] = 0
        st_ = np.exp(g[bi, ti, hi])[:, None] * st_
        st_ = st_ + beta[bi, ti, hi] * np.outer(k[bi, ti, hi], v[bi, ti, hi] - st_.T @ k[bi, ti, hi])
        o[bi, ti, hi] = st_.T @ (scale * q[bi, ti, hi])
      s[bi, hi] = st_
  return o, s


def _assert_close(x, ref, tol=F32_TOL, name=""):
  scale = max(float(np.max(np.abs(ref))), 1e-6)
  err = float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(ref, np.float64))))
  assert err <= tol * scale, f"{name}: max abs err {err:.3g} > {tol} x scale {scale:.3g}"


# ----------------------------------------------------------------------------- gate


def test_gate_formulas():
  rng = np.random.default_rng(0)
  z = rng.standard_normal((2, 3, 4, 5)).astype(np.float32) * 3
  a_log = rng.standard_normal((4,)).astype(np.float32)
  dt_bias = rng.standard_normal((4, 5)).astype(np.float32)
  x = z.astype(np.float64) + dt_bias
  rate = np.exp(a_log.astype(np.float64))[:, None]
  bounded = -5.0 / (1 + np.exp(-rate * x))
  unbounded = -rate * np.log1p(np.exp(x))
  g_b = kda.kda_gate(jnp.asarray(z), jnp.asarray(a_log), jnp.asarray(dt_bias), -5.0)
  g_u = kda.kda_gate(jnp.asarray(z), jnp.asarray(a_log), jnp.asarray(dt_bias))
  assert g_b.dtype == jnp.float32 and g_u.dtype == jnp.float32
  np.testing.assert_allclose(g_b, bounded, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g_u, unbounded, rtol=1e-5, atol=1e-6)


def test_gate_extremes_saturate():
  z = jnp.asarray([1e4, -1e4], jnp.float32).reshape(1, 2, 1, 1)
  a_log, dt_bias = jnp.zeros((1,)), jnp.zeros((1, 1))
  g_b = kda.kda_gate(z, a_log, dt_bias, -5.0)
  np.testing.assert_allclose(np.asarray(g_b).ravel(), [-5.0, 0.0], atol=1e-6)
  g_u = kda.kda_gate(z.astype(jnp.bfloat16), a_log, dt_bias)
  assert g_u.dtype == jnp.float32
  big = float(jnp.asarray(1e4, jnp.bfloat16))  # bf16 rounds 1e4 to 9984
  np.testing.assert_allclose(np.asarray(g_u).ravel(), [-big, 0.0], rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- recurrent


def test_recurrent_matches_float64_loop():
  q, k, v, g, beta, s0 = _inputs(1, 2, 23, 2, 8, 4, bounded=False)
  o, s = kda.kda_recurrent(q, k, v, g, beta, initial_state=s0, scale=0.7)
  o_ref, s_ref = _numpy_loop(q, k, v, g, beta, s0, None, 0.7)
  _assert_close(o, o_ref, 1e-5, "o")
  _assert_close(s, s_ref, 1e-5, "state")
  assert o.dtype == jnp.float32 and s.dtype == jnp.float32


# ----------------------------------------------------------------------------- chunked


@settings(max_examples=4)
@given(b=st.integers(1, 2), t=st.integers(1, 90), h=st.integers(1, 2),
       dk=st.sampled_from([8, 16]), dv=st.sampled_from([4, 8]),
       chunk=st.sampled_from([8, 16, 32]), bounded=st.booleans(), init=st.booleans(),
       seed=st.integers(0, 2**16))
def test_chunked_matches_recurrent(b, t, h, dk, dv, chunk, bounded, init, seed):
  q, k, v, g, beta, s0 = _inputs(seed, b, t, h, dk, dv, bounded=bounded)
  s0 = s0 if init else None
  o_ref, s_ref = kda.kda_recurrent(q, k, v, g, beta, initial_state=s0)
  o, s = kda.kda_chunked(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
  chex.assert_shape(o, (b, t, h, dv))
  _assert_close(o, o_ref, name="o")
  _assert_close(s, s_ref, name="final_state")


def test_chunked_many_scan_steps(monkeypatch):
  """Several groups per scan step and several scan steps (state passed between both)."""
  monkeypatch.setattr(kda, "_GROUP_TOKENS", 64)
  q, k, v, g, beta, s0 = _inputs(2, 1, 203, 2, 16, 8, rate=-3.0, bias=-4.0)
  o_ref, s_ref = _numpy_loop(q, k, v, g, beta, s0, None, 16 ** -0.5)
  o, s = kda.kda_chunked(q, k, v, g, beta, initial_state=s0, chunk_size=32)
  _assert_close(o, o_ref, name="o")
  _assert_close(s, s_ref, name="final_state")


@pytest.mark.parametrize("bounded", [True, False])
def test_extreme_gates_long_sequence_finite(bounded):
  """z = ±1e4 everywhere over T=4096: g saturates (−5 / 0 bounded, ±huge unbounded)."""
  t, h, dk, dv = 4096, 1, 8, 8
  rng = np.random.default_rng(3)
  z = jnp.asarray(np.where(rng.random((1, t, h, dk)) < 0.5, 1e4, -1e4), jnp.float32)
  g = kda.kda_gate(z, jnp.zeros((h,)), jnp.zeros((h, dk)), -5.0 if bounded else None)
  if bounded:
    assert float(g.min()) == -5.0
  q, k, v, _, beta, _ = _inputs(4, 1, t, h, dk, dv)
  o, s = kda.kda_chunked(q, k, v, g, beta)
  o_ref, s_ref = kda.kda_recurrent(q, k, v, g, beta)
  assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(s)))
  _assert_close(o, o_ref, name="o")
  _assert_close(s, s_ref, name="final_state")


@pytest.mark.parametrize("g_scale", [1.0, 30.0])
def test_chunked_fast_and_pairwise_diagonal_tiles(g_scale):
  """Both diagonal-tile forms vs the float64 loop and their gradients vs kda_recurrent: g ≈ −2.5
  everywhere (tile totals just above −40: the dense inverse-decay form at its bound, e^{40}) and
  g×30 (totals far below −40: the pairwise form)."""
  t, h, dk, dv = 70, 2, 8, 8
  rng = np.random.default_rng(11)
  q, k, v, _, beta, s0 = _inputs(12, 1, t, h, dk, dv)
  g = jnp.asarray(-2.5 + 0.01 * rng.random((1, t, h, dk)), jnp.float32) * g_scale
  tile_tot = np.asarray(g[:, :64]).reshape(1, 4, 16, h, dk).sum(2)
  assert (tile_tot.min() >= kda._FAST_MIN_TILE_DECAY) == (g_scale == 1.0)
  o, s = kda.kda_chunked(q, k, v, g, beta, initial_state=s0, chunk_size=32)
  o_ref, s_ref = _numpy_loop(q, k, v, g, beta, s0, None, dk ** -0.5)
  _assert_close(o, o_ref, name="o")
  _assert_close(s, s_ref, name="final_state")
  loss = lambda fn, *a: jnp.sum(fn(*a, initial_state=s0)[0] * v) + jnp.sum(
      fn(*a, initial_state=s0)[1])
  grads = jax.grad(lambda *a: loss(kda.kda_chunked, *a), argnums=(0, 1, 3, 4))(q, k, v, g, beta)
  grads_ref = jax.grad(lambda *a: loss(kda.kda_recurrent, *a), argnums=(0, 1, 3, 4))(
      q, k, v, g, beta)
  for name, x, ref in zip(("q", "k", "g", "beta"), grads, grads_ref):
    assert bool(jnp.all(jnp.isfinite(x))), name
    _assert_close(x, ref, 1e-3, f"d{name}")


def test_chunked_lower_bound_promise():
  # g saturated at the bound −5 over a long sequence (half-tile sums exactly −40): the form
  # chosen at trace time from lower_bound=-5 equals the recurrent scan and the cond path.
  t, h, dk, dv = 200, 2, 8, 8
  q, k, v, _, beta, s0 = _inputs(13, 1, t, h, dk, dv)
  g = jnp.full((1, t, h, dk), -5.0, jnp.float32)
  o, s = kda.kda_chunked(q, k, v, g, beta, initial_state=s0, lower_bound=-5.0)
  o_ref, s_ref = kda.kda_recurrent(q, k, v, g, beta, initial_state=s0)
  assert bool(jnp.all(jnp.isfinite(o)))
  _assert_close(o, o_ref, name="o")
  _assert_close(s, s_ref, name="final_state")
  o2, _ = kda.kda_chunked(q, k, v, g, beta, initial_state=s0)
  np.testing.assert_allclose(o, o2, rtol=1e-6, atol=1e-7)
  with pytest.raises(ValueError, match="lower_bound must be None or a negative number"):
    kda.kda_chunked(q, k, v, g, beta, lower_bound=5.0)


def test_step_loop_reproduces_chunked():
  q, k, v, g, beta, s0 = _inputs(5, 2, 19, 2, 8, 8, bounded=False)
  o_ref, s_ref = kda.kda_chunked(q, k, v, g, beta, initial_state=s0, chunk_size=16)
  step = jax.jit(kda.kda_step)
  state, outs = s0, []
  for t in range(q.shape[1]):
    o_t, state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
    outs.append(o_t)
  _assert_close(jnp.stack(outs, 1), o_ref, name="o")
  _assert_close(state, s_ref, name="state")


def test_grads_match_recurrent():
  q, k, v, g, beta, s0 = _inputs(6, 1, 45, 2, 8, 8, rate=-2.5, bias=-3.0)
  rng = np.random.default_rng(7)
  do = jnp.asarray(rng.standard_normal((1, 45, 2, 8)), jnp.float32)
  ds = jnp.asarray(rng.standard_normal((1, 2, 8, 8)), jnp.float32)

  def loss(fn, *args):
    o, s = fn(*args[:5], initial_state=args[5])
    return jnp.sum(o * do) + jnp.sum(s * ds)

  args = (q, k, v, g, beta, s0)
  grads = jax.grad(lambda *a: loss(lambda *x, **kw: kda.kda_chunked(*x, chunk_size=32, **kw),
                                   *a), argnums=tuple(range(6)))(*args)
  grads_ref = jax.grad(lambda *a: loss(kda.kda_recurrent, *a), argnums=tuple(range(6)))(*args)
  for name, x, ref in zip(("q", "k", "v", "g", "beta", "initial_state"), grads, grads_ref):
    _assert_close(x, ref, 1e-3, f"d{name}")


# ----------------------------------------------------------------------------- packing


def test_segment_ids_equal_separate_documents():
  lengths = [(7, 30, 3), (40,)]  # per batch row: document lengths (T = 40)
  q, k, v, g, beta, s0 = _inputs(8, 2, 40, 2, 8, 4, rate=-3.0, bias=-4.0)
  seg = np.concatenate([np.repeat(np.arange(len(ls)), ls)[None] for ls in lengths])
  o_r, s_r = kda.kda_recurrent(q, k, v, g, beta, initial_state=s0, segment_ids=jnp.asarray(seg))
  o_c, s_c = kda.kda_chunked(q, k, v, g, beta, initial_state=s0, chunk_size=16,
                             segment_ids=jnp.asarray(seg, jnp.int32))
  for bi, ls in enumerate(lengths):
    start = 0
    for di, n in enumerate(ls):
      sl = slice(start, start + n)
      init = s0[bi:bi + 1] if di == 0 else None  # initial_state: first document only
      o_d, s_d = kda.kda_recurrent(q[bi:bi + 1, sl], k[bi:bi + 1, sl], v[bi:bi + 1, sl],
                                   g[bi:bi + 1, sl], beta[bi:bi + 1, sl], initial_state=init)
      for name, o in (("recurrent", o_r), ("chunked", o_c)):
        _assert_close(o[bi:bi + 1, sl], o_d, name=f"{name} row {bi} doc {di}")
      start += n
    _assert_close(s_r[bi:bi + 1], s_d, name="recurrent final state = last document's")
    _assert_close(s_c[bi:bi + 1], s_d, name="chunked final state = last document's")


# Row 0 holds three documents: the middle one starts mid-tile and ends mid-chunk (16-token
# tiles), so its tiles and chunks are shared with both neighbours; row 1 is one document.
_ISO_T = 70
_ISO_SEG = np.array([[0] * 21 + [1] * 30 + [2] * 19, [5] * _ISO_T], np.int32)


@pytest.mark.parametrize("fn,chunk,bounded,strong", [
    ("chunked", 64, True, False),    # dense diagonal tiles (bound promised), per-segment refs
    ("chunked", 32, False, True),    # no bound, strong decay: pairwise diagonal tiles
    ("recurrent", None, False, False),
])
def test_packed_documents_are_bitwise_isolated(fn, chunk, bounded, strong):
  """Every other document's inputs replaced: the middle document's outputs and the gradients
  of its q, k, v, g, β are bit-for-bit unchanged (the cumulative gate sums restart at segment
  starts; nothing of another segment enters its sums but exact zeros)."""
  kw = dict(rate=1.0, bias=2.0) if strong else {}
  q, k, v, g, beta, s0 = _inputs(11, 2, _ISO_T, 2, 16, 8, bounded=bounded, **kw)
  alt = _inputs(12, 2, _ISO_T, 2, 16, 8, bounded=bounded, **kw)[:5]
  seg = jnp.asarray(_ISO_SEG)
  if fn == "chunked":
    op = lambda *x: kda.kda_chunked(*x[:5], initial_state=x[5], segment_ids=seg, chunk_size=chunk,
                                    lower_bound=-5.0 if bounded else None)[0]
  else:
    op = lambda *x: kda.kda_recurrent(*x[:5], initial_state=x[5], segment_ids=seg)[0]
  doc = _ISO_SEG == 1
  assert_isolated(op, [q, k, v, g, beta, s0], list(alt) + [s0], doc,
                  per_token=[True] * 5 + [False])


# ----------------------------------------------------------------------------- dtypes


def test_bf16_inputs_fp32_state():
  q, k, v, g, beta, s0 = _inputs(9, 1, 33, 2, 16, 8)
  bf = lambda x: x.astype(jnp.bfloat16)
  o, s = kda.kda_chunked(bf(q), bf(k), bf(v), g, bf(beta), initial_state=s0)
  o_ref, s_ref = kda.kda_recurrent(bf(q), bf(k), bf(v), g, bf(beta), initial_state=s0)
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  _assert_close(o.astype(jnp.float32), o_ref.astype(jnp.float32), 1e-2, "o")
  _assert_close(s, s_ref, F32_TOL, "state")


# ----------------------------------------------------------------------------- bad input


def _ok(b=2, t=37, h=4, dk=16, dv=8):
  z = lambda *s: jnp.zeros(s, jnp.float32)
  return dict(q=z(b, t, h, dk), k=z(b, t, h, dk), v=z(b, t, h, dv), g=z(b, t, h, dk),
              beta=z(b, t, h))


@pytest.mark.parametrize("fn", [kda.kda_chunked, kda.kda_recurrent])
@pytest.mark.parametrize("change, message", [
    (dict(k=jnp.zeros((2, 37, 4, 8))), r"k must be \[B,T,H,K\]=\[2,37,4,16\] like q, found \[2,37,4,8\]"),
    (dict(q=jnp.zeros((2, 37, 16))), r"q must be rank 4 \[B,T,H,K\], found shape \[2,37,16\]"),
    (dict(g=jnp.zeros((2, 37, 4, 15))), r"g must be \[B,T,H,K\]=\[2,37,4,16\]"),
    (dict(v=jnp.zeros((2, 36, 4, 8))), r"v must be \[B,T,H,V\] with \[B,T,H\]=\[2,37,4\]"),
    (dict(beta=jnp.zeros((2, 37, 4, 1))), r"beta must be \[B,T,H\]=\[2,37,4\]"),
    (dict(q=jnp.zeros((2, 37, 4, 16), jnp.int32)), r"q must have a floating dtype, found int32"),
    (dict(initial_state=jnp.zeros((2, 4, 16, 16))),
     r"initial_state must be \[B,H,K,V\]=\[2,4,16,8\], found \[2,4,16,16\]"),
    (dict(segment_ids=jnp.zeros((2, 36), jnp.int32)), r"segment_ids must be \[B,T\]=\[2,37\]"),
    (dict(segment_ids=jnp.zeros((2, 37), jnp.float32)), r"segment_ids must have an integer dtype"),
])
def test_bad_inputs_raise(fn, change, message):
  args = _ok()
  args.update(change)
  with pytest.raises(ValueError, match=fn.__name__ + ": " + message):
    fn(**args)


def test_bad_chunk_size_and_step_and_gate():
  with pytest.raises(ValueError, match=r"kda_chunked: chunk_size must be .* found 24"):
    kda.kda_chunked(**_ok(), chunk_size=24)
  z = jnp.zeros((2, 4, 16))
  with pytest.raises(ValueError, match=r"kda_step: state must be \[B,H,K,V\]=\[2,4,16,16\]"):
    kda.kda_step(z, z, z, z, jnp.zeros((2, 4)), jnp.zeros((2, 4, 16, 8)))
  with pytest.raises(ValueError, match=r"kda_step: beta must be \[B,H\]=\[2,4\] like q"):
    kda.kda_step(z, z, z, z, jnp.zeros((2, 4, 1)), jnp.zeros((2, 4, 16, 16)))
  with pytest.raises(ValueError, match=r"kda_gate: dt_bias must be \[H,K\]=\[4,16\], found \[4\]"):
    kda.kda_gate(jnp.zeros((1, 2, 4, 16)), jnp.zeros((4,)), jnp.zeros((4,)))
  with pytest.raises(ValueError, match=r"kda_gate: A_log must be \[H\]=\[4\]"):
    kda.kda_gate(jnp.zeros((1, 2, 4, 16)), jnp.zeros((1, 1, 4, 1)), jnp.zeros((4, 16)))
  with pytest.raises(ValueError, match=r"kda_gate: lower_bound must be negative"):
    kda.kda_gate(jnp.zeros((1, 2, 4, 16)), jnp.zeros((4,)), jnp.zeros((4, 16)), 5.0)
