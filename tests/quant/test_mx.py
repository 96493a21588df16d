"""MX codecs against ml_dtypes' element and scale types (an independent implementation)."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given
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
        # E8M0's smallest scale is 2^−127: blocks under 2^(emax − 127) keep that scale.
        x = max(int(np.floor(np.log2(amax))) - emax, -127)
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


# ---------------------------------------------------------------------- subnormals under XLA
def test_smallest_subnormal_scale_case():
  """A block whose largest magnitude is 2^−120 has scale 2^−127 (a float32 subnormal): its
  values are normal floats and XLA must not flush them (it did, via the 2^X multiply)."""
  x = jnp.full((1, 32), 2.0 ** -120, jnp.float32)
  want = mx.mx_round(np.asarray(x), "mxfp8")
  assert want[0, 0] == np.float32(7.523164e-37) and want[0, 0] > 0
  for fn in (lambda a: mx.fake_round(a, "mxfp8"), lambda a: mx.mx_round(a, "mxfp8")):
    got = np.asarray(jax.jit(fn)(x))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(fn(x)).view(np.uint32), want.view(np.uint32))


def _sweep_blocks(seed: int, exps: list[int]) -> np.ndarray:
  """One row of 32-value blocks, block i's largest magnitude 2^exps[i] times a factor in
  [1, 2) (clamped to the largest float32); the other values spread 30 binades below it, into
  and under the subnormal range; zeros and −0 sprinkled in; one all-zero block."""
  rng = np.random.default_rng(seed)
  blocks = []
  for e in exps:
    top = np.float32(min(rng.uniform(1, 2) * 2.0 ** e, np.finfo(np.float32).max))
    vals = rng.uniform(-1, 1, 32) * 2.0 ** rng.integers(-30, 1, 32) * float(top)
    vals[rng.integers(0, 32)] = top * rng.choice([-1, 1])
    vals[rng.random(32) < 0.1] = 0.0
    vals[rng.random(32) < 0.05] = -0.0
    blocks.append(vals.astype(np.float32))
  blocks.append(np.zeros(32, np.float32))
  return np.concatenate(blocks)[None]


_JIT = {(fmt, what): jax.jit(fn) for fmt in ("mxfp4", "mxfp8") for what, fn in (
    ("fake", lambda a, f=fmt: mx.fake_round(a, f)),
    ("fake2", lambda a, f=fmt: mx.fake_round(a, f, axis=-2)),
    ("round", lambda a, f=fmt: mx.mx_round(a, f)),
    ("pack", mx.mxfp4_pack if fmt == "mxfp4" else mx.mxfp8_pack))}


def _bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


@given(seed=st.integers(0, 2**16), exps=st.lists(st.integers(-140, 127), min_size=6,
                                                   max_size=6))
@example(seed=0, exps=[-140, -126, -124, -120, -118, 127])     # the edges, always
@example(seed=1, exps=[-133, -128, -127, -125, -119, -117])
def test_jax_equals_numpy_codec_bit_for_bit_over_all_exponents(seed, exps):
  """Block maxima from 2^−140 (subnormal inputs) to 2^127 (six blocks and an all-zero one:
  one shape, one compilation per function): jitted jax fake_round, mx_round,
  packers and unpackers (mxfp4_unpack, unpack_expert's fast decoder) = the numpy codec bit for
  bit (codes, scale bytes, values, signs of zero), and the numpy codec = the ml_dtypes
  reference."""
  w = _sweep_blocks(seed, exps)
  for fmt, elem, emax, top in (("mxfp4", F4, 2, 6.0), ("mxfp8", F8, 8, 448.0)):
    ref_codes, ref_scales = _reference(w, elem, emax, top)
    codes, scales = (mx.mxfp4_pack if fmt == "mxfp4" else mx.mxfp8_pack)(w)
    np.testing.assert_array_equal(scales, ref_scales)
    want = mx.mx_round(w, fmt)
    ref_vals = (ref_codes.view(elem).astype(np.float64) * np.repeat(
        2.0 ** (ref_scales.astype(np.float64) - 127), 32, axis=1)).astype(np.float32)
    np.testing.assert_array_equal(_bits(want), _bits(ref_vals))
    np.testing.assert_array_equal(_bits(mx.fake_round(w, fmt)), _bits(want))
    jcodes, jscales = _JIT[fmt, "pack"](jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(jcodes), codes)
    np.testing.assert_array_equal(np.asarray(jscales), scales)
    np.testing.assert_array_equal(_bits(_JIT[fmt, "fake"](jnp.asarray(w))), _bits(want))
    np.testing.assert_array_equal(_bits(_JIT[fmt, "round"](jnp.asarray(w))), _bits(want))
    wt = np.ascontiguousarray(w.T)
    np.testing.assert_array_equal(_bits(_JIT[fmt, "fake2"](jnp.asarray(wt))), _bits(want.T))
    # the unjitted jax path too
    np.testing.assert_array_equal(_bits(mx.fake_round(jnp.asarray(w), fmt)), _bits(want))
    if fmt == "mxfp4":
      np.testing.assert_array_equal(
          _bits(_UNPACK_FAST(jcodes, jscales)), _bits(want))


_UNPACK_FAST = jax.jit(lambda p, s: mx.mxfp4_unpack_fast(p, s, jnp.float32))


def test_decoders_give_exact_subnormals_for_the_smallest_scales():
  """Scale bytes 0 and 1 (2^−127, 2^−126) with every E2M1 / E4M3 code: the values (subnormal
  float32 among them) equal numpy's, jitted, for both decoders of MXFP4."""
  packed = np.arange(256, dtype=np.uint8).reshape(16, 16)
  for byte in (0, 1, 2, 254, 255):
    s = np.full((16, 1), byte, np.uint8)
    want = mx.mxfp4_unpack(packed, s)
    assert byte != 0 or np.count_nonzero(want) and np.abs(want[want != 0]).min() == 2.0 ** -128
    np.testing.assert_array_equal(_bits(jax.jit(mx.mxfp4_unpack)(packed, s)), _bits(want))
    np.testing.assert_array_equal(_bits(_UNPACK_FAST(packed, s)), _bits(want))
    codes = np.arange(256, dtype=np.uint8).reshape(8, 32)
    s8 = np.full((8, 1), byte, np.uint8)
    want8 = mx.mxfp8_unpack(codes, s8)
    got8 = np.asarray(jax.jit(mx.mxfp8_unpack)(codes, s8))
    np.testing.assert_array_equal(np.isnan(got8), np.isnan(want8))
    ok = ~np.isnan(want8)
    np.testing.assert_array_equal(_bits(got8[ok]), _bits(want8[ok]))
  assert np.nanmax(np.abs(mx.mxfp8_unpack(codes, np.zeros((8, 1), np.uint8)))) > 0


def test_non_finite_blocks():
  """The codec's rule for infinities and NaNs: numpy encoding refuses them (ValueError); jax
  encoding gives the block scale byte 255 (E8M0 NaN), which decodes to NaN for the whole
  block; fake_round gives NaNs for that block, numpy and jax alike; other blocks unchanged."""
  w = _sweep_blocks(0, [0, 3, -5])
  w[0, 3], w[0, 40] = np.inf, np.nan
  for fmt, pack in (("mxfp4", mx.mxfp4_pack), ("mxfp8", mx.mxfp8_pack)):
    with pytest.raises(ValueError, match="finite"):
      pack(w)
    codes, scales = jax.jit(pack)(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(scales)[0, :2], [255, 255])
    want_rest = mx.mx_round(w[:, 64:], fmt)
    for got in (np.asarray(jax.jit(lambda a: mx.mx_round(a, fmt))(w)),
                np.asarray(jax.jit(lambda a: mx.fake_round(a, fmt))(w)), mx.fake_round(w, fmt)):
      assert np.isnan(got[0, :64]).all()
      np.testing.assert_array_equal(_bits(got[:, 64:]), _bits(want_rest))


def _fake4(a):
  return mx.fake_round(a, "mxfp4")


def _fake8(a):
  return mx.fake_round(a, "mxfp8")


_FAKE = {"mxfp4": _fake4, "mxfp8": _fake8}


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_fake_round_gradient_is_straight_through(fmt):
  """fake_round inside QAT's straight-through estimator: the gradient is the cotangent,
  unchanged (tiny and subnormal-scale blocks included)."""
  from k3jax.quant import qat
  w = jnp.asarray(_sweep_blocks(1, [-124, -60, 0, 20]))
  ct = jnp.asarray(np.random.default_rng(2).normal(size=w.shape).astype(np.float32))
  q = functools.partial(qat.straight_through, _FAKE[fmt])
  g = jax.jit(jax.grad(lambda a: jnp.sum(q(a) * ct)))(w)
  np.testing.assert_array_equal(np.asarray(g), np.asarray(ct))
  np.testing.assert_array_equal(_bits(jax.jit(q)(w)), _bits(mx.fake_round(np.asarray(w), fmt)))
