"""The train step jitted on one device or a mesh, and the training state's shardings.

`jit_step(loss, tx, trainable, config, mesh)` is the one place a step becomes a compiled
callable, for every kind of training (pre-training here, LoRA, RL and the EAGLE-3 draft in
k3jax/posttrain). With a mesh it is a `ShardedStep`: jitted with the state's shardings (the
variables from the logical-axis table, the optimizer state like the variables it mirrors, the
step counter replicated; state donated), called under `jax.set_mesh(mesh)` so the layers take
the expert-/context-parallel paths while it traces, and its gradients pinned to the trainable
variables' shardings before the optimizer. `build_step(run, config, mesh)` is pre-training's
(the trainer and experiments/bench_sharding.py both build their step there).

Nothing here names a mesh axis (k3jax/sharding.py does) or keeps a mesh beyond the objects it
returns.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, NamedTuple, Sequence

import flax.linen as nn
import jax
import optax
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3jax import sharding
from k3jax.config import ModelConfig
from k3jax.model import abstract_variables
from k3jax.train.optim import MuonState, optimizer
from k3jax.train.run import RunConfig
from k3jax.train.state import BALANCE, Trainable, TrainState, abstract_state
from k3jax.train.step import Loss, lm_loss, make_eval_step, make_step
from k3jax.tree_paths import key_names

log = logging.getLogger("k3jax.train")


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
                          boxed: Any, trainable: Trainable,
                          rules: Sequence[tuple[str, Any]] | None = None,
                          offload_momentum: bool = False) -> TrainState:
  """Shardings of a `TrainState` (a tree like it): its variables from their logical axes
  (`boxed`: `abstract_variables(config)`, split like the state by `trainable`), the optimizer
  state like the variables it mirrors (Muon's momentum in host memory with
  `offload_momentum`), the step replicated. `state` may be abstract (`abstract_state`)."""
  collections = {c: boxed[c] for c in boxed if c != "stats"}
  params, frozen, balance = trainable.split(sharding.param_shardings(mesh, collections, rules))
  sh = state.replace(step=NamedSharding(mesh, P()), params=params, frozen=frozen,
                     balance=balance, opt_state=None)
  return sh.replace(opt_state=opt_state_shardings(mesh, state.opt_state, state.optimized,
                                                  sh.optimized, offload_momentum))


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
  """What a kind of training's step builder returns."""
  tx: optax.GradientTransformation
  schedule: Callable                 # step → learning rate
  train: Callable                    # (state, batch) → (state, metrics); state donated
  eval: Callable | None              # (variables, batch) → {"ce_sum", "tokens", "byte_tokens"}


def jit_step(loss: Loss, tx: optax.GradientTransformationExtraArgs, trainable: Trainable,
             config: ModelConfig, mesh: Mesh | None = None, *, grad_accum: int = 1,
             qk_clip: tuple[float | None, int] | None = None, schedule: Callable | None = None,
             rules: Sequence[tuple[str, Any]] | None = None, boxed: Any = None,
             offload_momentum: bool = False, donate: bool = True,
             compiler_layouts: Sequence[str] = ()) -> Callable:
  """`make_step(loss, tx, …)` jitted: on one device (`mesh` None; the state donated) or as a
  `ShardedStep` for `mesh`, with the state's shardings derived here from abstract values (the
  variables' logical axes by `rules`, default `sharding.axis_rules()`; `boxed` defaults to
  `abstract_variables(config)`), so nothing is allocated until the step is called.
  `offload_momentum` (Per-Head Muon's momentum in host memory) needs a mesh: host memory needs
  explicit shardings (a one-device mesh will do)."""
  if mesh is None:
    if offload_momentum:
      raise ValueError("config.optim.offload_momentum: host memory needs a jit with explicit "
                       "shardings: run experiments/train.py (it builds a mesh, a one-device "
                       "one if need be) or pass the step builder a mesh")
    fn = make_step(loss, tx, grad_accum=grad_accum, qk_clip=qk_clip, schedule=schedule)
    return jax.jit(fn, donate_argnums=0 if donate else ())
  boxed = abstract_variables(config) if boxed is None else boxed
  state = abstract_state(nn.unbox({c: v for c, v in boxed.items() if c != "stats"}),
                         trainable, tx)
  state_sh = train_state_shardings(mesh, state, boxed, trainable,
                                   sharding.axis_rules() if rules is None else rules,
                                   offload_momentum)
  fn = make_step(loss, tx, grad_accum=grad_accum, qk_clip=qk_clip, schedule=schedule,
                 grad_shardings=state_sh.params)
  return ShardedStep(fn, mesh, state_sh, state, donate, compiler_layouts)


# ------------------------------------------------------------------ the run config's step
PRETRAIN = Trainable(("params",), (BALANCE,))   # every weight, and the router biases by QB


def run_rules(run: RunConfig) -> tuple[tuple[str, Any], ...]:
  """The logical-axis rules of the run (`mesh.fsdp_over_data` / `mesh.fsdp_over_context` widen
  parameter sharding over `data` / `context`)."""
  return sharding.params_over(run.mesh)


def run_mesh(run: RunConfig) -> Mesh | None:
  """The mesh `run.mesh` asks for (`sharding.uses_mesh`), or None when the run is
  single-device (a one-device mesh when `optim.offload_momentum` asks for host memory: that
  needs explicit shardings). Used by experiments/train.py and experiments/rl.py."""
  if not sharding.uses_mesh(run.mesh, run.train.data_parallel) and not (
      run.optim.offload_momentum):
    return None
  mesh = sharding.make_mesh(run.mesh)
  log.info("mesh %s", dict(mesh.shape))
  return mesh


def check_mesh(run: RunConfig, config: ModelConfig, mesh: Mesh) -> None:
  """The run's micro-batch and sequence length against `mesh` (ValueError naming them)."""
  # Each micro-batch is split over the batch axes.
  sharding.check_shapes(config, mesh, batch_size=run.train.batch_size // run.train.grad_accum,
                        seq_len=run.train.seq_len)


def build_step(run: RunConfig, config: ModelConfig, mesh: Mesh | None = None, *,
               rules: Sequence[tuple[str, Any]] | None = None, boxed: Any = None,
               donate: bool = True) -> Step:
  """Pre-training's step (text, multimodal, SFT): the optimizer and schedule of `run`
  (`optimizer`), the language-model loss, every weight and the router biases trained, QK-Clip;
  jitted for `mesh` when given (after `check_mesh`; `rules` default to `run_rules(run)`)."""
  tx, schedule = optimizer(run, config)
  if mesh is not None:
    check_mesh(run, config, mesh)
  train = jit_step(lm_loss(config, run.train.mtp_weight), tx, PRETRAIN, config, mesh,
                   grad_accum=run.train.grad_accum,
                   qk_clip=(run.optim.qk_clip_tau, config.text.qk_nope_head_dim), schedule=schedule,
                   rules=run_rules(run) if rules is None else rules, boxed=boxed,
                   offload_momentum=run.optim.offload_momentum, donate=donate)
  return Step(tx, schedule, train, jax.jit(make_eval_step(config)))


__all__ = ["opt_state_shardings", "train_state_shardings", "ShardedStep", "Step", "jit_step",
           "PRETRAIN", "run_rules", "run_mesh", "check_mesh", "build_step"]
