"""`rl_visual_tiny`: vision-in-the-loop agentic RL (K3 §13) at CPU scale — the visual tool task
(k3jax/data/visual_tasks.py: the colour of the shape in a named cell of a 224 px image seen
at 56 px; a `crop` tool returns the cell at full size as a media block) rolled out through the
serving engine with the images as media, then the RL update with the same media.

python -m experiments.rl --config=configs/rl_visual_tiny.py --policy=CKPT --out=runs/rl_visual
(CKPT: a `tiny_multimodal` policy of this config's model, e.g. the cold start of
experiments/visual_tool_figure.py).

The `agent` group and the other RL groups: k3jax/posttrain/rl/loop.py.
"""

from k3jax.posttrain.rl.loop import rl_base_config


def get_config():
  c = rl_base_config("tiny_multimodal")
  # 4 layers: KDA (dense MLP), KDA, KDA, MLA (MoE), and the 2-layer tower.
  c.model.update(dict(num_layers=4, attn_res_block_size=2, num_mtp_layers=0))
  c.optim.lr = 3e-4
  c.optim.warmup_frac = 0.0
  c.optim.final_lr_frac = 1.0
  c.rl.rounds = 10
  c.rl.domains = ("crop",)
  c.rl.n_prompts = 2
  c.rl.k = 4                       # 8 trajectories a round = the engine's 8 slots
  c.rl.max_prompt_len = 224        # the visual prompts: about 200 tokens
  c.loss.adv_std_norm = True
  c.rl.expert_qat = "mxfp4_mxfp8"  # QAT from SFT through RL, rollouts and updates alike
  c.agent.enabled = True
  c.agent.max_tokens = 384         # prompt + a crop call + the tool's image + an answer
  c.agent.max_reply_tokens = 64
  c.agent.max_turns = 3
  c.budget.enabled = False         # b₀ on agentic T(y) is not wired (docs/notes/rl.md)
  return c
