"""Rejection sampling keeps the target distribution; LK loss; greedy acceptance."""

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.serve.speculative import lk_loss, residual_distribution, verify_drafts


def test_lk_loss_matches_definition():
  t = jax.random.normal(jax.random.PRNGKey(0), (4, 7))
  d = jax.random.normal(jax.random.PRNGKey(1), (4, 7))
  p, q = np.asarray(jax.nn.softmax(t)), np.asarray(jax.nn.softmax(d))
  ref = -np.log(np.minimum(p, q).sum(-1))
  np.testing.assert_allclose(lk_loss(t, d), ref, rtol=1e-5)
  np.testing.assert_allclose(lk_loss(t, t), 0.0, atol=1e-6)


def test_exact_output_distribution_formula():
  """P(x) = q(x) min(1, p/q) + (1 − Σ min(p, q)) · residual(x) equals p exactly."""
  p = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(2), (5, 9)))
  q = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(3), (5, 9)))
  out = q * jnp.minimum(1.0, p / q) + (1 - jnp.minimum(p, q).sum(-1, keepdims=True)) * \
      residual_distribution(p, q)
  np.testing.assert_allclose(out, p, atol=1e-6)


def test_verify_output_distribution_equals_target():
  """Statistical check with a fixed seed: 200k rounds of one draft each."""
  v, n = 6, 200_000
  p = jnp.array([0.05, 0.4, 0.1, 0.25, 0.0, 0.2])
  q = jnp.array([0.3, 0.1, 0.1, 0.2, 0.2, 0.1])
  kd, kv = jax.random.split(jax.random.PRNGKey(4))
  drafts = jax.random.categorical(kd, jnp.log(q), shape=(n,))[:, None]
  # Second target position (the bonus) has its own distribution.
  p2 = jnp.array([0.5, 0.0, 0.0, 0.0, 0.5, 0.0])
  target = jnp.broadcast_to(jnp.stack([p, p2]), (n, 2, v))
  num, nxt = verify_drafts(kv, target, jnp.broadcast_to(q, (n, 1, v)), drafts)
  first = np.where(np.asarray(num) == 1, np.asarray(drafts[:, 0]), np.asarray(nxt))
  freq = np.bincount(first, minlength=v) / n
  ref = np.asarray(p)
  np.testing.assert_array_less(np.abs(freq - ref), 5 * np.sqrt(ref * (1 - ref) / n) + 1e-9)
  accept = float(np.mean(np.asarray(num)))
  expect = float(jnp.minimum(p, q).sum())
  assert abs(accept - expect) < 5 * np.sqrt(expect * (1 - expect) / n)
  bonus = np.asarray(nxt)[np.asarray(num) == 1]
  assert set(np.unique(bonus)) <= {0, 4}


def test_greedy_acceptance_is_argmax_match():
  v = 5
  p = jax.nn.one_hot(jnp.array([[1, 3, 2], [4, 0, 0], [2, 2, 1]]), v)     # targets' argmaxes
  drafts = jnp.array([[1, 3], [4, 1], [0, 2]])
  q = jax.nn.one_hot(drafts, v)
  num, nxt = verify_drafts(jax.random.PRNGKey(0), p, q, drafts)
  np.testing.assert_array_equal(num, [2, 1, 0])
  np.testing.assert_array_equal(nxt, [2, 0, 2])
