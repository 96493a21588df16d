"""A reused prefix between a decode `Cache` and the `PrefixCache`'s host payloads.

What `prefix_cache.PrefixCache` stores for a prefix (docs/k3.md §10): the MLA latents of its tokens
(every MLA layer) and the KDA checkpoint at its boundary (every KDA layer's state and conv
tail). These three functions copy them out of a cache row and build a cache that resumes from
them; the layers are visited in global order through `Cache.layers` / `Cache.with_layer`.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from k3jax.cache import Cache, KDACache, MLACache
from k3jax.config import ModelConfig

_KDA_FIELDS = ("state", "conv_q", "conv_k", "conv_v")


def kda_checkpoint(cache: Cache, row: int) -> list[dict]:
  """Row `row`'s KDA checkpoint: per KDA layer {state, conv_q, conv_k, conv_v} (numpy)."""
  return [{f: np.asarray(getattr(c, f)[row]) for f in _KDA_FIELDS}
          for c in cache.layers if isinstance(c, KDACache)]


def mla_latents(cache: Cache, row: int, start: int, end: int) -> np.ndarray:
  """Row `row`'s latents of tokens [start, end): [L_mla, end−start, kv_rank+rope] (numpy)."""
  return np.stack([np.concatenate([np.asarray(c.c_kv[row, start:end], np.float32),
                                   np.asarray(c.k_rope[row, start:end], np.float32)], -1)
                   for c in cache.layers if isinstance(c, MLACache)])


def cache_from_prefix(config: ModelConfig, rows: Sequence[tuple], max_len: int) -> Cache:
  """A cache resuming each row from a reused prefix.

  rows: per sequence (latents [L_mla, n, kv_rank+rope] or None, kda checkpoint list or None);
  n = 0 / None means a cold start for that row. The inverse of `mla_latents`/`kda_checkpoint`.
  """
  cache = Cache.zeros(config, len(rows), max_len)
  layers = list(cache.layers)
  lengths = np.zeros(len(rows), np.int32)
  r = config.text.kv_lora_rank
  for b, (lat, kda) in enumerate(rows):
    n = 0 if lat is None else lat.shape[1]
    if n and kda is None and any(isinstance(c, KDACache) for c in layers):
      raise ValueError(f"rows[{b}]: latents of {n} tokens but no KDA checkpoint")
    if n > max_len:
      raise ValueError(f"rows[{b}]: latents of {n} tokens exceed max_len={max_len}")
    lengths[b] = n
    mla = kda_layers = 0
    for i, c in enumerate(layers):
      if isinstance(c, MLACache) and n:
        layers[i] = MLACache(c.c_kv.at[b, :n].set(lat[mla, :, :r].astype(c.c_kv.dtype)),
                             c.k_rope.at[b, :n].set(lat[mla, :, r:].astype(c.k_rope.dtype)))
        mla += 1
      elif isinstance(c, KDACache) and kda is not None:
        layers[i] = KDACache(*(getattr(c, f).at[b].set(kda[kda_layers][f])
                               for f in _KDA_FIELDS))
        kda_layers += 1
  for i, c in enumerate(layers):
    cache = cache.with_layer(i, c)
  return cache.replace(lengths=jnp.asarray(lengths))


__all__ = ["kda_checkpoint", "mla_latents", "cache_from_prefix"]
