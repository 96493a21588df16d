"""Kimi K3 (docs/k3.md §1, Table 1): the full model. Needs an accelerator pod (with a `config.mesh` layout);
the numbers follow docs/k3.md §8 — 1% warm-up cosine, Per-Head Muon, QK-Clip τ=100, QB with 1000
bins — and the report's context curriculum 8K → 64K (pre-training stages).
"""

from k3jax.train.run import base_config


def get_config():
  c = base_config("k3")
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.train.steps = 100_000
  c.train.batch_size = 1024
  c.train.seq_len = 65536
  c.train.curriculum = "80000:8192"   # 8K for 80% of the steps, then 64K
  c.train.checkpoint_every = 1000
  c.train.eval_every = 1000
  c.train.log_every = 10
  c.train.data_parallel = True
  c.optim.lr = 2e-4
  c.balance.num_bins = 1000
  return c
