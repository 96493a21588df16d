"""Reinforcement learning as in K3's post-training (docs/k3.md §13): embedded verifiable tasks,
effort budgets, multi-teacher on-policy distillation (MOPD), partial rollouts and the policy
update. docs/notes/rl.md has the formulas and the commands."""
