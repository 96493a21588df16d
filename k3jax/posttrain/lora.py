"""LoRA / QLoRA fine-tuning: low-rank adapters trained on a frozen base (docs/notes/lora.md).

A model config with `lora_rank > 0` has, besides "params" and "balance", a collection "lora"
(k3jax/layers/linear.py, k3jax/layers/moe.py): A/B pairs on the projections `lora_targets`
names. LoRA is the one train step (k3jax/train/step.py) with the adapters as its only
trainable variables (`ADAPTERS`): the base params — float, or packed MXFP4 experts (QLoRA) —
are constants of the step and come out bit-identical, and so does the router bias (the
routing of a frozen base is left as trained). The optimizer is AdamW over the adapters (β1, β2,
the learning-rate schedule and clipping of the run's `optim`, `train.lora.weight_decay`), so
its state is two fp32 moments per adapter weight and nothing for the base (no Per-Head Muon: A
and B are thin matrices; QK-Clip is off, it would rescale the frozen base).

  RECIPE                                           the trainer's kind (train.lora.rank > 0)
  state = init_state(with_adapters(config, rng, base), ADAPTERS, tx)   base: a model's variables
  save_adapters(dir, config, state.params["lora"]); load_adapters(dir)  a small orbax checkpoint
  merged_config, variables = merge_adapters(config, state.variables)  W + s·A·B

Shardings under a mesh: the adapters carry their base kernel's logical axes
(k3jax/sharding.py's table, "lora_rank" replicated) and the optimizer moments follow them
(`k3jax.train.sharded.train_state_shardings`); the frozen base is stored in the layouts the
compiled step reads (`ShardedStep(compiler_layouts=("frozen",))`).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from k3jax.config import ModelConfig, RunModes, config_diff, config_from_dict, config_to_dict
from k3jax.convert.checkpoint import load_pretrained, manager
from k3jax.layers.linear import LORA
from k3jax.ops.lora import merge
from k3jax.quant import mx
from k3jax.train.run import RunConfig
from k3jax.train.schedule import warmup_cosine
from k3jax.train.sharded import Step, check_mesh, jit_step, run_rules
from k3jax.train.state import TrainState, Trainable, init_variables
from k3jax.train.step import lm_loss, make_eval_step
from k3jax.train.trainer import Recipe

ADAPTERS = Trainable((LORA,))
ADAPTER_FIELDS = ("lora_rank", "lora_alpha", "lora_targets")


def check_config(config: ModelConfig) -> None:
  if config.modes.lora_rank <= 0:
    raise ValueError(f"ModelConfig.modes.lora_rank: LoRA training needs lora_rank > 0, found "
                     f"{config.modes.lora_rank}")


def without_adapters(config: ModelConfig) -> ModelConfig:
  """`config` with its adapter fields at their defaults: the model a base checkpoint for it
  holds (a base is compared with a LoRA run's config through this)."""
  return config.replace(**{f: getattr(RunModes(), f) for f in ADAPTER_FIELDS})


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


def with_adapters(config: ModelConfig, rng: jax.Array, base: dict | None = None) -> dict:
  """The variables of a LoRA model at step 0: fresh adapters (B = 0) on `base` ({"params",
  "balance"} of the model without adapters, e.g. `load_pretrained`'s; None: the fresh init's
  own base). A base of another shape is a ValueError naming the first leaf that differs."""
  check_config(config)
  v = init_variables(config, rng)
  if base is not None:
    for c in ("params", "balance"):
      _check_same_tree(f"base {c}", base.get(c, {}), jax.eval_shape(lambda: v[c]))
    v = {**v, "params": base["params"], "balance": base.get("balance", {})}
  return v


def adapter_optimizer(schedule, *, weight_decay: float = 0.0, adam_b1: float = 0.9,
                      adam_b2: float = 0.95, adam_eps: float = 1e-8,
                      clip_norm: float = 0.0) -> optax.GradientTransformationExtraArgs:
  """AdamW over the adapters (decoupled decay on every adapter weight), optionally after
  global-norm clipping."""
  tx = optax.adamw(schedule, b1=adam_b1, b2=adam_b2, eps=adam_eps, weight_decay=weight_decay)
  if clip_norm and clip_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(clip_norm), tx)
  return optax.with_extra_args_support(tx)


# ------------------------------------------------------------------ the run config's step
def build_adapter_step(run: RunConfig, config: ModelConfig, mesh=None, *, rules=None,
                       boxed: Any = None, donate: bool = True) -> Step:
  """The LoRA step of `run`: the language-model loss, the adapters trainable (`ADAPTERS`),
  AdamW with the run's schedule; jitted on one device or for `mesh` (the frozen base in the
  layouts the compiled step reads)."""
  check_config(config)
  o = run.optim
  schedule = warmup_cosine(o.lr, run.train.steps, o.warmup_frac, o.final_lr_frac)
  tx = adapter_optimizer(schedule, weight_decay=run.train.lora.weight_decay, adam_b1=o.adam_b1,
                         adam_b2=o.adam_b2, clip_norm=o.clip_norm)
  if mesh is not None:
    check_mesh(run, config, mesh)
  train = jit_step(lm_loss(config, run.train.mtp_weight), tx, ADAPTERS, config, mesh,
                   grad_accum=run.train.grad_accum, schedule=schedule,
                   rules=run_rules(run) if rules is None else rules, boxed=boxed,
                   donate=donate, compiler_layouts=("frozen",))
  return Step(tx, schedule, train, jax.jit(make_eval_step(config)))


def _initial(run: RunConfig, config: ModelConfig, rng, fresh: bool) -> dict:
  """Fresh adapters on train.lora.base (a pretrained checkpoint of the same model without
  adapters) or, when empty, on the seed's fresh base."""
  base = None
  path = run.train.lora.base
  if path:
    base_config, base = load_pretrained(path)
    diff = config_diff(without_adapters(config), without_adapters(base_config))
    if diff:
      raise ValueError(f"config.train.lora.base: {path!r} holds another model; differing "
                       f"fields (run, checkpoint): {diff}")
  return with_adapters(config, rng, base)


def _finish(run: RunConfig, config: ModelConfig, state: TrainState, workdir: str) -> None:
  save_adapters(os.path.join(workdir, "adapters"), config, state.params[LORA],
                step=run.train.steps)


# A LoRA run checkpoints its adapters alone (the base is train.lora.base, or the seed's) and
# saves them once more under WORKDIR/adapters at the end.
RECIPE = Recipe("lora", ADAPTERS, build_adapter_step, _initial, _finish, lm=True, muon=False)


# ------------------------------------------------------------------ adapters on disk
ADAPTER_ITEMS = ("model_config", "lora")


def _adapter_manager(directory, create: bool):
  return manager(directory, async_save=False, create=create, item_names=ADAPTER_ITEMS)


def save_adapters(directory: str | os.PathLike, config: ModelConfig, lora: dict,
                  step: int = 0) -> pathlib.Path:
  """Write the adapters alone (and the model config they belong to) as an orbax checkpoint
  `directory/<step>/` (written to a temporary name and renamed by orbax). Returns that path."""
  check_config(config)
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


__all__ = ["ADAPTERS", "RECIPE", "check_config", "without_adapters", "with_adapters",
           "adapter_optimizer", "build_adapter_step", "save_adapters", "load_adapters",
           "merge_adapters"]
