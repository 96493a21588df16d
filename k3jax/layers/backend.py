"""The one place a compute kernel is chosen from `ModelConfig.kernel_backend`.

Layers never branch on the backend themselves: they ask this module for the function.
"xla" is the pure-jnp path in `k3jax.ops` (runs everywhere, the reference semantics);
"pallas" the kernels in `pallas_kernels` (interpreted on CPU); "auto" picks Pallas on GPU/TPU
and XLA on CPU.
"""

from __future__ import annotations

import jax


def resolve(backend: str) -> str:
  if backend == "auto":
    return "xla" if jax.default_backend() == "cpu" else "pallas"
  if backend not in ("xla", "pallas"):
    raise ValueError(f"kernel_backend: expected 'xla', 'pallas' or 'auto', found {backend!r}")
  return backend


def kda_chunked_fn(backend: str):
  """`kda_chunked(q, k, v, g, beta, *, scale, initial_state, chunk_size, ...)` for a backend."""
  if resolve(backend) == "pallas":
    from pallas_kernels.kda_chunk import kda_chunked_pallas
    return kda_chunked_pallas
  from k3jax.ops.kda import kda_chunked
  return kda_chunked


def moe_method(backend: str) -> str:
  """`k3jax.ops.moe.expert_mlp` method for a backend: the Pallas grouped matmul ("gmm") on
  "pallas", the sorted dense-einsum path ("sort", fastest XLA path on CPU) on "xla"."""
  return "gmm" if resolve(backend) == "pallas" else "sort"
