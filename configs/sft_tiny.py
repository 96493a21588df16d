"""`sft_tiny`: supervised fine-tuning of a `tiny` model (4 layers) on chat conversations —
the embedded procedural tasks (k3jax/data/sft_tasks.py) unless data.sft_file names a JSONL
file (schema: k3jax/data/sft.py). Minutes on a CPU (300 steps: 565 s wall at a load average
near 10 on 2 cores; docs/notes/sft.md).

python -m experiments.sft --config=configs/sft_tiny.py --workdir=runs/sft_tiny [--init=CKPT]

data.sft_num_train / data.sft_num_eval: samples of the embedded tasks (cfg.seed);
train.init: a checkpoint to start from (fresh optimizer), "" = random init; it must hold this
model (4 layers: add --config.model.num_layers=13 to start from a configs/tiny.py run).
"""

from k3jax.train.run import base_config


def get_config():
  c = base_config("tiny")
  c.model.num_layers = 4
  # QAT from SFT on (K3 §13, docs/notes/qat.md): the routed experts' weights in MXFP4, their
  # inputs in MXFP8, straight-through gradients; the checkpoint carries it, so generation,
  # evaluation and RL from it quantise alike (a config derived from this one turns it off
  # with c.model.expert_qat = None).
  c.model.expert_qat = "mxfp4_mxfp8"
  c.train.steps = 300
  c.train.batch_size = 8
  c.train.seq_len = 352          # the longest calculator conversation (330 tokens) fits
  c.train.checkpoint_every = 100
  c.train.eval_every = 100
  c.train.eval_batches = 2
  c.train.log_every = 10
  c.train.init = ""
  c.optim.lr = 3e-3
  c.data.source = "sft"
  c.data.sft_file = ""
  c.data.sft_num_train = 20000
  c.data.sft_num_eval = 256
  return c
