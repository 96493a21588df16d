"""`rl_agentic_tiny`: agentic RL (docs/notes/rl.md) at CPU scale: multi-turn tool tasks (the
python tool in the sandbox) rolled out through the serving engine, then the RL update.

python -m experiments.rl --config=configs/rl_agentic_tiny.py --policy=CKPT --out=runs/rl_agentic

The `agent` group and the other RL groups: k3jax/posttrain/rl/loop.py.
"""

from configs import rl_tiny


def get_config():
  c = rl_tiny.get_config()
  c.agent.enabled = True
  c.rl.domains = ("bigmul", "strops", "lookup")
  c.rl.n_prompts = 2
  c.rl.k = 4                       # 8 trajectories a round = the engine's 8 slots
  c.rl.max_prompt_len = 576        # the tool tasks' prompts: 309–535 tokens
  c.agent.max_tokens = 832         # prompt + every turn
  c.agent.max_reply_tokens = 96
  c.agent.max_turns = 3
  c.budget.enabled = False         # b₀ on agentic T(y) is not wired (docs/notes/rl.md)
  return c
