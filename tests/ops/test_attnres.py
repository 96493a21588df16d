"""Tests for k3jax.ops.attnres against slow per-token numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from k3jax.config import preset
from isolation import assert_isolated
from k3jax.ops import attnres as ar


_mix = jax.jit(ar.attn_res_mix)
_partial = jax.jit(ar.attn_res_partial)
_merge_final = jax.jit(lambda a, b: ar.attn_res_finalize(ar.attn_res_merge(a, b)))


def _np_mix(sources, query, norm_weight, eps=1e-5, valid=None):
  """Loop over tokens and sources, float64."""
  v = np.asarray(sources, np.float64)
  s, d = v.shape[0], v.shape[-1]
  flat = v.reshape(s, -1, d)
  out = np.zeros(flat.shape[1:])
  for n in range(flat.shape[1]):
    logits = []
    for i in range(s):
      if valid is not None and not valid[i]:
        logits.append(-np.inf)
        continue
      x = flat[i, n]
      logits.append(float(np.dot(x / np.sqrt(np.mean(x * x) + eps) * norm_weight, query)))
    w = np.exp(np.array(logits) - max(logits))
    w /= w.sum()
    out[n] = sum(w[i] * flat[i, n] for i in range(s) if w[i] > 0)
  return out.reshape(v.shape[1:])


@given(st.sampled_from([1, 4]), st.sampled_from([1, 3]), st.integers(0, 10_000))
def test_mix_matches_loop(s, t, seed):
  rng = np.random.default_rng(seed)
  src = rng.normal(size=(s, 2, t, 8)).astype(np.float32) * rng.uniform(0.1, 3, (s, 1, 1, 1))
  q = rng.normal(size=8).astype(np.float32)
  w = rng.uniform(0.5, 1.5, 8).astype(np.float32)
  got = _mix(jnp.asarray(src), jnp.asarray(q), jnp.asarray(w))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, _np_mix(src, q, w), rtol=1e-5, atol=1e-5)


def test_tokens_are_bitwise_isolated():
  """The depth mix is per token: replacing every other token's sources changes nothing of a
  token's mix or of the gradients of its sources, bit for bit."""
  rng = np.random.default_rng(3)
  src, alt = (jnp.asarray(rng.normal(size=(2, 7, 4, 8)), jnp.float32) for _ in range(2))
  q = jnp.asarray(rng.normal(size=8), jnp.float32)
  w = jnp.asarray(rng.uniform(0.5, 1.5, 8), jnp.float32)
  valid = jnp.asarray([True, True, False, True])
  # token dims first ([B,T,S,d]) for the check; the op takes sources [S,B,T,d]
  op = lambda s, q, w: ar.attn_res_mix(jnp.moveaxis(s, 2, 0), q, w, valid=valid)
  doc = np.zeros((2, 7), bool)
  doc[0, 2:5] = True
  assert_isolated(op, [src, q, w], [alt, q, w], doc, per_token=[True, False, False])


def test_zero_query_is_uniform_mean():
  rng = np.random.default_rng(0)
  src = rng.normal(size=(4, 3, 5, 16)).astype(np.float32)
  got = ar.attn_res_mix(jnp.asarray(src), jnp.zeros(16), jnp.ones(16))
  np.testing.assert_allclose(got, src.mean(0), rtol=1e-5, atol=1e-6)
  valid = np.array([True, False, True, True])
  got = ar.attn_res_mix(jnp.asarray(src), jnp.zeros(16), jnp.ones(16), valid=jnp.asarray(valid))
  np.testing.assert_allclose(got, src[valid].mean(0), rtol=1e-5, atol=1e-6)


