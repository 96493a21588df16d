"""The one place a compute kernel is chosen from `ModelConfig.kernel_backend`.

Layers never branch on the backend themselves: they ask this module for the function.
"xla" is the pure-jnp path in `k3jax.ops` (runs everywhere, the reference semantics);
"pallas" the kernels in `pallas_kernels` (interpreted on CPU); "auto" picks Pallas on GPU/TPU
and XLA on CPU.
"""

from __future__ import annotations

import functools

import jax


def resolve(backend: str) -> str:
  if backend == "auto":
    return "xla" if jax.default_backend() == "cpu" else "pallas"
  if backend not in ("xla", "pallas"):
    raise ValueError(f"kernel_backend: expected 'xla', 'pallas' or 'auto', found {backend!r}")
  return backend


def kda_chunked_fn(backend: str, *, lower_bound: float | None = None, packed: bool = False):
  """`kda_chunked(q, k, v, g, beta, *, scale, initial_state, chunk_size, ...)` for a backend.

  The Pallas kernel relies on a bounded decay gate (g ≥ lower_bound, spec §3) and does not
  take `segment_ids`: with an unbounded gate (Kimi Linear) or packed documents the XLA op is
  used. (`ModelConfig` already rejects kernel_backend="pallas" with an unbounded gate.)
  Under `k3jax.sharding.activate(mesh)` with context > 1 the function runs context-parallel
  (k3jax/parallel/context.py); otherwise it is the op itself.
  """
  from k3jax.parallel.context import maybe_context_parallel
  if resolve(backend) == "pallas" and lower_bound is not None and not packed:
    from pallas_kernels.kda_chunk import kda_chunked_pallas
    return maybe_context_parallel(functools.partial(kda_chunked_pallas, lower_bound=lower_bound))
  from k3jax.ops.kda import kda_chunked
  # The bound lets the op pick its dense diagonal-tile form at trace time (no cond).
  return maybe_context_parallel(functools.partial(kda_chunked, lower_bound=lower_bound))


def expert_mlp_fn():
  """`k3jax.ops.moe.expert_mlp`, or — under `k3jax.sharding.activate(mesh)` with expert > 1 —
  its expert-parallel form (all_to_all dispatch, k3jax/parallel/expert.py), same signature."""
  from k3jax.ops.moe import expert_mlp
  from k3jax.parallel.expert import maybe_expert_parallel
  return maybe_expert_parallel(expert_mlp)


def short_conv_fn(conv_fn):
  """The KDA short convolution `conv_fn(x, kernel, segment_ids=None)` as given, or — under
  `k3jax.sharding.activate(mesh)` with context > 1 — its context-parallel form (each shard
  receives the W−1 boundary tokens of the previous one), same signature."""
  from k3jax.parallel.context import maybe_context_parallel_conv
  return maybe_context_parallel_conv(conv_fn)


def mla_attention_fn():
  """`k3jax.ops.mla.mla_attention` (→ (o, max_logit)), or — under `k3jax.sharding.activate(mesh)`
  with context > 1 — its context-parallel form (keys/values all-gathered over `context`, global
  causal mask, max logit reduced over all shards), same signature."""
  from k3jax.ops.mla import mla_attention
  from k3jax.parallel.context import maybe_context_parallel_attention
  return maybe_context_parallel_attention(mla_attention)


def moe_method(backend: str) -> str:
  """`k3jax.ops.moe.expert_mlp` method for a backend: the Pallas grouped matmul ("gmm") on
  "pallas", the sorted dense-einsum path ("sort", fastest XLA path on CPU) on "xla"."""
  return "gmm" if resolve(backend) == "pallas" else "sort"
