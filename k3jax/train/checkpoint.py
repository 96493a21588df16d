"""Training checkpoints of a run directory: save every N steps, resume from the newest complete
one (a step that fails to restore is set aside as `<step>.corrupt` and the previous one used).
The on-disk layout is k3jax/convert/checkpoint.py's: a run's `checkpoints/` is a directory
`load_pretrained` reads."""

from __future__ import annotations

import os
import pathlib
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from k3jax.config import ModelConfig, config_diff, config_from_dict, config_to_dict
from k3jax.convert.checkpoint import manager, to_numpy


class Checkpointer:
  """Training checkpoints of one run directory (`WORKDIR/checkpoints`)."""

  def __init__(self, workdir: str | os.PathLike, max_to_keep: int | None = 3,
               async_save: bool = True):
    self.directory = pathlib.Path(workdir) / "checkpoints"
    self.manager = manager(self.directory, max_to_keep=max_to_keep, async_save=async_save)

  def save(self, step: int, config: ModelConfig, variables: dict, opt_state: Any,
           meta: dict) -> None:
    """Queue an (async) save of step `step`; returns once the arrays are copied."""
    leaves = {str(i): x for i, x in enumerate(jax.tree.leaves(opt_state))}
    self.manager.save(step, args=ocp.args.Composite(
        model_config=ocp.args.JsonSave(config_to_dict(config)),
        variables=ocp.args.StandardSave(to_numpy(variables)),
        opt_state=ocp.args.StandardSave({"leaves": to_numpy(leaves)}),
        meta=ocp.args.JsonSave(meta)))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def check_config(self, config: ModelConfig) -> None:
    """Raise ValueError if the latest checkpoint was written for another model config
    (called before any compute, so a mismatched resume fails fast)."""
    step = self.manager.latest_step()
    if step is None:
      return
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
    self.check_config(config)
    abstract = lambda t: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
        if not hasattr(x, "dtype") else jax.ShapeDtypeStruct(x.shape, x.dtype), t)
    leaves, treedef = jax.tree.flatten(opt_state)
    abstract_leaves = {"leaves": abstract({str(i): x for i, x in enumerate(leaves)})}
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        out = self.manager.restore(step, args=ocp.args.Composite(
            variables=ocp.args.StandardRestore(abstract(to_numpy(variables))),
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


__all__ = ["Checkpointer"]
