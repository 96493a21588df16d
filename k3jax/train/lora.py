"""LoRA / QLoRA fine-tuning: train low-rank adapters on a frozen base (docs/notes/lora.md).

A model config with `lora_rank > 0` has, besides "params" and "balance", a collection "lora"
(k3jax/layers/linear.py, k3jax/layers/moe.py): A/B pairs on the projections `lora_targets`
names. The train step here differentiates the loss with respect to that collection alone, so
the base params — float, or packed MXFP4 experts (QLoRA) — are constants of the step and come
out bit-identical; the router bias is the base's too (no Quantile Balancing update: the routing
of a frozen base is left as trained). The optimizer is AdamW over the adapters (β1, β2, ε, the
learning-rate schedule and the decoupled weight decay of the run config's `optim`), so its
state is two fp32 moments per adapter weight and nothing for the base (no Per-Head Muon: A and
B are thin matrices; QK-Clip is off, it would rescale the frozen base).

  state = create_state(config, rng, tx, base=variables)      # base: a pretrained model's
  step = build_lora_step(cfg, config, mesh)                   # (tx, schedule, train, eval)
  save_adapters(dir, config, state.lora); load_adapters(dir)  # a small orbax checkpoint
  merged_config, variables = merge_adapters(config, state.variables)   # W + s·A·B

Shardings under a mesh: the adapters carry their base kernel's logical axes
(k3jax/sharding.py's table, "lora_rank" replicated) and the optimizer moments follow them
(`k3jax.train.sharded.opt_state_shardings`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Callable, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3jax import sharding
from k3jax.config import ModelConfig
from k3jax.layers.linear import LORA
from k3jax.train.step import accumulated_grads, make_eval_step

COLLECTIONS = ("params", "balance", LORA)


@flax.struct.dataclass
class LoRAState:
  step: jax.Array        # [] int32: optimizer steps taken
  params: Any            # the frozen base (never updated)
  balance: Any           # the base's router bias (never updated)
  lora: Any              # the adapters: the only trained variables
  opt_state: Any         # AdamW moments of the adapters

  @property
  def variables(self) -> dict:
    return {"params": self.params, "balance": self.balance, LORA: self.lora}


def check_config(config: ModelConfig) -> None:
  if config.lora_rank <= 0:
    raise ValueError(f"ModelConfig.lora_rank: LoRA training needs lora_rank > 0, found "
                     f"{config.lora_rank}")


ADAPTER_FIELDS = ("lora_rank", "lora_alpha", "lora_targets")


def without_adapters(config: ModelConfig) -> ModelConfig:
  """`config` with its adapter fields at their defaults: the model a base checkpoint for it
  holds (a base is compared with a LoRA run's config through this)."""
  return config.replace(**{f.name: f.default for f in dataclasses.fields(ModelConfig)
                           if f.name in ADAPTER_FIELDS})


def _model(config: ModelConfig):
  from k3jax.model import K3Model  # the model is a sibling package; import late
  return K3Model(config)


_INIT: dict = {}


def init_variables(config: ModelConfig, rng: jax.Array, seq_len: int = 8) -> dict:
  """{"params", "balance", "lora"} of a fresh LoRA model (unboxed; jitted init cached)."""
  check_config(config)
  if (config, seq_len) not in _INIT:
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    _INIT[config, seq_len] = jax.jit(lambda r: nn.unbox(_model(config).init(r, tokens)))
  v = _INIT[config, seq_len](rng)
  return {c: v.get(c, {}) for c in COLLECTIONS}


def _check_same_tree(what: str, got: Any, want: Any) -> None:
  """ValueError naming the first leaf whose path, shape or dtype differs."""
  g = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(got)}
  w = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(want)}
  for k in sorted(set(g) | set(w)):
    if k not in g or k not in w:
      raise ValueError(f"{what}: {k} is {'missing' if k not in g else 'not in the model'}")
    if tuple(np.shape(g[k])) != tuple(w[k].shape) or np.asarray(g[k]).dtype != w[k].dtype:
      raise ValueError(f"{what}: {k} expected {w[k].dtype} {tuple(w[k].shape)}, found "
                       f"{np.asarray(g[k]).dtype} {tuple(np.shape(g[k]))}")


