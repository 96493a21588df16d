"""The serving engine's device state and the compiled programs that run over it.

State (all device arrays):
  pools      every MLA layer's latent pages (`k3jax.cache.page_pools`: [num_pages, page, C],
             shared by every slot and by the prefix cache; page ids come from
             `k3jax.serve.pages.PageAllocator`);
  kda[t]     the KDA caches (state + conv tails) of the `rows` slots of decode tile t
             (`k3jax.cache.kda_zeros` layout);
  store      `num_checkpoints` KDA checkpoints (the prefix cache's device slots), same layout.

Programs (jitted once per shape, shared by every engine of one config, state donated):
  forward    `K3Model.extend` on rows of a paged cache, then each row's sample at its last real
             input. It runs as decode — one token for each row of a tile, [rows, 1] — and as
             prefill — up to `prefill_rows` pieces of one bucket, [prefill_rows, bucket], on
             the staging rows `stage` (each piece's slot row is copied in, and back after);
  copy_row   one row of KDA caches to another array (staging, checkpoints, a cold start);
  copy_page  one page of every MLA pool (copy-on-write of a shared, partly filled page).

Why a row's result is the same whatever shares its program (batch invariance, docs/notes/
serve.md): every program has a fixed shape whatever the number of slots or requests — a
decode is always one tile of `rows` rows, a piece always one of `prefill_rows` rows of its bucket
— and every
operation in it is row-independent: per-row norms, KDA and attention, matmuls whose reduction
runs over the contracted axis alone (XLA:CPU's dot of a fixed shape gives a row the same bits at
any position and beside any other rows; tests/serve/test_invariance.py holds the whole model to
it), a dropless MoE whose expert buffers have a static layout, and per-row sampling.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.cache import (commit_paged, kda_rows, kda_set_rows, kda_zeros, page_pools,
                         paged_cache)
from k3jax.config import ModelConfig
from k3jax.model import K3Model
from k3jax.serve import kv_spec
from k3jax.serve.sampling import sample_rows
from k3jax.vision.media import MediaEmbeddings


@dataclasses.dataclass
class Piece:
  """One prefill piece of one slot: tokens [width] (the first num_new real) fed to slot
  (tile, row), which holds `length` tokens; its block-table row; its sampling values (seed,
  counter, temperature, top_k, top_p); the features of the placeholders among the tokens
  ([n, d] or None); with a draft, the token after each input and how many pairs to feed."""
  tile: int
  row: int
  tokens: np.ndarray
  num_new: int
  length: int
  table_row: np.ndarray
  sampling: tuple
  media_rows: object = None
  next_tokens: np.ndarray | None = None
  draft_n: int = 0


@dataclasses.dataclass
class Sampled:
  """Host copies of a program's samples: tokens [B], logprobs [B], top ids / logprobs [B, n]."""
  tokens: np.ndarray
  logprobs: np.ndarray
  top_ids: np.ndarray | None = None
  top_logprobs: np.ndarray | None = None


def _forward(config: ModelConfig, num_top: int, logprobs: str, variables, kda, pools, table,
             lengths, tokens, num_new, seeds, counters, temperature, top_k, top_p, media=None):
  """`K3Model.extend` on the rows' paged cache (`media`: MediaEmbeddings for the placeholders
  among the tokens), then each row's sample at its last real input.
  Returns ((tokens, logprobs, top), kda, pools)."""
  cache = paged_cache(config, kda, pools, table, lengths)
  logits, _, after = K3Model(config).apply(variables, tokens, cache, num_new, media,
                                           method=K3Model.extend)
  last = jnp.maximum(num_new - 1, 0)
  at_last = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
  out = sample_rows(at_last, seeds, counters, temperature, top_k, top_p, num_top,
                    logprobs=logprobs)
  kda, pools = commit_paged(after, pools, table, lengths, num_new, tokens.shape[1])
  return out, kda, pools


