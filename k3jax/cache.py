"""The decode cache of a `K3Model`: every layer's own cache, laid out like the layers.

`stack` mirrors the model's module tree: the unrolled layers' caches under "layers_{i}"
(global index i) and the scanned body's under "body" → "layers_{j}" (j < mla_every), stacked
on a leading [num_groups] axis, so the scanned groups carry their caches as scan inputs and
outputs. A KDA layer's cache (`KDACache`) has a constant size; an MLA layer's (`MLACache`) is
preallocated for `max_len` tokens. `layers` gives the per-layer view in global order.

  lengths [B] int32     tokens already fed, per row
  mtp / mtp_lengths     the MTP layer's MLACache (position i holds the MTP input built from
                        h_i and token i+1) and its positions fed; None without an MTP layer

Paged latents (the serving engine, k3jax/serve/): an MLA layer's latents can live in a pool of
fixed-size pages shared by every slot (`MLAPages` [num_pages, page, C]) with a block table per
row ([B, max_pages] page ids; entry j holds positions [j·page, (j+1)·page)). The model itself
only ever sees a contiguous `MLACache`: `paged_cache` gathers each row's pages into one
(`gather_pages`, max_pages·page slots) and puts it beside the rows' KDA caches; after
`K3Model.extend`, `commit_paged` writes the new tokens' latents back into their pages
(`write_pages`) and returns the updated KDA caches. Slots past a row's length hold whatever
its pages hold (stale latents, or the zero page): attention never reads them (masked to exact
zeros), so a paged decode computes what the contiguous one does.
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


# ---------------------------------------------------------------------- paged MLA latents
@struct.dataclass
class MLAPages:
  """One MLA layer's latents in pages (a scanned group's layers: a leading [groups] axis)."""
  c_kv: jax.Array      # [P, page, kv_rank] normalised latents, compute dtype
  k_rope: jax.Array    # [P, page, rope]

  @classmethod
  def zeros(cls, config: ModelConfig, num_pages: int, page_size: int) -> "MLAPages":
    if num_pages < 1 or page_size < 1:
      raise ValueError(f"MLAPages: num_pages and page_size must be >= 1, found {num_pages}, "
                       f"{page_size}")
    c = MLACache.zeros(config, num_pages, page_size)
    return cls(c.c_kv, c.k_rope)

  @property
  def page_size(self) -> int:
    return self.c_kv.shape[-2]


def gather_pages(pages: MLAPages, block_table) -> MLACache:
  """Each row's pages in block-table order: block_table [B, M] → MLACache [B, M·page, C]."""
  def one(a):
    g = a[block_table]                                   # [B, M, page, C]
    return g.reshape(g.shape[0], -1, g.shape[-1])
  return MLACache(one(pages.c_kv), one(pages.k_rope))


def write_pages(pages: MLAPages, view: MLACache, block_table, start, count, t: int) -> MLAPages:
  """`pages` with the latents of positions start[b] … start[b]+count[b]−1 ([B] ints, count ≤
  t) copied from a row-contiguous `view` (MLACache [B, S, C]) into row b's pages."""
  page = pages.page_size
  pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]               # [B, t]
  valid = jnp.arange(t)[None] < count[:, None]
  safe = jnp.where(valid, pos, 0)
  slot = jnp.take_along_axis(block_table, jnp.minimum(safe // page, block_table.shape[1] - 1),
                             axis=1)
  slot = jnp.where(valid, slot, pages.c_kv.shape[0])                      # dropped below
  off = safe % page

  def one(pool, buf):
    new = jax.vmap(lambda a, i: a[i])(buf, jnp.minimum(safe, buf.shape[1] - 1))   # [B, t, C]
    return pool.at[slot, off].set(new.astype(pool.dtype), mode="drop")
  return MLAPages(one(pages.c_kv, view.c_kv), one(pages.k_rope, view.k_rope))


def _walk(stack: dict, fn, stacked: bool = False) -> dict:
  """{key: fn(leaf, stacked)} over a stack-shaped dict (the scanned body's leaves: stacked)."""
  out = {}
  for key, c in stack.items():
    if key == "body":
      out[key] = _walk(c, fn, True)
    else:
      out[key] = fn(c, stacked)
  return out


def _select(stack: dict, kind) -> dict:
  """The entries of a stack-shaped dict whose leaf is a `kind` (KDACache, MLACache, …)."""
  out = {}
  for key, c in stack.items():
    if key == "body":
      sub = _select(c, kind)
      if sub:
        out[key] = sub
    elif isinstance(c, kind):
      out[key] = c
  return out


def _merge(a: dict, b: dict) -> dict:
  out = dict(a)
  for key, c in b.items():
    out[key] = _merge(out.get(key, {}), c) if key == "body" else c
  return out


def kda_zeros(config: ModelConfig, batch: int) -> dict:
  """The KDA layers' caches of `batch` rows, laid out like `Cache.stack` (MLA layers left out);
  every leaf its own buffer (the serving engine donates them)."""
  return jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype),
                                _select(Cache.zeros(config, batch, 1).stack, KDACache))


