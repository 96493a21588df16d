"""The packed-expert parameter form (quant/mx.py) against the exporter's bytes (convert/names.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import preset
from k3jax.convert import names as N
from k3jax.quant import mx


def _tree(seed=0, e=4, d=64, f=96, groups=None):
  rng = np.random.default_rng(seed)
  lead = () if groups is None else (groups,)
  w = lambda *s: (rng.normal(size=lead + s) * 0.05).astype(np.float32)
  return {"layers_1": {"mlp": {"experts": {"w1": w(e, d, f), "w3": w(e, d, f),
                                           "w2": w(e, f, d)},
                               "routed_expert_norm": {"weight": np.ones(d, np.float32)}}}}


def test_pack_expert_params_layout_and_round_trip():
  t = _tree()
  p = mx.pack_expert_params(t)
  ex = p["layers_1"]["mlp"]["experts"]
  assert ex["w1"][mx.PACKED].shape == (4, 96, 32) and ex["w1"][mx.PACKED].dtype == np.uint8
  assert ex["w1"][mx.SCALE].shape == (4, 96, 2) and ex["w1"][mx.SCALE].dtype == np.uint8
  assert ex["w2"][mx.PACKED].shape == (4, 64, 48) and ex["w2"][mx.SCALE].shape == (4, 64, 3)
  assert (ex["w1"][mx.PACKED].shape, ex["w1"][mx.SCALE].shape) == mx.packed_expert_shapes(4, 64, 96)
  # Non-expert leaves untouched.
  assert p["layers_1"]["mlp"]["routed_expert_norm"]["weight"] is t["layers_1"]["mlp"][
      "routed_expert_norm"]["weight"]
  u = mx.unpack_expert_params(p)
  for n in mx.EXPERT_MATRICES:
    want = np.swapaxes(mx.mx_round(np.swapaxes(t["layers_1"]["mlp"]["experts"][n], -1, -2)),
                       -1, -2)
    np.testing.assert_array_equal(u["layers_1"]["mlp"]["experts"][n], want)
  # Re-packing the dequantised tree gives the same bytes (MXFP4 values are fixed points).
  p2 = mx.pack_expert_params(u)
  for n in mx.EXPERT_MATRICES:
    for k in (mx.PACKED, mx.SCALE):
      np.testing.assert_array_equal(p2["layers_1"]["mlp"]["experts"][n][k], ex[n][k])
  with pytest.raises(ValueError, match="already packed"):
    mx.pack_expert_params(p)
  with pytest.raises(ValueError, match="experts/w1: expected"):
    mx.unpack_expert_params(t)


def test_jax_and_numpy_pack_identical_bytes():
  t = _tree(seed=1, groups=2)
  pn = mx.pack_expert_params(t)
  pj = jax.jit(mx.pack_expert_params)(jax.tree.map(jnp.asarray, t))
  for n in mx.EXPERT_MATRICES:
    for k in (mx.PACKED, mx.SCALE):
      np.testing.assert_array_equal(np.asarray(pj["layers_1"]["mlp"]["experts"][n][k]),
                                    pn["layers_1"]["mlp"]["experts"][n][k])


def test_bytes_equal_what_the_exporter_writes():
  """Per expert, pack_expert == convert.names.from_ours (the export path) byte for byte, and
  the stacked release tensors are the packed leaves; the importer decodes them to unpack_expert."""
  c = preset("tiny")
  leaves = [l for l in N.leaves(c, "kimi_k3", "mxfp4") if l.mx]
  assert leaves, "tiny k3 export has MXFP4 expert leaves"
  rng = np.random.default_rng(2)
  for leaf in leaves[:6]:
    w = (rng.normal(size=leaf.shape) * 0.02).astype(np.float32)   # [..., E, in, out]
    packed, scale = mx.pack_expert(w)
    for slot in leaf.slots:
      rp, rs = N.from_ours(leaf, slot, w[slot.index], np.float32)
      np.testing.assert_array_equal(packed[slot.index], rp)
      np.testing.assert_array_equal(scale[slot.index], rs)
      np.testing.assert_array_equal(
          N.to_ours(leaf, [rp, rs]), mx.unpack_expert(packed[slot.index], scale[slot.index]))
    # Stacking one layer's release tensors gives the leaf slice back, unchanged.
    lead = leaf.slots[0].index[:-1]
    layer = [s for s in leaf.slots if s.index[:-1] == lead]
    pieces = [N.from_ours(leaf, s, w[s.index], np.float32) for s in layer]
    sp, ss = mx.stack_release_experts([p for p, _ in pieces], [s for _, s in pieces])
    np.testing.assert_array_equal(sp, packed[lead])
    np.testing.assert_array_equal(ss, scale[lead])
    back_p, back_s = mx.split_release_experts(sp, ss)
    for (p, s), bp, bs in zip(pieces, back_p, back_s):
      np.testing.assert_array_equal(bp, p)
      np.testing.assert_array_equal(bs, s)


def test_stack_release_experts_errors():
  p = [np.zeros((8, 32), np.uint8)] * 2
  s = [np.zeros((8, 2), np.uint8)] * 2
  assert mx.stack_release_experts(p, s)[0].shape == (2, 8, 32)
  with pytest.raises(ValueError, match=r"scales\[1\]: expected uint8 \(8, 2\)"):
    mx.stack_release_experts(p, [s[0], np.zeros((8, 3), np.uint8)])
  with pytest.raises(ValueError, match=r"packed\[0\]: expected uint8"):
    mx.stack_release_experts([p[0].astype(np.int8), p[1]], s)
  with pytest.raises(ValueError, match="same positive number"):
    mx.stack_release_experts(p, s[:1])
  with pytest.raises(ValueError, match="in_dim"):
    mx.packed_expert_shapes(2, 48, 32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fast_unpack_bit_identical_for_every_byte_and_scale(dtype):
  """Every packed byte (two codes) under every scale byte, incl. 0 (2^-127) and 255 (NaN):
  the same bits as the reference codec, the subnormal float32 results (scale bytes 0 and 1)
  included: the scale is applied by integer operations on the bits, which XLA does not flush
  (docs/notes/qat.md)."""
  packed = np.broadcast_to(np.arange(256, dtype=np.uint8), (256, 256))
  packed = np.ascontiguousarray(packed.reshape(256, 16, 16)).reshape(256, 256)   # [256, 256]
  scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 256 * 2 // 32, axis=1)
  want = mx.mxfp4_unpack(packed, scales, np.float32)
  tiny = (np.abs(want) < 2.0 ** -126) & (want != 0)
  assert tiny[:2].any() and not tiny[2:].any()    # subnormals: from scale bytes 0 and 1 only
  want = want.astype(dtype)
  got = np.asarray(jax.jit(lambda p, s: mx.mxfp4_unpack_fast(p, s, dtype))(packed, scales))
  np.testing.assert_array_equal(got.view(np.uint16 if dtype == jnp.bfloat16 else np.uint32),
                                np.asarray(want).view(np.uint16 if dtype == jnp.bfloat16
                                                      else np.uint32))
