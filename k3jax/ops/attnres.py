"""Block Attention Residuals: the depth mixer (docs/k3.md §5), as pure jnp math.

A mixer looks at a list of S sources V_i (finished blocks plus the running partial sum) and
returns Σ_i softmax_i(w · RMSNorm(V_i)) · V_i: a softmax over *depth*, per token, with a learned
pseudo-query w ∈ R^d. No 1/√d scale; the logits, softmax and the weighted sum are fp32; the
values are the raw (un-normalised) sources.

For decoding, the mix over finished blocks can be computed once per block and combined with
the in-block partial later: `attn_res_partial` returns the online-softmax triple
(max logit, Σ exp(logit − max), Σ exp(logit − max)·V) and `attn_res_merge` combines two such
triples exactly; `attn_res_finalize` turns a triple into the mix.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp


class MixPartial(NamedTuple):
  """Online-softmax state of a partial mix. Shapes: max/sum [...], acc [..., d] (fp32)."""
  max: jnp.ndarray
  sum: jnp.ndarray
  acc: jnp.ndarray


def _check(sources, query, norm_weight, valid):
  if sources.ndim < 2:
    raise ValueError(f"attn_res: sources must be [S, ..., d], found shape {sources.shape}")
  d = sources.shape[-1]
  if query.shape != (d,):
    raise ValueError(f"attn_res: query must be [d]=[{d}], found {query.shape}")
  if norm_weight.shape != (d,):
    raise ValueError(f"attn_res: norm_weight must be [d]=[{d}], found {norm_weight.shape}")
  if valid is not None and valid.shape != sources.shape[:1]:
    raise ValueError(f"attn_res: valid must be [S]=[{sources.shape[0]}], found {valid.shape}")


def attn_res_logits(sources, query, norm_weight, eps: float = 1e-5, valid=None):
  """Depth logits w · RMSNorm(V_i), fp32, [S, ...]; invalid slots get -inf."""
  _check(sources, query, norm_weight, valid)
  v = sources.astype(jnp.float32)
  normed = v * jnp.reciprocal(jnp.sqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps))
  logits = jnp.einsum("s...d,d->s...", normed * norm_weight.astype(jnp.float32),
                      query.astype(jnp.float32))
  if valid is not None:
    mask = valid.reshape(valid.shape + (1,) * (logits.ndim - 1))
    logits = jnp.where(mask, logits, -jnp.inf)
  return logits


def attn_res_partial(sources, query, norm_weight, eps: float = 1e-5, valid=None) -> MixPartial:
  """Online-softmax triple of the mix over `sources` [S, ..., d] (all-invalid ⇒ max=-inf, sum=0)."""
  logits = attn_res_logits(sources, query, norm_weight, eps, valid)
  m = jnp.max(logits, axis=0)
  safe_m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(logits - safe_m)  # exp(-inf) = 0 for invalid slots
  acc = jnp.einsum("s...,s...d->...d", p, sources.astype(jnp.float32))
  return MixPartial(m, jnp.sum(p, axis=0), acc)


def attn_res_merge(a: MixPartial, b: MixPartial) -> MixPartial:
  """Exact combination of two partial mixes over disjoint source sets."""
  m = jnp.maximum(a.max, b.max)
  safe_m = jnp.where(jnp.isfinite(m), m, 0.0)
  # A side with max = -inf holds no source: its factor must be 0, not exp(nan).
  fa = jnp.where(jnp.isfinite(a.max), jnp.exp(a.max - safe_m), 0.0)
  fb = jnp.where(jnp.isfinite(b.max), jnp.exp(b.max - safe_m), 0.0)
  return MixPartial(m, a.sum * fa + b.sum * fb, a.acc * fa[..., None] + b.acc * fb[..., None])


def attn_res_finalize(p: MixPartial) -> jnp.ndarray:
  """The mix Σ softmax · V from a triple, fp32 [..., d]."""
  return p.acc / p.sum[..., None]


def attn_res_mix(sources, query, norm_weight, eps: float = 1e-5, valid=None):
  """Depth mixer: sources [S, ..., d] → Σ_i softmax_i(w·RMSNorm(V_i)) V_i, fp32 [..., d].

  `valid` [S] bool masks unused slots of a fixed-size buffer (at least one must be valid).
  A zero `query` gives the uniform mean of the valid sources.
  """
  return attn_res_finalize(attn_res_partial(sources, query, norm_weight, eps, valid))


def attn_res_source_counts(num_layers: int, block_size: int | None) -> dict:
  """Number of sources each mixer sees under docs/k3.md §5's schedule (pure python).

  Returns {"attn": [per layer], "mlp": [per layer], "output": n}; 0 means the mixer is
  skipped (the layer-0 attention mixer, while `blocks` is empty). With plain residuals
  (block_size None) every count is 0. K3 (93 layers, block 12): output = 9.
  """
  if block_size is None:
    return {"attn": [0] * num_layers, "mlp": [0] * num_layers, "output": 0}
  blocks, attn, mlp = 0, [], []
  for i in range(num_layers):
    attn.append(blocks + 1 if blocks else 0)
    if i % block_size == 0:
      blocks += 1
    mlp.append(blocks + 1)
  return {"attn": attn, "mlp": mlp, "output": blocks + 1}


def blocks_before(i, block_size: int):
  """Finished blocks before layer i's append step: #multiples of block_size in [0, i).

  Works for python ints and traced int arrays (the scanned body's layer index).
  """
  return (i + block_size - 1) // block_size


__all__ = ["MixPartial", "attn_res_logits", "attn_res_partial", "attn_res_merge",
           "attn_res_finalize", "attn_res_mix", "attn_res_source_counts", "blocks_before"]
