"""The train step: a pure function of (state, batch) → (state, metrics), ready for jax.jit.

loss = CE(logits, targets; loss_mask) + mtp_weight · CE(mtp_logits, mtp_targets; mtp_mask)
(token means over the whole batch, fp32). One step: forward with the current router bias
(sowing "stats") → grads → optimizer update of {"params", "balance"} (Muon/AdamW for params;
Quantile Balancing sets the bias from this forward's stats, for the next step) → QK-Clip of
the MLA heads whose max logit exceeded τ. With `grad_accum=G` the batch is split into G
micro-batches along its batch axis, run one after another (`lax.scan`: activations of one
micro-batch at a time), their gradients and statistics summed (`max_logit`: max) and the
optimizer applied once — the same update as the whole batch at once (each micro-batch's CE is
divided by the whole batch's token count). Shardings are the caller's business
(k3jax/train/sharded.py jits the step for a mesh and hands it the params' shardings, which the
gradients are pinned to); nothing here names a mesh axis.

Media: a batch may carry `media` (a `k3jax.vision.media.Media` of B streams, stream b holding
the images of row b: k3jax/train/shapes.py); the model puts the projected vision tokens at the
placeholders, and the vision tower and projector train with the language model in the same
optimizer. Micro-batches split the streams with the rows.
"""

from __future__ import annotations

from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from k3jax import sharding
from k3jax.config import ModelConfig
from k3jax.train.balance import flat_stats
from k3jax.train.optim import integer_grads_to_zeros, qk_clip

LOGGED_STATS = ("load", "max_logit", "dropped")   # small stats returned for metrics


@flax.struct.dataclass
class TrainState:
  step: jax.Array        # [] int32: optimizer steps taken
  params: Any            # masters in config.param_dtype (fp32 by default), unboxed
  balance: Any           # router biases ("balance" collection)
  opt_state: Any

  @property
  def variables(self) -> dict:
    return {"params": self.params, "balance": self.balance}


def _model(config: ModelConfig):
  from k3jax.model import K3Model  # the model is a sibling package; import late
  return K3Model(config)


_INIT: dict = {}


def init_variables(config: ModelConfig, rng: jax.Array, seq_len: int = 8) -> dict:
  """Model variables {"params", "balance"} (unboxed), initialised under jit (the jitted init
  is cached per config, so a resumed run in the same process does not compile it again)."""
  if (config, seq_len) not in _INIT:
    model = _model(config)
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    _INIT[config, seq_len] = jax.jit(lambda r: nn.unbox(model.init(r, tokens)))
  variables = _INIT[config, seq_len](rng)
  return {"params": variables["params"], "balance": variables.get("balance", {})}


def create_state(config: ModelConfig, rng: jax.Array, tx: optax.GradientTransformation,
                 seq_len: int = 8) -> TrainState:
  v = init_variables(config, rng, seq_len)
  return TrainState(step=jnp.zeros([], jnp.int32), params=v["params"], balance=v["balance"],
                    opt_state=tx.init(v))


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array):
  """(sum of masked token CE in nats, number of masked tokens); fp32."""
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  tgt = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  mask = mask.astype(jnp.float32)
  return jnp.sum((lse - tgt) * mask), jnp.sum(mask)


def loss_fn(params, balance, batch, config: ModelConfig, mtp_weight: float, denominators=None,
            lora=None):
  """Scalar loss and aux (ce, mtp_ce, flat stats) for one batch (module doc).

  `denominators` = (tokens, mtp tokens) to divide the CE sums by (default: this batch's own
  masked token counts; a micro-batch passes the whole batch's). `lora`: the adapters'
  collection of a LoRA model (k3jax/train/lora.py), or None."""
  use_mtp = bool(config.num_mtp_layers) and mtp_weight > 0
  variables = {"params": params, "balance": balance}
  if lora is not None:
    variables["lora"] = lora
  out, mut = _model(config).apply(
      variables, batch["inputs"],
      segment_ids=batch["segment_ids"], return_mtp=use_mtp, mutable=["stats"],
      media=batch.get("media"))
  logits, mtp_logits = out if use_mtp else (out, None)
  n_all, n2_all = denominators if denominators is not None else _token_counts(batch, use_mtp)
  s, _ = cross_entropy(logits, batch["targets"], batch["loss_mask"])
  ce = s / n_all
  loss, mtp_ce = ce, jnp.zeros([], jnp.float32)
  if use_mtp:
    t = mtp_logits.shape[1]
    s2, _ = cross_entropy(mtp_logits, batch["mtp_targets"][:, :t], batch["mtp_mask"][:, :t])
    mtp_ce = s2 / n2_all
    loss = ce + mtp_weight * mtp_ce
  return loss, (ce, mtp_ce, flat_stats(mut.get("stats", {})))


def _token_counts(batch, use_mtp: bool):
  """(max(1, Σ loss_mask), max(1, Σ mtp_mask over the MTP positions)) in fp32."""
  n = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
  if not use_mtp:
    return n, jnp.ones([], jnp.float32)
  # The MTP head predicts t+2 from positions 0 … T−2 (its logits are one shorter).
  t = batch["inputs"].shape[1] - 1
  return n, jnp.maximum(jnp.sum(batch["mtp_mask"][:, :t].astype(jnp.float32)), 1.0)


