"""Quantisation-aware training (QAT) of the routed experts: MXFP4 weights, MXFP8 inputs.

Spec §13: from SFT on, every routed expert matmul runs on MXFP4 weights and MXFP8 input
activations in the forward pass, with straight-through gradients, and rollout/generation use
the same quantiser. `ModelConfig.modes.expert_qat = "mxfp4_mxfp8"` turns it on (docs/notes/qat.md).

The quantiser is `k3jax.quant.mx` — the codec the exporter (`tools/export_to_pytorch
--expert_format mxfp4`, k3jax/convert/names.py `from_ours`) and the packed experts
(`expert_format="mxfp4"`, `ops.moe.MXFP4Weight`) use — never a second rounding rule:

  weights  fake_mxfp4_expert(w) = unpack_expert(pack_expert(w)): the exporter's codes decoded
           by the served path's decoder, so a QAT model and its packed export compute with
           bit-identical expert weights;
  inputs   fake_mxfp8(x) = mx_round(x, "mxfp8") = mxfp8_unpack(mxfp8_pack(x)) along the last
           axis (32-value blocks, one E8M0 scale each, E4M3 elements).
Both are computed by `mx.fake_round`: the encoder's scale and rounding, multiplied back
without building codes (the same values, about 2× cheaper than packing and unpacking;
tests/quant/test_mx.py and test_qat.py hold it to the codec and to ml_dtypes).

Straight-through estimator (STE): forward q(x), backward identity,

  y = q(x),   ∂L/∂x := ∂L/∂y,

so the gradient of a QAT network is the gradient of the unquantised network evaluated at the
quantised point (weights and inputs replaced by their quantised values). It is a
`jax.custom_jvp` whose tangent is the input tangent (linear, so reverse mode transposes it to
the identity), not `x + stop_gradient(q(x) − x)`, whose forward value is q(x) only up to the
rounding of that sum. The STE is not clipped: MX scales follow each block's maximum, so the
only saturation is of values within one rounding step of it (E2M1 6 … 8 → 6), where the
identity is the usual choice.
"""

from __future__ import annotations

import functools

import jax

from k3jax.quant import mx

Array = jax.Array

EXPERT_QAT_MODES = ("mxfp4_mxfp8",)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def straight_through(quantize, x: Array) -> Array:
  """quantize(x) forward, identity backward (the STE). `quantize` must keep shape and dtype."""
  return quantize(x)


@straight_through.defjvp
def _straight_through_jvp(quantize, primals, tangents):
  (x,), (dx,) = primals, tangents
  return quantize(x), dx


def _mxfp4_expert_round(w: Array) -> Array:
  """MXFP4 values of an expert kernel [..., in, out] (blocks along `in`), in w.dtype."""
  return mx.fake_round(w, "mxfp4", axis=-2)


def _mxfp8_round(x: Array) -> Array:
  """MXFP8 (E4M3) values of x along its last axis, in x.dtype (computed in float32)."""
  return mx.fake_round(x, "mxfp8")


def fake_mxfp4_expert(w: Array) -> Array:
  """Fake-quantised expert kernel: w [..., in, out] float → its MXFP4 values (32-value blocks
  along the input axis, E8M0 scales; exactly the exporter's codes), same shape and dtype,
  straight-through gradient. `in` must be a multiple of 32."""
  if w.ndim < 2 or w.shape[-2] % mx.BLOCK:
    raise ValueError(f"w: expected an expert kernel [..., in, out] with in a multiple of "
                     f"{mx.BLOCK}, found shape {tuple(w.shape)}")
  return straight_through(_mxfp4_expert_round, w)


def fake_mxfp8(x: Array) -> Array:
  """Fake-quantised activations: x [..., n] → its MXFP8 values (E4M3, 32-value blocks along the
  last axis, E8M0 scales), same shape and dtype, straight-through gradient."""
  if x.ndim < 1 or x.shape[-1] % mx.BLOCK:
    raise ValueError(f"x: MXFP8 blocks need a last axis that is a multiple of {mx.BLOCK}, "
                     f"found shape {tuple(x.shape)}")
  return straight_through(_mxfp8_round, x)


def check_mode(mode: str | None, name: str = "expert_qat") -> None:
  """ValueError naming `name` unless mode is None or one of `EXPERT_QAT_MODES`."""
  if mode is not None and mode not in EXPERT_QAT_MODES:
    raise ValueError(f"{name}: expected None or one of {EXPERT_QAT_MODES}, found {mode!r}")


def input_format(mode: str | None) -> str | None:
  """The `input_quant` of `ops.moe.expert_mlp` for a QAT mode: "mxfp8" (`fake_mxfp8`), or None."""
  check_mode(mode)
  return None if mode is None else "mxfp8"


def weight_quantizer(mode: str | None):
  """The fake quantiser of float expert kernels [..., in, out] for a QAT mode (None: none)."""
  check_mode(mode)
  return None if mode is None else fake_mxfp4_expert


__all__ = ["EXPERT_QAT_MODES", "straight_through", "fake_mxfp4_expert", "fake_mxfp8",
           "check_mode", "input_format", "weight_quantizer"]
