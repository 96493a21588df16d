"""Tests for k3jax.ops.moe against slow, obviously correct numpy references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from isolation import assert_isolated
from k3jax.ops import moe
from pallas_kernels import moe_gmm

# The four ways to compute the routed experts: the dense reference, the sorted XLA path, and
# expert-sorted rows through a grouped matmul passed in (ragged_dot, or the Pallas kernel,
# interpreted on CPU).
PATHS = {"reference": moe.expert_mlp_reference, "sort": moe.expert_mlp,
         "ragged": functools.partial(moe.expert_mlp, gmm=moe.ragged_gmm),
         "gmm": functools.partial(moe.expert_mlp, gmm=moe_gmm.gmm)}
# One compile per (shape, option) instead of one per primitive: keeps the suite fast.
_JIT = {name: jax.jit(fn, static_argnames=("activation", "beta1", "beta2", "capacity"))
        for name, fn in PATHS.items()}


def _mlp(*args, path="sort", **kwargs):
  return _JIT[path](*args, **kwargs)


_route = jax.jit(moe.route, static_argnames=("k",))


def _np_situ(a, b, b1=4.0, b2=25.0):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  sig = np.exp(-np.logaddexp(0.0, -a))  # overflow-free sigmoid
  return b1 * np.tanh(a / b1) * sig * b2 * np.tanh(b / b2)


def _np_expert_mlp(x, weights, indices, w1, w3, w2, cap=None, act=_np_situ):
  """One (token, slot) pair at a time, in float64, with the documented dropping rule."""
  x, w1, w3, w2, weights = (np.asarray(t, np.float64) for t in (x, w1, w3, w2, weights))
  indices = np.asarray(indices)
  n, k = indices.shape
  y = np.zeros_like(x)
  seen = {}
  dropped = 0
  for i in range(n):
    for j in range(k):
      e = int(indices[i, j])
      seen[e] = seen.get(e, 0) + 1
      if cap is not None and seen[e] > cap:
        dropped += 1
        continue
      h = act(x[i] @ w1[e], x[i] @ w3[e])
      y[i] += weights[i, j] * (h @ w2[e])
  return y, dropped


def _problem(seed, n, d, f, e, k, dtype=jnp.float32):
  """Random tokens, routing (biased top-k) and expert weights; numpy-generated (no compiles)."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(n, d)), dtype)
  scores = jnp.asarray(1 / (1 + np.exp(-rng.normal(size=(n, e)))), jnp.float32)
  bias = jnp.asarray(0.3 * rng.normal(size=(e,)), jnp.float32)
  weights, indices, _ = _route(scores, bias, k)
  w1 = jnp.asarray(rng.normal(size=(e, d, f)) / np.sqrt(d), jnp.float32)
  w3 = jnp.asarray(rng.normal(size=(e, d, f)) / np.sqrt(d), jnp.float32)
  w2 = jnp.asarray(rng.normal(size=(e, f, d)) / np.sqrt(f), jnp.float32)
  return x, weights, indices, w1, w3, w2


# ----------------------------------------------------------------------------- activations
def test_situ_matches_formula_and_is_bounded():
  a = jnp.linspace(-1e4, 1e4, 4001)
  b = jnp.linspace(1e4, -1e4, 4001)
  f = moe.situ_glu(a, b)
  np.testing.assert_allclose(f, _np_situ(a, b), rtol=1e-5, atol=1e-5)
  assert float(jnp.max(jnp.abs(f))) <= 100.0
  g = moe.situ_glu(jnp.full((3,), 1e30), jnp.full((3,), -1e30))
  np.testing.assert_allclose(g, -100.0, rtol=1e-6)


def test_situ_close_to_swiglu_near_zero():
  a = jnp.asarray(np.random.default_rng(0).uniform(-0.1, 0.1, 1000), jnp.float32)
  b = jnp.asarray(np.random.default_rng(1).uniform(-0.1, 0.1, 1000), jnp.float32)
  assert float(jnp.max(jnp.abs(moe.situ_glu(a, b) - moe.swiglu(a, b)))) <= 1e-2
  np.testing.assert_allclose(moe.swiglu(a, b), np.asarray(a) / (1 + np.exp(-np.asarray(a)))
                             * np.asarray(b), rtol=1e-5, atol=1e-7)