def create_state(config: ModelConfig, rng: jax.Array, tx: optax.GradientTransformation,
                 base: dict | None = None, seq_len: int = 8) -> LoRAState:
  """A LoRA training state: fresh adapters (B = 0) on `base` ({"params", "balance"} of the
  model without adapters, e.g. `load_pretrained`'s; None: the fresh init's own base)."""
  v = init_variables(config, rng, seq_len)
  if base is not None:
    for c in ("params", "balance"):
      _check_same_tree(f"base {c}", base.get(c, {}), jax.eval_shape(lambda: v[c]))
    v = {**v, "params": base["params"], "balance": base.get("balance", {})}
  return LoRAState(step=jnp.zeros([], jnp.int32), params=v["params"], balance=v["balance"],
                   lora=v[LORA], opt_state=tx.init(v[LORA]))


def make_optimizer(schedule, *, weight_decay: float = 0.0, adam_b1: float = 0.9,
                   adam_b2: float = 0.95, adam_eps: float = 1e-8,
                   clip_norm: float = 0.0) -> optax.GradientTransformation:
  """AdamW over the adapters tree (decoupled decay on every adapter weight), optionally
  after global-norm clipping."""
  tx = optax.adamw(schedule, b1=adam_b1, b2=adam_b2, eps=adam_eps, weight_decay=weight_decay)
  if clip_norm and clip_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(clip_norm), tx)
  return tx


def make_train_step(config: ModelConfig, tx: optax.GradientTransformation, *,
                    mtp_weight: float = 0.3, schedule: Callable | None = None,
                    grad_accum: int = 1, grad_shardings: Any = None):
  """train_step(LoRAState, batch) → (LoRAState, metrics): adapters updated, nothing else.
  Metrics as `k3jax.train.step.make_train_step`'s (loss, ce, mtp_ce, grad_norm, stats, lr)."""
  check_config(config)
  from k3jax.train.step import LOGGED_STATS

  def train_step(state: LoRAState, batch: dict):
    (loss, (ce, mtp_ce, stats)), grads = accumulated_grads(
        state.params, state.balance, batch, config, mtp_weight, grad_accum, lora=state.lora)
    grads = sharding.constrain_like_params(grads, grad_shardings)
    updates, opt_state = tx.update(grads, state.opt_state, state.lora)
    metrics = {"loss": loss, "ce": ce, "mtp_ce": mtp_ce, "grad_norm": optax.tree.norm(grads),
               "stats": {k: v for k, v in stats.items() if k.rsplit("/", 1)[1] in LOGGED_STATS}}
    if schedule is not None:
      metrics["lr"] = schedule(state.step)
    return state.replace(step=state.step + 1, lora=optax.apply_updates(state.lora, updates),
                         opt_state=opt_state), metrics

  return train_step


# ------------------------------------------------------------------ the run config's step
def optimizer(cfg) -> tuple[optax.GradientTransformation, Callable]:
  """(AdamW over the adapters, warmup-cosine schedule) from the run config's `optim`
  (`train.lora.weight_decay` overrides optim.weight_decay: adapters usually take none)."""
  from k3jax.train.schedule import warmup_cosine
  o = cfg.optim
  schedule = warmup_cosine(o.lr, cfg.train.steps, o.warmup_frac, o.get("final_lr_frac", 0.1))
  lcfg = cfg.train.get("lora") or {}
  wd = lcfg.get("weight_decay", o.weight_decay)
  return make_optimizer(schedule, weight_decay=wd, adam_b1=o.adam_b1, adam_b2=o.adam_b2,
                        clip_norm=o.get("clip_norm", 0.0)), schedule


def logical_variables(config: ModelConfig) -> dict:
  """All collections as boxed `jax.ShapeDtypeStruct`s (nothing allocated)."""
  return jax.eval_shape(_model(config).init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))


