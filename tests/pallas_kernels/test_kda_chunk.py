"""Pallas KDA chunk kernel (interpret mode on CPU) against the reference ops.

`k3jax.ops.kda.kda_recurrent` (token-by-token scan) is the ground truth; `kda_chunked` the XLA
path the kernel replaces. Values and gradients of all inputs, both launch forms ("grid" for
TPU, "loop" for GPU), T not a multiple of the chunk, an initial state, saturated gates.
On a GPU/TPU machine the same tests run the compiled kernel (interpret=None picks it).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from k3jax.layers import backend
from k3jax.ops import kda
from pallas_kernels import kda_chunk
from pallas_kernels.kda_chunk import kda_chunked_pallas


def _inputs(seed, b, t, h, dk, dv, *, gate="random", with_state=True, dtype=jnp.float32):
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  unit = lambda x: x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
  q = unit(jax.random.normal(ks[0], (b, t, h, dk))).astype(dtype)
  k = unit(jax.random.normal(ks[1], (b, t, h, dk))).astype(dtype)
  v = jax.random.normal(ks[2], (b, t, h, dv)).astype(dtype)
  if gate == "saturated":
    g = jnp.full((b, t, h, dk), -5.0, jnp.float32)
  else:   # the bounded gate of the model, over its whole range (-5, 0)
    z = 3.0 * jax.random.normal(ks[3], (b, t, h, dk))
    g = kda.kda_gate(z, jnp.zeros((h,)), jnp.zeros((h, dk)), lower_bound=-5.0)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
  s0 = jax.random.normal(ks[5], (b, h, dk, dv)) if with_state else None
  return q, k, v, g, beta, s0


def _rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


_ON_CPU = jax.default_backend() == "cpu"


@functools.partial(jax.jit, static_argnames=("other",))
def _pallas(q, k, v, g, beta, s0, other=False):
  """The kernel as the platform runs it (CPU: interpreted "grid" form; GPU: compiled "loop"
  form; TPU: compiled "grid" form) or, with other=True, the other launch form, interpreted."""
  if not other:
    return kda_chunked_pallas(q, k, v, g, beta, initial_state=s0)
  launch = "loop" if _ON_CPU or jax.default_backend() == "tpu" else "grid"
  return kda_chunked_pallas(q, k, v, g, beta, initial_state=s0, launch=launch, interpret=True,
                            block_v=v.shape[-1] // 2)


@jax.jit
def _recurrent(q, k, v, g, beta, s0):
  return kda.kda_recurrent(q, k, v, g, beta, initial_state=s0)


@jax.jit
def _chunked(q, k, v, g, beta, s0):
  return kda.kda_chunked(q, k, v, g, beta, initial_state=s0)


def _grads(fn, args, seed=1):
  """Gradients of a random projection of (o, final state) w.r.t. q, k, v, g, beta, s0."""
  q, v, s0 = args[0], args[2], args[5]
  kd, ks = jax.random.split(jax.random.PRNGKey(seed))
  do = jax.random.normal(kd, q.shape[:3] + (v.shape[-1],))
  ds = jax.random.normal(ks, s0.shape)

  def loss(*a):
    o, s = fn(*a)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(s * ds)
  return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*args)


_NAMES = ("q", "k", "v", "g", "beta", "s0")
# The main case: T = 100 (not a multiple of 64: two chunks, padded), an initial state, the
# model's bounded gate over its whole range. Results are cached: each compiles once.
_MAIN = (1, 100, 2, 16, 16)


@functools.lru_cache(maxsize=None)
def _main_results(impl):
  args = _inputs(0, *_MAIN)
  if impl == "recurrent":
    fn = lambda *a: kda.kda_recurrent(*a[:5], initial_state=a[5])
  else:
    fn = lambda *a: _pallas(*a, other=impl == "other")
  return fn(*args), _grads(fn, args)


def test_forward_matches_recurrent_and_chunked():
  (o, s), _ = _main_results("pallas")
  (o_r, s_r), _ = _main_results("recurrent")
  o_c, s_c = _chunked(*_inputs(0, *_MAIN))
  assert o.shape == o_r.shape and s.shape == s_r.shape and s.dtype == jnp.float32
  assert _rel_err(o, o_r) < 1e-5 and _rel_err(s, s_r) < 1e-5
  assert _rel_err(o, o_c) < 1e-5 and _rel_err(s, s_c) < 1e-5


def test_gradients_match_recurrent():
  """All six gradients (q, k, v, g, beta, initial state) against autodiff of the recurrence.
  (kda_chunked's own gradients equal the recurrence's: tests/ops/test_kda.py.)"""
  _, grads = _main_results("pallas")
  _, grads_r = _main_results("recurrent")
  for name, a, r in zip(_NAMES, grads, grads_r):
    assert a.shape == r.shape, name
    assert _rel_err(a, r) < 1e-4, (name, _rel_err(a, r))


def test_both_launch_forms_agree():
  """The GPU form (one program per head and V block, fori_loop over chunks, state as loop
  carry) and the TPU form (grid over chunks, state in a scratch buffer) give the same values
  and gradients; the "other" form also splits V in two blocks (partial dq, dk, dg, dbeta)."""
  (o, s), grads = _main_results("pallas")
  (o_l, s_l), grads_l = _main_results("other")
  for name, a, b in zip(("o", "state") + _NAMES, (o, s) + tuple(grads), (o_l, s_l) + tuple(grads_l)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=name)


def test_saturated_gates_long_sequence():
  """All g = -5 over T = 1024: the largest rescales everywhere; outputs and gradients stay
  finite and match the recurrence."""
  args = _inputs(4, 1, 1024, 1, 16, 16, gate="saturated")
  o, s = _pallas(*args)
  o_r, s_r = _recurrent(*args)
  assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(s)))
  assert _rel_err(o, o_r) < 1e-5 and _rel_err(s, s_r) < 1e-5
  g_p = _grads(lambda *a: _pallas(*a), args)
  g_r = _grads(lambda *a: kda.kda_recurrent(*a[:5], initial_state=a[5]), args)
  for name, a, r in zip(_NAMES, g_p, g_r):
    assert np.all(np.isfinite(np.asarray(a))), name
    assert _rel_err(a, r) < 1e-4, (name, _rel_err(a, r))


def test_bfloat16_inputs_close_to_fp32_reference():
  """bf16 q, k, v (the accelerator setting): matmul operands in bf16, state and decay fp32.
  No initial state, T = 64 (exactly one chunk)."""
  args = _inputs(5, 2, 64, 1, 16, 16, dtype=jnp.bfloat16, with_state=False)
  o, s = _pallas(*args)
  o_r, s_r = _recurrent(*args)
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  assert _rel_err(o, o_r) < 3e-2 and _rel_err(s, s_r) < 3e-2


# --------------------------------------------------------------------- chunk math (pure jnp)
def _naive_chunk(q, k, v, g, beta, s):
  """Token-by-token delta rule over one chunk (numpy float64)."""
  q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, s))
  out = []
  for t in range(q.shape[0]):
    s = s * np.exp(g[t])[:, None]
    s = s + beta[t, 0] * np.outer(k[t], v[t] - k[t] @ s)
    out.append(q[t] @ s)
  return np.stack(out), s


_step64 = jax.jit(kda_chunk._chunk_step)


@given(seed=st.integers(0, 2**16), gate_scale=st.sampled_from([0.0, 0.3, 3.0, 30.0]))
def test_chunk_step_matches_token_loop(seed, gate_scale):
  """One 64-token chunk over decay regimes from none (g = 0) to saturated (g ~ -5)."""
  r = np.random.default_rng(seed)
  c, dk, dv = 64, 16, 8
  q, k = (r.standard_normal((c, dk)).astype(np.float32) * 0.3 for _ in range(2))
  v = r.standard_normal((c, dv)).astype(np.float32)
  g = (-5.0 / (1.0 + np.exp(-gate_scale * r.standard_normal((c, dk))))).astype(np.float32)
  if gate_scale == 0.0:
    g = np.zeros_like(g)
  beta = (1.0 / (1.0 + np.exp(-r.standard_normal((c, 1))))).astype(np.float32)
  s = r.standard_normal((dk, dv)).astype(np.float32)
  o, s_new = _step64(q, k, v, g, beta, s)
  o_ref, s_ref = _naive_chunk(q, k, v, g, beta, s)
  assert _rel_err(o, o_ref) < 1e-4 and _rel_err(s_new, s_ref) < 1e-4


@given(seed=st.integers(0, 2**16), gate_scale=st.sampled_from([3.0, 30.0, 300.0]))
def test_unbounded_chunk_step_matches_token_loop(seed, gate_scale):
  """The pair-by-pair diagonal tiles (an unbounded gate, as Kimi Linear's): one 64-token chunk
  with g down to -gate_scale equals the float64 token loop."""
  r = np.random.default_rng(seed)
  c, dk, dv = 64, 16, 8
  q, k = (r.standard_normal((c, dk)).astype(np.float32) * 0.3 for _ in range(2))
  v = r.standard_normal((c, dv)).astype(np.float32)
  g = (-gate_scale * r.uniform(size=(c, dk)) ** 3).astype(np.float32)   # many small, some huge
  beta = (1.0 / (1.0 + np.exp(-r.standard_normal((c, 1))))).astype(np.float32)
  s = r.standard_normal((dk, dv)).astype(np.float32)
  o, s_new = _step64_unbounded(q, k, v, g, beta, s)
  o_ref, s_ref = _naive_chunk(q, k, v, g, beta, s)
  assert _rel_err(o, o_ref) < 1e-4 and _rel_err(s_new, s_ref) < 1e-4


_step64_unbounded = jax.jit(functools.partial(kda_chunk._chunk_step, bounded=False))


def _naive_packed_chunk(q, k, v, g, beta, s, starts):
  """The token loop with the state reset to zero at every token where `starts` is set."""
  out, s = [], np.asarray(s, np.float64)
  for t in range(q.shape[0]):
    if starts[t]:
      s = np.zeros_like(s)
    o, s = _naive_chunk(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s)
    out.append(o)
  return np.concatenate(out), s


@given(seed=st.integers(0, 2**16), gate_scale=st.sampled_from([0.0, 3.0]),
       starts=st.lists(st.integers(1, 63), max_size=6))
def test_packed_chunk_step_matches_token_loop(seed, gate_scale, starts):
  """A chunk holding several documents (segment numbers as the kernels receive them): equal
  to the token loop that resets the state at each document start; the state carried in
  reaches only the first document, the state out is the last document's."""
  r = np.random.default_rng(seed)
  c, dk, dv = 64, 16, 8
  q, k = (r.standard_normal((c, dk)).astype(np.float32) * 0.3 for _ in range(2))
  v = r.standard_normal((c, dv)).astype(np.float32)
  g = (-5.0 / (1.0 + np.exp(-gate_scale * r.standard_normal((c, dk))))).astype(np.float32)
  beta = (1.0 / (1.0 + np.exp(-r.standard_normal((c, 1))))).astype(np.float32)
  s = r.standard_normal((dk, dv)).astype(np.float32)
  flags = np.zeros(c, bool)
  flags[starts] = True
  sc = np.cumsum(flags).astype(np.float32)[:, None]
  o, s_new = _step64(q, k, v, g, beta, s, sc)
  o_ref, s_ref = _naive_packed_chunk(q, k, v, g, beta, s, flags)
  assert _rel_err(o, o_ref) < 1e-4 and _rel_err(s_new, s_ref) < 1e-4


def test_unit_lower_inverse_by_doubling():
  r = np.random.default_rng(0)
  n = np.tril(r.standard_normal((64, 64)) * 0.3, -1).astype(np.float32)
  ident = np.eye(64, dtype=np.float32)
  inv = kda_chunk._unit_lower_inverse(jnp.asarray(n), jnp.asarray(ident), 64, kda_chunk._dot)
  np.testing.assert_allclose(np.asarray(inv), np.linalg.inv(ident + n.astype(np.float64)),
                             rtol=1e-4, atol=1e-4)


# ------------------------------------------------- written-out vjps against jax.vjp (pure jnp)
def _chunk_inputs(seed, c=32, dk=16, dv=8, gate="bounded", packed=False, dtype=np.float32):
  r = np.random.default_rng(seed)
  q, k = (jnp.asarray(r.standard_normal((c, dk)) * 0.3, dtype) for _ in range(2))
  v = jnp.asarray(r.standard_normal((c, dv)), dtype)
  if gate == "bounded":
    g = -5.0 / (1.0 + np.exp(-3.0 * r.standard_normal((c, dk))))
  else:
    g = -30.0 * r.uniform(size=(c, dk)) ** 3
  beta = 1.0 / (1.0 + np.exp(-r.standard_normal((c, 1))))
  sc = None
  if packed:   # starts inside the chunk, one at its first token's successor
    flags = np.zeros(c, bool)
    flags[[1, c // 2, c // 2 + 3]] = True
    sc = jnp.asarray(np.cumsum(flags)[:, None], jnp.float32)
  return q, k, v, jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32), sc


def _cotangents(seed, shapes):
  r = np.random.default_rng(seed + 1)
  return tuple(jnp.asarray(r.standard_normal(s), jnp.float32) for s in shapes)


@pytest.mark.parametrize("gate,packed", [("bounded", False), ("bounded", True),
                                         ("unbounded", False), ("unbounded", True)])
def test_chunk_wy_vjp_is_jax_vjp(gate, packed):
  """`_chunk_wy_vjp` (the backward kernel's hand-written transpose) = jax.vjp of `_chunk_wy`."""
  bounded = gate == "bounded"
  q, k, v, g, beta, sc = _chunk_inputs(0, gate=gate, packed=packed)
  a_kk, _ = kda_chunk._chunk_a(q, k, g, beta, sc, bounded=bounded)
  fn = functools.partial(kda_chunk._chunk_wy, sc=sc, bounded=bounded)
  outs, pull = jax.vjp(fn, q, k, v, g, beta, a_kk)
  cts = _cotangents(0, [o.shape for o in outs])
  want = dict(zip(("q", "k", "v", "g", "beta", "a_kk"), pull(cts)))
  want["a_kk"] = jnp.tril(want["a_kk"], -1)     # a_kk is strictly lower: the rest is unused
  src = dict(zip(("q", "k", "v", "g", "beta", "a_kk", "dw", "du", "dqg", "dkdec", "ddecay"),
                 (q, k, v, g, beta, a_kk) + cts))
  got = {}
  kda_chunk._chunk_wy_vjp(src.__getitem__, got.__setitem__, sc, bounded)
  assert sorted(got) == sorted(want)
  for name in want:
    assert _rel_err(got[name], want[name]) < 1e-5, name


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_state_step_vjp_is_jax_vjp(dtype):
  """`_state_step_vjp` (the state backward kernel's) = jax.vjp of `_state_step`, with the
  intermediates stored in the input dtype as the kernels store them."""
  q, k, v, g, beta, _ = _chunk_inputs(1, dtype=dtype)
  inter = kda_chunk._chunk_intra(q, k, v, g, beta)
  inter = [x.astype(dtype) if n in (0, 2, 3, 4) else x for n, x in enumerate(inter)]
  s = jnp.asarray(np.random.default_rng(2).standard_normal((16, 8)), jnp.float32)
  cd = jnp.dtype(dtype)
  f32 = jnp.float32
  fn = lambda *a: kda_chunk._state_step(*a, cd=cd, dot=kda_chunk._dot_vjp)
  (o, s_new), pull = jax.vjp(fn, *(x.astype(f32) for x in inter), s)
  do, ds = _cotangents(1, [o.shape, s_new.shape])
  want = pull((do, ds))
  got = {}
  ds_before = kda_chunk._state_step_vjp(*inter, s, do, ds, cd, got.__setitem__)
  tol = 1e-5 if dtype == np.float32 else 1e-2
  for name, w in zip(kda_chunk._INTER_NAMES, want[:-1]):
    assert _rel_err(got[name], w) < tol, name
  assert _rel_err(ds_before, want[-1]) < tol


def test_pairwise_tiles_vjp_recomputes_the_same_gradient():
  """The pairwise diagonal tiles' custom vjp (each pass recomputed) = autodiff of the plain
  passes."""
  q, k, _, g, _, _ = _chunk_inputs(3, gate="unbounded")
  qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
  cts = _cotangents(3, [(32, 32), (32, 32)])
  _, pull_ref = jax.vjp(kda_chunk._diagonal_tiles_pairwise, qf, kf, g)
  _, pull = jax.vjp(kda_chunk._diagonal_tiles_pairwise_vjp, qf, kf, g)
  for got, want in zip(pull(cts), pull_ref(cts)):
    assert _rel_err(got, want) < 1e-5


# --------------------------------------------------------------------- contract and errors
def test_backend_dispatches_to_kernel():
  for bound in (-5.0, None):    # K3's bounded gate, Kimi Linear's unbounded one
    fn = backend.kda_chunked_fn("pallas", lower_bound=bound)
    assert fn.func is kda_chunked_pallas and fn.keywords == {"lower_bound": bound}


def test_bad_gates_and_segments_are_rejected():
  q, k, v, g, beta, s0 = _inputs(6, 1, 16, 1, 16, 16)
  with pytest.raises(ValueError, match="g must be >= lower_bound.*lower_bound=None"):
    kda_chunked_pallas(q, k, v, g - 10.0, beta)
  with pytest.raises(ValueError, match=r"lower_bound must lie in \[-5, 0\].*or be None"):
    kda_chunked_pallas(q, k, v, g, beta, lower_bound=-10.0)
  with pytest.raises(ValueError, match=r"log-decay and must be <= 0, found max\(g\)=1"):
    kda_chunked_pallas(q, k, v, g.at[0, 3, 0, 2].set(1.0), beta, lower_bound=None)
  with pytest.raises(ValueError, match=r"segment_ids must be \[B, T\] = \(1, 16\)"):
    kda_chunked_pallas(q, k, v, g, beta, segment_ids=jnp.zeros((1, 15), jnp.int32))
  with pytest.raises(ValueError, match="segment_ids must have an integer dtype"):
    kda_chunked_pallas(q, k, v, g, beta, segment_ids=jnp.zeros((1, 16), jnp.float32))


def test_unbounded_gate_under_jit_flags_nan():
  """Under jit the bound cannot raise: the offending (batch, head) gets NaN, the others are
  untouched (and equal the recurrence)."""
  q, k, v, g, beta, s0 = _inputs(0, *_MAIN)   # compiled already
  g = g.at[:, 3, 1].add(-20.0)          # Kimi-Linear-like decay in head 1 only
  o, s = _pallas(q, k, v, g, beta, s0)
  o_r, s_r = _recurrent(q, k, v, g, beta, s0)
  assert np.all(np.isnan(np.asarray(o[:, :, 1]))) and np.all(np.isnan(np.asarray(s[:, 1])))
  assert _rel_err(o[:, :, 0], o_r[:, :, 0]) < 1e-5 and _rel_err(s[:, 0], s_r[:, 0]) < 1e-5


def test_bad_shapes_name_the_argument():
  q, k, v, g, beta, s0 = _inputs(7, 1, 16, 1, 16, 16)
  with pytest.raises(ValueError, match="beta"):
    kda_chunked_pallas(q, k, v, g, beta[..., None])
  with pytest.raises(ValueError, match="initial_state"):
    kda_chunked_pallas(q, k, v, g, beta, initial_state=s0[:, :, :8])
  with pytest.raises(ValueError, match="chunk_size"):
    kda_chunked_pallas(q, k, v, g, beta, chunk_size=48)


# --------------------------------------------------------------------- gates at the ends of the range
_NATIVE_LAUNCH = "loop" if jax.default_backend() in ("gpu", "cuda", "rocm") else "grid"


def _gates_at_both_ends(t, h, dk, lower_bound):
  """The bounded gate with some inputs saturated both ways: feature d of token t is exactly
  `lower_bound` (sigmoid = 1.0 in fp32) when (t + d) % 3 == 0, exactly 0 (sigmoid underflow)
  when (t + d) % 3 == 1, and inside (lower_bound, 0) otherwise, so every 16-token tile starts
  with exact zeros and exact bounds in some features."""
  pos = jnp.arange(t)[:, None, None] + jnp.arange(dk)[None, None, :]
  free = 3.0 * jax.random.normal(jax.random.PRNGKey(11), (1, t, h, dk))
  z = jnp.where(pos % 3 == 0, 200.0, jnp.where(pos % 3 == 1, -200.0, free))
  return kda.kda_gate(z, jnp.zeros((h,)), jnp.zeros((h, dk)), lower_bound=lower_bound)


@pytest.mark.parametrize("launch", ["grid", "loop"])
def test_gates_at_bound_and_zero_match_chunked(launch):
  """g exactly at lower_bound and exactly 0, mixed with free gates, over two 32-token chunks
  (padded: T = 40), so the off-diagonal tile rescale sees exponents of exactly 0: values and
  the gradients of q, k, v, g, beta, s0 equal `kda_chunked`'s for both launch forms."""
  lb, t, dk = -5.0, 40, 16
  q, k, v, _, beta, s0 = _inputs(12, 1, t, 1, dk, dk)
  g = _gates_at_both_ends(t, 1, dk, lb)
  assert np.any(np.asarray(g) == lb) and np.any(np.asarray(g) == 0.0)
  assert np.all(np.asarray(g) >= lb)
  interpret = None if launch == _NATIVE_LAUNCH else True
  pallas = lambda *a: kda_chunked_pallas(*a[:5], initial_state=a[5], chunk_size=32,
                                         lower_bound=lb, launch=launch, interpret=interpret)
  chunked = lambda *a: kda.kda_chunked(*a[:5], initial_state=a[5], lower_bound=lb)
  args = (q, k, v, g, beta, s0)
  o, s = jax.jit(pallas)(*args)
  o_c, s_c = jax.jit(chunked)(*args)
  assert _rel_err(o, o_c) < 1e-5 and _rel_err(s, s_c) < 1e-5
  for name, a, r in zip(_NAMES, _grads(pallas, args), _grads(chunked, args)):
    assert _rel_err(a, r) < 1e-4, (name, _rel_err(a, r))


# --------------------------------------------------------------------- packed documents
_SEGMENTS = np.array([[0] * 10 + [1] * 20 + [2] + [3] * 33 + [4] * 36,    # mid-chunk starts,
                      [5] * 64 + [7] * 16 + [6] * 20])                     # one at a chunk edge


@pytest.mark.parametrize("launch", ["grid", "loop"])
def test_packed_documents_match_recurrent(launch):
  """Documents packed in a row (`segment_ids`: starts inside a chunk, at a chunk boundary and
  a one-token document; T = 100 padded to 128): values and the six gradients equal the
  recurrence's, which resets the state at each start, for both launch forms (the "loop" one
  with two V blocks). Slow gates (g in (-0.3, 0)) so that the resets change the result."""
  q, k, v, g, beta, s0 = _inputs(7, 2, 100, 2, 16, 16)
  g = -0.3 * jax.random.uniform(jax.random.PRNGKey(3), g.shape)
  seg = jnp.asarray(_SEGMENTS)
  interpret = None if launch == _NATIVE_LAUNCH else True
  pallas = lambda *a: kda_chunked_pallas(*a[:5], initial_state=a[5], segment_ids=seg,
                                         launch=launch, interpret=interpret,
                                         block_v=8 if launch == "loop" else None)
  packed = lambda *a: kda.kda_recurrent(*a[:5], initial_state=a[5], segment_ids=seg)
  args = (q, k, v, g, beta, s0)
  o, s = jax.jit(pallas)(*args)
  o_r, s_r = _recurrent_packed(*args, seg)
  o_u, _ = _recurrent(*args)
  assert _rel_err(o_u, o_r) > 0.1           # the resets matter here
  assert _rel_err(o, o_r) < 1e-5 and _rel_err(s, s_r) < 1e-5
  for name, a, r in zip(_NAMES, _grads(pallas, args), _grads(packed, args)):
    assert _rel_err(a, r) < 1e-4, (name, _rel_err(a, r))


@jax.jit
def _recurrent_packed(q, k, v, g, beta, s0, seg):
  return kda.kda_recurrent(q, k, v, g, beta, initial_state=s0, segment_ids=seg)


# --------------------------------------------------------------------- unbounded gates
@pytest.mark.parametrize("launch", ["grid", "loop"])
def test_unbounded_gates_match_recurrent(launch):
  """Kimi Linear's gate (softplus decay, no bound; here down to about -80 per token) through
  the pair-by-pair diagonal tiles: values and the six gradients equal the recurrence's, both
  launch forms; the bounded form would overflow here (e^(8·80))."""
  q, k, v, _, beta, s0 = _inputs(3, 1, 100, 2, 16, 16)
  z = 3.0 * jax.random.normal(jax.random.PRNGKey(5), q.shape)
  g = kda.kda_gate(z, jnp.log(jnp.full((2,), 8.0)), jnp.zeros((2, 16)), lower_bound=None)
  assert float(jnp.min(g)) < -50.0
  interpret = None if launch == _NATIVE_LAUNCH else True
  pallas = lambda *a: kda_chunked_pallas(*a[:5], initial_state=a[5], lower_bound=None,
                                         launch=launch, interpret=interpret)
  args = (q, k, v, g, beta, s0)
  o, s = jax.jit(pallas)(*args)
  o_r, s_r = _recurrent(*args)
  assert _rel_err(o, o_r) < 1e-5 and _rel_err(s, s_r) < 1e-5
  for name, a, r in zip(_NAMES, _grads(pallas, args), _grads(lambda *a: kda.kda_recurrent(
      *a[:5], initial_state=a[5]), args)):
    assert _rel_err(a, r) < 1e-4, (name, _rel_err(a, r))


# --------------------------------------------------------------------- the GPU target's sizes
@pytest.mark.parametrize("model", ["k3", "kimi_linear"])
def test_full_head_dim_at_gpu_sizes_matches_xla_op(model):
  """K = V = 128, bf16 inputs, the launch form and sizes the GPU target compiles (one program
  per head and V block of 64, chunk 16; interpreted on CPU, compiled on a GPU): values and the
  six gradients equal the XLA op's (`kda_chunked`, same bf16 inputs). K3: the bounded gate with
  packed documents; Kimi Linear: the unbounded gate."""
  bounded = model == "k3"
  q, k, v, g, beta, s0 = _inputs(11, 1, 40, 2, 128, 128, dtype=jnp.bfloat16)
  if not bounded:
    z = 3.0 * jax.random.normal(jax.random.PRNGKey(6), q.shape)
    g = kda.kda_gate(z, jnp.log(jnp.full((2,), 4.0)), jnp.zeros((2, 128)), lower_bound=None)
  seg = jnp.asarray([[0] * 7 + [1] * 20 + [2] * 13]) if bounded else None
  bound = -5.0 if bounded else None
  pallas = lambda *a: kda_chunked_pallas(*a[:5], initial_state=a[5], segment_ids=seg,
                                         lower_bound=bound, launch="loop", chunk_size=16,
                                         block_v=64)
  xla = lambda *a: kda.kda_chunked(*a[:5], initial_state=a[5], segment_ids=seg)
  args = (q, k, v, g, beta, s0)
  (o, s), (o_x, s_x) = jax.jit(pallas)(*args), jax.jit(xla)(*args)
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  assert _rel_err(o, o_x) < 1e-2 and _rel_err(s, s_x) < 1e-2
  for name, a, r in zip(_NAMES, _grads(pallas, args), _grads(xla, args)):
    assert _rel_err(a, r) < 2e-2, (name, _rel_err(a, r))
