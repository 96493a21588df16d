"""Checkpoint save/restore, corrupt steps, config mismatch, load_pretrained (toy trees)."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import k3jax
from k3jax.config import preset
from k3jax.convert.checkpoint import save_pretrained
from k3jax.train import checkpoint as C

CFG = preset("tiny")


def _vars(x=1.0):
  return {"params": {"body": {"layers_0": {"q_proj": {"kernel": jnp.full((2, 3, 4), x)}}},
                     "norm": {"weight": jnp.arange(4.0) * x}},
          "balance": {"body": {"layers_0": {"block_sparse_moe": {"gate": {
              "e_score_correction_bias": jnp.full((2, 8), 0.5 * x)}}}}}}


def _opt(v):
  tx = optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(0.1))
  st = tx.init(v)
  _, st = tx.update(jax.tree.map(jnp.ones_like, v), st, v)   # non-trivial moments, count 1
  return st


def test_save_restore_roundtrip_and_max_to_keep(tmp_path):
  ck = C.Checkpointer(tmp_path, max_to_keep=2)
  for s in (5, 10, 15):
    v = _vars(float(s))
    ck.save(s, CFG, v, _opt(v), {"step": s, "data": {"step": s}})
  ck.close()
  ck = C.Checkpointer(tmp_path, max_to_keep=2)
  assert ck.manager.all_steps() == [10, 15]
  step, v, opt, meta = ck.restore_latest(CFG, _vars(), _opt(_vars()))
  assert step == 15 and meta["data"] == {"step": 15}
  jax.tree.map(np.testing.assert_array_equal, v, jax.tree.map(np.asarray, _vars(15.0)))
  jax.tree.map(np.testing.assert_array_equal, opt, _opt(_vars(15.0)))
  assert type(opt) is type(_opt(_vars()))           # optax state structure rebuilt
  ck.close()


def test_corrupt_latest_is_skipped_with_warning(tmp_path):
  ck = C.Checkpointer(tmp_path, async_save=False)
  for s in (1, 2):
    ck.save(s, CFG, _vars(float(s)), _opt(_vars()), {"step": s})
  ck.close()
  shutil.rmtree(tmp_path / "checkpoints" / "2" / "variables")     # a damaged step
  os.makedirs(tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-123")  # an unfinished save
  ck = C.Checkpointer(tmp_path, async_save=False)
  with pytest.warns(UserWarning, match="skipping unreadable checkpoint"):
    step, v, _, _ = ck.restore_latest(CFG, _vars(), _opt(_vars()))
  assert step == 1
  np.testing.assert_array_equal(v["params"]["norm"]["weight"], np.arange(4.0))
  assert (tmp_path / "checkpoints" / "2.corrupt").is_dir()     # set aside, never loaded
  ck.save(2, CFG, _vars(7.0), _opt(_vars()), {"step": 2})       # and step 2 can be redone
  ck.close()


def test_checkpoint_of_another_config_is_refused(tmp_path):
  ck = C.Checkpointer(tmp_path, async_save=False)
  ck.save(1, CFG, _vars(), _opt(_vars()), {"step": 1})
  with pytest.raises(ValueError, match=r"another model config.*d_model"):
    ck.check_config(CFG.replace(d_model=32))
  ck.check_config(CFG)
  ck.close()


def test_load_pretrained_forms(tmp_path):
  v = _vars(3.0)
  d = save_pretrained(tmp_path / "conv", CFG, {**v, "stats": {"x": jnp.ones(1)}})
  for path in (tmp_path / "conv", d):
    cfg, got = k3jax.load_pretrained(path)
    assert cfg == CFG and set(got) == {"params", "balance"}
    np.testing.assert_array_equal(got["balance"]["body"]["layers_0"]["block_sparse_moe"][
        "gate"]["e_score_correction_bias"], 1.5)
  ck = C.Checkpointer(tmp_path / "run", async_save=False)
  ck.save(4, CFG, v, _opt(v), {"step": 4})
  ck.close()
  cfg, got = k3jax.load_pretrained(tmp_path / "run")
  np.testing.assert_array_equal(got["params"]["norm"]["weight"], np.arange(4.0) * 3)
  with pytest.raises(ValueError, match="does not exist"):
    k3jax.load_pretrained(tmp_path / "nope")
  os.makedirs(tmp_path / "empty")
  with pytest.raises(ValueError, match="no checkpoint found"):
    k3jax.load_pretrained(tmp_path / "empty")