def test_activation_dtype_follows_inputs():
  a = jnp.ones((4,), jnp.bfloat16) * 3
  out = moe.situ_glu(a, a)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.float32(out), _np_situ(3.0, 3.0), rtol=1e-2)
  with pytest.raises(ValueError, match="same shape"):
    moe.situ_glu(jnp.ones(3), jnp.ones(4))


# ----------------------------------------------------------------------------- routing
@settings(max_examples=8)
@given(st.sampled_from([1, 9]), st.sampled_from([2, 5, 12]), st.integers(0, 2**16), st.data())
def test_route_matches_sorting_reference(n, e, seed, data):
  k = data.draw(st.integers(1, e - 1))
  rng = np.random.default_rng(seed)
  scores = rng.uniform(size=(n, e)).astype(np.float32)
  bias = rng.normal(scale=0.5, size=(e,)).astype(np.float32)
  w, idx, cut = _route(jnp.asarray(scores), jnp.asarray(bias), k)
  assert w.dtype == jnp.float32 and idx.dtype == jnp.int32 and cut.dtype == jnp.float32
  biased = scores + bias
  order = np.argsort(-biased, axis=1, kind="stable")
  np.testing.assert_array_equal(np.sort(idx, 1), np.sort(order[:, :k], 1))
  np.testing.assert_allclose(cut, np.take_along_axis(biased, order[:, k:k + 1], 1)[:, 0],
                             rtol=1e-6)
  chosen = np.take_along_axis(scores, np.asarray(idx), 1)
  np.testing.assert_allclose(w, chosen / (chosen.sum(1, keepdims=True) + 1e-20), rtol=1e-5)


def test_bias_changes_choice_never_weights_of_chosen():
  scores = jnp.array([[0.9, 0.8, 0.3, 0.1]], jnp.float32)
  w0, i0, _ = moe.route(scores, jnp.zeros(4), 2)
  assert set(np.asarray(i0[0]).tolist()) == {0, 1}
  # Push expert 3 above expert 1: the choice changes ...
  w1, i1, c1 = moe.route(scores, jnp.array([0.0, 0.0, 0.0, 0.75]), 2)
  assert set(np.asarray(i1[0]).tolist()) == {0, 3}
  np.testing.assert_allclose(c1, [0.8], rtol=1e-6)
  # ... and the weights are the unbiased scores renormalised over the chosen set.
  got = dict(zip(np.asarray(i1[0]).tolist(), np.asarray(w1[0]).tolist()))
  np.testing.assert_allclose([got[0], got[3]], [0.9 / 1.0, 0.1 / 1.0], rtol=1e-6)
  # A bias that keeps the same set leaves every weight bit-identical.
  w2, i2, _ = moe.route(scores, jnp.array([0.05, 0.0, 0.0, 0.0]), 2)
  np.testing.assert_array_equal(np.sort(i2, 1), np.sort(i0, 1))
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(w2), np.argsort(i2, 1), 1),
                                np.take_along_axis(np.asarray(w0), np.argsort(i0, 1), 1))


def test_route_rejects_bad_input():
  with pytest.raises(ValueError, match="k must be"):
    moe.route(jnp.ones((2, 4)), jnp.zeros(4), 4)
  with pytest.raises(ValueError, match="bias"):
    moe.route(jnp.ones((2, 4)), jnp.zeros(3), 1)
  with pytest.raises(ValueError, match="scores"):
    moe.route(jnp.ones((4,)), jnp.zeros(4), 1)


def test_capacity():
  assert moe.capacity(100, 8, 64, None) == 100          # dropless bound: one row per token
  assert moe.capacity(100, 8, 64, 1.0) == 13            # ceil(12.5)
  assert moe.capacity(100, 8, 64, 1000.0) == 100        # clamped to the dropless bound
  assert moe.capacity(1, 1, 64, 0.01) == 1
  with pytest.raises(ValueError, match="capacity_factor"):
    moe.capacity(10, 2, 4, 0.0)


# ----------------------------------------------------------------------------- expert_mlp
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cap", [None, 3])
def test_expert_mlp_matches_loop_reference(path, cap):
  x, w, idx, w1, w3, w2 = _problem(0, n=13, d=8, f=6, e=5, k=2)
  y, dropped = _mlp(x, w, idx, w1, w3, w2, capacity=cap, path=path)
  y_ref, d_ref = _np_expert_mlp(x, w, idx, w1, w3, w2, cap)
  assert y.dtype == jnp.float32 and dropped.dtype == jnp.int32
  np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5)
  assert int(dropped) == d_ref
  if cap is not None:
    assert d_ref > 0  # the case really drops


