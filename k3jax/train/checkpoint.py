"""Checkpoints (orbax): save every N steps, resume from the latest complete one, load weights.

On-disk layout (shared by training runs and converted PyTorch checkpoints):

    WORKDIR/                         a training run directory
      config.json                    the full run config (ml_collections, for humans)
      metrics.jsonl, events.*        metrics (k3jax.train.metrics)
      checkpoints/                   an orbax CheckpointManager directory
        <step>/                      one complete checkpoint (orbax finalises it atomically)
          model_config/              JSON item: ModelConfig fields (`config_to_dict`)
          variables/                 PyTree item: {"params": {...}, "balance": {...}}, float32,
                                     plain arrays (logical-partitioning boxes removed), paths
                                     exactly the Flax paths of K3Model (docs/contracts.md)
          opt_state/                 training only: {"leaves": {"0": ..., "1": ...}} (optax
                                     state flattened; rebuilt against a fresh optimizer.init)
          meta/                      training only: JSON {"step", "data": iterator state,
                                     "rng": uint32 key data, "run_config": ...}

`load_pretrained(path)` accepts the run directory, its `checkpoints/` directory (or any
CheckpointManager directory) or one `<step>/` directory, and needs only `model_config` and
`variables`: a converter calls `save_pretrained(dir, config, variables)` and gets a directory
that loads the same way. Orbax writes a step into a temporary directory and renames it when
complete, so a run killed mid-save leaves no half checkpoint behind; a step that still fails to
restore (deleted or truncated files) is skipped with a warning and the previous one is used.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import warnings
from typing import Any

import jax
import numpy as np

from k3jax.config import ModelConfig

ITEMS = ("model_config", "variables", "opt_state", "meta")


def _ocp():
  import orbax.checkpoint as ocp  # imported lazily: `import k3jax` stays light
  return ocp


# ---------------------------------------------------------------------- config <-> JSON
def config_to_dict(config: ModelConfig) -> dict:
  d = dataclasses.asdict(config)
  d["qb_range"] = list(d["qb_range"])
  d["lora_targets"] = list(d["lora_targets"])
  if d["eagle_blocks"] is not None:
    d["eagle_blocks"] = list(d["eagle_blocks"])
  return d


def config_from_dict(d: dict) -> ModelConfig:
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(d) - fields)
  if unknown:
    raise ValueError(f"model_config: unknown ModelConfig field(s) {unknown} in checkpoint")
  d = dict(d)
  if "qb_range" in d:
    d["qb_range"] = tuple(d["qb_range"])
  if "lora_targets" in d:
    d["lora_targets"] = tuple(d["lora_targets"])
  if d.get("eagle_blocks") is not None:
    d["eagle_blocks"] = tuple(d["eagle_blocks"])
  if "vision" in d:
    from k3jax.vision.config import as_vision_config
    d["vision"] = as_vision_config(d["vision"])
  return ModelConfig(**d)


def config_diff(a: ModelConfig, b: ModelConfig) -> dict:
  """{field: (a value, b value)} of the fields that differ."""
  da, db = config_to_dict(a), config_to_dict(b)
  return {k: (da[k], db.get(k)) for k in da if da[k] != db.get(k)}


# ---------------------------------------------------------------------- manager
def _manager(directory: str | os.PathLike, max_to_keep: int | None = None,
             async_save: bool = True, create: bool = True):
  ocp = _ocp()
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, create=create, enable_async_checkpointing=async_save)
  return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_names=ITEMS)


def _to_numpy(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


class Checkpointer:
  """Training checkpoints of one run directory (`WORKDIR/checkpoints`)."""

  def __init__(self, workdir: str | os.PathLike, max_to_keep: int | None = 3,
               async_save: bool = True):
    self.directory = pathlib.Path(workdir) / "checkpoints"
    self.manager = _manager(self.directory, max_to_keep=max_to_keep, async_save=async_save)

  def save(self, step: int, config: ModelConfig, variables: dict, opt_state: Any,
           meta: dict) -> None:
    """Queue an (async) save of step `step`; returns once the arrays are copied."""
    ocp = _ocp()
    leaves = {str(i): x for i, x in enumerate(jax.tree.leaves(opt_state))}
    self.manager.save(step, args=ocp.args.Composite(
        model_config=ocp.args.JsonSave(config_to_dict(config)),
        variables=ocp.args.StandardSave(_to_numpy(variables)),
        opt_state=ocp.args.StandardSave({"leaves": _to_numpy(leaves)}),
        meta=ocp.args.JsonSave(meta)))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def check_config(self, config: ModelConfig) -> None:
    """Raise ValueError if the latest checkpoint was written for another model config
    (called before any compute, so a mismatched resume fails fast)."""
    step = self.manager.latest_step()
    if step is None:
      return
    ocp = _ocp()
    try:
      saved = self.manager.restore(step, args=ocp.args.Composite(
          model_config=ocp.args.JsonRestore()))["model_config"]
    except Exception:  # noqa: BLE001 - a corrupt step is reported by restore_latest
      return
    diff = config_diff(config, config_from_dict(saved))
    if diff:
      raise ValueError(
          f"checkpoint {self.directory}/{step} was written for another model config; differing "
          f"fields (current, checkpoint): {diff}. Use a new --workdir or the same config.")

  def restore_latest(self, config: ModelConfig, variables: dict, opt_state: Any):
    """Restore the newest complete checkpoint into the structure of (variables, opt_state).

    Returns (step, variables, opt_state, meta), or None when there is nothing to resume.
    Steps that fail to restore are skipped with a warning.
    """
    ocp = _ocp()
    self.check_config(config)
    abstract = lambda t: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
        if not hasattr(x, "dtype") else jax.ShapeDtypeStruct(x.shape, x.dtype), t)
    leaves, treedef = jax.tree.flatten(opt_state)
    abstract_leaves = {"leaves": abstract({str(i): x for i, x in enumerate(leaves)})}
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        out = self.manager.restore(step, args=ocp.args.Composite(
            variables=ocp.args.StandardRestore(abstract(_to_numpy(variables))),
            opt_state=ocp.args.StandardRestore(abstract_leaves),
            meta=ocp.args.JsonRestore()))
      except Exception as e:  # noqa: BLE001 - any failure means "not loadable": skip it
        warnings.warn(f"skipping unreadable checkpoint {self.directory}/{step}: "
                      f"{type(e).__name__}: {str(e)[:200]}")
        self._set_aside(step)
        continue
      restored = out["opt_state"]["leaves"]
      new_opt = jax.tree.unflatten(treedef, [restored[str(i)] for i in range(len(leaves))])
      return step, out["variables"], new_opt, out["meta"]
    return None

  def _set_aside(self, step: int) -> None:
    """Rename an unreadable step to `<step>.corrupt` (kept for inspection, never loaded), so
    the resumed run can save that step number again."""
    src = self.directory / str(step)
    dst = self.directory / f"{step}.corrupt"
    n = 0
    while dst.exists():
      n += 1
      dst = self.directory / f"{step}.corrupt{n}"
    try:
      src.rename(dst)
      self.manager.reload()
    except OSError:
      pass

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


# ---------------------------------------------------------------------- pretrained weights
def save_pretrained(directory: str | os.PathLike, config: ModelConfig, variables: dict,
                  step: int = 0) -> pathlib.Path:
  """Write `variables` ({"params", "balance"}) and `config` as a checkpoint that
  `load_pretrained(directory)` reads (used by converters). Returns the step directory."""
  ocp = _ocp()
  variables = {k: v for k, v in dict(variables).items() if k in ("params", "balance")}
  variables = _to_numpy(_unbox(variables))
  mgr = _manager(directory, async_save=False)
  mgr.save(step, args=ocp.args.Composite(
      model_config=ocp.args.JsonSave(config_to_dict(config)),
      variables=ocp.args.StandardSave(variables)), force=True)
  mgr.wait_until_finished()
  mgr.close()
  return pathlib.Path(directory) / str(step)


def _unbox(tree):
  try:
    import flax.linen as nn
    return nn.unbox(tree)
  except Exception:  # noqa: BLE001 - already plain arrays
    return tree


def _sharded_target(config: ModelConfig, metadata, mesh: jax.sharding.Mesh) -> dict:
  """ShapeDtypeStructs of a checkpoint's variables (shapes and dtypes as saved) carrying the
  model's shardings over `mesh`."""
  from k3jax import sharding
  from k3jax.train.sharded import logical_variables   # it imports the model: import late
  boxed = logical_variables(config)
  shardings = sharding.param_shardings(mesh, {c: boxed[c] for c in metadata if c in boxed})
  return jax.tree.map(lambda m, sh: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sh),
                      {c: dict(metadata[c]) for c in shardings}, shardings)


