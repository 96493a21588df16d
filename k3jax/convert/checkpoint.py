"""The k3jax checkpoint on disk (orbax): `save_pretrained` / `load_pretrained`, and the manager
the training runs' checkpoints (k3jax/train/checkpoint.py) share.

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

import os
import pathlib
import warnings

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp

from k3jax import sharding
from k3jax.config import ModelConfig, config_from_dict, config_to_dict
from k3jax.model import abstract_variables

ITEMS = ("model_config", "variables", "opt_state", "meta")


# ---------------------------------------------------------------------- manager
def manager(directory: str | os.PathLike, max_to_keep: int | None = None,
            async_save: bool = True, create: bool = True, item_names=ITEMS):
  """An orbax CheckpointManager of `directory` over `item_names`."""
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, create=create, enable_async_checkpointing=async_save)
  return ocp.CheckpointManager(os.path.abspath(directory), options=options,
                                item_names=item_names)


def to_numpy(tree):
  """Every leaf as a host numpy array."""
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


# ---------------------------------------------------------------------- pretrained weights
def save_pretrained(directory: str | os.PathLike, config: ModelConfig, variables: dict,
                  step: int = 0) -> pathlib.Path:
  """Write `variables` ({"params", "balance"}) and `config` as a checkpoint that
  `load_pretrained(directory)` reads (used by converters). Returns the step directory."""
  variables = {k: v for k, v in dict(variables).items() if k in ("params", "balance")}
  variables = to_numpy(nn.unbox(variables))
  mgr = manager(directory, async_save=False)
  mgr.save(step, args=ocp.args.Composite(
      model_config=ocp.args.JsonSave(config_to_dict(config)),
      variables=ocp.args.StandardSave(variables)), force=True)
  mgr.wait_until_finished()
  mgr.close()
  return pathlib.Path(directory) / str(step)


def _sharded_target(config: ModelConfig, metadata, mesh: jax.sharding.Mesh) -> dict:
  """ShapeDtypeStructs of a checkpoint's variables (shapes and dtypes as saved) carrying the
  model's shardings over `mesh`."""
  boxed = abstract_variables(config)
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
  mgr = manager(root, create=False, async_save=False)
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


__all__ = ["ITEMS", "manager", "to_numpy", "save_pretrained", "load_pretrained"]
