"""The train step's gradient accumulation: G micro-batches = the whole batch at once."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax.config import preset
from k3jax.data import corpus as D
from k3jax.data import tokenizers
from k3jax.train.sharded import PRETRAIN
from k3jax.train.state import init_state, init_variables
from k3jax.train.step import lm_loss, make_step

CFG = preset("tiny", num_layers=2, mla_every=2)   # KDA (dense) + MLA (MoE), MTP


def create_state(config, rng, tx):
  return init_state(init_variables(config, rng), PRETRAIN, tx)


def make_train_step(config, tx, grad_accum=1):
  """Pre-training's step: the language-model loss, QK-Clip at τ = 100."""
  return make_step(lm_loss(config), tx, grad_accum=grad_accum,
                   qk_clip=(100.0, config.text.qk_nope_head_dim))


def _batch(b=4, t=16, seed=0):
  rng = np.random.default_rng(seed)
  windows = rng.integers(0, 256, size=(b, t + 2))
  windows[1, 5] = tokenizers.EOS                # a document boundary: masks and segment ids differ
  return jax.tree.map(jnp.asarray, D.pack_windows(windows))


def test_accumulated_step_equals_whole_batch_step():
  # SGD: the update is -lr·grad, so equal parameters after the step mean equal gradients.
  tx = optax.sgd(1.0)
  state = create_state(CFG, jax.random.PRNGKey(1), tx)
  batch = _batch()
  s1, m1 = jax.jit(make_train_step(CFG, tx, grad_accum=1))(state, batch)
  s2, m2 = jax.jit(make_train_step(CFG, tx, grad_accum=2))(state, batch)
  assert m1["loss"] > 1.0 and m1["mtp_ce"] > 1.0    # a real loss, MTP included
  for key in ("loss", "ce", "mtp_ce", "grad_norm"):
    np.testing.assert_allclose(m2[key], m1[key], rtol=1e-5, err_msg=key)
  moved = 0
  for a, b, p in zip(jax.tree.leaves(s2.params), jax.tree.leaves(s1.params),
                     jax.tree.leaves(state.params)):
    step = float(jnp.max(jnp.abs(b - p)))
    moved += step > 0
    # fp32 sums in another order: differences ~1e-4 of the step; a wrong normalisation of a
    # micro-batch would be tens of percent.
    np.testing.assert_allclose(a - p, b - p, rtol=1e-3, atol=1e-3 * step + 1e-9)
  assert moved > 10
  # Statistics: loads and drops add up over micro-batches, the max logit is the max.
  assert set(m1["stats"]) == set(m2["stats"])
  assert any(k.endswith("/load") for k in m1["stats"])
  assert any(k.endswith("/max_logit") for k in m1["stats"])
  for key in m1["stats"]:
    np.testing.assert_allclose(m2["stats"][key], m1["stats"][key], rtol=1e-6, err_msg=key)


def test_accumulation_rejects_bad_sizes():
  tx = optax.sgd(1.0)
  state = create_state(CFG, jax.random.PRNGKey(1), tx)
  with pytest.raises(ValueError, match="grad_accum=3 must divide the batch size 4"):
    jax.eval_shape(make_train_step(CFG, tx, grad_accum=3), state, _batch())
  with pytest.raises(ValueError, match="grad_accum: expected a positive int"):
    make_train_step(CFG, tx, grad_accum=0)


