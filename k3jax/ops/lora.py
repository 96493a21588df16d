"""Low-rank adapters (LoRA): the math, no parameters.

A projection with kernel W [in…, out…] (DenseGeneral layout: the contracted input axes first,
then the output axes) and an adapter A [in…, r], B [r, out…] computes

    y = x·W + s·(x·A)·B,        s = alpha / r,

so the adapted model is the base model exactly while B = 0 (B's initialisation), and folding
the adapter into the base is W' = W + s·A·B (`merge`). The factored form never builds the
[in, out] update: x·A is [..., r].

Routed experts carry one adapter per expert: A [E, in, r], B [E, r, out] beside the expert
kernel [E, in, out] (an array, or an `ops.moe.MXFP4Weight` — QLoRA: the base stays packed and
is dequantised a chunk at a time inside the expert matmul, k3jax/ops/moe.py). `LoRAExperts`
carries the three together through the expert op, with s already folded into B.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


def _check(kernel_shape, a, b, n_in: int, where: str):
  if a.ndim != n_in + 1 or tuple(a.shape[:n_in]) != tuple(kernel_shape[:n_in]):
    raise ValueError(f"{where}: lora A must be [in…={tuple(kernel_shape[:n_in])}, r], found "
                     f"shape {tuple(a.shape)}")
  r = a.shape[-1]
  if b.shape != (r, *kernel_shape[n_in:]):
    raise ValueError(f"{where}: lora B must be [r={r}, out…={tuple(kernel_shape[n_in:])}], "
                     f"found shape {tuple(b.shape)}")


def lora_delta(x: Array, a: Array, b: Array, scale: float, n_in: int = 1) -> Array:
  """s·(x·A)·B for x [..., in…] (its last `n_in` axes contracted with A's first n_in),
  A [in…, r], B [r, out…] → [..., out…], in x's dtype (A and B are cast to it)."""
  if x.shape[x.ndim - n_in:] != a.shape[:n_in]:
    raise ValueError(f"lora_delta: x's last {n_in} axes {x.shape[x.ndim - n_in:]} must match "
                     f"A's input axes {a.shape[:n_in]}")
  dt = x.dtype
  xa = jax.lax.dot_general(x, a.astype(dt), ((tuple(range(x.ndim - n_in, x.ndim)),
                                              tuple(range(n_in))), ((), ())))
  return scale * jax.lax.dot_general(xa, b.astype(dt), (((xa.ndim - 1,), (0,)), ((), ())))


def lora_dense(x: Array, kernel: Array, a: Array, b: Array, scale: float,
               n_in: int = 1) -> Array:
  """x·W + s·(x·A)·B: x [..., in…], kernel [in…, out…], A [in…, r], B [r, out…] →
  [..., out…] in x's dtype (W cast to it, like flax's DenseGeneral)."""
  _check(kernel.shape, a, b, n_in, "lora_dense")
  y = jax.lax.dot_general(x, kernel.astype(x.dtype),
                          ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ())))
  return y + lora_delta(x, a, b, scale, n_in)


def merge(kernel: Array, a: Array, b: Array, scale: float, n_in: int = 1) -> Array:
  """The adapted kernel W + s·A·B, computed in fp32 (highest precision), in the kernel's dtype.

  kernel [batch…, in…, out…], A [batch…, in…, r], B [batch…, r, out…]: `n_in` input axes;
  leading axes of A beyond them (experts, a scanned layer axis) are batch axes shared by all
  three."""
  nb = a.ndim - n_in - 1
  if nb < 0 or kernel.shape[:nb + n_in] != a.shape[:nb + n_in] or (
      b.shape != (*a.shape[:nb], a.shape[-1], *kernel.shape[nb + n_in:])):
    raise ValueError(f"merge: kernel {tuple(kernel.shape)}, A {tuple(a.shape)} and B "
                     f"{tuple(b.shape)} do not form [batch…, in…, out…] = [batch…, in…, r]"
                     f"·[batch…, r, out…] with {n_in} input axes")
  batch = tuple(range(nb))
  ab = jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32),
                           (((a.ndim - 1,), (nb,)), (batch, batch)),
                           precision=jax.lax.Precision.HIGHEST)
  return (kernel.astype(jnp.float32) + scale * ab).astype(kernel.dtype)


class LoRAExperts(NamedTuple):
  """Routed expert weights with per-expert adapters, as one argument of the expert op.

  base: [E, in, out] array or `ops.moe.MXFP4Weight` (kept packed: QLoRA);
  a: [E, in, r]; b: [E, r, out], the scale s already folded in (b = s·B).
  A pytree (NamedTuple): it slices, scans and shards along the expert axis like its leaves.
  """
  base: Any
  a: Array
  b: Array

  @property
  def shape(self) -> tuple[int, ...]:
    """The base kernel's logical shape (E, in, out)."""
    return tuple(self.base.shape)


def is_lora(w) -> bool:
  return isinstance(w, LoRAExperts)


def expert_einsum(spec: str, x: Array, w) -> Array:
  """einsum(spec, x, W) for an expert weight W, plus its adapter's ((x·A)·B with the same
  spec) when `w` is a `LoRAExperts` with a dense base. spec contracts x's last axis with the
  weight's `in` axis, e.g. "ecd,edf->ecf"."""
  if not is_lora(w):
    return jnp.einsum(spec, x, w)
  y = jnp.einsum(spec, x, w.base)
  return y + jnp.einsum(spec, jnp.einsum(spec, x, w.a), w.b)


def merge_experts(w: LoRAExperts) -> Array:
  """W + A·b per expert ([E, in, out], the base's dtype): the dense base must be an array
  (dequantise an MXFP4 base first)."""
  if not hasattr(w.base, "astype"):
    raise ValueError(f"merge_experts: base must be an array, found {type(w.base).__name__}")
  return merge(w.base, w.a, w.b, 1.0, n_in=1)


__all__ = ["lora_delta", "lora_dense", "merge", "LoRAExperts", "is_lora", "expert_einsum",
           "merge_experts"]
