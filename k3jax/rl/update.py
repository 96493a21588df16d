"""The RL policy update: the loss of k3jax/rl/losses.py through the training forward, then the
pre-training optimizer unchanged (k3jax/train/sharded.py `optimizer`: Per-Head Muon + AdamW,
Quantile Balancing of the router biases from this forward's statistics) and QK-Clip.

rl_step(state, batch) → (state, metrics); batch (numpy or jax):
  seqs [B,W] int (prompt + response, right-padded), prompt_lens [B], mask [B,L],
  behaviour_lp [B,L], adv [B], teacher_lp [B,L], has_teacher [B], ref_lp [B,L].
metrics carry lp [B,L], the trainer's log-probs before the update (for the mismatch metric).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from k3jax import sharding
from k3jax.config import ModelConfig
from k3jax.model import K3Model
from k3jax.rl.logprobs import response_logprobs
from k3jax.rl.losses import LossConfig, policy_loss
from k3jax.train.balance import flat_stats
from k3jax.train.optim import integer_grads_to_zeros, qk_clip
from k3jax.train.step import TrainState

BATCH_KEYS = ("seqs", "prompt_lens", "mask", "behaviour_lp", "adv", "teacher_lp",
              "has_teacher", "ref_lp")


def make_rl_step(config: ModelConfig, tx: optax.GradientTransformationExtraArgs,
                 loss_cfg: LossConfig, *, temperature: float = 1.0,
                 qk_clip_tau: float | None = 100.0, mesh=None, rules=None):
  """The RL step (module doc), the state donated: `jax.jit` on one device, or with a `mesh`
  a `k3jax.train.sharded.ShardedStep` — the state sharded by the logical-axis `rules` (default
  `sharding.axis_rules()`) as in pre-training, the batch split over the batch axes, the
  gradients pinned to the params' shardings."""
  grad_sh = state_sh = abstract = None
  if mesh is not None:
    from k3jax.train import sharded
    boxed = sharded.logical_variables(config)
    abstract = sharded.abstract_state(config, tx, boxed)
    state_sh = sharded.train_state_shardings(mesh, abstract, boxed,
                                             sharding.axis_rules() if rules is None else rules)
    grad_sh = state_sh.params

  def loss_fn(params, balance, batch):
    logits, mut = K3Model(config).apply({"params": params, "balance": balance}, batch["seqs"],
                                        mutable=["stats"])
    lp = response_logprobs(logits, batch["seqs"], batch["prompt_lens"],
                           batch["mask"].shape[1], temperature)
    loss, aux = policy_loss(lp, batch, loss_cfg)
    return loss, (aux, lp, flat_stats(mut.get("stats", {})))

  def step(state: TrainState, batch: dict):
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
      raise ValueError(f"rl batch: missing {missing}")
    (loss, (aux, lp, stats)), grads = jax.value_and_grad(
        loss_fn, has_aux=True, allow_int=True)(state.params, state.balance, batch)
    grads = integer_grads_to_zeros(grads)
    grads = sharding.constrain_like_params(grads, grad_sh)   # None: unchanged
    zero_b = jax.tree.map(jnp.zeros_like, state.balance)
    updates, opt_state = tx.update({"params": grads, "balance": zero_b}, state.opt_state,
                                   state.variables, stats=stats)
    new = optax.apply_updates(state.variables, updates)
    max_logits = {k.rsplit("/", 1)[0]: v for k, v in stats.items() if k.endswith("/max_logit")}
    params = qk_clip(new["params"], max_logits, qk_clip_tau, config.qk_nope_head_dim)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lp": lp, **aux}
    return TrainState(step=state.step + 1, params=params, balance=new["balance"],
                      opt_state=opt_state), metrics

  if mesh is None:
    return jax.jit(step, donate_argnums=0)
  return sharded.ShardedStep(step, mesh, state_sh, abstract)
