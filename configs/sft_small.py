"""`sft_small`: supervised fine-tuning of `small` (the model of configs/small.py, so that
`make train`'s checkpoint can be its --init) on the embedded chat tasks; `make sft` runs it
and experiments/eval_sft.py before and after, within minutes on a 2-core CPU.

python -m experiments.sft --config=configs/sft_small.py --workdir=runs/sft --init=runs/small

AdamW instead of Per-Head Muon: Muon's Newton–Schulz costs ~0.93 TFLOP per optimizer step for
`small` whatever the batch (configs/small.py), several times the model's own FLOPs on these
small fine-tuning batches; the fine-tuning starts a fresh optimizer anyway (train.init).
"""

from k3jax.train.run import base_config


def get_config():
  c = base_config("small")
  c.model.moe_capacity_factor = 1.1     # as configs/small.py: the same model config
  # QAT from SFT on (K3 §13, docs/notes/qat.md): the routed experts' weights in MXFP4, their
  # inputs in MXFP8, straight-through gradients; the checkpoint carries it, so generation,
  # evaluation and RL from it quantise alike (a config derived from this one turns it off
  # with c.model.expert_qat = None).
  c.model.expert_qat = "mxfp4_mxfp8"
  c.train.steps = 60
  c.train.batch_size = 8
  c.train.seq_len = 352          # the longest calculator conversation (330 tokens) fits
  c.train.checkpoint_every = 20
  c.train.eval_every = 20
  c.train.eval_batches = 1
  c.train.log_every = 5
  c.train.mtp_weight = 0.0
  c.train.init = ""
  c.optim.muon = False
  c.optim.lr = 2e-3
  c.optim.warmup_frac = 0.05
  c.data.source = "sft"
  c.data.sft_file = ""
  c.data.sft_num_train = 20000
  c.data.sft_num_eval = 256
  return c
