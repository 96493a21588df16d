"""OCP microscaling (MX) codecs: MXFP4 (E2M1 elements) and MXFP8 (E4M3 elements).

A block of 32 consecutive values along the **last** axis shares one E8M0 scale byte
(value 2^(byte − 127)); each value is stored as a small float code. MXFP4 packs two 4-bit
codes per byte, **low nibble first** (element 2i in bits 0–3, element 2i+1 in bits 4–7), which
is the layout of Kimi K3's published experts (`weight_packed` [out, in/2] + `weight_scale`
[out, in/32], PyTorch [out, in] weights: the blocks run along the input axis). docs/k3.md §9.

Encoding follows the OCP MX v1.0 rule: shared exponent X = floor(log2(max|v|)) − emax_elem
(emax_elem = 2 for E2M1, 8 for E4M3), elements = round-to-nearest-even(v / 2^X), saturated to
the element format's largest finite value (6 for E2M1, 448 for E4M3). An all-zero block gets
scale byte 0. Functions accept numpy or jax arrays and return the same kind, so the
checkpoint converter (numpy, streaming) and quantisation-aware training (jnp) share one codec.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

BLOCK = 32          # values per shared scale
SCALE_BIAS = 127    # E8M0: value 2^(byte - 127); byte 255 is NaN


class _Fmt(NamedTuple):
  name: str
  exp_bits: int
  man_bits: int
  bias: int
  max_value: float   # largest finite magnitude (saturation point)
  emax: int          # exponent of the largest normal binade (floor(log2(max_value)))


E2M1 = _Fmt("e2m1", 2, 1, 1, 6.0, 2)
E4M3 = _Fmt("e4m3", 4, 3, 7, 448.0, 8)


def _xp(x):
  """numpy for numpy inputs, jax.numpy otherwise."""
  if isinstance(x, np.ndarray) or np.isscalar(x):
    return np
  return jnp


def _decode_table(fmt: _Fmt) -> np.ndarray:
  """float32 value of every code 0 .. 2^(1+e+m) − 1 (sign in the top bit)."""
  n = 1 << (1 + fmt.exp_bits + fmt.man_bits)
  codes = np.arange(n)
  sign = np.where(codes >> (fmt.exp_bits + fmt.man_bits), -1.0, 1.0)
  e = (codes >> fmt.man_bits) & ((1 << fmt.exp_bits) - 1)
  m = codes & ((1 << fmt.man_bits) - 1)
  emin = 1 - fmt.bias
  mag = np.where(e == 0, m * 2.0 ** (emin - fmt.man_bits),
                 (1 + m / 2 ** fmt.man_bits) * 2.0 ** (e - fmt.bias))
  table = (sign * mag).astype(np.float32)
  if fmt is E4M3:  # E4M3 "fn": S.1111.111 is NaN, there is no infinity
    table[0x7F] = table[0xFF] = np.nan
  return table


_E2M1_TABLE = _decode_table(E2M1)
_E4M3_TABLE = _decode_table(E4M3)


def _check_last_axis(x, name: str):
  if x.ndim < 1 or x.shape[-1] % BLOCK:
    raise ValueError(f"{name}: last axis must be a multiple of {BLOCK}, found shape "
                     f"{tuple(x.shape)}")


def _round_to_format(y, fmt: _Fmt):
  """Round float32 `y` to the nearest value of `fmt` (ties to even), saturating at max.

  Returns (magnitude, sign_bit): the rounded |y| as float32 and 1 where y is negative.
  """
  xp = _xp(y)
  a = xp.abs(y)
  # Exponent of the binade of |y|, never below the subnormal binade: frexp gives
  # |y| = f · 2^e with f in [0.5, 1), so floor(log2|y|) = e − 1 (exact, no log rounding).
  _, e = xp.frexp(a)
  emin = 1 - fmt.bias
  e = xp.maximum(e - 1, emin)
  quantum = xp.ldexp(xp.ones_like(a), e - fmt.man_bits)
  # a / quantum and the product back are exact (power-of-two scaling); rint rounds half to even.
  mag = xp.minimum(xp.rint(a / quantum) * quantum, fmt.max_value).astype(xp.float32)
  sign = (y < 0) | ((y == 0) & xp.signbit(y))
  return mag, sign


def _encode(mag, sign, fmt: _Fmt):
  """Bit codes (uint8) of already-rounded magnitudes."""
  xp = _xp(mag)
  _, e = xp.frexp(mag)
  e = e - 1
  emin = 1 - fmt.bias
  sub = mag < 2.0 ** emin
  sub_code = mag * 2.0 ** (fmt.man_bits - emin)
  e_safe = xp.maximum(e, emin)
  man = (xp.ldexp(mag, -e_safe) - 1.0) * (1 << fmt.man_bits)
  norm_code = (e_safe + fmt.bias) * (1 << fmt.man_bits) + man
  code = xp.where(sub, sub_code, norm_code).astype(xp.uint8)
  return code | (sign.astype(xp.uint8) << (fmt.exp_bits + fmt.man_bits))


def _bits(x):
  """float32 → its uint32 bit pattern (no arithmetic: XLA keeps subnormals)."""
  if _xp(x) is np:
    return np.ascontiguousarray(x, np.float32).view(np.uint32)
  return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _from_bits(b):
  """uint32 bit patterns → float32 (no arithmetic)."""
  if _xp(b) is np:
    return np.ascontiguousarray(b, np.uint32).view(np.float32)
  return jax.lax.bitcast_convert_type(b.astype(jnp.uint32), jnp.float32)


def _floor_log2_int(m):
  """floor(log2 m) of positive int32 m < 2^24 (their float32 is exact and normal)."""
  xp = _xp(m)
  _, e = xp.frexp(xp.maximum(m, 1).astype(xp.float32))
  return e.astype(xp.int32) - 1


def _ldexp_exact(v, k):
  """`_ldexp_bits` (below); for jax arrays as one jitted function (eager callers compile it
  once per shape instead of each of its integer operations)."""
  if _xp(v) is np:
    return _ldexp_bits(v, k)
  return _ldexp_bits_jit(v, jnp.asarray(k, jnp.int32))


def _ldexp_bits(v, k):
  """v · 2^k for float32 v (subnormal v included) and int k, built from the bit pattern with
  integer operations: normal results are exact, subnormal results round half to even (exact
  whenever representable). No float multiply by 2^k, so XLA's flush of subnormal inputs,
  factors and results (denormals-are-zero / flush-to-zero on CPU, GPU, TPU) cannot touch it;
  numpy and jax give the same bits. Infinities and NaNs pass through unchanged."""
  xp = _xp(v)
  i32, u32 = xp.int32, xp.uint32
  b = _bits(v)
  sign = b & u32(0x80000000)
  ef = ((b >> 23) & u32(0xFF)).astype(i32)
  man = (b & u32(0x7FFFFF)).astype(i32)
  # A subnormal v = man · 2^−149 in normal form: significand (1.f) and exponent field ≤ 0.
  lz = 23 - _floor_log2_int(man)               # shift that brings man's top bit to bit 23
  sub = (ef == 0) & (man != 0)
  sig = xp.where(sub, (man << xp.clip(lz, 0, 23)) & 0x7FFFFF, man) | 0x800000   # 24 bits
  ne = xp.where(sub, 1 - lz, ef) + xp.asarray(k, i32)       # the result's exponent field
  normal = (sign | (xp.clip(ne, 1, 254).astype(u32) << 23)
            | (sig & 0x7FFFFF).astype(u32))
  # Subnormal result: field = sig · 2^(ne − 1), i.e. sig >> (1 − ne), rounded half to even.
  s = xp.clip(1 - ne, 1, 31).astype(u32)
  usig = sig.astype(u32)
  q = usig >> s
  rem = usig & ((u32(1) << s) - u32(1))
  half = u32(1) << (s - u32(1))
  q = q + ((rem > half) | ((rem == half) & ((q & u32(1)) == u32(1)))).astype(u32)
  subn = sign | q
  out = xp.where(ne >= 1, normal, subn)
  out = xp.where(ne > 254, sign | u32(0x7F800000), out)
  out = xp.where((ef == 0) & (man == 0), sign, out)          # ±0
  out = xp.where(ef == 255, b, out)                           # inf / NaN unchanged
  return _from_bits(out)


_ldexp_bits_jit = jax.jit(lambda v, k: _ldexp_bits(v, k))


def _shared_scale(blocks, fmt: _Fmt, axis: int = -1, keepdims: bool = False):
  """`_shared_scale_bits` (below); for jax arrays jitted as one function."""
  if _xp(blocks) is np:
    return _shared_scale_bits(blocks, fmt, axis, keepdims)
  return _shared_scale_jit(blocks, fmt, axis, keepdims)


def _shared_scale_bits(blocks, fmt: _Fmt, axis: int = -1, keepdims: bool = False):
  """E8M0 byte per block (blocks [..., nb, 32], or the 32 along `axis`) and its exponent X
  as int32. The block maximum and its floor(log2) come from the bit patterns (integer
  operations: subnormal values count, under XLA too). A block holding an infinity or a NaN
  gets byte 255 (E8M0 NaN) and X = 0."""
  xp = _xp(blocks)
  u32 = xp.uint32
  mag = _bits(blocks) & u32(0x7FFFFFFF)
  # For non-negative floats the bit patterns order as the values (NaNs above infinity).
  amax = xp.max(mag, axis=axis, keepdims=keepdims)
  finite = amax < u32(0x7F800000)
  ef = (amax >> 23).astype(xp.int32)
  flog2 = xp.where(ef > 0, ef - 127,
                   _floor_log2_int((amax & u32(0x7FFFFF)).astype(xp.int32)) - 149)
  x = xp.where(amax > 0, flog2 - fmt.emax, -SCALE_BIAS)
  x = xp.where(finite, xp.clip(x, -SCALE_BIAS, SCALE_BIAS), 0)
  byte = xp.where(finite, x + SCALE_BIAS, 255)
  return byte.astype(xp.uint8), x.astype(xp.int32)


_shared_scale_jit = jax.jit(_shared_scale_bits, static_argnums=(1, 2, 3))


def _quantize(w, fmt: _Fmt):
  """(codes uint8 [..., n], scale bytes uint8 [..., n/32]) of w along its last axis."""
  _check_last_axis(w, "w")
  xp = _xp(w)
  w = w.astype(xp.float32)
  if xp is np and not np.all(np.isfinite(w)):
    raise ValueError(f"w: MX {fmt.name} encoding needs finite values")
  blocks = w.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
  scale_byte, x = _shared_scale(blocks, fmt)
  y = _ldexp_exact(blocks, -x[..., None])   # division by 2^X (exact where it matters)
  mag, sign = _round_to_format(y, fmt)
  # A block with an infinity or a NaN (jax only: numpy refuses them above): scale byte 255
  # (NaN), codes 0; it decodes to NaN.
  codes = xp.where((scale_byte == 255)[..., None], xp.uint8(0), _encode(mag, sign, fmt))
  return codes.reshape(w.shape), scale_byte


def _dequantize(codes, scales, table: np.ndarray, dtype):
  xp = _xp(codes)
  vals = xp.asarray(table)[codes.astype(xp.int32)]
  if scales.shape != (*codes.shape[:-1], codes.shape[-1] // BLOCK):
    raise ValueError(f"scales: expected shape {(*codes.shape[:-1], codes.shape[-1] // BLOCK)} "
                     f"for {codes.shape[-1]} values, found {tuple(scales.shape)}")
  blocks = vals.reshape(*codes.shape[:-1], codes.shape[-1] // BLOCK, BLOCK)
  exps = scales.astype(xp.int32) - SCALE_BIAS
  out = _ldexp_exact(blocks, exps[..., None])
  # E8M0 byte 255 is NaN.
  out = xp.where((scales == 255)[..., None], xp.nan, out)
  return out.reshape(codes.shape).astype(dtype)


# ---------------------------------------------------------------------- MXFP4
def mxfp4_pack(w):
  """Encode w [..., n] (n a multiple of 32) as MXFP4.

  Returns (packed uint8 [..., n/2], scales uint8 [..., n/32]); two E2M1 codes per byte,
  element 2i in the low nibble.
  """
  codes, scales = _quantize(w, E2M1)
  pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
  return pairs[..., 0] | (pairs[..., 1] << 4), scales


def mxfp4_unpack(packed, scales, dtype=np.float32):
  """Decode MXFP4: packed uint8 [..., n/2], scales uint8 [..., n/32] → [..., n] of `dtype`."""
  xp = _xp(packed)
  if packed.dtype != xp.uint8 or scales.dtype != xp.uint8:
    raise ValueError(f"packed/scales: expected uint8, found {packed.dtype}/{scales.dtype}")
  lo, hi = packed & 0xF, packed >> 4
  codes = xp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
  _check_last_axis(codes, "packed (unpacked length)")
  return _dequantize(codes, scales, _E2M1_TABLE, dtype)


# ---------------------------------------------------------------------- MXFP8
def mxfp8_pack(w):
  """Encode w [..., n] as MXFP8 (E4M3): (codes uint8 [..., n], scales uint8 [..., n/32])."""
  return _quantize(w, E4M3)


def mxfp8_unpack(codes, scales, dtype=np.float32):
  """Decode MXFP8: codes uint8 [..., n], scales uint8 [..., n/32] → [..., n] of `dtype`."""
  xp = _xp(codes)
  if codes.dtype != xp.uint8 or scales.dtype != xp.uint8:
    raise ValueError(f"codes/scales: expected uint8, found {codes.dtype}/{scales.dtype}")
  _check_last_axis(codes, "codes")
  return _dequantize(codes, scales, _E4M3_TABLE, dtype)


def fake_round(w, fmt: str = "mxfp4", axis: int = -1):
  """The values of an MX round trip, computed without codes: each block's shared exponent X
  (`_shared_scale`), each value rounded on the element grid at that scale
  (`_round_to_format`, the encoder's own rounding) and multiplied back by 2^X. The encoder
  and decoder do the same arithmetic with a code in between, so this is `mx_round` value for
  value (and, along axis −2, `unpack_expert(pack_expert(w))`), in w.dtype, several times
  cheaper under XLA than building and decoding codes — the form QAT runs (k3jax/quant/qat.py).
  The power-of-two scalings are integer operations on the bit patterns (`_ldexp_exact`), so
  under XLA too the values equal the numpy codec's bit for bit, subnormal inputs and results
  included (docs/notes/qat.md). A block holding an infinity or a NaN gives NaNs (its E8M0
  scale is NaN). Blocks of 32 along `axis` (−1 or −2)."""
  f = {"mxfp4": E2M1, "mxfp8": E4M3}.get(fmt)
  if f is None:
    raise ValueError(f"fmt: expected 'mxfp4' or 'mxfp8', found {fmt!r}")
  if axis not in (-1, -2) or w.ndim < -axis or w.shape[axis] % BLOCK:
    raise ValueError(f"w: MX blocks need axis -1 or -2 of a multiple of {BLOCK} values, found "
                     f"axis {axis} of shape {tuple(w.shape)}")
  xp = _xp(w)
  w32 = w.astype(xp.float32)
  n = w.shape[axis]
  if axis == -1:
    blocks = w32.reshape(*w.shape[:-1], n // BLOCK, BLOCK)
  else:
    blocks = w32.reshape(*w.shape[:-2], n // BLOCK, BLOCK, w.shape[-1])
  byte, x = _shared_scale(blocks, f, axis=axis, keepdims=True)
  mag, sign = _round_to_format(_ldexp_exact(blocks, -x), f)
  out = _ldexp_exact(xp.where(sign, -mag, mag), x)      # · 2^X, one per block
  out = xp.where(byte == 255, xp.float32(np.nan), out)
  return out.reshape(w.shape).astype(w.dtype)


def mx_round(w, fmt: str = "mxfp4"):
  """Quantise-dequantise (fake quant) along the last axis: the values an MX round trip gives."""
  if fmt == "mxfp4":
    return mxfp4_unpack(*mxfp4_pack(w), dtype=w.dtype)
  if fmt == "mxfp8":
    return mxfp8_unpack(*mxfp8_pack(w), dtype=w.dtype)
  raise ValueError(f"fmt: expected 'mxfp4' or 'mxfp8', found {fmt!r}")


# ---------------------------------------------------------------------- packed expert params
# The parameter form of `ModelConfig.modes.expert_format="mxfp4"` (k3jax/layers/moe.py). Every routed
# expert matrix of a MoE layer's `experts` module is two uint8 leaves, each expert's slice being
# byte for byte the release's `experts.E.<w>.weight_packed` / `.weight_scale` tensor (PyTorch
# [out, in] orientation, MX blocks along the input axis), stacked along a leading expert axis:
#
#   <moe>/experts/w1/weight_packed  uint8 [E, F, D/2]    <moe>/experts/w1/weight_scale  uint8 [E, F, D/32]
#   <moe>/experts/w3/weight_packed  uint8 [E, F, D/2]    <moe>/experts/w3/weight_scale  uint8 [E, F, D/32]
#   <moe>/experts/w2/weight_packed  uint8 [E, D, F/2]    <moe>/experts/w2/weight_scale  uint8 [E, D, F/32]
#
# (D = latent_moe_dim ℓ, or d_model for a classic MoE; F = moe_intermediate_size; a scanned
# layer group adds its leading [num_groups] axis to every leaf.) The "bf16" form of the same
# module is `<moe>/experts/w1` [E, D, F], `w3` [E, D, F], `w2` [E, F, D] in param_dtype, so
# `unpack_expert(*pack_expert(w))` is the [in, out] kernel again. Only the stacking is new: a
# converter keeps MXFP4 packed by `stack_release_experts` over experts 0 … E−1 of a layer.
PACKED = "weight_packed"
SCALE = "weight_scale"
EXPERT_MATRICES = ("w1", "w3", "w2")


def pack_expert(w):
  """An expert kernel w [..., in, out] (float, ours) → (weight_packed uint8 [..., out, in/2],
  weight_scale uint8 [..., out, in/32]): the release's bytes, by the exporter's quantiser
  (`mxfp4_pack` of the [out, in] transpose, exactly what k3jax/convert writes)."""
  xp = _xp(w)
  if w.ndim < 2:
    raise ValueError(f"w: expected an expert kernel [..., in, out], found shape {tuple(w.shape)}")
  return mxfp4_pack(xp.swapaxes(w, -1, -2))


def mxfp4_unpack_fast(packed, scales, dtype):
  """`mxfp4_unpack` for jax arrays in a form XLA runs fast (bit-identical results): each
  E2M1 nibble's float32 bits are built directly (sign, exponent e−1+127, one mantissa bit;
  e = 0 is 0 or 0.5) instead of a table gather, and the block scale 2^(byte−127) is applied by
  `_ldexp_exact` (integer operations on the bits: values below 2^−126, from scale bytes 0 and
  1, are the exact subnormals, not flushed; byte 255 gives NaN).
  packed uint8 [..., n/2], scales uint8 [..., n/32] → [..., n] of `dtype`."""
  codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).astype(jnp.uint32)   # [..., n/2, 2]
  sign = (codes >> 3) << 31
  e = (codes >> 1) & 3
  m = codes & 1
  # e > 0: (1 + m/2)·2^(e−1) → exponent field e − 1 + 127, mantissa bit 22 = m.
  # e = 0: m · 0.5 → 0x3F000000 (0.5) when m = 1, else 0.
  bits = jnp.where(e > 0, ((e + 126) << 23) | (m << 22), m * jnp.uint32(0x3F000000)) | sign
  vals = jax.lax.bitcast_convert_type(bits, jnp.float32)
  n = packed.shape[-1] * 2
  vals = vals.reshape(*packed.shape[:-1], n // BLOCK, BLOCK)
  exps = scales.astype(jnp.int32) - SCALE_BIAS
  vals = _ldexp_exact(vals, exps[..., None])
  vals = jnp.where((scales == 255)[..., None], jnp.float32(jnp.nan), vals)
  return vals.reshape(*packed.shape[:-1], n).astype(dtype)


def unpack_expert(packed, scale, dtype=np.float32):
  """(weight_packed [..., out, in/2], weight_scale [..., out, in/32]) → kernel [..., in, out]
  of `dtype` (the inverse orientation of `pack_expert`; values as `mxfp4_unpack` decodes —
  for jax arrays by `mxfp4_unpack_fast`, the same bits)."""
  xp = _xp(packed)
  if xp is np:
    return np.swapaxes(mxfp4_unpack(packed, scale, dtype), -1, -2)
  if packed.dtype != xp.uint8 or scale.dtype != xp.uint8:
    raise ValueError(f"packed/scale: expected uint8, found {packed.dtype}/{scale.dtype}")
  if scale.shape != (*packed.shape[:-1], packed.shape[-1] * 2 // BLOCK):
    raise ValueError(f"scale: expected shape {(*packed.shape[:-1], packed.shape[-1] * 2 // BLOCK)}"
                     f" for packed {tuple(packed.shape)}, found {tuple(scale.shape)}")
  return xp.swapaxes(mxfp4_unpack_fast(packed, scale, dtype), -1, -2)


def packed_expert_shapes(num_experts: int, in_dim: int, out_dim: int):
  """((weight_packed shape), (weight_scale shape)) of one expert matrix with an [in, out]
  kernel: ([E, out, in/2], [E, out, in/32]). `in_dim` must be a multiple of 32."""
  if in_dim % BLOCK:
    raise ValueError(f"in_dim: MXFP4 needs an input width divisible by {BLOCK}, found {in_dim}")
  return (num_experts, out_dim, in_dim // 2), (num_experts, out_dim, in_dim // BLOCK)


def stack_release_experts(packed, scales):
  """One matrix's per-expert release tensors → the stacked parameter leaves.

  packed: sequence of E uint8 [out, in/2] (`experts.e.<w>.weight_packed`, e = 0 … E−1);
  scales: sequence of E uint8 [out, in/32] (`.weight_scale`). Returns (uint8 [E, out, in/2],
  uint8 [E, out, in/32]) numpy arrays, the bytes unchanged. Shapes and dtypes are checked
  (a ValueError names the expert and the expected vs. found shape/dtype).
  """
  if len(packed) != len(scales) or not len(packed):
    raise ValueError(f"packed/scales: expected the same positive number of experts, found "
                     f"{len(packed)} and {len(scales)}")
  p0 = np.asarray(packed[0])
  if p0.ndim != 2:
    raise ValueError(f"packed[0]: expected [out, in/2], found shape {p0.shape}")
  want_p, want_s = p0.shape, (p0.shape[0], p0.shape[1] * 2 // BLOCK)
  for e, (p, s) in enumerate(zip(packed, scales)):
    for what, a, want in (("packed", p, want_p), ("scales", s, want_s)):
      a = np.asarray(a)
      if a.dtype != np.uint8 or a.shape != want:
        raise ValueError(f"{what}[{e}]: expected uint8 {want}, found {a.dtype} {a.shape}")
  return np.stack([np.asarray(p) for p in packed]), np.stack([np.asarray(s) for s in scales])


def split_release_experts(packed, scale):
  """Inverse of `stack_release_experts`: ([E, out, in/2], [E, out, in/32]) → two lists of E
  numpy arrays (views), expert e's being the release's `experts.e.<w>.weight_packed/_scale`."""
  packed, scale = np.asarray(packed), np.asarray(scale)
  return list(packed), list(scale)


def _map_experts(tree, fn):
  """Apply fn(name, value) → new value to every w1/w3/w2 entry of every `experts` dict."""
  if not isinstance(tree, dict):
    return tree
  out = {}
  for key, v in tree.items():
    if key == "experts" and isinstance(v, dict) and set(EXPERT_MATRICES) <= set(v):
      out[key] = {n: (fn(n, x) if n in EXPERT_MATRICES else x) for n, x in v.items()}
    else:
      out[key] = _map_experts(v, fn)
  return out


def _unboxed(tree):
  """Plain arrays for a tree that may hold flax LogicallyPartitioned boxes (model.init)."""
  return meta.unbox(tree)


def pack_expert_params(params):
  """A param tree with "bf16"-form experts (float w1/w3/w2) → the "mxfp4" form (module section
  above), quantised by `pack_expert` (the exporter's quantiser). Other leaves are untouched;
  flax boxes are unboxed. numpy leaves give numpy, jax leaves jax (jit-able)."""
  def fn(name, w):
    if isinstance(w, dict):
      raise ValueError(f"experts/{name}: already packed (found {sorted(w)})")
    p, s = pack_expert(w)
    return {PACKED: p, SCALE: s}
  return _map_experts(_unboxed(params), fn)


def unpack_expert_params(params, dtype=np.float32):
  """The "mxfp4" param form → the "bf16" form with kernels of `dtype`: the dequantised tree a
  `expert_format="bf16"` model runs to reproduce the packed model exactly."""
  def fn(name, w):
    if not (isinstance(w, dict) and set(w) == {PACKED, SCALE}):
      raise ValueError(f"experts/{name}: expected {{{PACKED!r}, {SCALE!r}}}, found "
                       f"{type(w).__name__}")
    return unpack_expert(w[PACKED], w[SCALE], dtype)
  return _map_experts(_unboxed(params), fn)


__all__ = ["BLOCK", "mxfp4_pack", "mxfp4_unpack", "mxfp8_pack", "mxfp8_unpack", "mx_round",
           "mxfp4_unpack_fast", "PACKED", "SCALE", "EXPERT_MATRICES", "pack_expert",
           "unpack_expert",
           "packed_expert_shapes", "stack_release_experts", "split_release_experts",
           "pack_expert_params", "unpack_expert_params"]