def abstract_state(config: ModelConfig, tx: optax.GradientTransformation,
                   boxed: Any = None) -> LoRAState:
  boxed = logical_variables(config) if boxed is None else boxed
  v = nn.unbox({c: boxed.get(c, {}) for c in COLLECTIONS})
  return LoRAState(step=jax.ShapeDtypeStruct((), jnp.int32), params=v["params"],
                   balance=v["balance"], lora=v[LORA], opt_state=jax.eval_shape(tx.init, v[LORA]))


def state_shardings(mesh: Mesh | jax.sharding.AbstractMesh, state: LoRAState, boxed: Any,
                    rules: Sequence[tuple[str, Any]] | None = None) -> LoRAState:
  """Base, bias and adapters from their logical axes (the adapters like their base kernels);
  the AdamW moments like the adapters they mirror; the step replicated."""
  from k3jax.train.sharded import opt_state_shardings
  sh = sharding.param_shardings(mesh, {c: boxed[c] for c in COLLECTIONS if c in boxed}, rules)
  lora_sh = sh.get(LORA, {})
  return state.replace(step=NamedSharding(mesh, P()), params=sh["params"],
                       balance=sh.get("balance", {}), lora=lora_sh,
                       opt_state=opt_state_shardings(mesh, state.opt_state, state.lora, lora_sh))


def build_lora_step(cfg, config: ModelConfig, mesh: Mesh | None = None, *,
                    rules: Sequence[tuple[str, Any]] | None = None, boxed: Any = None,
                    donate: bool = True):
  """`k3jax.train.sharded.build_step` for a LoRA run: a `Step` (tx, schedule, train, eval)
  whose train step is `make_train_step`'s, jitted on one device or for `mesh` (a
  `ShardedStep` with `state_shardings`)."""
  from k3jax.train.sharded import ShardedStep, Step, mesh_rules
  check_config(config)
  accum = cfg.train.get("grad_accum", 1)
  tx, schedule = optimizer(cfg)
  eval_fn = jax.jit(make_eval_step(config))
  if mesh is None:
    fn = make_train_step(config, tx, mtp_weight=cfg.train.mtp_weight, schedule=schedule,
                         grad_accum=accum)
    return Step(tx, schedule, jax.jit(fn, donate_argnums=0 if donate else ()), eval_fn)
  rules = mesh_rules(cfg, config, mesh, rules)
  boxed = logical_variables(config) if boxed is None else boxed
  state = abstract_state(config, tx, boxed)
  sh = state_shardings(mesh, state, boxed, rules)
  fn = make_train_step(config, tx, mtp_weight=cfg.train.mtp_weight, schedule=schedule,
                       grad_accum=accum, grad_shardings=sh.lora)
  # The frozen base passes through the step unchanged: stored in the layouts the step reads.
  train = ShardedStep(fn, mesh, sh, state, donate, compiler_layouts=("params",))
  return Step(tx, schedule, train, eval_fn)


# ------------------------------------------------------------------ adapters on disk
ADAPTER_ITEMS = ("model_config", "lora")


def _adapter_manager(directory, create: bool):
  from k3jax.train.checkpoint import _ocp
  ocp = _ocp()
  return ocp.CheckpointManager(
      os.path.abspath(directory), item_names=ADAPTER_ITEMS,
      options=ocp.CheckpointManagerOptions(create=create, enable_async_checkpointing=False))


def save_adapters(directory: str | os.PathLike, config: ModelConfig, lora: dict,
                  step: int = 0) -> pathlib.Path:
  """Write the adapters alone (and the model config they belong to) as an orbax checkpoint
  `directory/<step>/` (written to a temporary name and renamed by orbax). Returns that path."""
  from k3jax.train.checkpoint import _ocp, config_to_dict
  check_config(config)
  ocp = _ocp()
  mgr = _adapter_manager(directory, create=True)
  try:
    mgr.save(step, args=ocp.args.Composite(
        model_config=ocp.args.JsonSave(config_to_dict(config)),
        lora=ocp.args.StandardSave(jax.tree.map(lambda x: np.asarray(jax.device_get(x)),
                                                nn.unbox(lora)))), force=True)
    mgr.wait_until_finished()
  finally:
    mgr.close()
  return pathlib.Path(directory) / str(step)


