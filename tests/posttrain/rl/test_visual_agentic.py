"""One agentic RL round on the visual task (k3jax/posttrain/rl/agentic.py, rl.domains =
("crop",)) with a 2-layer multimodal policy: trajectories rolled out through the engine with
their images as media, rewards from the hidden verifier, the update on the policy's tokens
with the same media (engine log-probs = the trainer's), parameters moved."""

import jax
import numpy as np
import pytest

from configs import rl_visual_tiny
from k3jax.data import visual_tasks as V
from k3jax.data.tokenizers import MEDIA
from k3jax.posttrain.rl import agentic
from k3jax.posttrain.rl.env import FINISHES
from k3jax.posttrain.rl.loop import rl_config
from k3jax.posttrain.rl.rewards import Teachers
from k3jax.train.state import init_variables


def _run(**rl):
  c = rl_visual_tiny.get_config()
  c.model.update(dict(num_layers=2, mla_every=2, first_dense_layers=2,
                      attn_res_block_size=None))
  c.rl.update({**dict(rounds=1, n_prompts=1, k=2, expert_qat=None), **rl})
  c.agent.update(dict(max_tokens=288, max_reply_tokens=8, max_turns=2, num_slots=2))
  c.optim.lr = 1e-2
  c.loss.kl_coef = 0.05
  return rl_config(c)


def test_one_visual_round_end_to_end():
  r = _run()
  config = r.run.model
  variables = init_variables(config, jax.random.PRNGKey(0))
  seen = {}

  def reward_fn(trajs):
    seen["trajs"] = trajs
    # the verifier's view: the task's answer, never shown in the prompt
    assert all(V.is_correct(t.task, t.task.answer) for t in trajs)
    return [1.0, 0.0]

  history, state = agentic.run(r, config, variables, log=None, reward_fn=reward_fn)
  (h,) = history
  trajs = seen["trajs"]
  assert h["trajectories"] == 2 and h["reward"] == 0.5
  assert sum(h["finish"].values()) == 2 and set(h["finish"]) == set(FINISHES)
  # mask = the policy's own tokens: the engine's replies, nothing of the prompt
  assert h["policy_tokens"] == sum(sum(t.policy) for t in trajs) > 0
  for t in trajs:
    assert len(t.images) >= 1 and t.tokens[:t.prompt_len] == list(t.task.tokens)
    assert MEDIA not in [tok for tok, p in zip(t.tokens[t.prompt_len:], t.policy) if p]
  # the update saw the rollout's media: its log-probs before the update = the engine's
  assert h["mismatch"] <= 1e-5, h
  # the KL reference (the initial policy, = the policy before this update) read the same
  # images: KL = 0 (without them its log-probs would differ by the images' whole effect)
  assert 0.0 <= h["kl"] <= 1e-6, h
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
                       state.variables["params"], variables["params"])
  assert max(jax.tree.leaves(moved)) > 1e-4
  assert max(jax.tree.leaves(moved["vision_tower"])) > 0     # gradients reach the tower


def test_visual_domain_needs_a_multimodal_policy():
  r = _run()
  text = r.run.model.replace(vision=None, media_placeholder_token_id=None)
  with pytest.raises(ValueError, match="multimodal"):
    agentic.run(r, text, {"params": {}}, log=None)
  with pytest.raises(ValueError, match="rl.domains"):
    agentic.run(_run(domains=("crop", "bigmul")), r.run.model, {"params": {}}, log=None)
  with pytest.raises(ValueError, match="teachers: MOPD teachers score text rows"):
    agentic.run(r, r.run.model, {"params": {}}, log=None,
                teachers=Teachers({}, r.run.model.text.vocab_size))
