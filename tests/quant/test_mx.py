"""MX codecs against ml_dtypes' element and scale types (an independent implementation)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3jax.quant import mx

F4 = ml_dtypes.float4_e2m1fn
F8 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu


def _reference(w: np.ndarray, elem, emax: int, max_value: float):
  """Slow, obviously-correct MX encoding: per block, in float64, with ml_dtypes casts."""
  rows, n = w.shape
  codes = np.zeros((rows, n), np.uint8)
  scales = np.zeros((rows, n // 32), np.uint8)
  for r in range(rows):
    for b in range(n // 32):
      blk = w[r, 32 * b:32 * (b + 1)].astype(np.float64)
      amax = np.abs(blk).max()
      if amax == 0:
        x = -127                      # all-zero block: scale byte 0 (E8M0 has no zero)
        scales[r, b] = 0
      else:
        x = int(np.floor(np.log2(amax))) - emax
        scales[r, b] = np.array([2.0 ** x], np.float32).astype(E8M0).view(np.uint8)[0]
      y = np.clip(blk / 2.0 ** x, -max_value, max_value).astype(np.float32)
      codes[r, 32 * b:32 * (b + 1)] = y.astype(elem).view(np.uint8)
  return codes, scales


def _weights(seed, rows, n, scale_exp):
  rng = np.random.default_rng(seed)
  w = rng.normal(size=(rows, n)) * 2.0 ** rng.integers(-scale_exp, scale_exp, size=(rows, 1))
  w[0, :32] = 0.0                                   # an all-zero block
  w[-1, 5] = -0.0
  if n >= 64:
    w[-1, 32:64] = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], 32)  # E2M1 ties at scale 1
    w[-1, 32] = 4.0                                 # forces X = 0 for that block
  return w.astype(np.float32)


@given(seed=st.integers(0, 2**16), rows=st.integers(1, 4), nblocks=st.integers(1, 4),
       scale_exp=st.integers(1, 40))
def test_mxfp4_matches_ml_dtypes(seed, rows, nblocks, scale_exp):
  w = _weights(seed, rows, 32 * nblocks, scale_exp)
  ref_codes, ref_scales = _reference(w, F4, emax=2, max_value=6.0)
  packed, scales = mx.mxfp4_pack(w)
  np.testing.assert_array_equal(scales, ref_scales)
  # low nibble first
  np.testing.assert_array_equal(packed & 0xF, ref_codes[:, 0::2])
  np.testing.assert_array_equal(packed >> 4, ref_codes[:, 1::2])
  # decoding: element value (ml_dtypes) times 2^(byte-127)
  ref_vals = ref_codes.view(F4).astype(np.float64) * np.repeat(
      2.0 ** (ref_scales.astype(np.float64) - 127), 32, axis=1)
  np.testing.assert_array_equal(mx.mxfp4_unpack(packed, scales), ref_vals.astype(np.float32))


@given(seed=st.integers(0, 2**16), rows=st.integers(1, 3), nblocks=st.integers(1, 3),
       scale_exp=st.integers(1, 40))
def test_mxfp8_matches_ml_dtypes(seed, rows, nblocks, scale_exp):
  w = _weights(seed, rows, 32 * nblocks, scale_exp)
  ref_codes, ref_scales = _reference(w, F8, emax=8, max_value=448.0)
  codes, scales = mx.mxfp8_pack(w)
  np.testing.assert_array_equal(scales, ref_scales)
  np.testing.assert_array_equal(codes, ref_codes)
  ref_vals = ref_codes.view(F8).astype(np.float64) * np.repeat(
      2.0 ** (ref_scales.astype(np.float64) - 127), 32, axis=1)
  np.testing.assert_array_equal(mx.mxfp8_unpack(codes, scales), ref_vals.astype(np.float32))


def test_e2m1_ties_round_to_even():
  # At scale 1 (block max 4 → X = 0) the E2M1 grid is the value itself: ties go to the even code.
  w = np.array([[4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -7.0] + [0.0] * 22], np.float32)
  got = mx.mx_round(w, "mxfp4")[0, :10]
  np.testing.assert_array_equal(got, [4.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -6.0])


def test_decode_table_and_nibble_order():
  # byte 0x72: low nibble 2 (1.0) comes first, high nibble 7 (6.0) second; scale byte 128 → ×2.
  packed = np.full((1, 16), 0x72, np.uint8)
  out = mx.mxfp4_unpack(packed, np.array([[128]], np.uint8))
  np.testing.assert_array_equal(out[0, :4], [2.0, 12.0, 2.0, 12.0])
  table = mx.mxfp4_unpack(np.array([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2], np.uint8),
                          np.array([[127]], np.uint8))[0, :16]
  np.testing.assert_array_equal(
      table, [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def test_representable_values_round_trip_exactly():
  rng = np.random.default_rng(1)
  w = mx.mx_round(rng.normal(size=(8, 96)).astype(np.float32), "mxfp4")
  np.testing.assert_array_equal(mx.mx_round(w, "mxfp4"), w)
  w8 = mx.mx_round(rng.normal(size=(8, 96)).astype(np.float32), "mxfp8")
  np.testing.assert_array_equal(mx.mx_round(w8, "mxfp8"), w8)


def test_jax_and_numpy_agree():
  w = _weights(3, 4, 96, 10)
  p, s = mx.mxfp4_pack(w)
  pj, sj = mx.mxfp4_pack(jnp.asarray(w))
  np.testing.assert_array_equal(np.asarray(pj), p)
  np.testing.assert_array_equal(np.asarray(sj), s)
  np.testing.assert_array_equal(np.asarray(mx.mxfp4_unpack(pj, sj)), mx.mxfp4_unpack(p, s))
  c, s8 = mx.mxfp8_pack(w)
  cj, s8j = mx.mxfp8_pack(jnp.asarray(w))
  np.testing.assert_array_equal(np.asarray(cj), c)
  np.testing.assert_array_equal(np.asarray(mx.mxfp8_unpack(cj, s8j)), mx.mxfp8_unpack(c, s8))


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_fake_round_is_the_round_trip(fmt):
  """fake_round (scale, round, multiply back: QAT's form) = decode(encode) value for value and
  sign for sign, numpy and jax, along the last axis and along axis −2 (expert kernels)."""
  w = _weights(5, 6, 128, 30)
  want = mx.mx_round(w, fmt)
  for got in (mx.fake_round(w, fmt), np.asarray(jax.jit(lambda x: mx.fake_round(x, fmt))(w))):
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
  wt = np.ascontiguousarray(w.T)                                     # [128, 6]: blocks on axis −2
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: mx.fake_round(x, fmt, axis=-2))(
      jnp.asarray(wt))), want.T)
  with pytest.raises(ValueError, match=r"axis -2 of shape \(6, 128\)"):
    mx.fake_round(w, fmt, axis=-2)
  with pytest.raises(ValueError, match="fmt"):
    mx.fake_round(w, "mxfp6")


def test_errors_name_the_argument():
  with pytest.raises(ValueError, match="multiple of 32"):
    mx.mxfp4_pack(np.zeros((2, 33), np.float32))
  with pytest.raises(ValueError, match="scales: expected shape"):
    mx.mxfp4_unpack(np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8))
  with pytest.raises(ValueError, match="uint8"):
    mx.mxfp8_unpack(np.zeros((2, 32), np.int8), np.zeros((2, 1), np.uint8))
  with pytest.raises(ValueError, match="fmt"):
    mx.mx_round(np.zeros((1, 32), np.float32), "mxfp6")