def test_sort_tiled_layout_many_tiles_per_expert():
  # Dropless with N·k=128 over 16 experts: 30 tiles of 8 rows (240 rows) against a [16, 64]
  # buffer (1024 rows), so this runs the tiled branch; capacity 10 runs the buffer.
  x, w, idx, w1, w3, w2 = _problem(7, n=64, d=8, f=8, e=16, k=2)
  assert moe.sort_layout(64, 2, 16, None) == ("tiled", 240, 8)
  assert moe.sort_layout(64, 2, 16, 10) == ("buffer", 160, 10)
  for cap in (None, 10):
    y, dr = _mlp(x, w, idx, w1, w3, w2, capacity=cap, path="sort")
    y_ref, d_ref = _np_expert_mlp(x, w, idx, w1, w3, w2, cap)
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5)
    assert int(dr) == d_ref
  assert d_ref > 0  # the capacity run really drops


@pytest.mark.parametrize("path,n,e", [
    ("sort", 13, 5),     # capacity-padded buffer layout
    ("sort", 64, 16),    # expert-aligned tiles
    ("ragged", 13, 5),
    ("gmm", 13, 5),
])
def test_dropless_tokens_are_bitwise_isolated(path, n, e):
  """Dropless, a token's output and the gradients of its input and combine weights are
  bit-for-bit the same whatever the other tokens hold and wherever they are routed — which
  moves the token's rows inside the expert-sorted buffer. (With a capacity, tokens compete
  for an expert's rows by design: the dropping rule ranks them in token order.)"""
  x, w, idx, w1, w3, w2 = _problem(0, n=n, d=8, f=6, e=e, k=2)
  alt = _problem(1, n=n, d=8, f=6, e=e, k=2)
  doc = np.arange(n) % 3 == 1
  assert not np.array_equal(np.asarray(alt[2])[~doc], np.asarray(idx)[~doc])  # routing moves
  op = lambda *a: PATHS[path](*a)[0]
  assert_isolated(op, [x, w, idx, w1, w3, w2], list(alt[:3]) + [w1, w3, w2], doc,
                  per_token=[True] * 3 + [False] * 3)


@settings(max_examples=10)
@given(st.integers(1, 9), st.integers(1, 6), st.integers(0, 2**16), st.booleans())
def test_gather_rows_value_and_transpose(num_src, m, seed, sparse):
  # out[r] = src[index[r]] (valid rows); its custom VJP must equal autodiff of a plain gather.
  rng = np.random.default_rng(seed)
  src = jnp.asarray(rng.normal(size=(num_src, 3)), jnp.float32)
  # A random relation: each source row is read by up to m output rows, each output row once.
  reads = [(s, j) for s in range(num_src) for j in range(m) if not sparse or rng.random() < 0.5]
  rows = rng.permutation(len(reads) + 2)            # 2 extra output rows stay invalid (zero)
  num_out = len(reads) + 2
  index = np.zeros(num_out, np.int32)
  valid = np.zeros(num_out, bool)
  inv_index = np.zeros((num_src, m), np.int32)
  inv_valid = np.zeros((num_src, m), bool)
  for (s, j), r in zip(reads, rows):
    index[r], valid[r] = s, True
    inv_index[s, j], inv_valid[s, j] = r, True
  args = tuple(map(jnp.asarray, (index, valid, inv_index, inv_valid)))
  probe = jnp.asarray(rng.normal(size=(num_out, 3)), jnp.float32)
  out = moe.gather_rows(src, *args)
  expect = np.where(valid[:, None], np.asarray(src)[index], 0.0)
  np.testing.assert_array_equal(out, expect)
  g = jax.grad(lambda s: jnp.sum(moe.gather_rows(s, *args) * probe))(src)
  g_ref = jax.grad(lambda s: jnp.sum(jnp.where(args[1][:, None], s[args[0]], 0.0) * probe))(src)
  np.testing.assert_allclose(g, g_ref, rtol=1e-6, atol=1e-6)


