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
  # The effort budget on agentic T(y) = thinking + tool-call argument tokens, b₀ from the
  # initial policy's trajectories on each task (k3jax/posttrain/rl/agentic.py); τ 1.5 → 1.0
  # over 10 rounds (not below 1: the tool call's code is part of T and must stay possible).
  c.budget.enabled = True
  c.budget.b0_samples = 2
  c.budget.tau_start = 1.5
  c.budget.tau_end = 1.0
  c.budget.anneal_rounds = 10
  return c
