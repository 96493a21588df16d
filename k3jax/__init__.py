"""k3jax: Kimi K3 in JAX/Flax.

`k3jax.preset(name)` builds a `ModelConfig`; `k3jax.load_pretrained(path, mesh=None)` reads a
checkpoint (`k3jax.convert.checkpoint.load_pretrained`)."""

import importlib

from k3jax.config import ModelConfig, preset


def __getattr__(name: str):
  # Every `import k3jax.<module>` runs this file first: importing the converter here would make
  # `import k3jax.model` load it. `load_pretrained` is resolved on first use instead.
  if name == "load_pretrained":
    return importlib.import_module("k3jax.convert.checkpoint").load_pretrained
  raise AttributeError(f"module 'k3jax' has no attribute {name!r}")


__all__ = ["ModelConfig", "preset", "load_pretrained"]
