"""k3jax: Kimi K3 in JAX/Flax."""

from k3jax.config import ModelConfig, preset

__all__ = ["ModelConfig", "preset"]


def load_pretrained(path):
  """(config, variables) of a training run or checkpoint dir: k3jax.train.checkpoint."""
  from k3jax.train.checkpoint import load_pretrained as _load  # lazy: keeps import light
  return _load(path)
