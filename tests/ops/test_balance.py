"""Tests for k3jax.ops.balance (Quantile Balancing, docs/k3.md §7)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from k3jax.ops import balance, moe

_route = jax.jit(moe.route, static_argnames=("k",))
_exact = jax.jit(balance.qb_bias_exact, static_argnames=("k", "centered"))
_hist = jax.jit(balance.qb_bias_histogram,
                static_argnames=("k", "num_bins", "value_range", "centered"))


def _loads(indices, n):
  return np.bincount(np.asarray(indices).ravel(), minlength=n)


def _np_qb(scores, cutoff, k):
  """Slow reference: per expert, sort the margins by hand and take the (q+1)-th largest."""
  m, n = scores.shape
  q = (m * k) // n
  b = np.array([-sorted(scores[:, j] - cutoff, reverse=True)[q] for j in range(n)])
  return b - b.mean()


# A batch of 8 tokens over 4 experts (k=1) whose plain routing loads are (4, 3, 1, 0).
WORKED = np.array([
    [0.685, 0.571, 0.199, 0.236], [0.924, 0.868, 0.648, 0.562], [0.412, 0.573, 0.383, 0.010],
    [0.646, 0.670, 0.319, 0.338], [0.631, 0.688, 0.416, 0.315], [0.990, 0.307, 0.093, 0.065],
    [0.433, 0.760, 0.849, 0.328], [0.829, 0.491, 0.268, 0.502]], np.float32)


def test_worked_example_one_step_balances():
  s = jnp.asarray(WORKED)
  _, idx, cutoff = _route(s, jnp.zeros(4), k=1)
  assert tuple(_loads(idx, 4)) == (4, 3, 1, 0)
  bias = _exact(s, cutoff, k=1)
  np.testing.assert_allclose(bias, _np_qb(WORKED, np.asarray(cutoff), 1), atol=1e-6)
  _, idx2, _ = _route(s, bias, k=1)
  assert tuple(_loads(idx2, 4)) == (2, 2, 2, 2)
  # The histogram estimate gives the same routing here.
  _, idx3, _ = _route(s, _hist(s, cutoff, k=1), k=1)
  assert tuple(_loads(idx3, 4)) == (2, 2, 2, 2)


def _random_batch(seed, m, n, k):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(m, n)) + rng.normal(scale=1.0, size=(n,))  # imbalanced experts
  s = jnp.asarray(1 / (1 + np.exp(-logits)), jnp.float32)
  b0 = jnp.asarray(rng.normal(scale=0.1, size=(n,)), jnp.float32)
  _, idx, cutoff = _route(s, b0, k=k)
  return s, cutoff, idx


@settings(max_examples=8)
@given(st.sampled_from([(32, 4, 1), (40, 6, 2), (64, 8, 3), (50, 16, 4)]), st.integers(0, 999))
def test_exact_q_margins_clear_the_uncentred_bias(shape, seed):
  m, n, k = shape
  s, _, _ = _random_batch(seed, m, n, k)
  # Generic fixed cutoffs (a routing's own cutoffs tie: the (k+1)-th expert's margin is -b_j).
  cutoff = jnp.asarray(np.random.default_rng(seed + 1).uniform(0.3, 0.9, size=m), jnp.float32)
  b = _exact(s, cutoff, k=k, centered=False)
  h = np.asarray(s) - np.asarray(cutoff)[:, None]
  q = (m * k) // n  # (40·2/6 and 50·4/16 are not integers: q rounds down)
  assert np.all(np.sum(h + np.asarray(b) > 0, axis=0) == q)
  centred = _exact(s, cutoff, k=k)
  np.testing.assert_allclose(centred, _np_qb(np.asarray(s), np.asarray(cutoff), k), atol=1e-6)
  assert abs(float(jnp.mean(centred))) < 1e-6


@settings(max_examples=6)
@given(st.sampled_from([(32, 4, 1), (257, 16, 4)]), st.integers(0, 999),
       st.sampled_from([10, 1000]))
def test_histogram_within_one_bin_of_exact(shape, seed, bins):
  m, n, k = shape
  s, cutoff, _ = _random_batch(seed, m, n, k)
  width = 4.0 / bins
  ex = _exact(s, cutoff, k=k, centered=False)
  hi = _hist(s, cutoff, k=k, num_bins=bins, value_range=(-2.0, 2.0), centered=False)
  assert float(jnp.max(jnp.abs(ex - hi))) < width
  hc = _hist(s, cutoff, k=k, num_bins=bins, value_range=(-2.0, 2.0))
  assert abs(float(jnp.mean(hc))) < 1e-6


def test_margin_histogram_counts_and_clipping():
  scores = jnp.array([[0.5, 3.0], [0.1, -5.0], [0.25, 0.0]], jnp.float32)
  cutoff = jnp.zeros(3, jnp.float32)
  counts = jax.jit(balance.margin_histogram, static_argnums=(2, 3))(scores, cutoff, 4, (-1.0, 1.0))
  assert counts.dtype == jnp.int32
  # bins [-1,-.5) [-.5,0) [0,.5) [.5,1): expert 0 margins .5,.1,.25; expert 1: 3 (clip), -5 (clip), 0
  np.testing.assert_array_equal(counts, [[0, 0, 2, 1], [1, 0, 1, 1]])
  # Summed counts (two "devices") give the bias of the whole batch.
  s, c, _ = _random_batch(3, 64, 8, 2)

  @jax.jit
  def two_ways(s, c):
    full = balance.margin_histogram(s, c, 200)
    parts = (balance.margin_histogram(s[:30], c[:30], 200)
             + balance.margin_histogram(s[30:], c[30:], 200))
    return (full, parts, balance.qb_bias_from_histogram(parts, 2),
            balance.qb_bias_histogram(s, c, 2, num_bins=200))

  full, parts, b_parts, b_full = two_ways(s, c)
  np.testing.assert_array_equal(full, parts)
  np.testing.assert_allclose(b_parts, b_full, atol=1e-7)


def test_qb_bias_never_changes_chosen_weights():
  s, cutoff, _ = _random_batch(5, 64, 8, 2)
  bias = _exact(s, cutoff, k=2)
  w, idx, _ = _route(s, bias, k=2)
  chosen = np.take_along_axis(np.asarray(s), np.asarray(idx), 1)
  np.testing.assert_allclose(w, chosen / chosen.sum(1, keepdims=True), rtol=1e-6)


def _cv(load):
  load = np.asarray(load, np.float64)
  return load.std() / load.mean()


def test_one_qb_step_beats_one_sign_step():
  m, n, k = 2048, 32, 4
  rng = np.random.default_rng(0)
  w_router = rng.normal(size=(16, n))
  pref = rng.normal(scale=1.0, size=(n,))   # a skewed router: some experts always preferred

  def batch(seed):
    x = np.random.default_rng(seed).normal(size=(m, 16))
    return jnp.asarray(1 / (1 + np.exp(-(x @ w_router / 4 + pref))), jnp.float32)

  zero = jnp.zeros(n, jnp.float32)
  s1 = batch(1)
  _, idx, cutoff = _route(s1, zero, k=k)
  load0 = balance.expert_load(idx, n)
  b_qb = _exact(s1, cutoff, k=k)
  b_sign = balance.sign_rule_update(zero, load0)
  # The bias takes effect on the next batch.
  s2 = batch(2)
  cv_none = _cv(_loads(_route(s2, zero, k=k)[1], n))
  cv_qb = _cv(_loads(_route(s2, b_qb, k=k)[1], n))
  cv_sign = _cv(_loads(_route(s2, b_sign, k=k)[1], n))
  assert cv_none > 0.5
  assert cv_qb < 0.15
  assert cv_qb < 0.25 * cv_sign


def test_sign_rule_and_load():
  load = balance.expert_load(jnp.array([[0, 1], [0, 2], [0, 1]]), 4)
  np.testing.assert_array_equal(load, [3, 2, 1, 0])
  b = balance.sign_rule_update(jnp.zeros(4), load, gamma=0.5)
  np.testing.assert_allclose(b, [-0.5, -0.5, 0.5, 0.5])


def test_bad_input():
  with pytest.raises(ValueError, match="cutoff"):
    balance.qb_bias_exact(jnp.ones((4, 3)), jnp.ones(3), 1)
  with pytest.raises(ValueError, match="k must be"):
    balance.qb_bias_histogram(jnp.ones((4, 3)), jnp.ones(4), 3)
  with pytest.raises(ValueError, match="counts"):
    balance.qb_bias_from_histogram(jnp.ones((3, 10)), 1)
  with pytest.raises(ValueError, match="value_range"):
    balance.margin_histogram(jnp.ones((4, 3)), jnp.ones(4), 10, (1.0, -1.0))
