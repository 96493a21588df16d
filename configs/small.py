"""`small`: ~100M total / 30M active parameters (64 experts, top-8); `make train` runs it on a
CPU (train + 1 eval + checkpoint + resume-able) in minutes.

Why so few steps: Per-Head Muon's Newton–Schulz costs ~0.93 TFLOP per step for `small`
(3 × 64 expert matrices × 7 MoE layers, 5 iterations each), independent of the batch — five
times the model's own FLOPs at 1024 tokens/step. A 2-core CPU does a step in tens of seconds.
Raise tokens per step (batch_size × seq_len) to amortise it (higher MFU), or steps to learn more.

python -m experiments.train --config=configs/small.py --workdir=runs/small
"""

from k3jax.train.trainer import base_config


def get_config():
  c = base_config("small")
  c.train.steps = 16
  c.train.batch_size = 4
  c.train.seq_len = 256
  c.train.checkpoint_every = 8
  c.train.eval_every = 16
  c.train.eval_batches = 1
  c.train.log_every = 2
  c.optim.lr = 2e-3
  # Capacity-padded expert dispatch (the fast XLA layout, ~1.5x a dense MLP of equal active
  # FLOPs instead of ~2.6x dropless; experiments/bench_moe.py). With Quantile Balancing the
  # loads stay near-uniform: at 1.1 about 0.5% of (token, expert) pairs are dropped, counted in
  # the `dropped` metric. Generation and scoring are always dropless.
  c.model.moe_capacity_factor = 1.1
  return c