def load_adapters(directory: str | os.PathLike,
                  config: ModelConfig | None = None) -> tuple[ModelConfig, dict]:
  """(model config, adapters) from `save_adapters`' directory (its newest step). With
  `config`, the saved config must equal it (ValueError naming the differing fields)."""
  from k3jax.train.checkpoint import _ocp, config_diff, config_from_dict
  ocp = _ocp()
  p = pathlib.Path(directory)
  if not p.is_dir():
    raise ValueError(f"load_adapters: {str(p)!r} is not a directory")
  mgr = _adapter_manager(p, create=False)
  try:
    step = mgr.latest_step()
    if step is None:
      raise ValueError(f"load_adapters: no adapter checkpoint under {str(p)!r}")
    out = mgr.restore(step, args=ocp.args.Composite(
        model_config=ocp.args.JsonRestore(), lora=ocp.args.StandardRestore()))
  finally:
    mgr.close()
  saved = config_from_dict(out["model_config"])
  if config is not None and config_diff(config, saved):
    raise ValueError(f"load_adapters: the adapters in {str(p)!r} were saved for another model "
                     f"config; differing fields (given, saved): {config_diff(config, saved)}")
  return saved, jax.tree.map(jnp.asarray, dict(out["lora"]))


# ------------------------------------------------------------------ merging
def _merge_tree(params: dict, lora: dict, scale: float, path: str) -> dict:
  """params with every adapter of `lora` folded into its kernel (see `merge_adapters`)."""
  from k3jax.ops.lora import merge
  from k3jax.quant import mx
  out = dict(params)
  keys = set(lora)
  if {"lora_a", "lora_b"} <= keys:            # a LoRALinear: kernel [batch…, in…, out…]
    k, a, b = params["kernel"], lora["lora_a"], lora["lora_b"]
    nb = a.ndim + b.ndim - 2 - k.ndim
    out["kernel"] = merge(k, a, b, scale, n_in=a.ndim - 1 - nb)
    keys -= {"lora_a", "lora_b"}
  for name in mx.EXPERT_MATRICES:             # experts: w*_lora_a [batch…, E, in, r]
    if f"{name}_lora_a" not in keys:
      continue
    a, b = lora[f"{name}_lora_a"], lora[f"{name}_lora_b"]
    w = params[name]
    packed = isinstance(w, dict)
    dense = mx.unpack_expert(w[mx.PACKED], w[mx.SCALE], jnp.float32) if packed else w
    merged = merge(dense, a, b, scale, n_in=1)
    if packed:   # the base stays MXFP4: re-quantised by the exporter's quantiser
      p, s = mx.pack_expert(merged)
      merged = {mx.PACKED: p, mx.SCALE: s}
    out[name] = merged
    keys -= {f"{name}_lora_a", f"{name}_lora_b"}
  for k in sorted(keys):
    if not isinstance(lora[k], dict):
      raise ValueError(f"merge_adapters: unexpected adapter leaf {path}/{k}")
    if k not in params:
      raise ValueError(f"merge_adapters: adapters at {path}/{k} have no base params")
    out[k] = _merge_tree(params[k], lora[k], scale, f"{path}/{k}")
  return out


def merge_adapters(config: ModelConfig, variables: dict) -> tuple[ModelConfig, dict]:
  """Fold the adapters into the base: every adapted kernel becomes W + s·A·B (fp32 sum, the
  kernel's dtype); packed MXFP4 experts are dequantised, summed and re-quantised with
  `k3jax.quant.mx.pack_expert` (the quantiser export and QAT share). Returns the config
  without adapters (lora_rank=0) and its {"params", "balance"}: a plain model."""
  check_config(config)
  if LORA not in variables:
    raise ValueError("merge_adapters: variables have no 'lora' collection")
  params = _merge_tree(variables["params"], variables[LORA], config.lora_scale, "lora")
  return config.replace(lora_rank=0), {"params": params,
                                       "balance": variables.get("balance", {})}


__all__ = ["LoRAState", "init_variables", "create_state", "make_optimizer", "make_train_step",
           "optimizer", "logical_variables", "abstract_state", "state_shardings",
           "build_lora_step", "save_adapters", "load_adapters", "merge_adapters"]
