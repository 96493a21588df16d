"""The RL policy update: the one train step (k3jax/train/step.py) with the policy loss of
k3jax/posttrain/rl/losses.py through the training forward — pre-training's optimizer unchanged
(Per-Head Muon + AdamW, Quantile Balancing of the router biases from this forward's
statistics) and QK-Clip, every weight trainable (`k3jax.train.sharded.PRETRAIN`).

rl_step(state, batch) → (state, metrics); batch (numpy or jax):
  seqs [B,W] int (prompt + response, right-padded), prompt_lens [B], mask [B,L],
  behaviour_lp [B,L], adv [B], teacher_lp [B,L], has_teacher [B], ref_lp [B,L]; optional
  media (a `Media` of B streams: row b's images, for a multimodal policy).
metrics carry rows["lp"] [B,L], the trainer's log-probs before the update (for the mismatch
metric), and the loss's mopd, clip_frac and kl.
"""

from __future__ import annotations

import optax

from k3jax import sharding
from k3jax.config import ModelConfig
from k3jax.model import K3Model
from k3jax.posttrain.rl.logprobs import response_logprobs
from k3jax.posttrain.rl.losses import LossConfig, policy_loss
from k3jax.train.balance import flat_stats
from k3jax.train.sharded import PRETRAIN, jit_step
from k3jax.train.step import Loss

BATCH_KEYS = ("seqs", "prompt_lens", "mask", "behaviour_lp", "adv", "teacher_lp",
              "has_teacher", "ref_lp")


def rl_loss(config: ModelConfig, loss_cfg: LossConfig, temperature: float = 1.0) -> Loss:
  """The policy loss of a batch of trajectories (module doc), as a `Loss` of the train step."""
  model = K3Model(config)

  def fn(variables, batch, totals):
    del totals    # the update is one batch: no micro-batches
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
      raise ValueError(f"rl batch: missing {missing}")
    logits, mut = model.apply(variables, batch["seqs"], mutable=["stats"],
                              media=batch.get("media"))
    lp = response_logprobs(logits, batch["seqs"], batch["prompt_lens"],
                           batch["mask"].shape[1], temperature)
    loss, aux = policy_loss(lp, batch, loss_cfg)
    return loss, {"metrics": aux, "stats": flat_stats(mut.get("stats", {})), "rows": {"lp": lp}}

  return Loss(fn)


def make_rl_step(config: ModelConfig, tx: optax.GradientTransformationExtraArgs,
                 loss_cfg: LossConfig, *, temperature: float = 1.0,
                 qk_clip_tau: float | None = 100.0, mesh=None, rules=None):
  """The RL step (module doc), the state donated: `jax.jit` on one device, or with a `mesh`
  a `k3jax.train.sharded.ShardedStep` — the state sharded by the logical-axis `rules` (default
  `sharding.axis_rules()`) as in pre-training, the batch split over the batch axes, the
  gradients pinned to the params' shardings."""
  return jit_step(rl_loss(config, loss_cfg, temperature), tx, PRETRAIN, config, mesh,
                  qk_clip=(qk_clip_tau, config.text.qk_nope_head_dim),
                  rules=sharding.axis_rules() if rules is None else rules)


__all__ = ["BATCH_KEYS", "rl_loss", "make_rl_step"]
