"""Tower variables shared by the vision tests."""

import functools

import jax

from k3jax.vision import init_vision


@functools.cache
def perturbed_init(cfg):
  """seed → initialised variables with every parameter perturbed, jitted: one compile per
  config (run eagerly, each parameter shape compiled its own init and noise ops: ~10 s)."""
  def make(seed):
    v = init_vision(cfg, jax.random.PRNGKey(seed))
    leaves, tree = jax.tree_util.tree_flatten(v)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    leaves = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(tree, leaves)
  return jax.jit(make)
