"""Blockwise latent MLA attention (k3jax/ops/mla_blockwise.py) against the materialised form
(ops.mla.mla_attention on keys/values expanded from the same latents): outputs, max logit and
the gradients of q, the latents and kv_b, with documents, padding of S and a query offset."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import mla as mla_ops
from k3jax.ops.mla_blockwise import expand_latent, mla_latent_attention

B, S, H, L, NOPE, R, V = 2, 40, 3, 8, 6, 4, 5


def _inputs(seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, S, H, NOPE + R))
  c = jax.random.normal(ks[1], (B, S, L))
  kr = jax.random.normal(ks[2], (B, S, R))
  w = 0.4 * jax.random.normal(ks[3], (L, H, NOPE + V))
  seg = np.zeros((B, S), np.int32)
  seg[0, 13:] = 1
  seg[0, 32:] = 2     # a boundary exactly at a key block's first key (block 16: 2nd block)
  seg[1, 29:] = 4
  return q, c, kr, w, jnp.asarray(seg)


def _reference(q, c, kr, w, seg, scale):
  k, v = expand_latent(c, kr, w, NOPE)
  return mla_ops.mla_attention(q, k, v, scale=scale, segment_ids=seg)


@pytest.mark.parametrize("key_block,query_block", [
    (16, None), (7, None), (64, None),   # 7: S padded inside; 64: one block
    (8, 12)])                            # query blocks (the last one padded), causal skipping
def test_matches_the_materialised_attention_and_its_gradients(key_block, query_block):
  q, c, kr, w, seg = _inputs()
  scale = 0.3

  def loss(fn, *a):
    o, m = fn(*a)
    return jnp.sum(jnp.sin(o) * jnp.arange(V)), (o, m)

  blockwise = lambda q, c, kr, w: mla_latent_attention(  # noqa: E731
      q, c, kr, w, scale=scale, key_block=key_block, segment_ids=seg, query_block=query_block)
  reference = lambda q, c, kr, w: _reference(q, c, kr, w, seg, scale)  # noqa: E731
  g, (o, m) = jax.jit(jax.grad(lambda *a: loss(blockwise, *a), argnums=(0, 1, 2, 3),
                               has_aux=True))(q, c, kr, w)
  g_ref, (o_ref, m_ref) = jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2, 3),
                                   has_aux=True)(q, c, kr, w)
  np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(m, m_ref, rtol=1e-5)
  for name, a, b in zip(("q", "c", "k_rope", "w_kv"), g, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


def test_queries_at_an_offset_see_the_keys_before_them():
  # The last 10 positions as queries (a context-parallel shard): equal to those rows of the
  # full problem; the first block(s) after them are never needed.
  q, c, kr, w, seg = _inputs(1)
  o_ref, _ = _reference(q, c, kr, w, seg, 0.3)
  o, m = mla_latent_attention(q[:, 30:], c, kr, w, scale=0.3, key_block=8, segment_ids=seg,
                              q_segment_ids=seg[:, 30:], q_start=30,
                              q_valid=jnp.arange(10) < 5)
  np.testing.assert_allclose(o, o_ref[:, 30:], rtol=1e-5, atol=1e-5)
  _, m_ref = _reference(q[:, 30:35], c[:, :35], kr[:, :35], w, seg[:, :35], 0.3)
  np.testing.assert_allclose(m, m_ref, rtol=1e-5)
  with pytest.raises(ValueError, match="q_segment_ids"):
    mla_latent_attention(q[:, 30:], c, kr, w, scale=0.3, key_block=8)
  with pytest.raises(ValueError, match="w_kv"):
    mla_latent_attention(q, c, kr, w[:, :2], scale=0.3, key_block=8)
