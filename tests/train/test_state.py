"""The one train state (k3jax/train/state.py): what `Trainable` splits off, what comes back
together, and that every kind of training runs the same step on it (pre-training, LoRA, the
EAGLE-3 draft): only the trainable variables move."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax.config import preset
from k3jax.posttrain import eagle, lora
from k3jax.train.sharded import PRETRAIN
from k3jax.train.state import (BALANCE, Trainable, init_state, init_variables, merge_trees,
                               with_optimized)
from k3jax.train.step import Loss, lm_loss, make_step

TREE = {"params": {"a": {"w": 1.0}, "mtp": {"w": 2.0}, "draft_fuse": {"k": 3.0}},
        "balance": {"a": {"b": 4.0}}, "lora": {"a": {"la": 5.0}}}


def test_split_and_merge_are_inverse():
  for trainable, params_keys, frozen_keys, balance in (
      (PRETRAIN, {"params"}, {"lora"}, {"a": {"b": 4.0}}),
      (lora.ADAPTERS, {"lora"}, {"params", "balance"}, {}),
      (eagle.DRAFT, {"params"}, {"params", "balance", "lora"}, {})):
    params, frozen, bal = trainable.split(TREE)
    assert set(params) == params_keys and set(frozen) == frozen_keys and bal == balance
    back = merge_trees(params, frozen)
    if bal:
      back = {**back, BALANCE: bal}
    assert back == TREE
  params, frozen, _ = eagle.DRAFT.split(TREE)
  assert params == {"params": {"mtp": {"w": 2.0}, "draft_fuse": {"k": 3.0}}}
  assert frozen["params"] == {"a": {"w": 1.0}}


def test_bad_paths_and_overlaps_are_named():
  with pytest.raises(ValueError, match="trainable path params/nope: no 'nope'"):
    Trainable(("params", "nope")).split(TREE)
  with pytest.raises(ValueError, match="name at least one path"):
    Trainable()
  with pytest.raises(ValueError, match="'w' is in both trees"):
    merge_trees({"a": {"w": 1}}, {"a": {"w": 2}})


def _batch(b=2, t=16):
  tok = jnp.asarray(np.random.default_rng(0).integers(0, 256, (b, t)), jnp.int32)
  return dict(inputs=tok, targets=jnp.roll(tok, -1, axis=1), loss_mask=jnp.ones((b, t)),
              segment_ids=jnp.ones((b, t), jnp.int32))


def _moved(a, b):
  return [not np.array_equal(np.asarray(x), np.asarray(y))
          for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]


@pytest.mark.parametrize("kind", ["adapters", "draft"])
def test_one_step_moves_only_the_trainable_variables(kind):
  """The same `make_step` trains adapters (base frozen) or the draft (target frozen): the
  trainable leaves move (an adapter's A only once its B is non-zero: B starts at zero), every
  frozen leaf and the router bias stay bit for bit, and the state's variables are the model's
  (what `K3Model.apply` takes)."""
  if kind == "adapters":
    config = preset("tiny", num_layers=2, num_mtp_layers=0, lora_rank=2, lora_targets=("q", "o"))
    trainable, loss = lora.ADAPTERS, lm_loss(config, 0.0)
  else:
    config = eagle.eagle_config(preset("tiny", num_layers=3, mla_every=2, attn_res_block_size=2),
                                (1, -1))
    trainable, loss = eagle.DRAFT, eagle.draft_loss(config, steps=2, anchor_stride=4)
  variables = init_variables(config, jax.random.PRNGKey(0))
  state = init_state(variables, trainable, optax.with_extra_args_support(optax.sgd(0.5)))
  assert not state.balance                      # the router bias stays as loaded: frozen
  new, metrics = jax.jit(make_step(loss, optax.with_extra_args_support(optax.sgd(0.5))))(
      state, _batch())
  assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
  moved = dict(zip((jax.tree_util.keystr(p) for p, _ in
                    jax.tree_util.tree_leaves_with_path(state.params)),
                   _moved(state.params, new.params)))
  must = {k: m for k, m in moved.items() if "lora_a" not in k}
  assert must and all(must.values()), must
  assert not any(_moved(state.frozen, new.frozen))
  assert jax.tree.structure(new.variables) == jax.tree.structure(variables)
  assert int(new.step) == 1


def test_with_optimized_restores_a_checkpoint_tree():
  config = preset("tiny", num_layers=2, num_mtp_layers=0)
  tx = optax.with_extra_args_support(optax.sgd(0.1))
  state = init_state(init_variables(config, jax.random.PRNGKey(0)), PRETRAIN, tx)
  assert set(state.optimized) == {"params", "balance"}     # what a run's checkpoint holds
  saved = jax.tree.map(lambda x: x + 1, state.optimized)
  back = with_optimized(state, saved)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), back.optimized, saved))
  assert back.frozen == state.frozen


def test_micro_batches_add_up_to_the_whole_batch():
  """Micro-batches add up to the batch for a loss that divides by its `totals`: the summed loss
  of two halves is the whole batch's."""
  config = preset("tiny", num_layers=2, num_mtp_layers=0)
  tx = optax.with_extra_args_support(optax.sgd(0.0))
  state = init_state(init_variables(config, jax.random.PRNGKey(0)), PRETRAIN, tx)
  loss = lm_loss(config, 0.0)
  whole = jax.jit(make_step(loss, tx))(state, _batch(4))[1]
  halves = jax.jit(make_step(loss, tx, grad_accum=2))(state, _batch(4))[1]
  np.testing.assert_allclose(halves["loss"], whole["loss"], rtol=1e-6)
  assert isinstance(loss, Loss)