def page_pools(config: ModelConfig, num_pages: int, page_size: int, mtp: bool = False) -> dict:
  """Zero page pools of every MLA layer, laid out like `Cache.stack` (KDA layers left out);
  with `mtp`, the MTP layer's pool too (key "mtp": its position i holds the MTP input built
  from h_i and token i+1, in the same pages as the other layers' position i)."""
  mla = _select(Cache.zeros(config, 1, 1).stack, MLACache)

  def one(_, stacked):
    p = MLAPages.zeros(config, num_pages, page_size)
    if stacked:
      groups = config.text.stack_layout()[1]
      return jax.tree_util.tree_map(lambda a: jnp.zeros((groups,) + a.shape, a.dtype), p)
    return p
  pools = _walk(mla, one)
  if mtp:
    pools["mtp"] = MLAPages.zeros(config, num_pages, page_size)
  return pools


def paged_cache(config: ModelConfig, kda: dict, pools: dict, block_table, lengths,
                mtp_lengths=None) -> Cache:
  """A `Cache` the model can extend: the rows' KDA caches (`kda`, from `kda_zeros`'s layout)
  and each MLA layer's pages gathered per row (`pools`, from `page_pools`), B = len(lengths);
  the MTP layer's too when `pools` has it (`mtp_lengths` [B] its positions fed)."""
  def gather(p, stacked):
    if stacked:
      return jax.vmap(gather_pages, in_axes=(0, None))(p, block_table)
    return gather_pages(p, block_table)
  prefix, groups, _ = config.text.stack_layout()
  layers = {k: v for k, v in pools.items() if k != "mtp"}
  mtp = gather_pages(pools["mtp"], block_table) if "mtp" in pools else None
  return Cache(jnp.asarray(lengths, jnp.int32), _merge(kda, _walk(layers, gather)), mtp,
               None if mtp is None else jnp.asarray(mtp_lengths, jnp.int32),
               layout=(prefix, groups, config.text.mla_every))


def commit_paged(cache: Cache, pools: dict, block_table, start, count, t: int
                 ) -> tuple[dict, dict]:
  """After `K3Model.extend` of t inputs on a `paged_cache`: (the rows' KDA caches, `pools` with
  the count[b] new latents of row b (positions start[b]…) written into its pages). The MTP
  pool, if any, is left as it is (`commit_mtp`)."""
  mla = _select(cache.stack, MLACache)

  def write(p, view, stacked):
    if stacked:
      return jax.vmap(write_pages, in_axes=(0, 0, None, None, None, None))(
          p, view, block_table, start, count, t)
    return write_pages(p, view, block_table, start, count, t)

  def walk(pools_, views, stacked=False):
    out = dict(pools_)
    for k in views:
      out[k] = walk(pools_[k], views[k], True) if k == "body" else write(pools_[k], views[k],
                                                                          stacked)
    return out
  return _select(cache.stack, KDACache), walk(pools, mla)


def commit_mtp(cache: Cache, pools: dict, block_table, start, count, t: int) -> dict:
  """`pools` with the MTP layer's count[b] new entries of row b (positions start[b]…) written
  from `cache.mtp` into its pages."""
  return {**pools, "mtp": write_pages(pools["mtp"], cache.mtp, block_table, start, count, t)}


def kda_rows(kda: dict, index) -> dict:
  """Rows `index` ([n] ints) of KDA caches laid out like `kda_zeros` (batch axis 0, or 1 in
  the scanned body)."""
  return _walk(kda, lambda c, stacked: jax.tree_util.tree_map(
      lambda a: jnp.take(a, index, axis=1 if stacked else 0), c))


def kda_set_rows(kda: dict, index, rows: dict) -> dict:
  """`kda` with rows `index` ([n] ints) replaced by `rows` (n rows, same layout)."""
  def one(c, r, stacked):
    if stacked:
      return jax.tree_util.tree_map(lambda a, x: a.at[:, index].set(x), c, r)
    return jax.tree_util.tree_map(lambda a, x: a.at[index].set(x), c, r)

  def walk(a, b, stacked=False):
    return {k: walk(a[k], b[k], True) if k == "body" else one(a[k], b[k], stacked) for k in a}
  return walk(kda, rows)


__all__ = ["Cache", "KDACache", "MLACache", "MLAPages", "gather_pages", "write_pages",
           "kda_zeros", "page_pools", "paged_cache", "commit_paged", "commit_mtp", "kda_rows",
           "kda_set_rows"]
