"""The one train step: `make_step(loss, tx)` → step(state, batch) → (state, metrics).

A kind of training brings its `Loss`; the step is the same for all of them:

  1. value and gradient of the loss with respect to `state.params` (the trainable variables;
     `state.frozen` and `state.balance` are constants), over `grad_accum` micro-batches: the
     batch is split along its batch axis and run one micro-batch after another (`lax.scan`:
     activations of one micro-batch at a time); losses, metrics and gradients are summed and
     router statistics merged (counts add, max logits take the max) — the same update as the
     whole batch at once, because the loss divides by the whole batch's `totals`;
  2. the gradients pinned to the parameters' shardings (`grad_shardings`, on a mesh);
  3. one optimizer update of {**params, "balance": balance}: Per-Head Muon / AdamW for the
     params, and Quantile Balancing sets the router biases from this forward's statistics
     (the `stats=` extra argument), when the run trains them;
  4. QK-Clip (`qk_clip=(τ, nope dim)`) of the MLA heads whose max logit exceeded τ, when the
     trainable variables hold the model's params.

`lm_loss(config, mtp_weight)` is the language-model loss of pre-training, multimodal training
and SFT: CE(logits, targets; loss_mask) + mtp_weight · CE(mtp_logits, mtp_targets; mtp_mask),
token means over the whole batch in fp32; a batch may carry `media` (the image streams of its
rows: k3jax/data/captions.py), which the model places at the placeholders. Shardings are the
caller's business (k3jax/train/sharded.py); nothing here names a mesh axis.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from k3jax import sharding
from k3jax.config import ModelConfig, dtype_of
from k3jax.model import K3Model
from k3jax.train.balance import flat_stats
from k3jax.train import optim
from k3jax.train.optim import integer_grads_to_zeros
from k3jax.train.state import BALANCE, TrainState

LOGGED_STATS = ("load", "max_logit", "dropped")   # small stats returned for metrics


@dataclasses.dataclass(frozen=True)
class Loss:
  """What a kind of training minimises.

  fn(variables, batch, totals) → (loss, aux): `variables` are all the model's variables,
  `totals` what `totals(batch)` gave for the whole batch (a micro-batch's loss divides by the
  whole batch's totals, so micro-batch losses add up to the batch's). aux = {"metrics":
  {name: scalar}, "stats": flat router statistics (`flat_stats`), optionally "rows": {name:
  [micro-batch rows, …]} per-row outputs}. Metrics are summed over micro-batches, rows
  concatenated.
  """
  fn: Callable[[dict, dict, Any], tuple[jax.Array, dict]]
  totals: Callable[[dict], Any] = lambda batch: None


def _merge_stats(a: dict, b: dict) -> dict:
  """Statistics of two micro-batches → those of both: counts add, max logits take the max."""
  return {key: jnp.maximum(a[key], b[key]) if key.endswith("/max_logit") else a[key] + b[key]
          for key in a}


def _add_aux(a: dict, b: dict) -> dict:
  out = {"metrics": jax.tree.map(jnp.add, a["metrics"], b["metrics"]),
         "stats": _merge_stats(a["stats"], b["stats"])}
  if "rows" in a:
    out["rows"] = jax.tree.map(lambda x, y: jnp.concatenate([x, y]), a["rows"], b["rows"])
  return out


def loss_and_grads(loss: Loss, state: TrainState, batch: dict, grad_accum: int = 1):
  """((loss, aux), grads) of the whole batch with respect to `state.params`, over
  `grad_accum` micro-batches (module doc). Integer (packed MXFP4) leaves get uint8 zeros."""
  def value_and_grad(params, mb, totals):
    # allow_int: packed MXFP4 experts are uint8 params (frozen by the optimizer); their
    # float0 gradients become zeros so that sums and norms work.
    out, grads = jax.value_and_grad(
        lambda p: loss.fn(state.replace(params=p).variables, mb, totals), has_aux=True,
        allow_int=True)(params)
    return out, integer_grads_to_zeros(grads)

  totals = loss.totals(batch)
  if grad_accum == 1:
    return value_and_grad(state.params, batch, totals)
  b = jax.tree.leaves(batch)[0].shape[0]
  if b % grad_accum:
    raise ValueError(f"grad_accum={grad_accum} must divide the batch size {b}")
  micro = jax.tree.map(lambda x: x.reshape(grad_accum, b // grad_accum, *x.shape[1:]), batch)
  first = jax.tree.map(lambda x: x[0], micro)
  # The first micro-batch seeds the accumulators (their structure comes from the model).
  out0, g0 = value_and_grad(state.params, first, totals)

  def body(carry, mb):
    (l1, a1), g1 = carry
    (l2, a2), g2 = value_and_grad(state.params, mb, totals)
    return ((l1 + l2, _add_aux(a1, a2)), jax.tree.map(jnp.add, g1, g2)), None

  rest = jax.tree.map(lambda x: x[1:], micro)
  (out, grads), _ = jax.lax.scan(body, (out0, g0), rest)
  return out, grads


def make_step(loss: Loss, tx: optax.GradientTransformationExtraArgs, *, grad_accum: int = 1,
              qk_clip: tuple[float | None, int] | None = None,
              schedule: Callable | None = None, grad_shardings: Any = None):
  """step(state, batch) → (state, metrics); pure, jit it (donate the state). Module doc.

  metrics: "loss", "grad_norm", the loss's own metrics, "stats" (the router statistics named
  in LOGGED_STATS), "rows" when the loss has per-row outputs, "lr" with a `schedule`.
  `qk_clip`: (τ or None, the MLA heads' nope width) — applied to `params["params"]`.
  `grad_shardings`: the NamedShardings of `state.params` the gradients are pinned to, or None.
  """
  if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
    raise ValueError(f"grad_accum: expected a positive int, found {grad_accum!r}")

  def step(state: TrainState, batch: dict):
    (value, aux), grads = loss_and_grads(loss, state, batch, grad_accum)
    grads = sharding.constrain_like_params(grads, grad_shardings)
    stats = aux["stats"]
    optimized = state.optimized
    g = {**grads, BALANCE: jax.tree.map(jnp.zeros_like, state.balance)} if state.balance \
        else grads
    updates, opt_state = tx.update(g, state.opt_state, optimized, stats=stats)
    new = optax.apply_updates(optimized, updates)
    balance = new.pop(BALANCE, {}) if state.balance else {}
    if qk_clip is not None and "params" in new:
      tau, nope = qk_clip
      max_logits = {k.rsplit("/", 1)[0]: v for k, v in stats.items()
                    if k.endswith("/max_logit")}
      new["params"] = optim.qk_clip(new["params"], max_logits, tau, nope)
    metrics = {"loss": value, "grad_norm": optax.tree.norm(grads), **aux["metrics"],
               "stats": {k: v for k, v in stats.items() if k.rsplit("/", 1)[1] in LOGGED_STATS}}
    if "rows" in aux:
      metrics["rows"] = aux["rows"]
    if schedule is not None:
      metrics["lr"] = schedule(state.step)
    return state.replace(step=state.step + 1, params=new, balance=balance,
                         opt_state=opt_state), metrics

  return step


# ---------------------------------------------------------------------- the language-model loss
def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array):
  """(sum of masked token CE in nats, number of masked tokens); fp32."""
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  tgt = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  mask = mask.astype(jnp.float32)
  return jnp.sum((lse - tgt) * mask), jnp.sum(mask)


def head_matrix(config: ModelConfig, params) -> jax.Array:
  """The output head as [d, vocab] (tied: the token table transposed), as `K3Model._head`
  applies it: both operands in the compute dtype."""
  if config.text.tie_word_embeddings:
    return params["embed_tokens"]["embedding"].T
  return params["lm_head"]["kernel"]


def chunked_cross_entropy(h: jax.Array, w: jax.Array, targets: jax.Array, mask: jax.Array,
                          chunks: int, dtype):
  """`cross_entropy` of the logits (h·w) fp32 — h [B,T,d] the head's input, w [d,vocab] —
  over `chunks` strided token chunks: chunk j holds tokens j, j+n, j+2n, … (a reshape that
  keeps T's sharding over `context`: every chunk takes its share from every shard). Each
  chunk's logits [B,T/n,vocab] are formed, reduced and dropped (`jax.checkpoint`: the backward
  forms them again), so the head never holds [B,T,vocab]. Returns (Σ CE, Σ mask) fp32."""
  b, t, d = h.shape
  if t % chunks:
    raise ValueError(f"modes.ce_chunks={chunks} must divide the sequence length {t}")

  def split(x):   # [B,T,...] → [n,B,T/n,...]: token t = i·n + j goes to chunk j
    return jnp.moveaxis(x.reshape(b, t // chunks, chunks, *x.shape[2:]), 2, 0)

  @jax.checkpoint
  def one(hc, tc, mc):
    logits = jnp.dot(hc.astype(dtype), w.astype(dtype)).astype(jnp.float32)
    return cross_entropy(logits, tc, mc)

  def body(acc, xs):
    s, n = one(*xs)
    return (acc[0] + s, acc[1] + n), None

  zero = jnp.zeros([], jnp.float32)
  (s, n), _ = jax.lax.scan(body, (zero, zero), (split(h), split(targets), split(mask)))
  return s, n


def token_counts(batch: dict, use_mtp: bool):
  """(max(1, Σ loss_mask), max(1, Σ mtp_mask over the MTP positions)) in fp32."""
  n = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
  if not use_mtp:
    return n, jnp.ones([], jnp.float32)
  # The MTP head predicts t+2 from positions 0 … T−2 (its logits are one shorter).
  t = batch["inputs"].shape[1] - 1
  return n, jnp.maximum(jnp.sum(batch["mtp_mask"][:, :t].astype(jnp.float32)), 1.0)


def lm_loss(config: ModelConfig, mtp_weight: float = 0.3) -> Loss:
  """The language-model loss (module doc); metrics "ce" and "mtp_ce" (nats/token)."""
  use_mtp = bool(config.text.num_mtp_layers) and mtp_weight > 0
  model = K3Model(config)
  chunks = config.modes.ce_chunks
  if chunks and use_mtp and not config.modes.mtp_full_length:
    raise ValueError("modes.ce_chunks: the MTP loss is chunked over all T positions; set "
                     "modes.mtp_full_length=True (T−1 positions do not divide into chunks)")
  dtype = dtype_of(config.modes.dtype)

  def ce_of(out, variables, targets, mask):
    """CE sum of the model's head output: logits, or with ce_chunks the head's input."""
    if not chunks:
      return cross_entropy(out, targets, mask)[0]
    w = head_matrix(config, variables["params"])
    return chunked_cross_entropy(out, w, targets, mask, chunks, dtype)[0]

  def fn(variables, batch, totals):
    out, mut = model.apply(variables, batch["inputs"], segment_ids=batch["segment_ids"],
                           return_mtp=use_mtp, mutable=["stats"], media=batch.get("media"),
                           mtp_full=use_mtp and config.modes.mtp_full_length,
                           return_hidden=bool(chunks))
    logits, mtp_logits = out if use_mtp else (out, None)
    n_all, n2_all = totals
    s = ce_of(logits, variables, batch["targets"], batch["loss_mask"])
    ce = s / n_all
    value, mtp_ce = ce, jnp.zeros([], jnp.float32)
    if use_mtp:
      t = mtp_logits.shape[1]
      mask = batch["mtp_mask"][:, :t]
      if t == batch["inputs"].shape[1]:      # mtp_full: the last position is a stand-in
        mask = mask * (jnp.arange(t) < t - 1)
      s2 = ce_of(mtp_logits, variables, batch["mtp_targets"][:, :t], mask)
      mtp_ce = s2 / n2_all
      value = ce + mtp_weight * mtp_ce
    return value, {"metrics": {"ce": ce, "mtp_ce": mtp_ce},
                   "stats": flat_stats(mut.get("stats", {}))}

  return Loss(fn, lambda batch: token_counts(batch, use_mtp))


def make_eval_step(config: ModelConfig):
  """eval_step(variables, batch) → {"ce_sum", "tokens", "byte_tokens"} (sums, fp32)."""
  model = K3Model(config)

  def eval_step(variables, batch):
    logits, _ = model.apply(variables, batch["inputs"], segment_ids=batch["segment_ids"],
                            mutable=["stats"], media=batch.get("media"))
    s, n = cross_entropy(logits, batch["targets"], batch["loss_mask"])
    byte = jnp.sum(batch["loss_mask"] * (batch["targets"] < 256))
    return {"ce_sum": s, "tokens": n, "byte_tokens": byte}

  return eval_step


__all__ = ["Loss", "LOGGED_STATS", "loss_and_grads", "make_step", "cross_entropy",
           "token_counts", "lm_loss", "make_eval_step"]
