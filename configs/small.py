"""`small`: ~100M total / 30M active parameters (64 experts, top-8); `make train` runs it on a
CPU (train + 1 eval + checkpoint + resume-able) in minutes.

Tokens per step: Per-Head Muon's Newton–Schulz costs ~0.93 TFLOP per optimizer step for
`small` (3 × 64 expert matrices × 7 MoE layers, 5 iterations each), independent of the batch —
about the model's own FLOPs on 5K tokens. So a step takes 32 × 256 = 8K tokens, as 4
micro-batches of 8 × 256 (gradient accumulation keeps the activations of one micro-batch in
memory), which puts MFU near 30% on a 2-core CPU instead of 8% at 1K tokens per step.

python -m experiments.train --config=configs/small.py --workdir=runs/small
"""

from k3jax.train.run import base_config


def get_config():
  c = base_config("small")
  c.train.steps = 8
  c.train.batch_size = 32
  c.train.grad_accum = 4
  c.train.seq_len = 256
  c.train.checkpoint_every = 4
  c.train.eval_every = 8
  c.train.eval_batches = 1
  c.train.log_every = 1
  c.optim.lr = 2e-3
  # Capacity-padded expert dispatch (the fast XLA layout, ~1.5x a dense MLP of equal active
  # FLOPs instead of ~2.6x dropless; experiments/bench_moe.py). With Quantile Balancing the
  # loads stay near-uniform: at 1.1 about 0.5% of (token, expert) pairs are dropped, counted in
  # the `dropped` metric. Generation and scoring are always dropless.
  c.model.moe_capacity_factor = 1.1
  return c
