"""Where converters write: the destination check, the staged directory renamed when complete,
the progress bar and the storage dtypes — shared by the text and the vision converters."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil

import ml_dtypes
import numpy as np
from tqdm import tqdm

STORE = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def progress_bar(total: int, desc: str, enabled: bool):
  """A tqdm bar in bytes (disabled: a silent one with the same interface)."""
  return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
              disable=not enabled, dynamic_ncols=True)


def check_dst(dst: pathlib.Path) -> None:
  """`dst` must be new, in an existing directory (ValueError naming it)."""
  if dst.exists():
    raise ValueError(f"--dst {str(dst)!r} already exists; choose a new directory")
  if not dst.parent.is_dir():
    raise ValueError(f"--dst: parent directory {str(dst.parent)!r} does not exist")


def staging_path(dst: pathlib.Path, kind: str = "tmp") -> pathlib.Path:
  """A hidden sibling of `dst` private to this process (`.NAME.KIND-PID`)."""
  return dst.parent / f".{dst.name}.{kind}-{os.getpid()}"


@contextlib.contextmanager
def staged_dir(dst: pathlib.Path, *, create: bool = True):
  """Yield the staging directory of `dst` (made when `create`; else the block makes it);
  renamed to `dst` when the block completes — atomic on one filesystem, so `dst` appears only
  when complete — and removed on any error, interruption included."""
  tmp = staging_path(dst)
  try:
    if create:
      tmp.mkdir()
    yield tmp
    os.rename(tmp, dst)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


__all__ = ["STORE", "progress_bar", "check_dst", "staging_path", "staged_dir"]
