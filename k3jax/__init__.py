"""k3jax: Kimi K3 in JAX/Flax."""

from k3jax.config import ModelConfig, preset

__all__ = ["ModelConfig", "preset"]