def _is_step_dir(p: pathlib.Path) -> bool:
  return p.is_dir() and p.name.isdigit() and (p / "variables").is_dir()


def load_pretrained(path: str | os.PathLike, mesh: jax.sharding.Mesh | None = None
                    ) -> tuple[ModelConfig, dict]:
  """(config, variables) from a training run directory, a CheckpointManager directory or one
  step directory; `K3Model(config).apply(variables, tokens)` then gives logits.

  mesh: restore every array sharded over it by the model's logical-axis rules
  (`sharding.param_shardings`), each process reading only the pieces its devices hold (what a
  pod needs for a checkpoint larger than one host's memory); None: whole arrays.
  Picks the newest step that restores; unreadable steps are skipped with a warning.
  """
  ocp = _ocp()
  p = pathlib.Path(path)
  if not p.exists():
    raise ValueError(f"load_pretrained: path {str(p)!r} does not exist")
  if (p / "checkpoints").is_dir():
    p = p / "checkpoints"
  if _is_step_dir(p):
    root, steps = p.parent, [int(p.name)]
  else:
    root = p
    steps = sorted((int(c.name) for c in p.iterdir() if _is_step_dir(c)), reverse=True)
  if not steps:
    raise ValueError(f"load_pretrained: no checkpoint found under {str(path)!r} (expected a run "
                     f"directory, a checkpoints/ directory or a <step>/ directory)")
  mgr = _manager(root, create=False, async_save=False)
  try:
    for step in steps:
      try:
        if mesh is None:
          out = mgr.restore(step, args=ocp.args.Composite(
              model_config=ocp.args.JsonRestore(), variables=ocp.args.StandardRestore()))
          config = config_from_dict(out["model_config"])
          return config, jax.tree.map(jax.numpy.asarray, dict(out["variables"]))
        config = config_from_dict(mgr.restore(step, args=ocp.args.Composite(
            model_config=ocp.args.JsonRestore()))["model_config"])
        metadata = ocp.StandardCheckpointHandler().metadata(root / str(step) / "variables")
        target = _sharded_target(config, metadata.tree, mesh)
        out = mgr.restore(step, args=ocp.args.Composite(
            variables=ocp.args.StandardRestore(target)))
        return config, dict(out["variables"])
      except Exception as e:  # noqa: BLE001
        warnings.warn(f"load_pretrained: skipping unreadable checkpoint {root}/{step}: "
                      f"{type(e).__name__}: {str(e)[:200]}")
        continue
  finally:
    mgr.close()
  raise ValueError(f"load_pretrained: no readable checkpoint under {str(path)!r}")
