"""Kimi Linear 48B-A3B (docs/k3.md §9 presets): KDA + MLA, classic MoE without AttnRes/MTP.
Accelerator-scale; on a CPU shrink it from the command line (e.g. --config.model.num_layers=4).
"""

from k3jax.train.run import base_config


def get_config():
  c = base_config("kimi_linear_48b")
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.train.steps = 50_000
  c.train.batch_size = 256
  c.train.seq_len = 8192
  c.train.checkpoint_every = 1000
  c.train.eval_every = 1000
  c.train.mtp_weight = 0.0          # Kimi Linear has no MTP layer
  c.train.data_parallel = True
  c.optim.lr = 3e-4
  return c
