"""Context parallelism (k3jax/parallel/context.py) against unsharded, obviously correct
references, on 8 simulated CPU devices (mesh data=2 × context=4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k3jax import sharding
from k3jax.ops import mla as mla_ops
from k3jax.parallel import context as cp

B, T, H, K, V = 2, 32, 2, 4, 3   # V ≠ K: the [v | 0] trick must not assume square states


def kda_naive(q, k, v, g, beta, *, scale, initial_state=None, chunk_size=16,
              segment_ids=None):
  """Token-by-token delta rule (docs/k3.md §3): decay, S += β k (v − Sᵀk)ᵀ, o = Sᵀ(scale·q).
  The state is reset to zero where the segment id changes (initial_state: first segment)."""
  del chunk_size
  b, t, h, dk = k.shape
  s = (jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32) if initial_state is None
       else initial_state.astype(jnp.float32))
  seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids
  reset = jnp.concatenate([jnp.zeros((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)

  def step(s, xs):
    q_i, k_i, v_i, g_i, b_i, r_i = xs
    s = jnp.where(r_i[:, None, None, None], 0.0, s) * jnp.exp(g_i)[..., None]
    kv = jnp.einsum("bhkv,bhk->bhv", s, k_i, precision="highest")
    s = s + b_i[..., None, None] * jnp.einsum("bhk,bhv->bhkv", k_i, v_i - kv,
                                              precision="highest")
    return s, jnp.einsum("bhkv,bhk->bhv", s, scale * q_i, precision="highest")

  xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta, reset))
  s, o = jax.lax.scan(step, s, xs)
  return jnp.moveaxis(o, 0, 1), s


def _inputs(seed=0):
  ks = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(ks[0], (B, T, H, K))
  k = jax.random.normal(ks[1], (B, T, H, K))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  v = jax.random.normal(ks[2], (B, T, H, V))
  g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, K)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
  s0 = 0.3 * jax.random.normal(ks[5], (B, H, K, V))
  return q, k, v, g, beta, s0


def _mesh():
  return sharding.make_mesh(sharding.MeshConfig(data=2, context=4))


def _kda_fns():
  fns = [kda_naive]
  from k3jax.ops import kda as kda_ops  # the unsharded chunked op is the reference when present
  fns.append(kda_ops.kda_chunked)
  return fns


@pytest.mark.parametrize("with_segments", [False, True])
def test_kda_context_parallel_matches_unsharded(with_segments):
  q, k, v, g, beta, s0 = _inputs()
  seg = None
  if with_segments:
    # Row 0: a boundary inside shard 1 (token 11) and one exactly at shard 2's first token (16).
    # Row 1: a boundary inside shard 3 (token 27) only.
    seg = np.zeros((B, T), np.int32)
    seg[0, 11:] = 1
    seg[0, 16:] = 2
    seg[1, 27:] = 5
    seg = jnp.asarray(seg)
  mesh = _mesh()
  for fn in _kda_fns():
    o_ref, s_ref = jax.jit(lambda *a, **kw: fn(*a, scale=K ** -0.5, chunk_size=16, **kw))(
        q, k, v, g, beta, initial_state=s0, segment_ids=seg)
    o, s = jax.jit(lambda *a: cp.kda_context_parallel_sharded(
        mesh, *a[:5], scale=K ** -0.5, initial_state=a[5], chunk_size=16,
        segment_ids=a[6] if len(a) > 6 else None, kda_fn=fn))(
            q, k, v, g, beta, s0, *([] if seg is None else [seg]))
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s, s_ref, rtol=1e-5, atol=1e-5)


def test_kda_context_parallel_without_initial_state_or_segments():
  q, k, v, g, beta, _ = _inputs(1)
  mesh = _mesh()
  o_ref, s_ref = jax.jit(lambda *a: kda_naive(*a, scale=0.5))(q, k, v, g, beta)
  o, s = jax.jit(lambda *a: cp.kda_context_parallel_sharded(
      mesh, *a, scale=0.5, kda_fn=kda_naive))(q, k, v, g, beta)
  np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(s, s_ref, rtol=1e-5, atol=1e-5)


def conv_naive(x, kernel, segment_ids=None):
  """y_t = Σ_j kernel[j] · x_{t−(W−1)+j}, zeros before the start or in another document."""
  w, t = kernel.shape[0], x.shape[1]
  y = np.zeros(x.shape, np.float64)
  x = np.asarray(x, np.float64)
  for i in range(t):
    for j in range(w):
      src = i - (w - 1) + j
      if src < 0:
        continue
      same = np.ones(x.shape[0]) if segment_ids is None else (
          np.asarray(segment_ids)[:, src] == np.asarray(segment_ids)[:, i]).astype(np.float64)
      y[:, i] += np.asarray(kernel[j]) * x[:, src] * same.reshape((-1,) + (1,) * (x.ndim - 2))
  return y


@pytest.mark.parametrize("with_segments", [False, True])
def test_causal_conv_gets_previous_shard_tail(with_segments):
  x = jax.random.normal(jax.random.key(2), (B, T, H, K))
  kernel = jax.random.normal(jax.random.key(3), (4, H, K))
  seg = None
  if with_segments:
    seg = np.zeros((B, T), np.int32)
    seg[0, 9:] = 1      # boundary 1 token after shard 1 starts: halo taps must be masked
    seg[1, 24:] = 3     # boundary exactly at shard 3's first token
    seg = jnp.asarray(seg)
  mesh = _mesh()
  bt = P(sharding.BATCH_AXES, "context")
  if seg is None:
    fn = jax.shard_map(lambda a, w: cp.causal_conv_context_parallel(a, w), mesh=mesh,
                       in_specs=(bt, P()), out_specs=bt)
    y = fn(x, kernel)
  else:
    fn = jax.shard_map(lambda a, w, s: cp.causal_conv_context_parallel(a, w, segment_ids=s),
                       mesh=mesh, in_specs=(bt, P(), bt), out_specs=bt)
    y = fn(x, kernel, seg)
  np.testing.assert_allclose(y, conv_naive(x, kernel, seg), rtol=1e-5, atol=1e-5)


def attention_naive(q, k, v, scale, segment_ids=None):
  t = q.shape[1]
  logits = np.einsum("bqhd,bkhd->bhqk", np.float64(q), np.float64(k)) * scale
  mask = np.tril(np.ones((t, t), bool))[None]
  if segment_ids is not None:
    s = np.asarray(segment_ids)
    mask = mask & (s[:, :, None] == s[:, None, :])
  logits = np.where(mask[:, None], logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p = p / p.sum(-1, keepdims=True)
  return np.einsum("bhqk,bkhd->bqhd", p, np.float64(v))


def test_mla_attention_gathers_keys_with_global_causal_mask():
  ks = jax.random.split(jax.random.key(4), 3)
  q = jax.random.normal(ks[0], (B, T, H, 6))
  k = jax.random.normal(ks[1], (B, T, H, 6))
  v = jax.random.normal(ks[2], (B, T, H, 5))
  seg = np.zeros((B, T), np.int32)
  seg[1, 13:] = 1
  mesh = _mesh()
  bt = P(sharding.BATCH_AXES, "context")
  fn = jax.shard_map(
      lambda a, b_, c, s: cp.mla_attention_context_parallel(a, b_, c, scale=0.4, segment_ids=s),
      mesh=mesh, in_specs=(bt, bt, bt, bt), out_specs=(bt, P("data")), check_vma=False)
  out, max_logit = fn(q, k, v, jnp.asarray(seg))
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, attention_naive(q, k, v, 0.4, seg), rtol=1e-5, atol=1e-5)
  # Per-head max logit of each data shard's rows, over the whole sequence (reduced over context).
  ref_o, ref_max = mla_ops.mla_attention(q, k, v, scale=0.4, segment_ids=jnp.asarray(seg))
  h = q.shape[2]
  half = q.shape[0] // 2
  for i in range(2):
    _, m_i = mla_ops.mla_attention(q[i * half:(i + 1) * half], k[i * half:(i + 1) * half],
                                   v[i * half:(i + 1) * half], scale=0.4,
                                   segment_ids=jnp.asarray(seg)[i * half:(i + 1) * half])
    np.testing.assert_allclose(max_logit[i * h:(i + 1) * h], m_i, rtol=1e-5)
  np.testing.assert_allclose(jnp.max(max_logit.reshape(2, h), 0), ref_max, rtol=1e-5)


@pytest.mark.parametrize("with_segments", [False, True])
def test_mla_attention_pads_a_length_the_context_axis_does_not_divide(with_segments):
  # T − 1 = 31 positions on context=4 (the MTP layer's case): padded to 32 inside, outputs,
  # max logit and gradients equal the unsharded op on the 31 real positions.
  t = T - 1
  ks = jax.random.split(jax.random.key(5), 4)
  q = jax.random.normal(ks[0], (B, t, H, 6))
  k = jax.random.normal(ks[1], (B, t, H, 6))
  v = jax.random.normal(ks[2], (B, t, H, 5))
  seg = None
  if with_segments:
    seg = np.zeros((B, t), np.int32)
    seg[1, 20:] = 1   # the last document of row 1 runs into the padding
    seg = jnp.asarray(seg)
  mesh = _mesh()

  def loss(fn, q, k, v):
    o, m = fn(q, k, v, scale=0.4, segment_ids=seg)
    return jnp.sum(jnp.sin(o)), (o, m)

  grad = lambda fn: jax.grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2), has_aux=True)  # noqa: E731
  with jax.set_mesh(mesh):   # chosen and run under the mesh (JAX's context)
    attn = cp.maybe_context_parallel_attention(mla_ops.mla_attention)
    g, (o, m) = jax.jit(grad(attn))(q, k, v)
    m_neg = jax.jit(attn)(-jnp.abs(q), jnp.abs(k), v, scale=0.4, segment_ids=seg)[1]
  g_ref, (o_ref, m_ref) = grad(mla_ops.mla_attention)(q, k, v)
  assert o.shape == (B, t, H, 5) and o.dtype == jnp.float32
  np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
  # Padded queries (zeros: logit 0) are left out: every head's max logit here is negative.
  m_neg_ref = mla_ops.mla_attention(-jnp.abs(q), jnp.abs(k), v, scale=0.4, segment_ids=seg)[1]
  assert np.all(np.asarray(m_neg_ref) < 0)
  np.testing.assert_allclose(m_neg, m_neg_ref, rtol=1e-5)
  np.testing.assert_allclose(m, m_ref, rtol=1e-5)
  for a, b_ in zip(g, g_ref):
    np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-5)


def test_from_previous_shard_shifts_by_one_shard():
  mesh = _mesh()
  x = jnp.arange(8.0).reshape(2, 4)   # [data, context]
  fn = jax.shard_map(lambda a: cp.from_previous_shard(a), mesh=mesh,
                     in_specs=P("data", "context"), out_specs=P("data", "context"))
  np.testing.assert_array_equal(fn(x), [[0, 0, 1, 2], [0, 4, 5, 6]])


@pytest.mark.parametrize("n", [3, 5, 8])
def test_shard_maps_compose_in_order_for_any_shard_count(n):
  """The parallel prefix over the shards' affine maps x ↦ P_j (keep_j x) + S0_j (⌈log2 n⌉
  ppermute doubling steps) gives every shard the start the sequential composition gives, and
  every shard the last shard's end — also where n is not a power of two and a shard drops
  what it is handed (keep 0)."""
  rng = np.random.default_rng(n)
  b, h = 2, 3
  p = (0.5 * rng.standard_normal((n, b, h, K, K))).astype(np.float32)
  s0 = rng.standard_normal((n, b, h, K, V)).astype(np.float32)
  keep = np.ones((n, b), np.float32)
  keep[n // 2, 0] = 0.0
  init = rng.standard_normal((b, h, K, V)).astype(np.float32)
  want_starts, state = [], init.astype(np.float64)
  for j in range(n):
    start = state * keep[j][:, None, None, None]
    want_starts.append(start)
    state = np.einsum("bhij,bhjv->bhiv", p[j], start) + s0[j]
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("context",))
  spec = P("context")

  def body(p_, s0_, keep_, init_):
    idx = jax.lax.axis_index("context")
    start, final = cp._compose_shards(p_[0], s0_[0], keep_[0], init_, idx, "context")
    return start[None], final[None]

  starts, finals = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, P()),
                                         out_specs=(spec, spec), check_vma=False))(
      p, s0, keep, init)
  np.testing.assert_allclose(starts, np.stack(want_starts), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(finals, np.broadcast_to(state, finals.shape), rtol=1e-4,
                             atol=1e-4)
