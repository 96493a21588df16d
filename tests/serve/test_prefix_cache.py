"""KDA-aware prefix cache: reuse rule, landing, refcounts, eviction, atomic KDA invalidation."""

import numpy as np
import pytest

from k3jax.serve.prefix_cache import PoolExhausted, PrefixCache, PrefixCacheConfig

WIDTH = 3  # latent width in the payloads (any)


def _cache(num_pages=1000, **kw):
  base = dict(num_pages=num_pages, page_bytes=4096, mla_bytes_per_token=64,
              kda_layer_bytes=8192, num_kda_layers=3)
  return PrefixCache(PrefixCacheConfig(**{**base, **kw}))


def _latents(tokens, start=0):
  """Latents that encode (layer, absolute position, token) so reads can be checked exactly."""
  t = np.asarray(tokens[start:], np.float64)
  pos = np.arange(start, len(tokens), dtype=np.float64)
  return np.stack([np.stack([pos, t, np.full_like(t, l)], -1) for l in range(2)])


def _ckpts(cache, tokens, start=0):
  n = cache.config.hash_tokens
  return {b: [("state", l, b) for l in range(cache.config.num_kda_layers)]
          for b in range(n * (start // n + 1), len(tokens) + 1, n)}


def _serve(cache, tokens, land=True, release=True):
  lease = cache.match(tokens)
  cache.store(lease, _latents(tokens, lease.reused), _ckpts(cache, tokens, lease.reused))
  if land:
    cache.land(lease)
  if release:
    cache.release(lease)
  return lease


def _reused(cache, tokens):
  lease = cache.match(tokens)
  cache.release(lease)
  return lease.reused


def _tokens(n, seed):
  return list(np.random.default_rng(seed).integers(0, 1000, n))


def test_report_example_2800_reuses_2560():
  cache = _cache()
  a = _tokens(3000, 0)
  _serve(cache, a)
  b = a[:2800] + _tokens(300, 1)
  lease = cache.match(b)
  assert (lease.mla_hit, lease.reused) == (2560, 2560)
  lat = cache.read_mla(lease)
  np.testing.assert_array_equal(lat, _latents(a)[:, :2560])
  assert cache.read_kda(lease) == [("state", l, 2560) for l in range(3)]


def test_reuse_needs_a_kda_checkpoint_sparse_boundaries():
  cache = _cache(kda_checkpoint_every=1024)
  a = _tokens(3000, 0)
  _serve(cache, a)
  lease = cache.match(a[:2800] + [7])
  # MLA pages exist up to 2560, but the last KDA checkpoint at or before it is at 2048.
  assert (lease.mla_hit, lease.reused) == (2560, 2048)
  assert cache.read_kda(lease) == [("state", l, 2048) for l in range(3)]
  np.testing.assert_array_equal(cache.read_mla(lease), _latents(a)[:, :2048])


def test_whole_prompt_hit_leaves_one_token_to_compute():
  cache = _cache()
  a = _tokens(1024, 2)
  _serve(cache, a)
  assert cache.match(a).reused == 512          # 1024 would leave nothing to compute
  assert cache.match(a + [1]).reused == 1024


def test_reads_across_physical_blocks():
  cache = _cache(hash_tokens=4, block_tokens=8, kda_checkpoint_every=4)
  a = _tokens(30, 3)
  _serve(cache, a[:10])
  _serve(cache, a)                                # resumes at 8, new blocks from position 8
  lease = cache.match(a[:29])
  assert lease.reused == 28
  np.testing.assert_array_equal(cache.read_mla(lease), _latents(a)[:, :28])


def test_no_match_before_the_copy_lands():
  cache = _cache()
  a = _tokens(1100, 4)
  lease = _serve(cache, a, land=False, release=False)
  assert cache.match(a).reused == 0
  # Only some KDA layers landed: the checkpoint is not usable by any layer.
  cache.land(lease, kda_layers=[0, 1])
  assert cache.kda_layer_hits(a, 1024) == [False] * 3
  m = cache.match(a)
  assert (m.mla_hit, m.reused) == (1024, 0)
  cache.land(lease, kda_layers=[2])
  assert cache.kda_layer_hits(a, 1024) == [True] * 3
  assert cache.match(a).reused == 1024


def test_refcounts_with_concurrent_requests():
  cache = _cache()
  a = _tokens(1100, 5)
  first = _serve(cache, a, release=False)
  assert cache.refcounts(first) == [1, 1, 1]      # one MLA block + two checkpoints (512, 1024)
  r1 = cache.match(a + [1])
  r2 = cache.match(a + [2])
  assert cache.refcounts(r1) == [3, 3]            # block, checkpoint at 1024
  cache.release(first)
  cache.release(r1)
  cache.release(r1)                               # idempotent
  assert cache.refcounts(r2) == [1, 1]
  with pytest.raises(ValueError, match="pinned"):
    cache.invalidate_checkpoint(a, 1024)
  cache.release(r2)
  assert cache.refcounts(r2) == [0, 0]


def test_evicting_a_kda_checkpoint_misses_every_layer_and_falls_back():
  cache = _cache()
  a = _tokens(1100, 6)
  _serve(cache, a)
  free = cache.stats()["free_pages"]
  assert cache.kda_layer_hits(a, 1024) == [True] * 3
  assert cache.invalidate_checkpoint(a, 1024)
  assert cache.kda_layer_hits(a, 1024) == [False] * 3
  assert cache.stats()["free_pages"] == free + 3 * cache.config.pages_per_kda_layer
  lease = cache.match(a)
  assert (lease.mla_hit, lease.reused) == (1024, 512)
  assert not cache.invalidate_checkpoint(a, 1024)


def test_pin_before_allocate_and_lru_eviction():
  cfg = dict(page_bytes=1024, mla_bytes_per_token=1, kda_layer_bytes=1024, num_kda_layers=1,
             hash_tokens=4, block_tokens=8, kda_checkpoint_every=4)
  # One block = 1 page, one checkpoint = 1 page. Request of 9 tokens: 2 blocks + 2 checkpoints.
  cache = _cache(num_pages=6, **cfg)
  a, b, c = _tokens(9, 7), _tokens(9, 8), _tokens(9, 9)
  _serve(cache, a)
  assert cache.stats()["free_pages"] == 2
  lease = cache.match(a[:8] + [5])                # pins a's first block and checkpoint at 8
  assert lease.reused == 8
  cache.store(lease, _latents(a[:8] + [5], 8), {})   # needs one block: free page, no eviction
  # b needs 4 pages: only 1 free + a's unpinned checkpoint at 4 is evictable → exhausted.
  with pytest.raises(PoolExhausted, match="pinned"):
    _serve(cache, b)
  cache.release(lease)
  _serve(cache, b)                                # now a's objects are evicted (LRU first)
  assert _reused(cache, a) == 0
  assert _reused(cache, b) == 8
  _serve(cache, c)
  assert _reused(cache, c) == 8


def test_bad_input():
  cache = _cache()
  with pytest.raises(ValueError, match="non-empty"):
    cache.match([])
  with pytest.raises(ValueError, match="block_tokens"):
    PrefixCacheConfig(num_pages=1, page_bytes=1, mla_bytes_per_token=1, kda_layer_bytes=1,
                      num_kda_layers=1, hash_tokens=512, block_tokens=1000)
  lease = cache.match(_tokens(10, 0))
  with pytest.raises(ValueError, match="latents"):
    cache.store(lease, np.zeros((2, 3, WIDTH)), {})
