"""The train step of a run config, on one device or a mesh, and the training state's shardings.

`build_step(cfg, config, mesh)` is the one place a run config (configs/*.py) becomes the
optimizer, its schedule and the jitted train and eval steps; the trainer and
experiments/bench_sharding.py both build their step here. With a mesh the train step is a
`ShardedStep`: jitted with the state's shardings (params and router bias from the logical-axis
table, optimizer state like the params it mirrors, the step counter replicated; state donated),
called under `jax.set_mesh(mesh)` so the layers take the expert-/context-parallel paths while it
traces, and its gradients pinned to the params' shardings before the optimizer.

Nothing here names a mesh axis (k3jax/sharding.py does) or keeps a mesh beyond the objects it
returns.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3jax import sharding
from k3jax.config import ModelConfig, dtype_of
from k3jax.train import balance as qb
from k3jax.train.optim import MuonState, make_optimizer
from k3jax.train.schedule import warmup_cosine
from k3jax.train.step import TrainState, make_eval_step, make_train_step
from k3jax.tree_paths import key_names


# ------------------------------------------------------------------ shardings of the state
def opt_state_shardings(mesh: Mesh | jax.sharding.AbstractMesh, abstract_opt_state: Any,
                        params: Any, param_sh: Any, offload_momentum: bool = False) -> Any:
  """Optimizer state sharded like the params it mirrors; everything else replicated.

  A state leaf mirrors a param when the param's tree path is a suffix of the leaf's path and
  the shapes agree (optax's mu/nu/momentum trees). Leaves that match no param (counts,
  factored statistics) are replicated. `offload_momentum`: Per-Head Muon's momentum (the `mu`
  of a `MuonState`) goes to host memory (memory kind "pinned_host"), for
  `make_optimizer(offload_momentum=True)`.
  """
  table: dict[tuple[str, ...], tuple[tuple[int, ...], NamedSharding]] = {}
  flat_p = jax.tree_util.tree_flatten_with_path(params)[0]
  flat_s = jax.tree_util.tree_leaves(param_sh, is_leaf=lambda x: isinstance(x, NamedSharding))
  if len(flat_p) != len(flat_s):
    raise ValueError(f"param_sh: expected {len(flat_p)} shardings (one per param), "
                     f"found {len(flat_s)}")
  for (path, leaf), sh in zip(flat_p, flat_s):
    table[key_names(path)] = (tuple(leaf.shape), sh)

  def one(path, leaf):
    names = key_names(path)
    for start in range(len(names)):
      hit = table.get(names[start:])
      if hit is not None and hit[0] == tuple(getattr(leaf, "shape", ())):
        return hit[1]
    return NamedSharding(mesh, P())

  out = jax.tree_util.tree_map_with_path(one, abstract_opt_state)
  if not offload_momentum:
    return out
  is_muon = lambda x: isinstance(x, MuonState)  # noqa: E731
  if not any(is_muon(x) for x in jax.tree.leaves(out, is_leaf=is_muon)):
    raise ValueError("offload_momentum=True: the optimizer state has no MuonState "
                     "(optim.muon=False?), so there is no momentum to offload")
  return jax.tree.map(
      lambda x: MuonState(mu=jax.tree.map(lambda sh: sh.with_memory_kind("pinned_host"), x.mu))
      if is_muon(x) else x, out, is_leaf=is_muon)


def train_state_shardings(mesh: Mesh | jax.sharding.AbstractMesh, state: TrainState,
                          logical_variables: Any,
                          rules: Sequence[tuple[str, Any]] | None = None,
                          offload_momentum: bool = False) -> TrainState:
  """Shardings of a `TrainState` (a tree like it): params/balance from their logical axes,
  optimizer state like the params it mirrors (Muon's momentum in host memory with
  `offload_momentum`), the step replicated. `state` may be abstract (`abstract_state`);
  `logical_variables`: the *boxed* variables (`logical_variables(config)`)."""
  sh = sharding.param_shardings(mesh, {c: logical_variables[c] for c in ("params", "balance")
                                       if c in logical_variables}, rules)
  var_sh = {"params": sh["params"], "balance": sh.get("balance", {})}
  variables = {"params": state.params, "balance": state.balance}
  return state.replace(
      step=NamedSharding(mesh, P()), params=var_sh["params"], balance=var_sh["balance"],
      opt_state=opt_state_shardings(mesh, state.opt_state, variables, var_sh,
                                    offload_momentum))


def logical_variables(config: ModelConfig) -> dict:
  """The model's variables as `jax.ShapeDtypeStruct`s, boxed with their logical axis names
  (`jax.eval_shape` of the init: nothing allocated)."""
  from k3jax.model import K3Model  # the model is a sibling package; import late
  return jax.eval_shape(K3Model(config).init, jax.random.PRNGKey(0),
                        jnp.zeros((1, 8), jnp.int32))


def abstract_state(config: ModelConfig, tx: optax.GradientTransformation,
                   boxed: Any = None) -> TrainState:
  """The `TrainState` of `config` and `tx` as `jax.ShapeDtypeStruct`s (nothing allocated).
  `boxed`: `logical_variables(config)` if already at hand."""
  boxed = logical_variables(config) if boxed is None else boxed
  variables = nn.unbox({c: boxed.get(c, {}) for c in ("params", "balance")})
  return TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=variables["params"],
                    balance=variables["balance"],
                    opt_state=jax.eval_shape(tx.init, variables))


# ------------------------------------------------------------------ the jitted step
def _with_shardings(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


class ShardedStep:
  """A train step `step_fn(state, batch) → (state, metrics)` jitted for `mesh`.

  Calling it places the state (a no-op once it is sharded) and the host batch
  (`sharding.put_batch`: with several processes each materialises only its own devices'
  slices) and runs the step under `jax.set_mesh(mesh)`. `lower(state, batch)` lowers it from
  `jax.ShapeDtypeStruct`s with the same shardings (a deviceless compile at pod scale).

  `compiler_layouts`: names of state fields (a frozen base: "params") whose memory layouts XLA
  chooses (`Layout.AUTO`, in and out) instead of the default row-major ones. A field the step
  passes through unchanged is then stored the way the step reads it: XLA:TPU otherwise
  re-lays a scanned stack of packed experts out in a temporary copy per layer group (k3 QLoRA
  at 32 v5p chips: 122.92G of temporaries with default layouts, 56.87 GiB with the compiler's;
  docs/notes/lora.md). The step is then compiled once per batch shape and called compiled;
  the first call moves those fields into the chosen layouts (donating the old buffers), and
  later calls find them there. On CPU the chosen layouts are the default ones.
  """

  def __init__(self, step_fn: Callable, mesh: Mesh, state_shardings: TrainState,
               abstract: TrainState, donate: bool = True,
               compiler_layouts: Sequence[str] = ()):
    self.mesh = mesh
    self.state_shardings = state_shardings
    self.abstract_state = abstract      # what the shardings were derived from
    self.compiler_layouts = tuple(compiler_layouts)
    self._donate = donate
    for name in self.compiler_layouts:
      if not hasattr(state_shardings, name):
        raise ValueError(f"compiler_layouts: the state has no field {name!r}")
    auto = lambda s: Format(Layout.AUTO, s)  # noqa: E731
    formats = state_shardings.replace(**{
        name: jax.tree.map(auto, getattr(state_shardings, name))
        for name in self.compiler_layouts})
    self._compiled = {}                 # batch shapes → compiled step (compiler_layouts only)
    # No flax logical-rules context while tracing: under a JAX mesh it would make flax apply
    # logical constraints in its parameter shape checks (the rules act through the shardings).
    # The batch's shardings are its own (`put_batch` placed it): None = taken from the argument.
    self._jit = jax.jit(step_fn, in_shardings=(formats, None),
                        out_shardings=(formats, NamedSharding(mesh, P())),
                        donate_argnums=(0,) if donate else ())

  def batch_shardings(self, batch: Any) -> Any:
    return sharding.batch_shardings(self.mesh, batch)

  def __call__(self, state: TrainState, batch: Any):
    state = sharding.put_batch(state, self.state_shardings)
    batch = sharding.put_batch(batch, self.batch_shardings(batch))
    if not self.compiler_layouts:
      with jax.set_mesh(self.mesh):
        return self._jit(state, batch)
    key = tuple((x.shape, x.dtype) for x in jax.tree.leaves(batch))
    if key not in self._compiled:
      self._compiled[key] = self.lower(self.abstract_state, batch).compile()
    compiled = self._compiled[key]
    state_formats = compiled.input_formats[0][0]
    state = state.replace(**{
        name: jax.tree.map(functools.partial(_put_format, donate=self._donate),
                           getattr(state, name), getattr(state_formats, name))
        for name in self.compiler_layouts})
    with jax.set_mesh(self.mesh):
      return compiled(state, batch)

  def lower(self, state: TrainState, batch: Any):
    """`jax.jit(...).lower` of the step from abstract `state` and `batch` (shapes and dtypes;
    their shardings are set here)."""
    with jax.set_mesh(self.mesh):
      return self._jit.lower(_with_shardings(state, self.state_shardings),
                             _with_shardings(batch, self.batch_shardings(batch)))


def _put_format(x: jax.Array, fmt: Format, donate: bool) -> jax.Array:
  """`x` in the compiled step's input format: as it is when already there, else moved (with
  a donating step, its old buffer donated: a large frozen base is not held twice)."""
  if x.format == fmt:
    return x
  return jax.device_put(x, fmt, donate=donate)


class Step(NamedTuple):
  """What `build_step` returns."""
  tx: optax.GradientTransformation
  schedule: Callable                 # step → learning rate
  train: Callable                    # (state, batch) → (state, metrics); state donated
  eval: Callable                     # (variables, batch) → {"ce_sum", "tokens", "byte_tokens"}


def optimizer(cfg, config: ModelConfig) -> tuple[optax.GradientTransformation, Callable]:
  """(tx, schedule) of the run config: warmup-cosine, Per-Head Muon / AdamW, Quantile Balancing."""
  o = cfg.optim
  schedule = warmup_cosine(o.lr, cfg.train.steps, o.warmup_frac, o.get("final_lr_frac", 0.1))
  balance_tx = qb.quantile_balancing(cfg.balance.method, k=config.experts_per_token,
                                     value_range=config.qb_range, gamma=cfg.balance.gamma)
  tx = make_optimizer(schedule, weight_decay=o.weight_decay, momentum=o.momentum,
                      adam_b1=o.adam_b1, adam_b2=o.adam_b2, muon=o.muon, balance_tx=balance_tx,
                      clip_norm=o.get("clip_norm", 0.0),
                      mu_dtype=dtype_of(o.mu_dtype) if o.get("mu_dtype") else None,
                      offload_momentum=bool(o.get("offload_momentum", False)),
                      freeze_experts=bool(cfg.train.get("freeze_experts", False)))
  return tx, schedule


def run_rules(cfg) -> tuple[tuple[str, Any], ...]:
  """The logical-axis rules of the run config (`mesh.fsdp_over_data` widens parameter
  sharding over `data`)."""
  mesh_cfg = cfg.get("mesh")
  return sharding.axis_rules(
      fsdp_over_data=bool(mesh_cfg.get("fsdp_over_data", False)) if mesh_cfg is not None
      else False)


def run_mesh(cfg) -> Mesh | None:
  """The mesh `cfg.mesh` asks for (`sharding.uses_mesh`), or None when the run is
  single-device (a one-device mesh when `optim.offload_momentum` asks for host memory: that
  needs explicit shardings). Used by experiments/train.py and experiments/rl.py."""
  import logging
  mesh_cfg = cfg.get("mesh")
  offload = bool(cfg.optim.get("offload_momentum", False))
  if not sharding.uses_mesh(mesh_cfg, cfg.train.get("data_parallel", False)) and not offload:
    return None
  mesh = sharding.make_mesh(mesh_cfg)
  logging.getLogger("k3jax.train").info("mesh %s", dict(mesh.shape))
  return mesh


def mesh_rules(cfg, config: ModelConfig, mesh: Mesh, rules=None) -> tuple:
  """Check the run's micro-batch and sequence length against `mesh`; the sharding rules
  (`rules`, default `run_rules(cfg)`). Shared by `build_step` and the LoRA step
  (k3jax/train/lora.py)."""
  # Each micro-batch is split over the batch axes (the trainer's validate() names a
  # grad_accum that does not divide the batch).
  accum = cfg.train.get("grad_accum", 1)
  micro = cfg.train.batch_size // accum if cfg.train.batch_size % accum == 0 else None
  sharding.check_shapes(config, mesh, batch_size=micro or cfg.train.batch_size,
                        seq_len=cfg.train.seq_len)
  return run_rules(cfg) if rules is None else tuple(rules)


def build_step(cfg, config: ModelConfig, mesh: Mesh | None = None, *,
               rules: Sequence[tuple[str, Any]] | None = None, boxed: Any = None,
               donate: bool = True) -> Step:
  """The optimizer, schedule and jitted train / eval steps of run config `cfg` for `config`.

  `mesh` None: the train step is `jax.jit` on one device (state donated). A `Mesh`: a
  `ShardedStep` (module doc), after `sharding.check_shapes` of the run's micro-batch and
  sequence length against it; `rules` default to `run_rules(cfg)`, `boxed` to
  `logical_variables(config)`. Shardings are derived here, from abstract values, so nothing
  is allocated until the step is called. `optim.offload_momentum` needs a mesh (host memory
  needs explicit shardings; a one-device mesh will do).
  """
  o = cfg.optim
  offload = bool(o.get("offload_momentum", False))
  if offload and mesh is None:
    raise ValueError("config.optim.offload_momentum: host memory needs a jit with explicit "
                     "shardings: run experiments/train.py (it builds a mesh, a one-device one "
                     "if need be) or pass build_step / train a mesh")
  accum = cfg.train.get("grad_accum", 1)
  tx, schedule = optimizer(cfg, config)
  eval_fn = jax.jit(make_eval_step(config))
  if mesh is None:
    step_fn = make_train_step(config, tx, mtp_weight=cfg.train.mtp_weight,
                              qk_clip_tau=o.qk_clip_tau, schedule=schedule, grad_accum=accum)
    return Step(tx, schedule, jax.jit(step_fn, donate_argnums=0 if donate else ()), eval_fn)

  rules = mesh_rules(cfg, config, mesh, rules)
  boxed = logical_variables(config) if boxed is None else boxed
  state = abstract_state(config, tx, boxed)
  state_sh = train_state_shardings(mesh, state, boxed, rules, offload)
  step_fn = make_train_step(config, tx, mtp_weight=cfg.train.mtp_weight,
                            qk_clip_tau=o.qk_clip_tau, schedule=schedule, grad_accum=accum,
                            grad_shardings=state_sh.params)
  return Step(tx, schedule, ShardedStep(step_fn, mesh, state_sh, state, donate), eval_fn)


__all__ = ["opt_state_shardings", "train_state_shardings", "logical_variables",
           "abstract_state", "ShardedStep", "Step", "optimizer", "run_rules", "run_mesh", "mesh_rules",
           "build_step"]
