"""A tiny model and engine settings shared by the engine tests (one compiled shape set)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import preset
from k3jax.data.tokenizers import CHAT_END
from k3jax.model import K3Model
from k3jax.serve.engine import Engine, EngineConfig

# 4 layers, MLA every 2nd: KDA + MLA unrolled (layers 0–1), one scanned [KDA, MLA] group
# (2–3) — every kind of cache entry at a fraction of tiny's compile time.
OVERRIDES = dict(num_layers=4, mla_every=2)
# Every engine of the tests has these shapes (tiles of 2 rows, 12 pages a sequence, a pool of
# 80 pages, pieces of 16 or 32 tokens two at a time), so the programs compile once; slot
# counts, budgets and cache policies vary freely.
ENGINE = EngineConfig(num_slots=4, tile_rows=2, max_len=96, page_size=8, num_pages=80,
                      prefill_chunk=32, prefill_buckets=(16, 32), checkpoint_interval=32,
                      boundary_token=CHAT_END, step_tokens=40, num_checkpoints=8,
                      prefill_rows=2)


@functools.lru_cache(maxsize=None)
def model(name: str = "tiny", **extra):
  cfg = preset(name, **{**OVERRIDES, **dict(extra)})
  v = jax.jit(K3Model(cfg).init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
  return cfg, jax.tree_util.tree_map(np.asarray, dict(v))


def engine(name: str = "tiny", decode=None, **changes) -> Engine:
  cfg, v = model(name)
  return Engine(cfg, v, dataclasses.replace(ENGINE, **changes), decode=decode)


def prompt(rng: np.random.Generator, n: int, boundaries=()) -> list[int]:
  """n random byte ids, with the turn-boundary id at the given positions."""
  ids = rng.integers(0, 256, n)
  for p in boundaries:
    ids[p] = CHAT_END
  return [int(i) for i in ids]
