"""`rl_tiny`: the RL recipe (docs/notes/rl.md) at CPU scale on a 4-layer tiny model.

python -m experiments.rl --config=configs/rl_tiny.py --policy=CKPT --teachers=arith:low=CKPT,...
"""

import ml_collections

from k3jax.train.trainer import base_config


def get_config():
  c = base_config("tiny")
  # 4 layers: KDA (dense MLP), KDA, KDA, MLA (MoE); both cache kinds are exercised.
  c.model.update(dict(num_layers=4, attn_res_block_size=2, num_mtp_layers=0))
  c.rl = ml_collections.ConfigDict(dict(
      rounds=20, n_prompts=4, k=4, lam=0.75, max_new_tokens=16, max_prompt_len=112,
      temperature=1.0, domains=("arith", "sort", "puzzle"), efforts=("low", "high", "max"),
      # None: the policy's own config; "mxfp4_mxfp8": QAT of the routed experts in rollouts
      # and updates alike (k3jax/rl/loop.py policy_config).
      expert_qat=ml_collections.FieldReference(None, field_type=str)))
  c.loss = ml_collections.ConfigDict(dict(
      eps_low=0.2, eps_high=0.28, dual_clip=3.0, kl_coef=0.0, mopd_coef=1.0, r_max=1.0,
      adv_std_norm=False, adv_eps=1e-6))
  c.budget = ml_collections.ConfigDict(dict(
      enabled=True, b0_samples=2, tau_start=1.5, tau_end=0.8, anneal_rounds=10))
  c.train.steps = c.rl.rounds      # the learning-rate schedule spans the rounds
  c.optim.lr = 3e-4
  c.optim.warmup_frac = 0.0
  c.optim.final_lr_frac = 1.0
  return c
