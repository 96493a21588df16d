"""Paged MLA latents (k3jax/cache.py): a paged cache decodes exactly what the contiguous one
does (same logits, bit for bit, pages in any order, shared pool), and both follow the full
forward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import cache as C
from k3jax.config import preset
from k3jax.model import K3Model

PAGE, PAGES_PER_ROW = 4, 6          # 24 slots a row
S = PAGE * PAGES_PER_ROW


@functools.lru_cache(maxsize=None)
def _model():
  # 4 layers, MLA every 2nd: prefix 0–1 (MLA layer 1 unrolled), one scanned group 2–3 (MLA
  # layer 3 in the body): every kind of cache entry.
  cfg = preset("tiny", num_layers=4, mla_every=2)
  v = jax.jit(K3Model(cfg).init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
  return cfg, v


@functools.lru_cache(maxsize=None)
def _extend_fn(cfg):
  return jax.jit(lambda v, c, t, n: K3Model(cfg).apply(v, t, c, n, method=K3Model.extend))


def _extend(cfg, v, cache, tokens, n):
  return _extend_fn(cfg)(v, cache, tokens, n)


def test_paged_equals_contiguous_equals_full_forward():
  cfg, v = _model()
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.text.vocab_size, (2, 16)).astype(np.int32)
  lengths = np.array([13, 9], np.int32)
  # Rows own scrambled pages of one pool (page 0 unused: the zero page of unset entries).
  table = rng.permutation(np.arange(1, 1 + 2 * PAGES_PER_ROW)).reshape(2, PAGES_PER_ROW)
  table = jnp.asarray(table, jnp.int32)
  pools = C.page_pools(cfg, 1 + 2 * PAGES_PER_ROW, PAGE)
  kda = C.kda_zeros(cfg, 2)
  contiguous = K3Model(cfg).init_cache(2, S).replace(mtp=None, mtp_lengths=None)

  def paged_step(kda, pools, have, toks, n):
    cache = C.paged_cache(cfg, kda, pools, table, have)
    logits, _, after = _extend(cfg, v, cache, toks, n)
    kda, pools = C.commit_paged(after, pools, table, jnp.asarray(have), jnp.asarray(n),
                                toks.shape[1])
    return logits, kda, pools

  # Prefill in two chunks of 8 (rows stop at their lengths), then the rest one token a call.
  have = np.zeros(2, np.int32)
  got_p, got_c = {}, {}
  for s in (0, 8):
    n = np.clip(lengths - s, 0, 8).astype(np.int32)
    lp, kda, pools = paged_step(kda, pools, have, jnp.asarray(tokens[:, s:s + 8]), n)
    lc, _, contiguous = _extend(cfg, v, contiguous, jnp.asarray(tokens[:, s:s + 8]),
                                jnp.asarray(n))
    for b in range(2):
      for t in range(n[b]):
        got_p[(b, s + t)], got_c[(b, s + t)] = np.asarray(lp[b, t]), np.asarray(lc[b, t])
    have = have + n
  while (have < 16).any():        # then one token a call (8-wide calls: one compiled shape)
    n = (have < 16).astype(np.int32)
    step = np.zeros((2, 8), np.int32)
    step[:, 0] = tokens[np.arange(2), np.minimum(have, 15)]
    lp, kda, pools = paged_step(kda, pools, have, jnp.asarray(step), n)
    lc, _, contiguous = _extend(cfg, v, contiguous, jnp.asarray(step), jnp.asarray(n))
    for b in np.flatnonzero(n):
      got_p[(b, have[b])], got_c[(b, have[b])] = np.asarray(lp[b, 0]), np.asarray(lc[b, 0])
    have = have + n
  assert set(got_p) == {(b, t) for b in range(2) for t in range(16)}
  for key in got_p:
    np.testing.assert_array_equal(got_p[key], got_c[key], err_msg=str(key))
  full = np.asarray(jax.jit(K3Model(cfg).apply)(v, jnp.asarray(tokens)))
  for (b, t), lg in got_p.items():
    np.testing.assert_allclose(lg, full[b, t], atol=2e-4 * np.abs(full).max(), err_msg=str((b, t)))
  # The pages hold exactly the contiguous cache's latents, row by row.
  view = C.gather_pages(pools["layers_1"], table)
  np.testing.assert_array_equal(np.asarray(view.c_kv)[:, :16],
                                np.asarray(contiguous.layer(1).c_kv)[:, :16])


def test_kda_rows_round_trip():
  cfg, _ = _model()
  kda = C.kda_zeros(cfg, 3)
  rows = jax.tree_util.tree_map(lambda a: jnp.ones_like(a), C.kda_rows(kda, jnp.array([1])))
  out = C.kda_set_rows(kda, jnp.array([1]), rows)
  back = C.kda_rows(out, jnp.array([1, 0]))
  assert np.asarray(back["body"]["layers_0"].state)[:, 0].min() == 1
  assert np.asarray(back["layers_0"].conv_q)[1].max() == 0
  st = out["body"]["layers_0"].state            # [groups, B, H, K, V]
  assert np.asarray(st)[:, 1].min() == 1 and np.asarray(st)[:, [0, 2]].max() == 0
  assert np.asarray(out["layers_0"].state)[1].min() == 1
