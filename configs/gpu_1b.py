"""`gpu_1b`: a ~1B-parameter K3-shaped model (KDA K = V = 128 heads with the bounded gate, Gated
MLA every 4th layer and last, Stable LatentMoE 64 experts top-8, AttnRes blocks) in bf16, for
one training step's tokens/s and MFU on one accelerator (experiments/gpu_check.sh). MFU is
against the bf16 matmul rate measured at start-up in the same process (trainer: 8192² on an
accelerator). The byte tokenizer's vocabulary keeps the embedded data usable offline.

python -m experiments.train --config=configs/gpu_1b.py --workdir=/tmp/gpu_1b
"""

from k3jax.train.run import base_config


def get_config():
  c = base_config("small")
  m = c.model
  m.d_model, m.num_layers = 1536, 12
  m.kda_num_heads, m.kda_head_dim, m.kda_gate_rank = 12, 128, 128
  m.num_heads, m.q_lora_rank, m.kv_lora_rank = 12, 768, 256
  m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 128, 64, 128
  m.dense_intermediate_size = 4096
  m.num_experts, m.experts_per_token, m.num_shared_experts = 64, 8, 1
  m.moe_intermediate_size, m.latent_moe_dim = 512, 768
  m.dtype = "bfloat16"
  m.kernel_backend = "auto"
  m.moe_capacity_factor = 1.1
  c.train.steps = 6
  c.train.batch_size = 8
  c.train.grad_accum = 1
  c.train.seq_len = 4096
  c.train.checkpoint_every = 0    # no checkpoint (12 GB of state) in a speed run
  c.train.eval_every = 0
  c.train.log_every = 1
  c.train.progress = False
  c.train.tensorboard = False
  return c
