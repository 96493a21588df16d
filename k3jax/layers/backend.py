"""The one place a compute kernel is chosen from `ModelConfig.modes.kernel_backend`.

Layers never branch on the backend themselves: they ask this module for the function.
"xla" is the pure-jnp path in `k3jax.ops` (runs everywhere, the reference semantics);
"pallas" the kernels in `pallas_kernels` (interpreted on CPU); "auto" picks per platform the
fastest path measured correct there (`AUTO`; the measurements: docs/notes/pallas_kda.md,
"Which path carries which platform").

`kernels(config)` resolves the config's backend once (cached) into a `Kernels` record of plain
functions. The `*_fn` helpers below are what layers call: they take the record's function and,
when the active mesh has a context or expert axis, wrap it in its parallel form — decided at
trace time, because that is when the mesh is known. The ops never import a kernel; they take
it as an argument (`ops.moe.expert_mlp(gmm=...)`), and so does the expert-parallel path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax

from k3jax.ops.kda import kda_chunked
from k3jax.ops.mla import mla_attention
from k3jax.ops.moe import expert_mlp
from k3jax.parallel.context import (maybe_context_parallel, maybe_context_parallel_attention,
                                    maybe_context_parallel_conv,
                                    maybe_context_parallel_latent_attention)
from k3jax.parallel.expert import maybe_expert_parallel
from pallas_kernels.kda_chunk import kda_chunked_pallas
from pallas_kernels.moe_gmm import gmm as pallas_gmm


# What "auto" runs on each platform, and why (docs/notes/pallas_kda.md has the figures):
#   cpu: XLA — Pallas runs interpreted there, a correctness vehicle (bench_kda 1024x4x64,
#        2026-11-29: forward 2.3x slower; fwd+bwd 1.4x faster, on a loaded machine).
#   gpu: XLA — the one H200 run (2026-11-30) measured XLA's kda_chunked correct; the Pallas
#        kernels failed to compile there (shared memory) and their resized forms have not run
#        on a GPU since. Switch when `experiments/gpu_check.sh` shows them correct and faster.
#   tpu: Pallas — the Mosaic kernels lower for TPU (export tests) and hold one fp32 state per
#        chunk as the backward's residual (12 MiB vs XLA's 194 MiB fwd+bwd at 1024x4x64);
#        speed on a TPU not measured.
AUTO = {"cpu": "xla", "gpu": "xla", "tpu": "pallas"}


def resolve(backend: str) -> str:
  """"xla" | "pallas" for a `kernel_backend` value; the one place "auto" is decided (`AUTO`)."""
  if backend == "auto":
    platform = jax.default_backend()
    return AUTO.get("gpu" if platform in ("cuda", "rocm") else platform, "xla")
  if backend not in ("xla", "pallas"):
    raise ValueError(f"kernel_backend: expected 'xla', 'pallas' or 'auto', found {backend!r}")
  return backend


@dataclasses.dataclass(frozen=True)
class Kernels:
  """The kernel functions one (kernel_backend, kda_lower_bound) resolves to.

  backend: "xla" | "pallas", with "auto" resolved.
  kda_chunked: `kda_chunked(q, k, v, g, beta, *, scale, initial_state, chunk_size,
    segment_ids=None)` → (o, final state): the Pallas kernel on "pallas", else the XLA op
    (both told the gate's bound, None for an unbounded gate; both take packed documents'
    segment ids).
  gmm: the grouped matmul the routed experts run through (`ops.moe.GroupedMatmul`):
    `pallas_kernels.moe_gmm.gmm` on "pallas"; None on "xla" (the sorted dense-einsum path,
    the fastest XLA one on CPU).
  expert_mlp: `ops.moe.expert_mlp` with `gmm` bound (signature less `gmm`).
  """
  backend: str
  kda_chunked: Callable
  gmm: Callable | None
  expert_mlp: Callable


@functools.cache
def _kernels(name: str, kda_lower_bound: float | None) -> Kernels:
  """The record of a resolved backend name ("xla" | "pallas")."""
  # The bound lets the XLA op pick its dense diagonal-tile form at trace time (no cond).
  kda, gmm = functools.partial(kda_chunked, lower_bound=kda_lower_bound), None
  if name == "pallas":
    gmm = pallas_gmm
    # A bounded gate (K3, docs/k3.md §3) takes the kernel's fast diagonal tiles; an unbounded one
    # (Kimi Linear, lower_bound None) its pair-by-pair form.
    kda = functools.partial(kda_chunked_pallas, lower_bound=kda_lower_bound)
  mlp = expert_mlp if gmm is None else functools.partial(expert_mlp, gmm=gmm)
  return Kernels(backend=name, kda_chunked=kda, gmm=gmm, expert_mlp=mlp)


def kernels(config) -> Kernels:
  """The `Kernels` of a `ModelConfig` (its `kernel_backend` and `kda_lower_bound`); cached, so
  every layer of a model shares one record (and "auto" the record of what it resolves to)."""
  return _kernels(resolve(config.modes.kernel_backend), config.text.kda_lower_bound)


def kda_chunked_fn(backend: str, *, lower_bound: float | None = None):
  """`kda_chunked(q, k, v, g, beta, *, scale, initial_state, chunk_size, segment_ids=None)`
  for a backend: `Kernels.kda_chunked`.

  Under `k3jax.sharding.activate(mesh)` with context > 1 the function runs context-parallel
  (k3jax/parallel/context.py); otherwise it is the op itself.
  """
  ks = _kernels(resolve(backend), lower_bound)
  return maybe_context_parallel(ks.kda_chunked)


def expert_mlp_fn(config):
  """`kernels(config).expert_mlp` (`ops.moe.expert_mlp` less `gmm`), or — under
  `k3jax.sharding.activate(mesh)` with expert > 1 — its expert-parallel form (all_to_all
  dispatch, k3jax/parallel/expert.py) running the same grouped matmul, same signature.

  `expert_format="mxfp4"`: on "pallas" the Pallas gmm, which dequantises the packed experts
  tile by tile inside its kernel; on "xla" the sorted path (`ops.moe.expert_mlp` with
  gmm=None), which dequantises them a chunk at a time inside the computation. Adapted experts
  (LoRA target "experts") take the sorted path on every backend."""
  # Per-expert LoRA adapters take the same sorted path: their rank-wide grouped matmuls are
  # below the kernels' tile widths.
  lora_experts = config.lora_on("experts")
  ks = kernels(config)
  if lora_experts:
    return maybe_expert_parallel(expert_mlp, gmm=None)
  return maybe_expert_parallel(ks.expert_mlp, gmm=ks.gmm)


def short_conv_fn(conv_fn):
  """The KDA short convolution `conv_fn(x, kernel, segment_ids=None)` as given, or — under
  `k3jax.sharding.activate(mesh)` with context > 1 — its context-parallel form (each shard
  receives the W−1 boundary tokens of the previous one), same signature."""
  return maybe_context_parallel_conv(conv_fn)


def mla_attention_fn():
  """`k3jax.ops.mla.mla_attention` (→ (o, max_logit)), or — under `k3jax.sharding.activate(mesh)`
  with context > 1 — its context-parallel form (keys/values all-gathered over `context`, global
  causal mask, max logit reduced over all shards), same signature."""
  return maybe_context_parallel_attention(mla_attention)


def mla_latent_attention_fn():
  """`k3jax.ops.mla_blockwise.mla_latent_attention` (attention from the latents in key
  blocks), or — under a mesh with context > 1 — its context-parallel form (the latents
  all-gathered over `context`), same signature."""
  return maybe_context_parallel_latent_attention()


__all__ = ["Kernels", "kernels", "resolve", "kda_chunked_fn", "expert_mlp_fn", "short_conv_fn",
           "mla_attention_fn", "mla_latent_attention_fn"]
