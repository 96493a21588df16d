"""Names of pytree key paths, shared by the optimizer labels and the sharding tables."""

from __future__ import annotations

from typing import Any


def key_names(path: Any) -> tuple[str, ...]:
  """A jax key path → its names: dict keys, attribute names and sequence indices as strings."""
  names = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        names.append(str(getattr(k, attr)))
        break
    else:
      names.append(str(k))
  return tuple(names)


def path_str(path: Any) -> str:
  """A jax key path → "a/b/c"."""
  return "/".join(key_names(path))
