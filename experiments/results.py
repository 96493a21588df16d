"""Result files of the experiments: JSON written whole, through a temporary file beside the
target and a rename, so neither a reader nor an interrupted run ever sees half a file."""
from __future__ import annotations

import json
import os


def write_json(path, obj, *, indent: int | None = None, ensure_ascii: bool = True) -> None:
  """obj as JSON (one line unless `indent`) and a newline at `path` (a str or path; its folder
  is made). The temporary name carries the process id, so concurrent writers never share it."""
  text = json.dumps(obj, indent=indent, ensure_ascii=ensure_ascii) + "\n"   # fails before any file
  path = os.fspath(path)
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
  with open(tmp, "w") as fh:
    fh.write(text)
  os.replace(tmp, path)
