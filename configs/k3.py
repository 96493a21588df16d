"""Kimi K3 (docs/k3.md §1, Table 1): the full model. Needs an accelerator pod (with a `config.mesh` layout);
the numbers follow docs/k3.md §8 — 1% warm-up cosine, Per-Head Muon, QK-Clip τ=100, QB with 1000
bins — and the report's whole context curriculum as `train.stages`: 8K → 64K in pre-training,
then 256K → 1M in the cool-down on long-document rows with evidence tasks mixed in.

The report gives the lengths, not how long each stage runs nor its batch: here 80% / 15% / 4% /
1% of the steps, and 16M tokens a step throughout (the batch shrinks as the rows grow). Every
stage runs on the same 4096 chips (v5p:16x16x16) with one sequence's tokens on `context` × 4K
(the batch over data × fsdp × expert, experts over `expert`), and its own memory settings:

  stage      seq_len    batch  layout (data, fsdp, expert, context)  memory
  pre 8K       8,192    2,048  1, 32, 64,   2   remat per layer group, MLA from the latents in
                                                  2K query and key blocks, the cross-entropy
                                                  in 8 chunks, expert gradients made layer by
                                                  layer
  pre 64K     65,536      256  1,  4, 64,  16   the same
  cool 256K  262,144       64  1,  1, 64,  64   + layer inputs and Muon momentum in host memory,
                                                  capacity factor 1.0
  cool 1M  1,048,576       16  1,  1, 16, 256   + the same

Parameters and optimizer state are sharded over `context` too (FSDP over context) wherever a
row spans chips. 4096 chips, not 2048: at 8K tokens a chip on 2048 chips the deviceless
compiles of the 256K and 1M steps need 103.37 and 103.18 GiB a chip, over the v5p's 95.74;
at 4K tokens a chip on 4096 they fit (docs/results.md, "The smallest pod that fits").
(docs/notes/long_context.md: why each setting, and what was measured.)
"""

from k3jax.train.run import base_config

TOKENS_PER_STEP = 1 << 24   # 16M
STEPS = 100_000


def _stage(steps, seq_len, *, fsdp, expert, context, modes, data="", evidence_fraction=0.0,
           offload_momentum=None):
  # Parameters and optimizer state sharded over `context` too wherever a row spans several
  # chips (FSDP over context): the batch axes alone hold 4096 / context chips.
  return dict(steps=steps, seq_len=seq_len, batch_size=TOKENS_PER_STEP // seq_len,
              mesh=dict(data=1, fsdp=fsdp, expert=expert, context=context, tensor=1,
                        fsdp_over_context=context > 1),
              modes=modes, data=data, evidence_fraction=evidence_fraction,
              offload_momentum=offload_momentum)


def stages():
  """The curriculum: pre-training 8K → 64K, cool-down 256K → 1M (module doc)."""
  # The cool-down's memory settings: what the deviceless compiles of the 256K and 1M steps
  # needed least of (docs/results.md, "What the 1M step holds at its peak" and "The
  # smallest pod that fits").
  long_rows = dict(remat=True, remat_offload=True, mla_query_block=2048, mla_key_block=2048,
                   kda_chunk_size=64, moe_capacity_factor=1.0, ce_chunks=8,
                   expert_grad_barrier=True)
  # Pre-training's settings, all exact (the same numbers, less memory): MLA from the latents
  # in 2K query and key blocks, the cross-entropy in 8 token chunks, each MoE layer's expert
  # weight gradients made before the next layer's backward. Without the last two the 64K
  # step needs 97.36 GiB a chip; with keys and values materialised in 1K query blocks the 8K
  # step needs 111.97 (docs/results.md).
  pre = dict(remat=True, mla_query_block=2048, mla_key_block=2048, ce_chunks=8,
             expert_grad_barrier=True)
  return (
      _stage(80_000, 8_192, fsdp=32, expert=64, context=2, modes=pre),
      _stage(15_000, 65_536, fsdp=4, expert=64, context=16, modes=pre),
      _stage(4_000, 262_144, fsdp=1, expert=64, context=64, data="long",
             evidence_fraction=0.1, offload_momentum=True, modes=long_rows),
      _stage(1_000, 1_048_576, fsdp=1, expert=16, context=256, data="long",
             evidence_fraction=0.1, offload_momentum=True, modes=long_rows),
  )


def get_config():
  c = base_config("k3")
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.train.steps = STEPS
  c.train.batch_size = TOKENS_PER_STEP // 8_192
  c.train.seq_len = 8_192
  c.train.stages = stages()
  c.train.checkpoint_every = 1000
  c.train.eval_every = 1000
  c.train.log_every = 10
  c.mesh.data = 1      # the first stage's layout (each stage sets its own)
  c.mesh.fsdp = 32
  c.mesh.expert = 64
  c.mesh.context = 2
  c.mesh.fsdp_over_context = True
  c.optim.lr = 2e-4
  c.balance.num_bins = 1000
  # Cool-down rows: documents of ≥ 64K tokens count as long and anchor rows 4× their share.
  c.data.long_threshold = 65_536
  c.data.long_upsample = 4.0
  return c
