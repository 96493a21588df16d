"""Bias-free projections with logical-axis annotations, shared by every layer.

`linear(...)` is flax's DenseGeneral with the project's conventions: master kernel in
`config.param_dtype` (fp32 by default) annotated with logical axis names (docs/contracts.md),
compute in `config.dtype`, no bias.
Kernel shape = (input axes…, features…), e.g. q_proj [d,H,K], o_proj [H,V,d].
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

from k3jax.config import dtype_of

default_kernel_init = nn.initializers.lecun_normal()


def linear(config, features, names: Sequence[str], *, axis=-1, name: str,
           kernel_init=default_kernel_init) -> nn.DenseGeneral:
  """A DenseGeneral mapping `axis` of the input to `features` (int or tuple).

  `names` are the logical axes of the whole kernel: input axes first, then output axes.
  """
  return nn.DenseGeneral(
      features=features, axis=axis, use_bias=False, name=name,
      dtype=dtype_of(config.dtype), param_dtype=dtype_of(config.param_dtype),
      kernel_init=nn.with_logical_partitioning(kernel_init, tuple(names)))


def param(module: nn.Module, name: str, init, shape, names: Sequence[str],
          dtype=jnp.float32):
  """A logically-partitioned parameter owned by `module`: fp32 for vectors, norms, convs and
  the router (A_log, dt_bias …); the expert weights pass `config.param_dtype`."""
  return module.param(name, nn.with_logical_partitioning(init, tuple(names)), shape, dtype)


__all__ = ["linear", "param", "default_kernel_init"]
