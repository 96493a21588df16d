"""`rl_tiny`: the RL recipe (docs/notes/rl.md) at CPU scale on a 4-layer tiny model.

python -m experiments.rl --config=configs/rl_tiny.py --policy=CKPT --teachers=arith:low=CKPT,...

The RL groups (`rl`, `loss`, `budget`) and their defaults: k3jax/posttrain/rl/loop.py.
"""

from k3jax.posttrain.rl.loop import rl_base_config


def get_config():
  c = rl_base_config("tiny")
  # 4 layers: KDA (dense MLP), KDA, KDA, MLA (MoE); both cache kinds are exercised.
  c.model.update(dict(num_layers=4, attn_res_block_size=2, num_mtp_layers=0))
  c.optim.lr = 3e-4
  c.optim.warmup_frac = 0.0
  c.optim.final_lr_frac = 1.0
  # The setting under which the reward rises (docs/notes/rl.md: K = 8 with std-normalised
  # advantages; K = 4 or no normalisation roughly halve the rise).
  c.rl.k = 8
  c.loss.adv_std_norm = True
  # QAT from SFT through RL (K3 §13): the routed experts in MXFP4, their inputs in MXFP8, in
  # rollouts and updates alike (the tiny model's MLA layer has the MoE).
  c.rl.expert_qat = "mxfp4_mxfp8"
  return c
