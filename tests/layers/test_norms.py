"""RMSNorm: fp32 statistics, weight param, dtype handling."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers.norms import RMSNorm


def test_rmsnorm_matches_numpy_and_keeps_fp32_stats():
  x = np.random.default_rng(0).normal(size=(2, 3, 16)).astype(np.float32) * 100
  mod = RMSNorm(eps=1e-5)
  v = mod.init(jax.random.key(0), x)
  np.testing.assert_array_equal(nn.unbox(v)["params"]["weight"], np.ones(16))
  w = np.linspace(0.5, 2, 16).astype(np.float32)
  v = {"params": {"weight": jnp.asarray(w)}}
  ref = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-5) * w
  np.testing.assert_allclose(mod.apply(v, x), ref, rtol=1e-6)
  # bf16 input: statistics are fp32 (mean of squares of 100-scale values would lose bits in
  # bf16), the output comes back in the input dtype unless keep_fp32.
  xb = jnp.asarray(x, jnp.bfloat16)
  yb = mod.apply(v, xb)
  assert yb.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(yb, np.float32), ref, rtol=1e-2, atol=1e-2)
  assert RMSNorm(keep_fp32=True).apply(v, xb).dtype == jnp.float32
