"""Quantile Balancing of the router bias as an optax transformation (docs/k3.md §7).

The router bias `e_score_correction_bias` lives in the `balance` collection, which the
optimizer manages next to `params` (label "balance", k3jax.train.optim). It never receives a
gradient: `quantile_balancing(...)` ignores the incoming (zero) updates and returns
`new_bias − bias`, where `new_bias` is computed from the statistics the MoE layers sowed in the
forward pass of this step (`stats=` extra argument, `flat_stats` form). The new bias therefore
takes effect on the next step, never on the batch that produced it.

Methods:
  "qb"    b ← qb_bias_from_histogram(margin_hist): the (q+1)-th largest margin per expert,
          negated and centred, read from the integer histogram of margins (summed over the
          batch — over devices too, one all-reduce of integers, when the batch is sharded).
  "sign"  the old rule b += γ·sign(mean(load) − load) (k3jax.ops.balance.sign_rule_update).
  "none"  the bias stays zero.
Scanned MoE layers carry a leading [num_groups] axis on bias and stats: each layer is
balanced on its own (vmap).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from k3jax.ops import balance as ops
from k3jax.tree_paths import path_str

BIAS_NAME = "e_score_correction_bias"
METHODS = ("qb", "sign", "none")


def flat_stats(stats: Any) -> dict[str, jax.Array]:
  """The sown "stats" collection → {"module/path/name": array} (paths relative to the
  collection; a sown tuple of one value is unwrapped, of several summed)."""
  out = {}

  def visit(tree, prefix):
    if isinstance(tree, dict) or hasattr(tree, "items"):
      for k, v in tree.items():
        visit(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(tree, tuple):
      out[prefix] = tree[0] if len(tree) == 1 else sum(tree[1:], tree[0])
    else:
      out[prefix] = tree

  visit(stats if stats is not None else {}, "")
  return out


def moe_module_of(bias_path: str) -> str:
  """".../block_sparse_moe/gate/e_score_correction_bias" (optionally under "balance/") →
  ".../block_sparse_moe" (the key prefix of that layer's stats)."""
  parts = bias_path.split("/")
  if parts and parts[0] == "balance":
    parts = parts[1:]
  if len(parts) < 3 or parts[-1] != BIAS_NAME or parts[-2] != "gate":
    raise ValueError(f"balance: unexpected router-bias path {bias_path!r}; expected "
                     f"'.../gate/{BIAS_NAME}'")
  return "/".join(parts[:-2])


def new_bias(method: str, bias: jax.Array, stats: dict[str, jax.Array], module: str, *,
             k: int, value_range: tuple[float, float], gamma: float) -> jax.Array:
  """The bias of the next step for one MoE module (bias [E] or [G, E])."""
  if method == "none":
    return jnp.zeros_like(bias)
  if method == "qb":
    hist = stats[f"{module}/margin_hist"]
    fn = lambda h: ops.qb_bias_from_histogram(h, k, value_range)  # noqa: E731
    out = jax.vmap(fn)(hist) if bias.ndim == 2 else fn(hist)
  elif method == "sign":
    load = stats[f"{module}/load"]
    fn = lambda b, l: ops.sign_rule_update(b, l, gamma)  # noqa: E731
    out = jax.vmap(fn)(bias, load) if bias.ndim == 2 else fn(bias, load)
  else:
    raise ValueError(f"balance.method: expected one of {METHODS}, found {method!r}")
  return out.astype(bias.dtype)


def quantile_balancing(method: str = "qb", *, k: int, value_range=(-2.0, 2.0),
                       gamma: float = 1e-3) -> optax.GradientTransformationExtraArgs:
  """Sets every router bias from `stats` (extra argument); see the module docstring.

  update(updates, state, params, stats={flat stats}) → (new_bias − params, state). `params`
  (the current biases) is required. Without `stats` (or for a layer missing from them) the
  bias is left unchanged.
  """
  if method not in METHODS:
    raise ValueError(f"balance.method: expected one of {METHODS}, found {method!r}")

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, stats=None, **extra):
    del extra
    if params is None:
      raise ValueError("quantile_balancing: params (the current router biases) are required")

    def one(path, upd, bias):
      module = moe_module_of(path_str(path))
      if stats is None or (method == "qb" and f"{module}/margin_hist" not in stats) or (
          method == "sign" and f"{module}/load" not in stats):
        return jnp.zeros_like(upd) if method != "none" else -bias
      nb = new_bias(method, bias, stats, module, k=k, value_range=tuple(value_range),
                    gamma=gamma)
      return (nb - bias).astype(upd.dtype)

    return jax.tree_util.tree_map_with_path(one, updates, params), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
