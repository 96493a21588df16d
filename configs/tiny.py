"""`tiny`: a seconds-scale model for tests and smoke runs (13 layers, d=64, 8 experts).

python -m experiments.train --config=configs/tiny.py --workdir=runs/tiny
"""

from k3jax.train.run import base_config


def get_config():
  c = base_config("tiny")
  c.train.steps = 300
  c.train.batch_size = 8
  c.train.seq_len = 64
  c.train.checkpoint_every = 100
  c.train.eval_every = 100
  c.train.log_every = 10
  c.optim.lr = 3e-3
  return c
