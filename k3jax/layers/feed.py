"""What a token mixer needs to extend its cache: where the new tokens go.

A decode call feeds T new tokens per sequence on top of a cache; rows may have different
lengths (right padding), so every row says how many tokens it already holds and how many of
its T inputs are real. The layers' own caches (`layers.kda.KDACache`, `layers.mla.MLACache`)
are extended with the helpers below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Feed:
  """Row b already holds `lengths[b]` tokens; the first `num_new[b]` of its T inputs are real."""
  lengths: jax.Array   # [B] int32
  num_new: jax.Array   # [B] int32

  def valid(self, t: int) -> jax.Array:
    """[B,T] bool: input t of row b is a real token."""
    return jnp.arange(t)[None] < self.num_new[:, None]

  def positions(self, t: int) -> jax.Array:
    """[B,T] int32: the absolute position (cache slot) of input t of row b."""
    return self.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]


def gather_time(x, idx):
  """x [B,T,...], idx [B,n] → [B,n,...] (a per-row gather along time)."""
  return jax.vmap(lambda a, i: a[i])(x, idx)


def write_slots(buf, new, pos, valid):
  """buf [B,S,C] with new [B,T,C] written at slots pos [B,T]; invalid tokens are dropped."""
  pos = jnp.where(valid, pos, buf.shape[1])          # out of range: dropped by mode="drop"
  rows = jnp.broadcast_to(jnp.arange(buf.shape[0])[:, None], pos.shape)
  return buf.at[rows, pos].set(new.astype(buf.dtype), mode="drop")


__all__ = ["Feed", "gather_time", "write_slots"]