def _copy_page(pools, src, dst):
  def one(a):   # [P, page, C], or [groups, P, page, C] in the scanned body
    if a.ndim == 4:
      return a.at[:, dst].set(a[:, src])
    return a.at[dst].set(a[src])
  return jax.tree_util.tree_map(one, pools)


@functools.lru_cache(maxsize=None)
def programs(config: ModelConfig, num_top: int, logprobs: str = "model") -> dict:
  """The jitted programs of one config (shared by every engine of it: one compilation per
  shape); `logprobs`: the distribution whose log-probs a sample reports (`sample_rows`).
  State arguments are donated."""
  return dict(
      forward=jax.jit(functools.partial(_forward, config, num_top, logprobs),
                      donate_argnums=(1, 2)),
      copy_row=jax.jit(lambda dst, i, src, j: kda_set_rows(dst, i[None], kda_rows(src, j[None])),
                       donate_argnums=(0,)),
      put=jax.jit(lambda kda, row, rows: kda_set_rows(kda, row[None], rows),
                  donate_argnums=(0,)),
      take=jax.jit(lambda store, slot: kda_rows(store, slot[None])),
      copy_page=jax.jit(_copy_page, donate_argnums=(0,)),
      encode=jax.jit(lambda v, media: K3Model(config).apply(v, media,
                                                            method=K3Model.encode_media)),
  )


def _i32(x):
  return jnp.asarray(np.asarray(x, np.int32))