@settings(max_examples=6)
@given(st.sampled_from([1, 12]), st.sampled_from([2, 7]), st.integers(0, 2**16), st.data())
def test_sort_equals_reference_random_shapes(n, e, seed, data):
  k = data.draw(st.integers(1, e - 1))
  cap = data.draw(st.one_of(st.none(), st.integers(1, n)))
  act = data.draw(st.sampled_from(["situ", "swiglu"]))
  x, w, idx, w1, w3, w2 = _problem(seed, n=n, d=4, f=3, e=e, k=k)
  y, dr = _mlp(x, w, idx, w1, w3, w2, capacity=cap, path="sort", activation=act)
  npact = _np_situ if act == "situ" else (lambda a, b: a / (1 + np.exp(-a)) * b)
  y_ref, d_ref = _np_expert_mlp(x, w, idx, w1, w3, w2, cap, act=npact)
  np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5)
  assert int(dr) == d_ref


@pytest.mark.parametrize("cap,paths,e", [(None, ("sort",), 4), (None, ("sort",), 16),
                                         (4, ("sort", "ragged", "gmm"), 4)])
def test_expert_mlp_gradients_agree(cap, paths, e):
  # e=4: buffer layout; e=16 dropless: tiled layout.
  assert moe.sort_layout(24, 2, e, cap)[0] == ("tiled" if e == 16 else "buffer")
  x, w, idx, w1, w3, w2 = _problem(1, n=24, d=6, f=5, e=e, k=2)
  probe = jnp.asarray(np.random.default_rng(9).normal(size=x.shape), jnp.float32)

  def loss(path):
    def f(x, w, w1, w3, w2):
      y, _ = PATHS[path](x, w, idx, w1, w3, w2, capacity=cap)
      return jnp.sum(y * probe)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(x, w, w1, w3, w2)

  g_ref = loss("reference")
  # The loop reference's derivative wrt the combine weights is the expert output itself.
  for path in paths:
    g = loss(path)
    for a, b in zip(g, g_ref):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  # Independent check of d/dweights against the float64 loop reference.
  eps = 1e-3
  wd = np.asarray(w, np.float64).copy()
  wd[3, 1] += eps
  yp, _ = _np_expert_mlp(x, wd, idx, w1, w3, w2, cap)
  wd[3, 1] -= 2 * eps
  ym, _ = _np_expert_mlp(x, wd, idx, w1, w3, w2, cap)
  fd = np.sum((yp - ym) / (2 * eps) * np.asarray(probe, np.float64))
  np.testing.assert_allclose(g_ref[1][3, 1], fd, rtol=1e-3, atol=1e-5)


def test_expert_mlp_bf16_compute():
  x, w, idx, w1, w3, w2 = _problem(2, n=16, d=8, f=8, e=4, k=2)
  y, _ = _mlp(x.astype(jnp.bfloat16), w, idx, w1, w3, w2, path="sort")
  y_ref, _ = _np_expert_mlp(x, w, idx, w1, w3, w2)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.float32(y), y_ref, rtol=5e-2, atol=5e-2)


def test_expert_mlp_jits_and_all_in_one_expert():
  x, w, _, w1, w3, w2 = _problem(3, n=9, d=4, f=4, e=4, k=2)
  idx = jnp.tile(jnp.array([[2, 0]], jnp.int32), (9, 1))
  f = jax.jit(lambda x: moe.expert_mlp(x, w, idx, w1, w3, w2, capacity=5))
  y, dropped = f(x)
  y_ref, d_ref = _np_expert_mlp(x, w, idx, w1, w3, w2, 5)
  np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5)
  assert int(dropped) == d_ref == 8


def test_expert_mlp_rejects_bad_input():
  x, w, idx, w1, w3, w2 = _problem(0, n=4, d=4, f=3, e=3, k=1)
  with pytest.raises(ValueError, match="w2"):
    moe.expert_mlp(x, w, idx, w1, w3, w1)
  with pytest.raises(ValueError, match="x must be"):
    moe.expert_mlp(x[None], w, idx, w1, w3, w2)
  with pytest.raises(ValueError, match="weights"):
    moe.expert_mlp(x, w[:, :0], idx, w1, w3, w2)
  with pytest.raises(ValueError, match="gmm"):
    moe.expert_mlp(x, w, idx, w1, w3, w2, gmm="fast")
  with pytest.raises(ValueError, match="activation"):
    moe.expert_mlp(x, w, idx, w1, w3, w2, activation="gelu")
  with pytest.raises(ValueError, match="indices"):
    moe.expert_mlp(x, w, idx.astype(jnp.float32), w1, w3, w2)
