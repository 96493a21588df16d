"""The one training state, and what a kind of training trains.

Every kind of training — pre-training (text and multimodal), SFT, LoRA/QLoRA, the RL update,
the EAGLE-3 draft — holds the same `TrainState`:

  params     the trainable variables: a variables-shaped dict ({collection: subtree}), e.g.
             {"params": the whole model} or {"lora": the adapters} or {"params": {"mtp": …,
             "draft_fuse": …}}; the optimizer updates them from gradients;
  frozen     every other variable of the model (constants of the loss; never updated);
  balance    the router biases when the run sets them by Quantile Balancing from each step's
             statistics (the "balance" collection; {} when they stay as loaded, in `frozen`);
  opt_state  the optimizer's state over {**params, "balance": balance};
  step       optimizer steps taken.

What differs between kinds is only which variables are trainable: a `Trainable` names them by
path prefixes, `(("params",), ("balance",))` for pre-training, `(("lora",),)` for adapters,
`(("params", "mtp"), ("params", "draft_fuse"))` for the draft. Splitting and merging are pure
dict operations, so a state's trees keep the model's own paths (the optimizer's labels, the
logical-axis table and checkpoints all read those).
"""

from __future__ import annotations

from typing import Any, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from k3jax.config import ModelConfig
from k3jax.model import K3Model

BALANCE = "balance"


class Trainable:
  """The trainable variables of a kind of training, as path prefixes into the variables.

  `paths`: tuples of keys from the top of the variables dict, e.g. ("params",) (a whole
  collection) or ("params", "mtp") (one subtree). `("balance",)` among them means the router
  biases are set by the optimizer's Quantile Balancing (they take no gradient).
  """

  def __init__(self, *paths: Sequence[str]):
    if not paths:
      raise ValueError("Trainable: name at least one path (e.g. ('params',))")
    self.paths = tuple(tuple(p) for p in paths)
    for p in self.paths:
      if not p or not all(isinstance(k, str) for k in p):
        raise ValueError(f"Trainable: a path is a non-empty tuple of keys, found {p!r}")
    self.balance = (BALANCE,) in self.paths
    self.grad_paths = tuple(p for p in self.paths if p != (BALANCE,))

  def __repr__(self) -> str:
    return f"Trainable{self.paths}"

  def __eq__(self, other) -> bool:
    return isinstance(other, Trainable) and self.paths == other.paths

  def __hash__(self) -> int:
    return hash(self.paths)

  def split(self, variables: dict) -> tuple[dict, dict, dict]:
    """variables → (params: the gradient paths' subtrees, frozen: the rest, balance: the
    router biases when they are trained, else {}). Each keeps the variables' nesting."""
    params, rest = {}, dict(variables)
    for path in self.grad_paths:
      sub, rest = _take(rest, path)
      params = merge_trees(params, _nest(path, sub))
    balance = {}
    if self.balance:
      balance = rest.pop(BALANCE, {})
    return params, _prune(rest), balance


def _take(tree: dict, path: tuple[str, ...], depth: int = 0) -> tuple[Any, dict]:
  """(tree at `path[depth:]`, tree without it); ValueError naming a missing key."""
  key = path[depth]
  if not isinstance(tree, dict) or key not in tree:
    raise ValueError(f"trainable path {'/'.join(path)}: no {key!r} among "
                     f"{sorted(tree) if isinstance(tree, dict) else type(tree).__name__}")
  if depth == len(path) - 1:
    return tree[key], {k: v for k, v in tree.items() if k != key}
  sub, left = _take(tree[key], path, depth + 1)
  return sub, {**tree, key: left}


def _nest(path: tuple[str, ...], sub: Any) -> dict:
  for key in reversed(path):
    sub = {key: sub}
  return sub


def _prune(tree: dict) -> dict:
  """Drop dict branches left empty by `_take` (an empty collection stays out of `frozen`)."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      v = _prune(v)
      if not v:
        continue
    out[k] = v
  return out


def merge_trees(a: dict, b: dict) -> dict:
  """The union of two variables-shaped dicts with disjoint leaves (ValueError on overlap)."""
  out = dict(a)
  for k, v in b.items():
    if k not in out:
      out[k] = v
    elif isinstance(out[k], dict) and isinstance(v, dict):
      out[k] = merge_trees(out[k], v)
    else:
      raise ValueError(f"merge: {k!r} is in both trees")
  return out


@flax.struct.dataclass
class TrainState:
  step: jax.Array        # [] int32: optimizer steps taken
  params: Any            # trainable variables ({collection: subtree}), unboxed
  frozen: Any            # the model's other variables (constants of the loss)
  balance: Any           # router biases set by Quantile Balancing ({} when frozen)
  opt_state: Any         # the optimizer's state over `optimized`

  @property
  def variables(self) -> dict:
    """All the model's variables ({"params", "balance", …}), ready for `K3Model.apply`."""
    out = merge_trees(self.params, self.frozen)
    return {**out, BALANCE: self.balance} if self.balance else out

  @property
  def optimized(self) -> dict:
    """What the optimizer and a run's checkpoints hold: the trainable variables and the
    trained router biases."""
    return {**self.params, BALANCE: self.balance} if self.balance else dict(self.params)


_INIT: dict = {}


def init_variables(config: ModelConfig, rng: jax.Array, seq_len: int = 8) -> dict:
  """Every collection of a fresh `K3Model(config)` but "stats" (unboxed), initialised under
  jit; the jitted init is cached per config, so a resumed run in the same process does not
  compile it again."""
  if (config, seq_len) not in _INIT:
    model = K3Model(config)
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    _INIT[config, seq_len] = jax.jit(lambda r: nn.unbox(model.init(r, tokens)))
  variables = dict(_INIT[config, seq_len](rng))
  variables.pop("stats", None)
  variables.setdefault(BALANCE, {})
  return variables


def init_state(variables: dict, trainable: Trainable,
               tx: optax.GradientTransformation) -> TrainState:
  """A step-0 state over `variables` (all collections): split by `trainable`, a fresh
  optimizer state."""
  params, frozen, balance = trainable.split(variables)
  state = TrainState(step=jnp.zeros([], jnp.int32), params=params, frozen=frozen,
                     balance=balance, opt_state=None)
  return state.replace(opt_state=tx.init(state.optimized))


def with_optimized(state: TrainState, optimized: dict) -> TrainState:
  """`state` with its trainable variables and router biases replaced (a restored checkpoint's
  `optimized` tree)."""
  optimized = dict(optimized)
  balance = optimized.pop(BALANCE, {}) if state.balance else {}
  return state.replace(params=optimized, balance=balance)


def abstract_state(variables: dict, trainable: Trainable,
                   tx: optax.GradientTransformation) -> TrainState:
  """The `TrainState` of (abstract) `variables` as `jax.ShapeDtypeStruct`s: nothing
  allocated (shardings and deviceless compiles start here)."""
  return jax.eval_shape(lambda v: init_state(v, trainable, tx), variables)


__all__ = ["Trainable", "TrainState", "merge_trees", "init_variables", "init_state", "with_optimized",
           "abstract_state", "BALANCE"]
