"""The decode cache of a `K3Model`: every layer's own cache, laid out like the layers.

`stack` mirrors the model's module tree: the unrolled layers' caches under "layers_{i}"
(global index i) and the scanned body's under "body" → "layers_{j}" (j < mla_every), stacked
on a leading [num_groups] axis, so the scanned groups carry their caches as scan inputs and
outputs. A KDA layer's cache (`KDACache`) has a constant size; an MLA layer's (`MLACache`) is
preallocated for `max_len` tokens. `layers` gives the per-layer view in global order.

  lengths [B] int32     tokens already fed, per row
  mtp / mtp_lengths     the MTP layer's MLACache (position i holds the MTP input built from
                        h_i and token i+1) and its positions fed; None without an MTP layer
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from k3jax.config import KDA, ModelConfig
from k3jax.layers.kda import KDACache
from k3jax.layers.mla import MLACache


def _slot(layout, i: int):
  """Global layer i → (key in `stack`, key under "body" or None, group index or None)."""
  prefix, groups, p = layout
  if prefix <= i < prefix + groups * p:
    g, j = divmod(i - prefix, p)
    return "body", f"layers_{j}", g
  return f"layers_{i}", None, None


@struct.dataclass
class Cache:
  lengths: jax.Array
  stack: dict
  mtp: Any = None
  mtp_lengths: Any = None
  layout: tuple = struct.field(pytree_node=False, default=(0, 0, 1))  # (prefix, groups, p)

  @classmethod
  def zeros(cls, config: ModelConfig, batch: int, max_len: int) -> "Cache":
    """A zero cache for `batch` sequences of up to `max_len` tokens."""
    if max_len < 1:
      raise ValueError(f"max_len: expected >= 1, found {max_len}")
    prefix, groups, _ = config.text.stack_layout()
    layout = (prefix, groups, config.text.mla_every)

    def one(mixer):
      return (KDACache.zeros(config, batch) if mixer == KDA
              else MLACache.zeros(config, batch, max_len))

    stack: dict = {}
    for i, (mixer, _) in enumerate(config.text.layer_types()):
      key, sub, g = _slot(layout, i)
      if sub is None:
        stack[key] = one(mixer)
      elif g == 0:
        stack.setdefault("body", {})[sub] = jax.tree_util.tree_map(
            lambda a: jnp.zeros((groups,) + a.shape, a.dtype), one(mixer))
    zeros = jnp.zeros((batch,), jnp.int32)
    if config.text.num_mtp_layers:
      return cls(zeros, stack, MLACache.zeros(config, batch, max_len), zeros, layout)
    return cls(zeros, stack, layout=layout)

  @property
  def num_layers(self) -> int:
    prefix, groups, p = self.layout
    return len(self.stack) - ("body" in self.stack) + groups * p

  def layer(self, i: int):
    """Layer i's own cache (a KDACache or MLACache of batch-leading arrays)."""
    key, sub, g = _slot(self.layout, i)
    if sub is None:
      return self.stack[key]
    return jax.tree_util.tree_map(lambda a: a[g], self.stack[key][sub])

  def with_layer(self, i: int, c) -> "Cache":
    """This cache with layer i's cache replaced by `c`."""
    key, sub, g = _slot(self.layout, i)
    stack = dict(self.stack)
    if sub is None:
      stack[key] = c
    else:
      body = dict(stack[key])
      body[sub] = jax.tree_util.tree_map(lambda a, x: a.at[g].set(x), body[sub], c)
      stack[key] = body
    return self.replace(stack=stack)

  @property
  def layers(self) -> tuple:
    """Every layer's cache in global order."""
    return tuple(self.layer(i) for i in range(self.num_layers))

  @property
  def max_len(self) -> int:
    for c in jax.tree_util.tree_leaves(self.stack, is_leaf=lambda x: isinstance(x, MLACache)):
      if isinstance(c, MLACache):
        return c.c_kv.shape[-2]
    return np.iinfo(np.int32).max    # KDA-only stacks have no length limit

  def nbytes(self) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))


__all__ = ["Cache", "KDACache", "MLACache"]
