"""experiments/eagle.py end to end on a random 3-layer `tiny` target: the draft trains (its
LK loss falls), both drafts decode exactly plain greedy, the figures and the draft checkpoint
are written; a bad block index is refused before any work."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from experiments import eagle as cli
from k3jax.config import preset
from k3jax.model import K3Model
from k3jax.convert.checkpoint import load_pretrained, save_pretrained


def test_eagle_experiment(tmp_path):
  cfg = preset("tiny", num_layers=3, mla_every=2, attn_res_block_size=2)
  v = nn.meta.unbox(K3Model(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))
  save_pretrained(tmp_path / "target", cfg, v)
  with pytest.raises(ValueError, match=r"eagle_blocks.*\[7\] out of range"):
    cli.run(str(tmp_path / "target"), str(tmp_path / "bad"), blocks="1,7")
  res = cli.run(str(tmp_path / "target"), str(tmp_path / "out"), blocks="1,0,-1", steps=12,
                chain_steps=2, anchor_stride=4, batch_size=2, seq_len=16, lr=2e-2,
                eval_prompts=2, prompt_len=8, max_new_tokens=6, draft_len=2, log_every=1)
  assert res["untuned_mtp"]["same_as_greedy"] and res["eagle3"]["same_as_greedy"]
  losses = [c["loss"] for c in res["curve"]]
  assert len(losses) == 12 and min(losses[-3:]) < 0.8 * losses[0], losses
  for fig in (res["untuned_mtp"], res["eagle3"]):
    assert 0.0 <= fig["acceptance_rate"] <= 1.0 and fig["speculative_tokens_per_s"] > 0
  assert json.loads((tmp_path / "out" / "eagle.json").read_text()) == res
  dcfg, dv = load_pretrained(tmp_path / "out" / "draft")
  assert dcfg.modes.eagle_blocks == (1, 0, -1) and dv["params"]["draft_fuse"]["kernel"].shape == (
      3 * cfg.text.d_model, cfg.text.d_model)
