"""The EAGLE-3 draft (docs/k3.md §10, §13): the MTP layer re-tuned, target frozen, as a chained draft.

The draft is the model's MTP layer with one change of input (`ModelConfig.modes.eagle_blocks`): the
feature of position i is draft_fuse(concat of AttnRes block representations, K3: blocks 1, 4
and the last) instead of the final hidden state, so the draft sees low, middle and high
features of the target. At inference (`speculative.speculative_generate(draft_len=n)`) it
drafts a chain: (feature_i, x_{i+1}) → a_i, q_1; then (a_i, d_1) → a', q_2; … — after the
first step its feature input is its own pre-norm hidden state, never a target feature.

Training (`chain_loss`) therefore unrolls the same chain ("training-time test"): step 0 runs
the draft over every position with the target's features; step k ≥ 1 continues the chain
anchored at every position i with the draft's own hidden state of step k−1 and the true
token x_{i+1+k}. Each chain row carries its own copy of the draft's cache holding the
step-0 entries 0 … i and the chain's own entries, through the decode path itself, so
attention at step k sees exactly what it sees when decoding. Step k at anchor i predicts
x_{i+2+k}; its loss is the LK loss −log Σ_x min(p(x), q(x)) against the target's
distribution at position i+1+k (Σ min(p, q) is the acceptance probability of the draft).

The draft trains through the one train step (k3jax/train/step.py) and the trainer's loop:
`recipe(target, blocks, …)` makes the draft's params (`DRAFT`: the MTP layer and
`draft_fuse`) the only trainable variables, everything else (the target) frozen.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import optax

from k3jax.cache import Cache, MLACache
from k3jax.config import ModelConfig
from k3jax.convert.checkpoint import load_pretrained, save_pretrained
from k3jax.model import K3Model
from k3jax.serve.speculative import lk_loss
from k3jax.train.balance import flat_stats
from k3jax.train.run import RunConfig
from k3jax.train.sharded import Step, jit_step
from k3jax.train.state import Trainable, init_variables
from k3jax.train.step import Loss
from k3jax.train.trainer import Recipe

# The parameters the draft owns: the MTP layer and the feature fusion. Everything else
# (embedding and lm_head, which the draft shares, included) is the frozen target.
DRAFT_PARAMS = ("mtp", "draft_fuse")
DRAFT = Trainable(*(("params", k) for k in DRAFT_PARAMS))


def split_params(params: dict) -> tuple[dict, dict]:
  """params → (the draft's subtrees {mtp, draft_fuse}, the frozen rest)."""
  missing = [k for k in DRAFT_PARAMS if k not in params]
  if missing:
    raise ValueError(f"params: the EAGLE-3 draft needs {missing} (a config with "
                     f"num_mtp_layers=1 and eagle_blocks set)")
  return ({k: params[k] for k in DRAFT_PARAMS},
          {k: v for k, v in params.items() if k not in DRAFT_PARAMS})


def eagle_config(config: ModelConfig, blocks: tuple[int, ...] = (1, 4, -1)) -> ModelConfig:
  """`config` with the EAGLE-3 draft input (inference-ready: dropless MoE)."""
  return config.replace(eagle_blocks=tuple(blocks)).for_inference()


def chain_logits(config: ModelConfig, draft: dict, variables: dict, tokens, *,
                 steps: int = 7, anchor_stride: int = 1) -> list[tuple]:
  """The unrolled draft on tokens [B,T] (whole documents, no padding).

  draft: the draft's params (`split_params`), which replace those in `variables` (the
  target's params and collections); gradients flow into `draft` only (the target's logits
  are stop-gradient). Chains start at anchors 0, s, 2s, … < T−1 (s = anchor_stride).
  Returns one (target logits, draft logits, weight) per step, rows flattened: step 0 has
  the B·(T−1) positions (b, i) in order; step k ≥ 1 the chains (b, anchor) in order, weight
  0 where the chain ran past the end of the row (target logits fp32 [N,V], draft [N,V],
  weight [N]).
  """
  if not config.modes.eagle_blocks:
    raise ValueError("chain_logits: config.modes.eagle_blocks is None (not an EAGLE-3 draft config)")
  if not isinstance(steps, int) or steps < 1:
    raise ValueError(f"steps: expected an int >= 1, found {steps!r}")
  if not isinstance(anchor_stride, int) or anchor_stride < 1:
    raise ValueError(f"anchor_stride: expected an int >= 1, found {anchor_stride!r}")
  if tokens.ndim != 2 or tokens.shape[1] < 3:
    raise ValueError(f"tokens: expected [B,T] with T >= 3, found {tokens.shape}")
  b, t = tokens.shape
  model = K3Model(config)
  variables = {**variables, "params": {**variables["params"], **draft}}
  logits, feats = model.apply(variables, tokens, method=K3Model.draft_inputs)
  target = jax.lax.stop_gradient(logits)        # target[:, j] predicts token j+1
  s = t - 1                                     # draft positions: (feature i, token i+1)
  zeros = jnp.zeros((b,), jnp.int32)
  cache = Cache(zeros, {}, MLACache.zeros(config, b, s + steps - 1), zeros)

  def draft_step(cache, h, nxt, num_new):
    return model.apply(variables, h, nxt, cache, num_new, True, method=K3Model.draft)

  q0, a0, cache = draft_step(cache, feats[:, :-1], tokens[:, 1:], jnp.full((b,), s, jnp.int32))
  out = [(target[:, 1:].reshape(b * s, -1), q0.reshape(b * s, -1), jnp.ones((b * s,)))]
  if steps == 1:
    return out
  anchors = jnp.arange(0, s, anchor_stride, dtype=jnp.int32)      # [A]
  rows = b * anchors.shape[0]
  seq = jnp.repeat(jnp.arange(b), anchors.shape[0])                 # row → sequence
  anc = jnp.tile(anchors, b)                                        # row → anchor i
  # Each chain's own copy of its sequence's draft cache, holding entries 0 … i (the slots
  # past i are overwritten by the chain before its queries can see them).
  chain = Cache(jnp.zeros((rows,), jnp.int32), {},
                jax.tree.map(lambda x: x[seq], cache.mtp), anc + 1)
  h = a0[seq, anc]                                                  # [R,d]
  ones = jnp.ones((rows,), jnp.int32)
  for k in range(1, steps):
    pos = anc + 1 + k          # the token fed (x_{i+1+k}); the target there predicts the next
    at = jnp.minimum(pos, t - 1)
    q, h, chain = draft_step(chain, h[:, None], tokens[seq, at][:, None], ones)
    h = h[:, 0]
    out.append((target[seq, at], q[:, 0], (pos <= t - 1).astype(jnp.float32)))
  return out


def chain_loss(config: ModelConfig, draft: dict, variables: dict, tokens, *, steps: int = 7,
               anchor_stride: int = 1):
  """The EAGLE-3 training loss (see `chain_logits` for the arguments): the mean over steps
  of each step's weighted mean LK loss. Returns (loss, {"lk" [steps], "accept" [steps]: the
  mean acceptance probability Σ min(p, q) per step})."""
  lks, accs = [], []
  for p, q, w in chain_logits(config, draft, variables, tokens, steps=steps,
                              anchor_stride=anchor_stride):
    lk, acc = _step_terms(p, q)
    norm = jnp.maximum(jnp.sum(w), 1.0)
    lks.append(jnp.sum(lk * w) / norm)
    accs.append(jnp.sum(acc * w) / norm)
  lks, accs = jnp.stack(lks), jnp.stack(accs)
  return jnp.mean(lks), {"lk": lks, "accept": accs}


def _step_terms(target_logits, draft_logits):
  """Per position: the LK loss and the acceptance probability Σ min(p, q) (no gradient)."""
  lk = lk_loss(target_logits, draft_logits)
  return lk, jax.lax.stop_gradient(jnp.exp(-lk))


# ------------------------------------------------------------------ training the draft
def draft_loss(config: ModelConfig, *, steps: int = 7, anchor_stride: int = 1) -> Loss:
  """`chain_loss` over a batch's token windows (batch["inputs"]) as a `Loss` of the train
  step; metrics: the mean acceptance probability of each chain step (accept [steps])."""
  def fn(variables, batch, totals):
    del totals    # one batch per step: no micro-batches
    draft, _ = split_params(variables["params"])
    loss, met = chain_loss(config, draft, variables, batch["inputs"], steps=steps,
                           anchor_stride=anchor_stride)
    return loss, {"metrics": {"accept": met["accept"]}, "stats": flat_stats({})}

  return Loss(fn)


def draft_optimizer(run: RunConfig) -> tuple[optax.GradientTransformationExtraArgs, object]:
  """(tx, schedule): AdamW without decay after clipping the global norm at 1, the learning rate
  warmed up over the first 5% of train.steps from 0 to optim.lr, then a cosine to 0."""
  steps = run.train.steps
  schedule = optax.warmup_cosine_decay_schedule(0.0, run.optim.lr, max(1, steps // 20),
                                                max(2, steps))
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
  return optax.with_extra_args_support(tx), schedule


def recipe(target: str, *, chain_steps: int = 7, anchor_stride: int = 2) -> Recipe:
  """The trainer's kind for the EAGLE-3 draft of checkpoint `target` (run.model: its
  `eagle_config`): the LK chain loss, the draft's params trainable, the target frozen; the
  draft starts from the target's MTP layer and a fresh `draft_fuse` (seed run.seed). At the
  end of the run the whole model (target + draft) is saved as a checkpoint WORKDIR/draft,
  which `experiments.generate --speculative` reads."""

  def build(run: RunConfig, config: ModelConfig, mesh=None) -> Step:
    tx, schedule = draft_optimizer(run)
    train = jit_step(draft_loss(config, steps=chain_steps, anchor_stride=anchor_stride), tx,
                     DRAFT, config, mesh, schedule=schedule)
    return Step(tx, schedule, train, None)

  def initial(run: RunConfig, config: ModelConfig, rng, fresh: bool) -> dict:
    del fresh
    _, variables = load_pretrained(target)
    fuse = init_variables(config, rng)["params"]["draft_fuse"]
    return {**variables, "params": {**variables["params"], "draft_fuse": fuse}}

  def finish(run: RunConfig, config: ModelConfig, state, workdir: str) -> None:
    save_pretrained(os.path.join(workdir, "draft"), config, state.variables)

  return Recipe("eagle3", DRAFT, build, initial, finish, lm=False, muon=False)


__all__ = ["DRAFT_PARAMS", "DRAFT", "chain_logits", "chain_loss", "eagle_config",
           "split_params", "draft_loss", "draft_optimizer", "recipe"]