def test_bf16_kernels_and_moments_train_like_fp32():
  """param_dtype=bfloat16 + mu_dtype=bfloat16 (the 256-chip recipe of docs/notes/sharding.md):
  Linear and expert kernels and the first moments are bf16, vectors/norms/router/convs stay fp32,
  dtypes survive the update, and three steps track the fp32 run's losses."""
  from k3jax.train.optim import make_optimizer
  from k3jax.tree_paths import path_str
  batch = _batch()
  losses = {}
  small = dict(num_layers=2, num_mtp_layers=0)        # a dense + an MoE layer: cheap compiles
  for name, cfg, mu in (("fp32", preset("tiny", **small), None),
                        ("bf16", preset("tiny", param_dtype="bfloat16", **small),
                         jnp.bfloat16)):
    tx = make_optimizer(lambda s: 1e-2, mu_dtype=mu)
    state = create_state(cfg, jax.random.PRNGKey(1), tx)
    if name == "bf16":    # the fp32 run's initial values, rounded: only the numerics differ
      params = jax.tree.map(lambda a, b: a.astype(b.dtype), init32, state.params)
      state = state.replace(params=params)
      state = state.replace(opt_state=tx.init(state.optimized))
    else:
      init32 = state.params
    dtypes = {path_str(p): x.dtype for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
    step = jax.jit(make_train_step(cfg, tx))
    losses[name] = []
    for _ in range(3):
      state, m = step(state, batch)
      losses[name].append(float(m["loss"]))
    after = {path_str(p): x.dtype for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
    assert after == dtypes
    if name == "bf16":
      kernels = {p: d for p, d in dtypes.items()
                 if p.endswith(("/w1", "/w2", "/w3", "q_proj/kernel"))}
      assert kernels and set(kernels.values()) == {jnp.dtype(jnp.bfloat16)}, kernels
      vectors = {p: d for p, d in dtypes.items()
                 if p.endswith(("A_log", "dt_bias", "/weight", "gate/kernel", "conv1d"))}
      assert vectors and set(vectors.values()) == {jnp.dtype(jnp.float32)}, vectors
      mus = [x.dtype for x in jax.tree.leaves(state.opt_state) if x.ndim >= 2]
      assert jnp.dtype(jnp.bfloat16) in mus
  assert losses["fp32"][2] < losses["fp32"][0] and losses["bf16"][2] < losses["bf16"][0]
  # Step 1 differs only by the rounding of the initial kernels (measured 0.12%); later steps
  # follow diverging trajectories at lr 1e-2 (measured 0.06% and 0.6% apart).
  np.testing.assert_allclose(losses["bf16"][0], losses["fp32"][0], rtol=5e-3)
  np.testing.assert_allclose(losses["bf16"], losses["fp32"], rtol=5e-2)


def test_frozen_packed_experts_fine_tune():
  """expert_format='mxfp4' with freeze_experts: the packed (uint8) experts stay bit for bit,
  everything else takes a step, and the loss goes down; without the freeze the optimizer
  refuses the packed parameters by name."""
  from k3jax.train.optim import make_optimizer
  from k3jax.tree_paths import path_str
  cfg = preset("tiny", num_layers=2, num_mtp_layers=0, expert_format="mxfp4")
  with pytest.raises(ValueError, match=r"experts/w1/weight_packed: uint8 parameter cannot be "
                                       r"trained"):
    create_state(cfg, jax.random.PRNGKey(1), make_optimizer(lambda s: 1e-2))
  tx = make_optimizer(lambda s: 1e-2, freeze_experts=True)
  state = create_state(cfg, jax.random.PRNGKey(1), tx)
  step = jax.jit(make_train_step(cfg, tx))
  batch = _batch()
  new, m1 = step(state, batch)
  new, m2 = step(new, batch)
  assert float(m2["loss"]) < float(m1["loss"])
  packed = moved = 0
  for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(state.params),
                       jax.tree.leaves(new.params)):
    if a.dtype == jnp.uint8:
      packed += 1
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path_str(p))
    else:
      moved += bool(jnp.any(a != b))
  assert packed == 6 and moved > 10     # weight_packed + weight_scale of w1, w3, w2


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_cross_entropy_is_the_loss_and_gradient_of_the_whole(tied):
  """`modes.ce_chunks`: the head applied to 4 strided chunks of tokens at a time (its logits
  recomputed in the backward) gives the loss, the CE / MTP CE metrics and every gradient of
  the whole-vocabulary loss (lm_head, or the tied token table, included); bad settings are
  refused."""
  from k3jax.train.step import chunked_cross_entropy
  cfg = preset("tiny", num_layers=2, mla_every=2, tie_word_embeddings=tied)
  variables = init_variables(cfg, jax.random.PRNGKey(3))
  batch = _batch()
  totals = lambda c: lm_loss(c).totals(batch)  # noqa: E731

  def grads(c):
    loss = lm_loss(c)
    return jax.jit(jax.value_and_grad(
        lambda p: loss.fn({**variables, "params": p}, batch, totals(c)), has_aux=True))(
            variables["params"])

  (v1, aux1), g1 = grads(cfg)
  (v2, aux2), g2 = grads(cfg.replace(ce_chunks=4))
  assert aux1["metrics"]["mtp_ce"] > 1.0
  np.testing.assert_allclose(v2, v1, rtol=1e-6)
  for k in ("ce", "mtp_ce"):
    np.testing.assert_allclose(aux2["metrics"][k], aux1["metrics"][k], rtol=1e-6, err_msg=k)
  head = "embed_tokens" if tied else "lm_head"
  assert float(jnp.abs(jax.tree.leaves(g1[head])[0]).max()) > 0
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g2)[0], jax.tree.leaves(g1)):
    scale = float(jnp.abs(b).max()) + 1e-12
    assert float(jnp.abs(a - b).max()) <= 1e-5 * scale, jax.tree_util.keystr(path)
  with pytest.raises(ValueError, match="ce_chunks=5 must divide"):
    chunked_cross_entropy(jnp.zeros((1, 16, 4)), jnp.zeros((4, 8)), jnp.zeros((1, 16), int),
                          jnp.ones((1, 16)), 5, jnp.float32)
  with pytest.raises(ValueError, match="mtp_full_length"):
    lm_loss(cfg.replace(ce_chunks=4, mtp_full_length=False))
  with pytest.raises(ValueError, match="ce_chunks"):
    cfg.replace(ce_chunks=0)
