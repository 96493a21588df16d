"""`small`: ~100M total parameters (64 experts, top-8); `make train` runs it on a CPU in minutes.

python -m experiments.train --config=configs/small.py --workdir=runs/small
"""

from k3jax.train.trainer import base_config


def get_config():
  c = base_config("small")
  c.train.steps = 200
  c.train.batch_size = 4
  c.train.seq_len = 256
  c.train.checkpoint_every = 100
  c.train.eval_every = 100
  c.train.log_every = 10
  c.optim.lr = 2e-3
  return c
