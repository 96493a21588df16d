"""Quantile Balancing (QB) of the selection-only router bias, and the old sign rule. Spec §7.

A batch of m tokens routed top-k over n experts with bias b gives, per token i, the cutoff
α_i = the (k+1)-th largest biased score (`k3jax.ops.moe.route`). The margin of expert j for
token i is h_ij = s_ij − α_i. QB sets the new bias so that each expert would clear exactly
q = m·k/n of the batch's margins against these fixed cutoffs:

  b̂_j = −(the (q+1)-th largest of h_{:,j}),   b^(t+1) = b̂ − mean(b̂).

Rounding: when m·k/n is not an integer, q = ⌊m·k/n⌋ (so at most m·k slots are targeted in
total; the lower order statistic of the 1 − k/n quantile).

Two estimators:
  `qb_bias_exact`: a per-expert sort of the margins.
  `qb_bias_histogram`: per-expert integer histograms of margins (`margin_histogram`, summable
    across devices with one integer all-reduce), then `qb_bias_from_histogram` reads the
    quantile with linear interpolation inside the bin: error < one bin width for margins
    inside `value_range` (values outside are clipped into the edge bins).
The bias takes effect on the next step; it never changes the weight a chosen expert receives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _target(m, k: int, n: int):
  """q = ⌊m·k/n⌋ (m may be traced); the rank of the margin that is negated."""
  return (m * k) // n


def _check(scores, cutoff, k, name):
  if scores.ndim != 2:
    raise ValueError(f"{name}: scores must be [m, n], found shape {scores.shape}")
  m, n = scores.shape
  if cutoff.shape != (m,):
    raise ValueError(f"{name}: cutoff must be [m]=[{m}], found shape {cutoff.shape}")
  if not isinstance(k, int) or not 1 <= k < n:
    raise ValueError(f"{name}: k must be an int in [1, n={n}), found {k!r}")


def margins(scores: Array, cutoff: Array) -> Array:
  """h_ij = s_ij − α_i in fp32: [m, n]."""
  return scores.astype(jnp.float32) - cutoff.astype(jnp.float32)[:, None]


def qb_bias_exact(scores: Array, cutoff: Array, k: int, *, centered: bool = True) -> Array:
  """Exact QB bias [n] fp32 from scores [m, n] and cutoffs [m] (module docstring).

  With distinct margins exactly q = ⌊m·k/n⌋ margins of every expert exceed −b̂_j (uncentred).
  """
  _check(scores, cutoff, k, "qb_bias_exact")
  m, n = scores.shape
  q = _target(m, k, n)
  h_desc = -jnp.sort(-margins(scores, cutoff), axis=0)   # [m, n], largest first
  b = -h_desc[q]
  return b - jnp.mean(b) if centered else b


def margin_histogram(scores: Array, cutoff: Array, num_bins: int = 1000,
                     value_range: tuple[float, float] = (-2.0, 2.0)) -> Array:
  """Per-expert histogram of margins: int32 counts [n, num_bins] over `value_range`.

  Bin b covers [lo + b·w, lo + (b+1)·w), w = (hi − lo)/num_bins; values outside are clipped into
  the edge bins. Counts from several devices add (one integer all-reduce).
  """
  if scores.ndim != 2:
    raise ValueError(f"margin_histogram: scores must be [m, n], found shape {scores.shape}")
  if cutoff.shape != (scores.shape[0],):
    raise ValueError(f"margin_histogram: cutoff must be [m]=[{scores.shape[0]}], "
                     f"found shape {cutoff.shape}")
  lo, hi = value_range
  if not hi > lo or num_bins < 1:
    raise ValueError(f"margin_histogram: need value_range lo < hi and num_bins ≥ 1, found "
                     f"{value_range} and {num_bins}")
  h = margins(scores, cutoff)
  b = jnp.floor((h - lo) * (num_bins / (hi - lo))).astype(jnp.int32)
  b = jnp.clip(b, 0, num_bins - 1)                       # [m, n]
  n = scores.shape[1]
  expert = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), b.shape)
  return jnp.zeros((n, num_bins), jnp.int32).at[expert, b].add(1)


def qb_bias_from_histogram(counts: Array, k: int,
                           value_range: tuple[float, float] = (-2.0, 2.0), *,
                           centered: bool = True) -> Array:
  """QB bias [n] fp32 read from (summed) margin histograms counts [n, num_bins] int.

  m is each expert's total count. The (q+1)-th largest margin lies in the highest bin b* whose
  count from the top (bins ≥ b*) reaches q+1; it is placed inside that bin by linear
  interpolation (values assumed uniform in the bin), so the error is below one bin width.
  """
  if counts.ndim != 2:
    raise ValueError(f"qb_bias_from_histogram: counts must be [n, num_bins], "
                     f"found shape {counts.shape}")
  if not jnp.issubdtype(counts.dtype, jnp.integer):
    raise ValueError(f"qb_bias_from_histogram: counts must be integer, found {counts.dtype}")
  n, num_bins = counts.shape
  if not isinstance(k, int) or not 1 <= k < n:
    raise ValueError(f"qb_bias_from_histogram: k must be an int in [1, n={n}), found {k!r}")
  lo, hi = value_range
  width = (hi - lo) / num_bins
  counts = counts.astype(jnp.int32)
  m = jnp.sum(counts, axis=1)                              # [n]
  q = _target(m, k, n)                                     # [n]
  from_top = jnp.flip(jnp.cumsum(jnp.flip(counts, 1), axis=1), 1)   # bins ≥ b
  b_star = jnp.sum(from_top >= (q + 1)[:, None], axis=1) - 1        # from_top is non-increasing
  b_star = jnp.clip(b_star, 0, num_bins - 1)
  above = jnp.where(b_star + 1 < num_bins,
                    jnp.take_along_axis(from_top, jnp.minimum(b_star + 1, num_bins - 1)[:, None],
                                        1)[:, 0], 0)
  in_bin = jnp.maximum(jnp.take_along_axis(counts, b_star[:, None], 1)[:, 0], 1)
  r = (q - above).astype(jnp.float32)                     # 0-based rank inside the bin, from top
  upper = lo + (b_star + 1).astype(jnp.float32) * width
  t = upper - (r + 0.5) / in_bin.astype(jnp.float32) * width
  b = jnp.where(m > 0, -t, 0.0)
  return b - jnp.mean(b) if centered else b


def qb_bias_histogram(scores: Array, cutoff: Array, k: int, num_bins: int = 1000,
                      value_range: tuple[float, float] = (-2.0, 2.0), *,
                      centered: bool = True) -> Array:
  """`qb_bias_from_histogram(margin_histogram(scores, cutoff, ...), k, ...)`: bias [n] fp32."""
  _check(scores, cutoff, k, "qb_bias_histogram")
  counts = margin_histogram(scores, cutoff, num_bins, value_range)
  return qb_bias_from_histogram(counts, k, value_range, centered=centered)


def expert_load(indices: Array, num_experts: int) -> Array:
  """Tokens routed to each expert: float32 [num_experts] from indices [N, k]."""
  return jnp.bincount(indices.reshape(-1), length=num_experts).astype(jnp.float32)


def sign_rule_update(bias: Array, load: Array, gamma: float = 1e-3) -> Array:
  """The pre-QB rule: b_j += γ·sign(mean(load) − load_j). bias, load: [n] → [n] fp32."""
  if bias.shape != load.shape or bias.ndim != 1:
    raise ValueError(f"sign_rule_update: bias and load must both be [n], found {bias.shape} "
                     f"and {load.shape}")
  load = load.astype(jnp.float32)
  return bias.astype(jnp.float32) + gamma * jnp.sign(jnp.mean(load) - load)