def _merge_stats(a: dict, b: dict) -> dict:
  """Statistics of two micro-batches → those of both: counts add, max logits take the max."""
  return {key: jnp.maximum(a[key], b[key]) if key.endswith("/max_logit") else a[key] + b[key]
          for key in a}


def accumulated_grads(params, balance, batch, config: ModelConfig, mtp_weight: float,
                      grad_accum: int, lora=None):
  """((loss, (ce, mtp_ce, stats)), grads) of the whole batch, computed over `grad_accum`
  micro-batches in a `lax.scan` (module doc). `grad_accum=1` is one plain value_and_grad.
  With `lora` (a LoRA model's adapters) the gradients are the adapters' alone: the base
  params are constants of the loss."""
  if lora is None:
    # allow_int: packed MXFP4 experts are uint8 params (frozen); their float0 gradients become
    # zeros so that sums and norms work (the optimizer's "frozen" label ignores them).
    value_and_grad = jax.value_and_grad(loss_fn, has_aux=True, allow_int=True)
  else:
    value_and_grad = jax.value_and_grad(
        lambda lo, p, *rest: loss_fn(p, *rest, lora=lo), has_aux=True)
    params = (lora, params)     # differentiated argument first; unpacked by grad_fn

  def grad_fn(p, *args):
    out, grads = value_and_grad(*(p if lora is not None else (p,)), *args)
    return out, integer_grads_to_zeros(grads)

  use_mtp = bool(config.num_mtp_layers) and mtp_weight > 0
  counts = _token_counts(batch, use_mtp)
  if grad_accum == 1:
    return grad_fn(params, balance, batch, config, mtp_weight, counts)
  b = batch["inputs"].shape[0]
  if b % grad_accum:
    raise ValueError(f"grad_accum={grad_accum} must divide the batch size {b}")
  micro = jax.tree.map(lambda x: x.reshape(grad_accum, b // grad_accum, *x.shape[1:]), batch)
  first = jax.tree.map(lambda x: x[0], micro)
  # The first micro-batch seeds the accumulators (their structure comes from the model).
  out0, g0 = grad_fn(params, balance, first, config, mtp_weight, counts)

  def body(carry, mb):
    (loss, (ce, mtp_ce, stats)), grads = carry
    (l2, (c2, m2, s2)), g2 = grad_fn(params, balance, mb, config, mtp_weight, counts)
    return ((loss + l2, (ce + c2, mtp_ce + m2, _merge_stats(stats, s2))),
            jax.tree.map(jnp.add, grads, g2)), None

  rest = jax.tree.map(lambda x: x[1:], micro)
  (out, grads), _ = jax.lax.scan(body, (out0, g0), rest)
  return out, grads


def make_train_step(config: ModelConfig, tx: optax.GradientTransformationExtraArgs, *,
                    mtp_weight: float = 0.3, qk_clip_tau: float | None = 100.0,
                    schedule: Callable | None = None, grad_accum: int = 1,
                    grad_shardings: Any = None):
  """train_step(state, batch) → (state, metrics); pure, jit it (donate the state).
  `grad_accum` micro-batches per optimizer step (module doc; must divide the batch size).
  `grad_shardings`: the params' NamedShardings (a tree like `state.params`) the gradients are
  pinned to before the optimizer (`sharding.constrain_like_params`), or None."""
  if not isinstance(grad_accum, int) or grad_accum < 1:
    raise ValueError(f"grad_accum: expected a positive int, found {grad_accum!r}")

  def train_step(state: TrainState, batch: dict):
    (loss, (ce, mtp_ce, stats)), grads = accumulated_grads(
        state.params, state.balance, batch, config, mtp_weight, grad_accum)
    grads = sharding.constrain_like_params(grads, grad_shardings)
    variables = state.variables
    zero_b = jax.tree.map(jnp.zeros_like, state.balance)
    updates, opt_state = tx.update({"params": grads, "balance": zero_b}, state.opt_state,
                                   variables, stats=stats)
    new = optax.apply_updates(variables, updates)
    max_logits = {k.rsplit("/", 1)[0]: v for k, v in stats.items() if k.endswith("/max_logit")}
    params = qk_clip(new["params"], max_logits, qk_clip_tau, config.qk_nope_head_dim)
    metrics = {"loss": loss, "ce": ce, "mtp_ce": mtp_ce, "grad_norm": optax.tree.norm(grads),
               "stats": {k: v for k, v in stats.items() if k.rsplit("/", 1)[1] in LOGGED_STATS}}
    if schedule is not None:
      metrics["lr"] = schedule(state.step)
    return TrainState(step=state.step + 1, params=params, balance=new["balance"],
                      opt_state=opt_state), metrics

  return train_step


def make_eval_step(config: ModelConfig):
  """eval_step(variables, batch) → {"ce_sum", "tokens", "byte_tokens"} (sums, fp32)."""

  def eval_step(variables, batch):
    logits, _ = _model(config).apply(variables, batch["inputs"],
                                     segment_ids=batch["segment_ids"], mutable=["stats"],
                                     media=batch.get("media"))
    s, n = cross_entropy(logits, batch["targets"], batch["loss_mask"])
    byte = jnp.sum(batch["loss_mask"] * (batch["targets"] < 256))
    return {"ce_sum": s, "tokens": n, "byte_tokens": byte}

  return eval_step
