"""Slow, obviously-correct QAT references for tests/quant/test_qat*.py: MX fake quantisation
block by block with ml_dtypes' E2M1 / E4M3 / E8M0 types, and the routed expert MLP per (token,
slot) pair on quantised weights and inputs."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from k3jax.ops import moe as moe_ops

F4 = ml_dtypes.float4_e2m1fn
F8 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu


def mx_reference(x: np.ndarray, elem, emax: int, max_value: float) -> np.ndarray:
  """MX fake quantisation along the last axis, block by block, with ml_dtypes casts: shared
  scale 2^(floor(log2 amax) − emax) as an E8M0 value, elements rounded by the element type."""
  x = np.ascontiguousarray(x, np.float64)
  out = np.zeros(x.shape)
  flat, oflat = x.reshape(-1, x.shape[-1]), out.reshape(-1, x.shape[-1])
  for r in range(flat.shape[0]):
    for b in range(flat.shape[1] // 32):
      blk = flat[r, 32 * b:32 * (b + 1)]
      amax = np.abs(blk).max()
      if amax == 0:
        continue
      scale = float(np.array([2.0 ** (np.floor(np.log2(amax)) - emax)], np.float32)
                    .astype(E8M0).astype(np.float64)[0])
      y = np.clip(blk / scale, -max_value, max_value).astype(np.float32).astype(elem)
      oflat[r, 32 * b:32 * (b + 1)] = y.astype(np.float64) * scale
  return out.astype(np.float32)


def ref_mxfp8(x):
  return mx_reference(x, F8, 8, 448.0)


def ref_mxfp4_kernel(w):
  """MXFP4 of an [..., in, out] kernel: blocks along `in`."""
  return np.swapaxes(mx_reference(np.swapaxes(np.asarray(w), -1, -2), F4, 2, 6.0), -1, -2)


def act(a, b):
  return moe_ops.situ_glu(a, b)


def stage1(xq, w1, w3, indices):
  """h [N, k, F]: the gated activation of each (token, slot) pair, unquantised op."""
  hi = jax.lax.Precision.HIGHEST
  a = jnp.einsum("nd,nkdf->nkf", xq, w1[indices], precision=hi)
  b = jnp.einsum("nd,nkdf->nkf", xq, w3[indices], precision=hi)
  return act(a, b)


def stage2(hq, w2, weights, indices):
  """y [N, D] = Σ_k weights · hq w2[e], unquantised op."""
  return jnp.einsum("nk,nkf,nkfd->nd", weights, hq, w2[indices],
                    precision=jax.lax.Precision.HIGHEST)


def qat_reference(x, weights, indices, w1, w3, w2):
  """Per-pair QAT expert MLP on ml_dtypes-quantised weights and inputs (numpy quantisers)."""
  q4 = lambda w: jnp.asarray(ref_mxfp4_kernel(w))
  q8 = lambda a: jnp.asarray(ref_mxfp8(a))
  xq, w1q, w3q, w2q = q8(x), q4(w1), q4(w3), q4(w2)
  hq = q8(stage1(xq, w1q, w3q, indices))
  return stage2(hq, w2q, weights, indices), (xq, w1q, w3q, w2q, hq)


