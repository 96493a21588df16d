"""Bias-free projections with logical-axis annotations, shared by every layer.

`linear(...)` is flax's DenseGeneral with the project's conventions: master kernel in
`config.modes.param_dtype` (fp32 by default) annotated with logical axis names (docs/contracts.md),
compute in `config.modes.dtype`, no bias.
Kernel shape = (input axes…, features…), e.g. q_proj [d,H,K], o_proj [H,V,d].

LoRA (docs/notes/lora.md): `linear(..., target=...)` names the projection's LoRA target
(`config.LORA_TARGETS`); when the config adapts it (`config.lora_on`), the module is a
`LoRALinear`: the same `kernel` param plus `lora_a` [in…, r] and `lora_b` [r, out…] in the
collection "lora", with the kernel's logical axes on their in/out axes (sharded like the base)
and "lora_rank" on r.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import dtype_of
from k3jax.ops import lora as lora_ops

default_kernel_init = nn.initializers.lecun_normal()
LORA = "lora"                 # the adapters' Flax collection
LORA_RANK_AXIS = "lora_rank"  # logical axis of the adapters' rank dimension


def lora_variables(module: nn.Module, in_shape, out_shape, in_names, out_names, rank: int,
                   *, prefix: str = "", batch_shape=(), batch_names=()):
  """(A [batch…, in…, r], B [batch…, r, out…]) fp32 variables of `module` in the "lora"
  collection, named `{prefix}lora_a` / `{prefix}lora_b`, with the base kernel's logical axes
  (so they shard like it) and "lora_rank" on r. A ~ N(0, 1/fan_in) (fan_in = Π in), B = 0:
  the adapted model starts as the base model. `batch_shape`: leading axes of one adapter per
  slice (the experts)."""
  fan_in = int(np.prod(in_shape))
  bs, bn = tuple(batch_shape), tuple(batch_names)

  def a_init(key, shape, dtype):
    return jax.random.normal(key, shape, dtype) * fan_in ** -0.5

  def var(name, init, shape, names):
    boxed = nn.with_logical_partitioning(init, names)
    # A lambda: the rng is drawn only when the variable is created (init), not in apply.
    return module.variable(LORA, prefix + name,
                           lambda: boxed(module.make_rng("params"), shape, jnp.float32)).value

  a = var("lora_a", a_init, (*bs, *in_shape, rank), (*bn, *in_names, LORA_RANK_AXIS))
  b = var("lora_b", nn.initializers.zeros, (*bs, rank, *out_shape),
          (*bn, LORA_RANK_AXIS, *out_names))
  return a, b


class LoRALinear(nn.DenseGeneral):
  """DenseGeneral (same `kernel` param) + a LoRA adapter: y = x·W + s·(x·A)·B
  (k3jax/ops/lora.py), A/B in the "lora" collection. `names`: the kernel's logical axes."""
  names: tuple = ()
  lora_rank: int = 1
  lora_scale: float = 1.0

  @nn.compact
  def __call__(self, x):
    y = super().__call__(x)
    n_in = len(self.axis) if isinstance(self.axis, tuple) else 1
    feats = self.features if isinstance(self.features, tuple) else (self.features,)
    in_shape = x.shape[x.ndim - n_in:]
    a, b = lora_variables(self, in_shape, feats, self.names[:n_in], self.names[n_in:],
                          self.lora_rank)
    return y + lora_ops.lora_delta(x.astype(self.dtype), a, b, self.lora_scale, n_in)

  def effective_kernel(self):
    """W + s·A·B (the kernel the adapted projection applies), in the kernel's dtype."""
    v = self.variables
    n_in = len(self.axis) if isinstance(self.axis, tuple) else 1
    return lora_ops.merge(nn.meta.unbox(v["params"]["kernel"]), nn.meta.unbox(v[LORA]["lora_a"]),
                          nn.meta.unbox(v[LORA]["lora_b"]), self.lora_scale, n_in)


def effective_kernel(module: nn.Module):
  """The kernel a (bound) `linear` module applies: its `kernel`, plus s·A·B when adapted."""
  if isinstance(module, LoRALinear):
    return module.effective_kernel()
  return nn.meta.unbox(module.variables["params"]["kernel"])


def linear(config, features, names: Sequence[str], *, axis=-1, name: str,
           kernel_init=default_kernel_init, target: str | tuple[str, ...] | None = None
           ) -> nn.DenseGeneral:
  """A DenseGeneral mapping `axis` of the input to `features` (int or tuple).

  `names` are the logical axes of the whole kernel: input axes first, then output axes.
  `target`: the projection's LoRA target name(s) (`config.LORA_TARGETS`; adapted when the
  config adapts any of them), or None for projections that never carry adapters.
  """
  kw = dict(features=features, axis=axis, use_bias=False, name=name,
            dtype=dtype_of(config.modes.dtype), param_dtype=dtype_of(config.modes.param_dtype),
            kernel_init=nn.with_logical_partitioning(kernel_init, tuple(names)))
  targets = (target,) if isinstance(target, str) else tuple(target or ())
  if any(config.lora_on(t) for t in targets):
    return LoRALinear(**kw, names=tuple(names), lora_rank=config.modes.lora_rank,
                      lora_scale=config.lora_scale)
  return nn.DenseGeneral(**kw)


def param(module: nn.Module, name: str, init, shape, names: Sequence[str],
          dtype=jnp.float32):
  """A logically-partitioned parameter owned by `module`: fp32 for vectors, norms, convs and
  the router (A_log, dt_bias …); the expert weights pass `config.modes.param_dtype`."""
  return module.param(name, nn.with_logical_partitioning(init, tuple(names)), shape, dtype)


__all__ = ["linear", "param", "default_kernel_init", "LoRALinear", "effective_kernel",
           "lora_variables", "LORA", "LORA_RANK_AXIS"]