class DeviceState:
  """The device arrays of an engine (module doc) and calls of the compiled programs on them.

  config: the model's config (run as `config.for_inference()`: dropless MoE); variables: its
  variables; num_tiles × rows slots; num_pages pages of page_size tokens; num_checkpoints
  device checkpoint slots (0: none); num_top: top log-probs returned per sample; logprobs:
  "model" (the model's own distribution) or "sampling" (the one each row samples from:
  temperature, top-k, top-p; `sampling.logprobs_rows`).
  """

  def __init__(self, config: ModelConfig, variables, *, num_tiles: int, rows: int,
               num_pages: int, page_size: int, num_checkpoints: int, num_top: int = 5,
               draft_len: int = 0, prefill_rows: int = 1, logprobs: str = "model"):
    self.config = config.for_inference()
    self.set_variables(variables)
    self.rows = rows
    self.num_top = num_top
    self.draft_len = draft_len
    self.pools = page_pools(self.config, num_pages, page_size, mtp=draft_len > 0)
    self.kda = [kda_zeros(self.config, rows) for _ in range(num_tiles)]
    self.store = kda_zeros(self.config, num_checkpoints) if num_checkpoints else None
    self.prefill_rows = prefill_rows
    self.stage = kda_zeros(self.config, prefill_rows)
    self._zero_row = kda_zeros(self.config, 1)
    self._p = programs(self.config, num_top, logprobs)
    if draft_len:
      if not self.config.text.num_mtp_layers:
        raise ValueError("draft_len: speculative decoding needs the model's MTP layer "
                         "(config.text.num_mtp_layers=1), found 0")
      self._s = kv_spec.speculative_programs(self.config, draft_len, num_top, logprobs)
      d = self.config.text.d_model
      self.pend = [(jnp.zeros((rows, draft_len + 1, d), jnp.float32),
                    jnp.zeros((rows, draft_len + 1), jnp.int32), jnp.zeros((rows,), jnp.int32))
                   for _ in range(num_tiles)]

  def set_variables(self, variables) -> None:
    """The weights the programs run (same structure and shapes: nothing recompiles)."""
    v = nn.meta.unbox(dict(variables))
    self.variables = jax.device_put({k: v[k] for k in v if k in ("params", "balance")})

  # ------------------------------------------------------------------ forward programs

  def _sampled(self, out) -> Sampled:
    toks, lps, top = out
    if top is None:
      return Sampled(np.asarray(toks), np.asarray(lps))
    return Sampled(np.asarray(toks), np.asarray(lps), np.asarray(top[0]), np.asarray(top[1]))

  def decode(self, tile: int, tokens, lengths, table, active, sampling) -> Sampled:
    """One token for each row of tile `tile`: tokens/lengths/active [rows], table [rows, M],
    sampling = (seeds, counters, temperature, top_k, top_p) per row. Inactive rows change no
    cache."""
    seeds, counters, temp, top_k, top_p = sampling
    out, self.kda[tile], self.pools = self._p["forward"](
        self.variables, self.kda[tile], self.pools, _i32(table), _i32(lengths),
        _i32(np.asarray(tokens)[:, None]), _i32(active), jnp.asarray(seeds, jnp.uint32),
        _i32(counters), jnp.asarray(temp, jnp.float32), _i32(top_k), jnp.asarray(top_p,
                                                                                 jnp.float32))
    return self._sampled(out)

  def prefill(self, pieces: Sequence[Piece]):
    """Run up to `prefill_rows` pieces of one width in one program: each piece's slot row is
    copied to the staging rows, prefilled, copied back. Returns (Sampled over the staging
    rows — row i is pieces[i]'s sample at its last real token —, and with a draft the hidden
    state at each piece's last real token [rows, d] (device), else None)."""
    p = self.prefill_rows
    if not 1 <= len(pieces) <= p or len({len(x.tokens) for x in pieces}) != 1:
      raise ValueError(f"prefill: 1 to {p} pieces of one width, found "
                       f"{[len(x.tokens) for x in pieces]}")
    width = len(pieces[0].tokens)
    m = len(pieces[0].table_row)
    tokens, nxt = np.zeros((p, width), np.int32), np.zeros((p, width), np.int32)
    num_new, draft_n, lengths = (np.zeros(p, np.int32) for _ in range(3))
    table = np.zeros((p, m), np.int32)
    samp = [np.zeros(p, np.uint32), np.zeros(p, np.int32), np.zeros(p, np.float32),
            np.zeros(p, np.int32), np.ones(p, np.float32)]
    for i, x in enumerate(pieces):
      self.stage = self._p["copy_row"](self.stage, _i32(i), self.kda[x.tile], _i32(x.row))
      tokens[i], num_new[i], lengths[i], table[i] = x.tokens, x.num_new, x.length, x.table_row
      for k in range(5):
        samp[k][i] = x.sampling[k]
      if x.next_tokens is not None:
        nxt[i], draft_n[i] = x.next_tokens, x.draft_n
    args = (_i32(table), _i32(lengths), _i32(tokens), _i32(num_new))
    sampling = (jnp.asarray(samp[0], jnp.uint32), _i32(samp[1]), jnp.asarray(samp[2]),
                _i32(samp[3]), jnp.asarray(samp[4]))
    media = self._media(width, [x.media_rows for x in pieces])
    h = None
    if self.draft_len:
      out, h, self.stage, self.pools = self._s["prefill"](
          self.variables, self.stage, self.pools, *args, _i32(nxt), _i32(draft_n), *sampling,
          media)
    else:
      out, self.stage, self.pools = self._p["forward"](self.variables, self.stage, self.pools,
                                                       *args, *sampling, media)
    for i, x in enumerate(pieces):
      self.kda[x.tile] = self._p["copy_row"](self.kda[x.tile], _i32(x.row), self.stage, _i32(i))
    return self._sampled(out), h

  def _media(self, width: int, media_rows):
    """The MediaEmbeddings of a multimodal model's prefill (every call carries them: one
    program per bucket): row i's first n_i features are pieces[i]'s placeholders' (its
    `media_rows`, [n_i, d] or None). None for a text-only model."""
    if self.config.vision is None:
      if any(r is not None for r in media_rows):
        raise ValueError("media: the model has no vision tower (config.vision is None)")
      return None
    feats = jnp.zeros((self.prefill_rows, width, self.config.text.d_model), jnp.float32)
    counts = np.zeros(self.prefill_rows, np.int32)
    for i, r in enumerate(media_rows):
      if r is not None and r.shape[0]:
        feats = feats.at[i, :r.shape[0]].set(r)
        counts[i] = r.shape[0]
    return MediaEmbeddings(feats, _i32(counts))

  # ------------------------------------------------------------------ speculative decoding
  def set_pend(self, tile: int, row: int, h, token: int) -> None:
    """Slot (tile, row)'s pending pairs ← (h, token): what the first round drafts from."""
    self.pend[tile] = self._s["set_pend"](self.pend[tile], _i32(row), h, _i32(token))

  def round(self, tile: int, lengths, table, active, sampling):
    """One speculative round for tile `tile` → (drafts [rows, n], accepted [rows], next
    [rows], logprobs [rows, n+1], top ids / logprobs [rows, n+1, k] or None), host arrays."""
    seeds, counters, temp, top_k, top_p = sampling
    d, num, y, lps, top, self.kda[tile], self.pools, self.pend[tile] = self._s["round"](
        self.variables, self.kda[tile], self.pools, self.pend[tile], _i32(table), _i32(lengths),
        jnp.asarray(np.asarray(active, bool)), jnp.asarray(seeds, jnp.uint32), _i32(counters),
        jnp.asarray(temp, jnp.float32), _i32(top_k), jnp.asarray(top_p, jnp.float32))
    top = None if top is None else (np.asarray(top[0]), np.asarray(top[1]))
    return np.asarray(d), np.asarray(num), np.asarray(y), np.asarray(lps), top

  def encode_media(self, media):
    """A `Media`'s placeholder features, in order: [Σ num_merged, d] fp32 (device)."""
    feats = self._p["encode"](self.variables, media)
    counts = np.asarray(media.num_merged)
    return jnp.concatenate([feats[s, :int(n)] for s, n in enumerate(counts)], axis=0)

  # ------------------------------------------------------------------ KDA rows and checkpoints
  def zero(self, tile: int, row: int) -> None:
    """A cold start: slot (tile, row)'s KDA caches zeroed."""
    self.kda[tile] = self._p["copy_row"](self.kda[tile], _i32(row), self._zero_row, _i32(0))

  def save(self, tile: int, row: int, slot: int) -> None:
    """Checkpoint slot `slot` ← slot (tile, row)'s KDA caches."""
    self.store = self._p["copy_row"](self.store, _i32(slot), self.kda[tile], _i32(row))

  def load(self, slot: int, tile: int, row: int) -> None:
    """Slot (tile, row)'s KDA caches ← checkpoint slot `slot`."""
    self.kda[tile] = self._p["copy_row"](self.kda[tile], _i32(row), self.store, _i32(slot))

  def take_row(self, tile: int, row: int):
    """A copy of slot (tile, row)'s state, one row (device arrays; a paused request's): its
    KDA caches and, with a draft, its pending pairs — (kda, pend or None)."""
    pend = self._s["take_pend"](self.pend[tile], _i32(row)) if self.draft_len else None
    return self._p["take"](self.kda[tile], _i32(row)), pend

  def put_row(self, rows, tile: int, row: int) -> None:
    """Slot (tile, row)'s state ← `rows` (from `take_row`)."""
    kda, pend = rows
    self.kda[tile] = self._p["put"](self.kda[tile], _i32(row), kda)
    if self.draft_len:
      self.pend[tile] = self._s["put_pend"](self.pend[tile], _i32(row), pend)

  def to_host(self, slot: int):
    """Checkpoint slot `slot` as numpy arrays (host offload)."""
    return jax.tree_util.tree_map(np.asarray, self._p["take"](self.store, _i32(slot)))

  def from_host(self, rows, tile: int, row: int) -> None:
    """Slot (tile, row)'s KDA caches ← a checkpoint offloaded by `to_host`."""
    self.kda[tile] = self._p["put"](self.kda[tile], _i32(row), jax.device_put(rows))

  def copy_page(self, src: int, dst: int) -> None:
    self.pools = self._p["copy_page"](self.pools, _i32(src), _i32(dst))

  @property
  def checkpoint_bytes(self) -> int:
    """Bytes of one KDA checkpoint (every KDA layer's state and conv tails)."""
    return sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(self._zero_row))


__all__ = ["DeviceState", "Piece", "Sampled", "programs"]