def test_valid_mask_equals_dropping_sources():
  rng = np.random.default_rng(1)
  src = rng.normal(size=(5, 2, 8)).astype(np.float32)
  q, w = rng.normal(size=8).astype(np.float32), np.ones(8, np.float32)
  valid = np.array([True, True, False, False, True])
  got = ar.attn_res_mix(jnp.asarray(src), jnp.asarray(q), jnp.asarray(w), valid=jnp.asarray(valid))
  np.testing.assert_allclose(got, _np_mix(src[valid], q, w), rtol=1e-5, atol=1e-6)
  # garbage (even inf) in invalid slots must not leak
  src2 = src.copy()
  src2[2] = 1e30
  got2 = ar.attn_res_mix(jnp.asarray(src2), jnp.asarray(q), jnp.asarray(w),
                         valid=jnp.asarray(valid))
  np.testing.assert_allclose(got2, got, rtol=1e-6)


@given(st.sampled_from([1, 3]), st.sampled_from([1, 2]), st.integers(0, 10_000))
def test_merge_of_partials_equals_full_mix(sa, sb, seed):
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(sa, 3, 8)).astype(np.float32) * 2
  b = rng.normal(size=(sb, 3, 8)).astype(np.float32)
  q = (rng.normal(size=8) * 3).astype(np.float32)
  w = rng.uniform(0.5, 1.5, 8).astype(np.float32)
  full = _mix(jnp.asarray(np.concatenate([a, b])), jnp.asarray(q), jnp.asarray(w))
  pa = _partial(jnp.asarray(a), jnp.asarray(q), jnp.asarray(w))
  pb = _partial(jnp.asarray(b), jnp.asarray(q), jnp.asarray(w))
  np.testing.assert_allclose(_merge_final(pa, pb), full, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(_merge_final(pb, pa), full, rtol=1e-5, atol=1e-6)


def test_merge_with_empty_partial():
  rng = np.random.default_rng(2)
  a = jnp.asarray(rng.normal(size=(3, 4, 8)).astype(np.float32))
  q, w = jnp.asarray(rng.normal(size=8).astype(np.float32)), jnp.ones(8)
  empty = ar.attn_res_partial(a, q, w, valid=jnp.zeros(3, bool))
  assert np.all(np.isneginf(empty.max)) and np.all(np.asarray(empty.sum) == 0)
  merged = ar.attn_res_finalize(ar.attn_res_merge(empty, ar.attn_res_partial(a, q, w)))
  np.testing.assert_allclose(merged, ar.attn_res_mix(a, q, w), rtol=1e-6)
  assert np.all(np.isfinite(merged))


def test_source_counts_k3():
  cfg = preset("k3")
  c = ar.attn_res_source_counts(cfg.text.num_layers, cfg.text.attn_res_block_size)
  assert c["output"] == 9 == cfg.text.num_attn_res_blocks + 1
  assert c["attn"][0] == 0 and c["mlp"][0] == 2  # [embedding, attn out of layer 0]
  assert c["attn"][1:12] == [2] * 11 and c["mlp"][1:12] == [2] * 11
  assert c["attn"][12] == 2 and c["mlp"][12] == 3  # block 1 closes before layer 12's attention
  assert c["attn"][92] == 9 and c["mlp"][92] == 9
  assert max(c["attn"] + c["mlp"]) == 9
  plain = ar.attn_res_source_counts(93, None)
  assert plain["output"] == 0 and set(plain["attn"]) == {0}


def test_blocks_before():
  for i in range(40):
    assert ar.blocks_before(i, 12) == sum(1 for j in range(i) if j % 12 == 0)
  np.testing.assert_array_equal(ar.blocks_before(jnp.arange(30), 4),
                                [ar.blocks_before(i, 4) for i in range(30)])


@pytest.mark.parametrize("args,match", [
    (((4, 8), (7,), (8,)), "query"),
    (((4, 8), (8,), (3,)), "norm_weight"),
    (((8,), (8,), (8,)), "sources"),
])
def test_bad_shapes(args, match):
  s, q, w = (jnp.zeros(a) for a in args)
  with pytest.raises(ValueError, match=match):
    ar.attn_res_mix(s, q, w)
  with pytest.raises(ValueError, match="valid"):
    ar.attn_res_mix(jnp.zeros((4, 8)), jnp.zeros(8), jnp.ones(8), valid=jnp.ones(3, bool))
