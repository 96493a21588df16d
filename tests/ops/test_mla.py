"""Tests for k3jax.ops.mla against a naive per-head, per-query numpy loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from isolation import assert_isolated
from k3jax.ops import mla


def _np_attention(q, k, v, scale, seg=None, kv_mask=None):
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, h, _ = q.shape
  s = k.shape[1]
  out = np.zeros((b, t, h, v.shape[-1]))
  mx = np.full(h, -np.inf)
  for bi in range(b):
    for hi in range(h):
      for ti in range(t):
        pos = ti + s - t
        keys = [j for j in range(s) if j <= pos
                and (seg is None or seg[bi, j] == seg[bi, pos])
                and (kv_mask is None or kv_mask[bi, j])]
        if not keys:
          continue
        logits = np.array([q[bi, ti, hi] @ k[bi, j, hi] * scale for j in keys])
        mx[hi] = max(mx[hi], logits.max())
        p = np.exp(logits - logits.max())
        p /= p.sum()
        out[bi, ti, hi] = sum(pj * v[bi, j, hi] for pj, j in zip(p, keys))
  return out, mx


# jit once per shape; hypothesis draws shapes from small sets so that compiles stay few.
_attn = jax.jit(mla.mla_attention, static_argnames=("scale",))
_absorbed = jax.jit(mla.mla_absorbed_attention, static_argnames=("scale",))


# (T, S - T): a decode-like single query, prefill, and queries offset into a longer cache
SHAPES = [(1, 3), (6, 0), (5, 2)]


@given(st.sampled_from(SHAPES), st.booleans(), st.integers(0, 10_000))
def test_attention_matches_loop(shape, packed, seed):
  rng = np.random.default_rng(seed)
  (t, extra), b, h = shape, 2, 2
  s = t + extra
  q = rng.normal(size=(b, t, h, 6)).astype(np.float32)
  k = rng.normal(size=(b, s, h, 6)).astype(np.float32)
  v = rng.normal(size=(b, s, h, 5)).astype(np.float32)
  # all-zero ids are the unpacked case (one compile per shape, with or without packing)
  seg = (np.sort(rng.integers(0, 3, (b, s)), axis=1) if packed else np.zeros((b, s))).astype(
      np.int32)
  o, mx = _attn(q, k, v, scale=0.4, segment_ids=jnp.asarray(seg))
  ro, rmx = _np_attention(q, k, v, 0.4, seg)
  assert o.dtype == jnp.float32 and mx.shape == (h,)
  np.testing.assert_allclose(o, ro, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(mx, rmx, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_query_blocks_equal_all_queries(packed):
  # T = 11 in blocks of 4 (last block padded), queries offset into S = 13 keys, a document
  # boundary inside a block: outputs, max logit and gradients as with all queries at once.
  rng = np.random.default_rng(7)
  b, t, s, h = 2, 11, 13, 3
  q = jnp.asarray(rng.normal(size=(b, t, h, 6)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(b, s, h, 6)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, s, h, 5)), jnp.float32)
  seg = jnp.asarray(np.repeat([[0] * 6 + [1] * 7], b, 0) if packed else np.zeros((b, s)),
                    jnp.int32)
  w = jnp.asarray(rng.normal(size=(b, t, h, 5)), jnp.float32)

  def run(block):
    def loss(q, k, v):
      o, mx = mla.mla_attention(q, k, v, scale=0.3, segment_ids=seg, query_block=block)
      return jnp.sum(o * w), (o, mx)
    (_, (o, mx)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
    return o, mx, grads

  o0, mx0, g0 = run(None)
  o1, mx1, g1 = run(4)
  ro, rmx = _np_attention(q, k, v, 0.3, np.asarray(seg))
  np.testing.assert_allclose(o0, ro, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(o1, o0, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(mx1, rmx, rtol=1e-5, atol=1e-5)
  for a, c in zip(g1, g0):
    np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="query_block"):
    mla.mla_attention(q, k, v, query_block=0)


@pytest.mark.parametrize("form", ["all_queries", "query_blocks", "absorbed"])
def test_packed_documents_are_bitwise_isolated(form):
  """Every other document's queries, keys and values replaced: the middle document's outputs
  and the gradients of its inputs are bit-for-bit unchanged (masked logits never reach a sum:
  their probabilities are exact zeros)."""
  b, t, h = 2, 13, 2
  seg = np.array([[0] * 4 + [1] * 6 + [2] * 3, [0] * t])
  segj = jnp.asarray(seg, jnp.int32)
  absorbed = form == "absorbed"
  # absorbed: q_nope, q_rope, c_kv, k_rope per token, then w_kb [L,H,N], w_vb [L,H,V]
  shapes = ([(b, t, h, 4), (b, t, h, 2), (b, t, 6), (b, t, 2), (6, h, 4), (6, h, 5)] if absorbed
            else [(b, t, h, 6), (b, t, h, 6), (b, t, h, 5)])

  def inputs(seed):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in shapes]

  if absorbed:
    op = lambda *a: mla.mla_absorbed_attention(*a, scale=0.3, segment_ids=segj)[0]
    per_token = [True] * 4 + [False] * 2
  else:
    block = 4 if form == "query_blocks" else None
    op = lambda *a: mla.mla_attention(*a, scale=0.3, segment_ids=segj, query_block=block)[0]
    per_token = [True] * 3
  assert_isolated(op, inputs(0), inputs(1), seg == 1, per_token=per_token)


def test_default_scale_and_kv_mask():
  rng = np.random.default_rng(0)
  q = rng.normal(size=(2, 3, 2, 4)).astype(np.float32)
  k = rng.normal(size=(2, 5, 2, 4)).astype(np.float32)
  v = rng.normal(size=(2, 5, 2, 3)).astype(np.float32)
  kv_mask = np.array([[1, 1, 0, 1, 1], [0, 0, 0, 0, 0]], bool)
  o, mx = mla.mla_attention(q, k, v, kv_mask=jnp.asarray(kv_mask))
  ro, rmx = _np_attention(q, k, v, 0.5, kv_mask=kv_mask)
  np.testing.assert_allclose(o, ro, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(mx, rmx, rtol=1e-5)
  assert np.all(np.asarray(o)[1] == 0)  # rows with no allowed key give zeros, not nan


def test_bf16_inputs_keep_fp32_output():
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 4, 2, 8)), jnp.bfloat16) for _ in range(3))
  o, _ = mla.mla_attention(q, k, v)
  ro, _ = _np_attention(np.asarray(q, np.float32), np.asarray(k, np.float32),
                        np.asarray(v, np.float32), 8 ** -0.5)
  assert o.dtype == jnp.float32
  np.testing.assert_allclose(o, ro, atol=2e-2)


@given(st.sampled_from(SHAPES), st.booleans(), st.integers(0, 10_000))
def test_absorbed_equals_materialised(shape, packed, seed):
  rng = np.random.default_rng(seed)
  (t, extra), b, h, n, r, lat, dv = shape, 2, 3, 4, 2, 6, 5
  s = t + extra
  q_nope = rng.normal(size=(b, t, h, n)).astype(np.float32)
  q_rope = rng.normal(size=(b, t, h, r)).astype(np.float32)
  c = rng.normal(size=(b, s, lat)).astype(np.float32)
  k_rope = rng.normal(size=(b, s, r)).astype(np.float32)
  w_kb = rng.normal(size=(lat, h, n)).astype(np.float32) * 0.5
  w_vb = rng.normal(size=(lat, h, dv)).astype(np.float32)
  seg = jnp.asarray(np.sort(rng.integers(0, 2, (b, s)), axis=1) * packed, jnp.int32)
  k_full = np.concatenate([np.einsum("bsl,lhn->bshn", c, w_kb),
                           np.broadcast_to(k_rope[:, :, None], (b, s, h, r))], -1)
  v_full = np.einsum("bsl,lhv->bshv", c, w_vb)
  q_full = np.concatenate([q_nope, q_rope], -1)
  ref, ref_mx = _attn(q_full, k_full, v_full, scale=0.3, segment_ids=seg)
  got, mx = _absorbed(q_nope, q_rope, c, k_rope, w_kb, w_vb, scale=0.3,
                                       segment_ids=seg)
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(mx, ref_mx, rtol=1e-4, atol=1e-4)


_blocked = jax.jit(mla.mla_absorbed_attention, static_argnames=("scale", "key_block"))


@pytest.mark.parametrize("key_block", [4, 8, 64])
def test_absorbed_key_blocks_equal_one_block(key_block):
  """The absorbed attention over a decode-like buffer (S = 37 slots, per-row query positions,
  invalid slots, two documents) in key blocks — 4 and 8 do not divide 37 (the last block
  overlaps the one before, masked); 64 ≥ S is the one-block path — equals the unblocked form,
  outputs, max logit and the gradients of every input."""
  rng = np.random.default_rng(key_block)
  b, t, h, n, r, lat, dv, s = 2, 3, 3, 4, 2, 6, 5, 37
  args = [rng.normal(size=shp).astype(np.float32) for shp in
          [(b, t, h, n), (b, t, h, r), (b, s, lat), (b, s, r), (lat, h, n), (lat, h, dv)]]
  # row 0: queries at 9..11 (blocks after the third are skipped); row 1: at 20, 21, 36 (the
  # last slot: the overlapping last block is read)
  qpos = jnp.asarray([[9, 10, 11], [20, 21, 36]], jnp.int32)
  kv_mask = jnp.asarray(rng.random((b, s)) > 0.2)
  seg = jnp.asarray((np.arange(s)[None] >= np.array([[5], [25]])).astype(np.int32))
  kw = dict(scale=0.3, query_positions=qpos, kv_mask=kv_mask, segment_ids=seg)
  ref, ref_mx = _blocked(*args, key_block=None, **kw)
  got, mx = _blocked(*args, key_block=key_block, **kw)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(mx, ref_mx, rtol=1e-6, atol=1e-6)
  assert float(jnp.abs(ref).max()) > 0.1
  cot = jnp.asarray(rng.normal(size=ref.shape), jnp.float32)
  grad = lambda kb: jax.grad(lambda a: jnp.sum(mla.mla_absorbed_attention(  # noqa: E731
      *a, key_block=kb, **kw)[0] * cot))(args)
  for g, rg in zip(grad(key_block), grad(None)):
    np.testing.assert_allclose(g, rg, rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match="key_block"):
    mla.mla_absorbed_attention(*args, key_block=0, **kw)


def test_bad_inputs():
  z = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(ValueError, match="rank 4"):
    mla.mla_attention(z[0], z, z)
  with pytest.raises(ValueError, match="k must be"):
    mla.mla_attention(z, jnp.zeros((1, 4, 3, 8)), z)
  with pytest.raises(ValueError, match="must not exceed"):
    mla.mla_attention(jnp.zeros((1, 5, 2, 8)), z, z)
  with pytest.raises(ValueError, match="segment_ids"):
    mla.mla_attention(z, z, z, segment_ids=jnp.zeros((1, 3), jnp.int32))
