"""Quantile Balancing as an optax transformation (k3jax/train/balance.py).

The QB maths is tested in tests/ops/test_balance.py; here: the transformation sets the bias
from the forward pass's stats, per layer, inside the full optimizer, with no gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import balance as ops
from k3jax.ops.moe import route
from k3jax.train import balance as qb
from k3jax.train.optim import make_optimizer

K, E, BINS, RANGE = 2, 8, 200, (-1.0, 1.0)
MOD = "layers_1/block_sparse_moe"


def _router_stats(key, bias, m=256):
  """What a MoE layer sows: loads and the margin histogram against the current bias."""
  logits = jax.random.normal(key, (m, E)) + jnp.linspace(-1.5, 1.5, E)   # skewed router
  scores = jax.nn.sigmoid(logits)
  _, idx, cutoff = route(scores, bias, K)
  load = jnp.zeros(E).at[idx.reshape(-1)].add(1.0)
  return scores, load, ops.margin_histogram(scores, cutoff, BINS, RANGE)


def _bias_tree(b):
  return {"balance": {"layers_1": {"block_sparse_moe": {"gate": {qb.BIAS_NAME: b}}}}}


def test_flat_stats_paths():
  st = {"body": {"layers_3": {"self_attn": {"max_logit": jnp.ones((2, 3))}}},
        "mtp": {"layer": {"block_sparse_moe": {"load": (jnp.ones(4),)}}}}
  flat = qb.flat_stats(st)
  assert set(flat) == {"body/layers_3/self_attn/max_logit", "mtp/layer/block_sparse_moe/load"}
  assert qb.moe_module_of(f"balance/body/layers_0/block_sparse_moe/gate/{qb.BIAS_NAME}") == (
      "body/layers_0/block_sparse_moe")
  with pytest.raises(ValueError, match="router-bias path"):
    qb.moe_module_of("balance/foo/bar")


def test_qb_transform_sets_bias_from_histogram():
  b0 = jnp.zeros(E)
  scores, load, hist = _router_stats(jax.random.PRNGKey(0), b0)
  tx = qb.quantile_balancing("qb", k=K, value_range=RANGE)
  tree = _bias_tree(b0 + 0.3)            # the old bias is replaced, not accumulated
  upd, _ = tx.update(jax.tree.map(jnp.zeros_like, tree), tx.init(tree), tree,
                     stats={f"{MOD}/margin_hist": hist, f"{MOD}/load": load})
  new = (tree["balance"]["layers_1"]["block_sparse_moe"]["gate"][qb.BIAS_NAME]
         + upd["balance"]["layers_1"]["block_sparse_moe"]["gate"][qb.BIAS_NAME])
  np.testing.assert_allclose(new, ops.qb_bias_from_histogram(hist, K, RANGE), atol=1e-6)
  assert abs(float(new.mean())) < 1e-6
  # The new bias balances the batch that produced it (near q = m·k/E per expert) far better
  # than before.
  _, idx, _ = route(scores, new, K)
  after = np.bincount(np.asarray(idx).ravel(), minlength=E)
  cv = lambda l: np.std(l) / np.mean(l)  # noqa: E731
  assert cv(after) < 0.35 * cv(np.asarray(load)), (load, after)


def test_sign_and_none_methods():
  b0 = jnp.linspace(-0.1, 0.1, E)
  _, load, hist = _router_stats(jax.random.PRNGKey(1), b0)
  stats = {f"{MOD}/margin_hist": hist, f"{MOD}/load": load}
  tree = _bias_tree(b0)
  for method, want in [("sign", ops.sign_rule_update(b0, load, 0.01)), ("none", jnp.zeros(E))]:
    tx = qb.quantile_balancing(method, k=K, value_range=RANGE, gamma=0.01)
    upd, _ = tx.update(jax.tree.map(jnp.zeros_like, tree), tx.init(tree), tree, stats=stats)
    got = b0 + upd["balance"]["layers_1"]["block_sparse_moe"]["gate"][qb.BIAS_NAME]
    np.testing.assert_allclose(got, want, atol=1e-7)
  with pytest.raises(ValueError, match="balance.method"):
    qb.quantile_balancing("median", k=K)


def test_inside_optimizer_per_scanned_layer_and_no_gradient():
  """The full optimizer: params get Muon/AdamW, the [G, E] bias is set per layer from
  [G, E, bins] stats (each layer its own histogram), and a bias gradient is ignored."""
  keys = jax.random.split(jax.random.PRNGKey(2), 2)
  hists = jnp.stack([_router_stats(k, jnp.zeros(E))[2] for k in keys])
  b = jnp.zeros((2, E))
  path = "body/layers_0/block_sparse_moe"
  variables = {"params": {"lm_head": {"kernel": jnp.ones((4, 3))}},
               "balance": {"body": {"layers_0": {"block_sparse_moe": {"gate": {
                   qb.BIAS_NAME: b}}}}}}
  tx = make_optimizer(lambda s: 0.1, balance_tx=qb.quantile_balancing(
      "qb", k=K, value_range=RANGE))
  grads = jax.tree.map(jnp.ones_like, variables)      # a (bogus) bias gradient: ignored
  upd, _ = tx.update(grads, tx.init(variables), variables,
                     stats={f"{path}/margin_hist": hists})
  got = upd["balance"]["body"]["layers_0"]["block_sparse_moe"]["gate"][qb.BIAS_NAME]
  for g in range(2):
    np.testing.assert_allclose(got[g], ops.qb_bias_from_histogram(hists[g], K, RANGE),
                               atol=1e-6)
  assert not np.allclose(got[0], got[1])
  assert np.all(np.asarray(upd["params"]["lm_head"]["kernel"]) < 0)   # AdamW moved params
  # Without stats (e.g. a step that sowed none) the bias is left as it is.
  upd, _ = tx.update(grads, tx.init(variables), variables)
  np.testing.assert_array_equal(
      upd["balance"]["body"]["layers_0"]["block_sparse_moe"]["gate"][qb.BIAS_NAME], 0.0)
