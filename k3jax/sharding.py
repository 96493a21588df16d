"""Meshes, the logical-axis rules, and the shardings of params, batches, activations, caches.

This is the only module that knows mesh axis names. Modules annotate parameters with *logical*
axis names (docs/contracts.md) through `nn.with_logical_partitioning`; `LOGICAL_AXIS_RULES` maps
them onto the five mesh axes:

  data     pure data parallelism (batch only; params replicated unless `fsdp_over_data`)
  fsdp     data parallelism with params and optimizer state sharded along `embed`/`moe_latent`
  expert   routed experts sharded over it; outside the MoE it is one more batch axis
  context  the sequence axis (KDA state passing / MLA latent gathering in k3jax/parallel)
  tensor   heads / MLP hidden / vocab (Megatron style)

The mesh a model runs under is JAX's own: `with jax.set_mesh(mesh):` around the *call* of a
jitted function (JAX refuses it inside a trace; the call traces inside the context, and JAX's
jit cache keys on it). Traced code reads it back with `jax.sharding.get_abstract_mesh()`: the
layers' expert-/context-parallel paths (k3jax/parallel) and `constrain_activations`. Nothing
here remembers a mesh. The logical-axis rules are applied explicitly (`param_shardings(...,
rules)`), never through flax's rules context at trace time. Shardings of the training state and
the jitted train step are in k3jax/train/sharded.py.

Usage:
  mesh = make_mesh(MeshConfig(expert=4))                      # data = -1 fills the rest
  p_sh = param_shardings(mesh, jax.eval_shape(model.init, ...))  # boxed (Partitioned) tree
  b_sh = batch_sharding(mesh)                                 # [B, T, ...] arrays
  check_shapes(model_config, mesh, batch_size=B, seq_len=T)   # clear errors before compiling
  with jax.set_mesh(mesh):                                    # around the jitted call:
    out = jax.jit(model.apply)(variables, tokens)             # EP / CP paths, constraints
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")
# Mesh axes that split the batch of tokens (the expert axis is a batch axis outside the MoE).
BATCH_AXES = ("data", "fsdp", "expert")

# The single table of logical-axis rules: (logical name, mesh axis or axes or None), in priority
# order; flax assigns each mesh axis at most once per array, so a later rule for the same logical
# name is a fallback when the first one's mesh axis is already taken by another dimension.
LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    # activations
    ("batch", BATCH_AXES),
    ("length", "context"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    # parameters: experts over `expert`, matrices split along `embed` (FSDP) and a hidden axis
    # (tensor); the scanned group axis is never sharded (each group is gathered when it runs).
    ("experts", "expert"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("expert_mlp", "tensor"),
    ("embed", "fsdp"),
    ("moe_latent", "fsdp"),      # W_down [d, ℓ] keeps `embed` on fsdp; experts [E, ℓ, F] use it
    ("kv_latent", "fsdp"),       # kv_b [kv_rank, H, ...]: second choice when embed is absent
    ("q_latent", "fsdp"),
    ("head_dim", None),
    ("gate_rank", None),
    ("conv", None),
    ("norm", None),
    ("layers", None),
    # LoRA adapters (k3jax/layers/linear.py) carry their base kernel's axes on in/out, so
    # they shard like it; the rank dimension is small and stays replicated.
    ("lora_rank", None),
)


def axis_rules(fsdp_over_data: bool = False,
               param_axes: Sequence[str] | None = None,
               fsdp_over_context: bool = False) -> tuple[tuple[str, Any], ...]:
  """`LOGICAL_AXIS_RULES`, with the parameter-sharding axis `fsdp` widened.

  `fsdp_over_data`: params and optimizer state sharded over (data, fsdp) (ZeRO-3 over data).
  `param_axes`: any tuple of mesh axes replacing `fsdp` (e.g. ("fsdp", "expert") shards the
  dense weights over the expert axis too); every widened rule keeps plain `fsdp` as its
  fallback, used where another dimension of the same array already took one of the axes
  (the expert matrices, whose `experts` dimension holds `expert`).
  `fsdp_over_context`: params and optimizer state also sharded over `context` (FSDP over the
  sequence axis: at 1M tokens a row spans 128 devices and the batch axes hold few), placed
  right after `fsdp` in the widened axes — ("fsdp", "context", "expert") for
  param_axes=("fsdp", "expert") — with ("fsdp", "context") as the expert matrices' fallback.
  Each layer's weights are then all-gathered over `context` when it runs and its gradients
  reduce-scattered, as over `fsdp` (XLA SPMD from the shardings).
  """
  if param_axes is None:
    param_axes = ("data", "fsdp") if fsdp_over_data else ("fsdp",)
  param_axes = tuple(param_axes)
  candidates = [param_axes]
  if fsdp_over_context and "context" not in param_axes:
    i = param_axes.index("fsdp") + 1 if "fsdp" in param_axes else len(param_axes)
    widened = param_axes[:i] + ("context",) + param_axes[i:]
    candidates = [widened, tuple(a for a in widened if a != "expert")]
  if candidates == [("fsdp",)]:
    return LOGICAL_AXIS_RULES
  fallbacks = []
  for axes in candidates:
    if axes != ("fsdp",) and axes not in fallbacks:
      fallbacks.append(axes)
  out = []
  for name, axes in LOGICAL_AXIS_RULES:
    if axes == "fsdp":
      out.extend((name, f if len(f) > 1 else f[0]) for f in fallbacks)
    out.append((name, axes))
  return tuple(out)


def params_over(mesh_cfg: Any, param_axes: Sequence[str] | None = None
                ) -> tuple[tuple[str, Any], ...]:
  """The rules of a mesh config (`MeshConfig` or its mapping): its `fsdp_over_data` and
  `fsdp_over_context` options applied (`axis_rules`)."""
  c = MeshConfig.from_any(mesh_cfg)
  return axis_rules(fsdp_over_data=c.fsdp_over_data, param_axes=param_axes,
                    fsdp_over_context=c.fsdp_over_context)


# ------------------------------------------------------------------------------------- meshes
@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the mesh axes; their product must be the device count, one may be -1 (= fill)."""
  data: int = -1
  fsdp: int = 1
  expert: int = 1
  context: int = 1
  tensor: int = 1
  fsdp_over_data: bool = False  # also shard params / optimizer state over `data` (ZeRO-3 style)
  fsdp_over_context: bool = False  # also shard params / optimizer state over `context`

  @classmethod
  def from_any(cls, cfg: Any) -> "MeshConfig":
    """From a MeshConfig, a mapping or an ml_collections ConfigDict with the same fields."""
    if isinstance(cfg, MeshConfig):
      return cfg
    if cfg is None:
      return cls()
    get = cfg.get if isinstance(cfg, Mapping) or hasattr(cfg, "get") else (
        lambda k, d: getattr(cfg, k, d))
    fields = {f.name: get(f.name, f.default) for f in dataclasses.fields(cls)}
    return cls(**fields)

  def axis_sizes(self) -> tuple[int, ...]:
    return tuple(getattr(self, a) for a in MESH_AXES)


def mesh_shape(cfg: Any, num_devices: int) -> dict[str, int]:
  """Resolve `-1` and check the product: {axis: size} in `MESH_AXES` order.

  Raises ValueError naming the field when a size is invalid or the product is not `num_devices`.
  """
  cfg = MeshConfig.from_any(cfg)
  sizes = dict(zip(MESH_AXES, cfg.axis_sizes()))
  fill = [a for a, s in sizes.items() if s == -1]
  for a, s in sizes.items():
    if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or (s < 1 and s != -1):
      raise ValueError(f"mesh.{a}: expected a positive int or -1, found {s!r}")
  if len(fill) > 1:
    raise ValueError(f"mesh: at most one axis may be -1 (fill), found {fill}")
  known = math.prod(s for s in sizes.values() if s != -1)
  if fill:
    if num_devices % known:
      raise ValueError(
          f"mesh.{fill[0]}=-1: the other axes' product {known} does not divide the device "
          f"count {num_devices} ({_fmt(sizes)})")
    sizes[fill[0]] = num_devices // known
  elif known != num_devices:
    raise ValueError(
        f"mesh: product of axis sizes must equal the device count {num_devices}, found "
        f"{known} ({_fmt(sizes)})")
  return sizes


def _fmt(sizes: Mapping[str, int]) -> str:
  return ", ".join(f"{a}={s}" for a, s in sizes.items())


def make_mesh(cfg: Any = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A `Mesh` with axes `MESH_AXES` (all of them, size 1 where unused) over `devices`.

  Devices are laid out in `jax.devices()` order, `tensor` fastest and `data` slowest, so the
  axes with the most traffic (tensor, context, expert) stay within a host / slice.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape(cfg, len(devices))
  arr = np.array(devices, dtype=object).reshape(tuple(sizes[a] for a in MESH_AXES))
  return Mesh(arr, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def abstract_mesh(cfg: Any, num_devices: int) -> jax.sharding.AbstractMesh:
  """An `AbstractMesh` (no devices) with the same axes, for lowering at pod scale."""
  sizes = mesh_shape(cfg, num_devices)
  return jax.sharding.AbstractMesh(
      tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
      axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def axis_size(mesh: Mesh | jax.sharding.AbstractMesh | None, name: str | Sequence[str]) -> int:
  """Product of the sizes of mesh axes `name` (1 for axes the mesh lacks, or no mesh)."""
  if mesh is None:
    return 1
  names = (name,) if isinstance(name, str) else tuple(name)
  shape = dict(mesh.shape)
  return math.prod(shape.get(n, 1) for n in names)


# ----------------------------------------------------------------- the mesh and constraints
def activate(mesh: Mesh) -> jax.set_mesh:
  """`jax.set_mesh(mesh)` itself, under the name older callers use: enter it around the call of
  a jitted model, never inside one. Nothing is stored here."""
  return jax.set_mesh(mesh)


def constrain_like_params(grads: Any, shardings: Any) -> Any:
  """`grads` pinned to `shardings` (the params' NamedSharding tree, same structure); unchanged
  when `shardings` is None.

  So the optimizer update runs on shards whatever layout XLA's propagation picked for the
  backward pass: without it XLA may build a whole-vocabulary fp32 embedding / lm_head gradient
  on every device before scattering it (docs/notes/sharding.md)."""
  if shardings is None:
    return grads
  return jax.lax.with_sharding_constraint(grads, shardings)


# ----------------------------------------------------------------------- shardings of trees
def _divisible_spec(shape: Sequence[int], spec: P, mesh: Mesh, name: str = "",
                    logical: Sequence[str | None] = ()) -> P:
  """Drop mesh axes from dims they do not divide (replicate those dims instead).

  The expert axis is the exception: experts not divisible by it is a configuration error.
  """
  out = []
  for i, axes in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
    if axes is None:
      out.append(None)
      continue
    # Axes of size 1 say nothing: drop them so specs read as the layout actually used.
    names = tuple(a for a in ((axes,) if isinstance(axes, str) else tuple(axes))
                  if axis_size(mesh, a) > 1)
    if not names:
      out.append(None)
      continue
    n = axis_size(mesh, names)
    if shape[i] % n:
      if i < len(logical) and logical[i] == "experts":
        raise ValueError(
            f"{name}: dimension {i} of size {shape[i]} (experts) is not divisible by the "
            f"expert axis size {n}")
      # Keep the longest prefix of axes that still divides.
      while names and shape[i] % axis_size(mesh, names):
        names = names[:-1]
      axes = None if not names else (names[0] if len(names) == 1 else names)
    out.append(axes)
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def logical_to_sharding(
    shape: Sequence[int], logical: Sequence[str | None] | P | None, mesh: Mesh,
    rules: Sequence[tuple[str, Any]] | None = None, name: str = "") -> NamedSharding:
  """NamedSharding of one array from its logical axis names (None / () = replicated)."""
  rules = LOGICAL_AXIS_RULES if rules is None else rules
  if logical is None:
    return NamedSharding(mesh, P())
  spec = nn.logical_to_mesh_axes(tuple(logical), rules)
  return NamedSharding(mesh, _divisible_spec(shape, spec, mesh, name, tuple(logical)))


def logical_specs(abstract_tree: Any) -> Any:
  """Logical PartitionSpecs of a boxed variables tree (`nn.Partitioned` leaves; others P())."""
  return nn.get_partition_spec(abstract_tree)


# The token embedding table (logical axes of k3jax/model.py's `embed_tokens`): read by a gather
# of token ids. It is never sharded over `context` (FSDP over context leaves it to the other
# parameter axes): XLA:TPU (libtpu 0.0.42.1) fails to partition that gather when the table's
# `embed` dimension is split over `context` while the ids are not split over it (the MTP
# layer's T−1 positions) — "INTERNAL: during context [post-layout]: Expected instruction to
# have shape equal to f32[1,1048575,56], actual shape is f32[1,1048575,7168]" at k3's 1M stage.
GATHERED_TABLE = ("vocab", "embed")


def _without_axis(rules: Sequence[tuple[str, Any]], axis: str) -> tuple[tuple[str, Any], ...]:
  """`rules` with the mesh axis `axis` taken out of every rule (rules left empty dropped)."""
  out = []
  for name, axes in rules:
    if axes is None or isinstance(axes, str):
      if axes != axis:
        out.append((name, axes))
      continue
    kept = tuple(a for a in axes if a != axis)
    if kept:
      out.append((name, kept if len(kept) > 1 else kept[0]))
  return tuple(out)


def param_shardings(mesh: Mesh, abstract_tree: Any,
                    rules: Sequence[tuple[str, Any]] | None = None) -> Any:
  """NamedShardings for a (boxed) variables tree, e.g. `jax.eval_shape(model.init, ...)`.

  Returns a tree shaped like the *unboxed* tree (`nn.unbox(abstract_tree)`). Leaves without
  logical names (e.g. the `balance` router bias) are replicated.
  """
  rules = LOGICAL_AXIS_RULES if rules is None else rules
  specs = nn.get_partition_spec(abstract_tree)
  shapes = nn.unbox(abstract_tree)
  paths_shapes, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  flat_specs = treedef.flatten_up_to(specs)
  table_rules = _without_axis(rules, "context")
  out = [logical_to_sharding(leaf.shape, tuple(spec), mesh,
                             table_rules if tuple(spec) == GATHERED_TABLE else rules,
                             jax.tree_util.keystr(path))
         for (path, leaf), spec in zip(paths_shapes, flat_specs)]
  return jax.tree_util.tree_unflatten(treedef, out)


def batch_spec(ndim: int, context: bool = True) -> P:
  """[B, T, ...] → (batch axes, context); rank 1 → batch axes only; scalars replicated."""
  if ndim == 0:
    return P()
  if ndim == 1 or not context:
    return P(BATCH_AXES)
  return P(BATCH_AXES, "context")


def constrain_activations(tree: Any, *, context: bool = True) -> Any:
  """Under a mesh (JAX's, `jax.set_mesh`): every array [..., B, T, d] of `tree`
  constrained to batch over (data, fsdp, expert), T over context (unless `context=False`), d
  replicated — the layout of the residual stream between layers. Without the constraint XLA may
  carry the FSDP sharding of the weights' `embed` dim into the activations, which then hold the
  whole global batch on every device (docs/notes/sharding.md). Axes a dimension does not divide
  are dropped. Without a mesh the tree is returned unchanged."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return tree

  def one(x):
    if not hasattr(x, "ndim") or x.ndim < 3:
      return x
    lead = (None,) * (x.ndim - 3)
    spec = P(*lead, BATCH_AXES, "context" if context else None, None)
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, _divisible_spec(x.shape, spec, mesh)))

  return jax.tree.map(one, tree)


def batch_sharding(mesh: Mesh, ndim: int = 2, context: bool = True) -> NamedSharding:
  """Sharding of a [B, T, ...] batch array: batch over (data, fsdp, expert), T over context."""
  return NamedSharding(mesh, batch_spec(ndim, context))


def batch_shardings(mesh: Mesh, batch: Any) -> Any:
  """Shardings for a tree of batch arrays (leading [B] or [B, T])."""
  return jax.tree_util.tree_map(lambda x: batch_sharding(mesh, np.ndim(x)), batch)


def cache_shardings(mesh: Mesh, cache: Any, batch_size: int) -> Any:
  """Decode caches (KDA states, conv tails, MLA latents): the first dim equal to `batch_size`
  is sharded over the batch axes (leading [num_groups] axes of scanned caches stay replicated),
  when it divides; everything else is replicated (a cache is read whole every step)."""
  n = axis_size(mesh, BATCH_AXES)

  def one(x):
    shape = tuple(np.shape(x))
    if batch_size % n == 0 and batch_size in shape:
      i = shape.index(batch_size)
      return NamedSharding(mesh, P(*([None] * i + [BATCH_AXES])))
    return NamedSharding(mesh, P())

  return jax.tree_util.tree_map(one, cache)


# ------------------------------------------------------------------------- early checks
def check_shapes(config: Any, mesh: Mesh | jax.sharding.AbstractMesh, *,
                 batch_size: int | None = None, seq_len: int | None = None) -> None:
  """Clear errors before compiling: experts vs. the expert axis, sequence vs. the context
  axis, batch vs. the batch axes. `config` is a ModelConfig."""
  ep = axis_size(mesh, "expert")
  cp = axis_size(mesh, "context")
  nb = axis_size(mesh, BATCH_AXES)
  moe = config.text.first_dense_layers < config.text.num_layers
  if moe and config.text.num_experts % ep:
    raise ValueError(
        f"ModelConfig.text.num_experts: {config.text.num_experts} experts are not divisible by the "
        f"expert axis size {ep}")
  if seq_len is not None and seq_len % cp:
    raise ValueError(
        f"seq_len: sequence length {seq_len} is not divisible by the context axis size {cp}")
  if batch_size is not None and batch_size % nb:
    raise ValueError(
        f"batch_size: {batch_size} is not divisible by the batch axes data*fsdp*expert = {nb}")


# ------------------------------------------------------------------------- placement
def put_batch(batch: Any, shardings: Any) -> Any:
  """Place a host tree (numpy or single-device arrays, the same global values on every process)
  onto `shardings`; arrays already laid out that way are returned as they are.

  With several processes (jax.distributed) each process materialises only the slices its own
  devices hold (`make_array_from_callback`): the per-process part of data loading.
  """
  multi = jax.process_count() > 1

  def one(x, sh):
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sh, x.ndim):
      return x
    if not multi:
      return jax.device_put(x, sh)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])

  return jax.tree_util.tree_map(one, batch, shardings)


# ------------------------------------------------------------------------- run configs
def uses_mesh(mesh_cfg: Any, data_parallel: bool = False) -> bool:
  """Whether a run config asks for a mesh: any axis other than `data` > 1, `data` > 1, or
  `data_parallel` (then data = -1 fills every device). The default (all 1, data = -1) keeps
  the single-device step."""
  if mesh_cfg is None:
    return bool(data_parallel)
  c = MeshConfig.from_any(mesh_cfg)
  return bool(data_parallel) or c.data > 1 or any(
      getattr(c, a) != 1 for a in MESH_AXES if a != "data") or c.fsdp_over_data


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None) -> None:
  """`jax.distributed.initialize` from arguments or the usual environment variables
  (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID; unset: the cluster's own
  auto-detection, e.g. SLURM or Cloud TPU). Call before anything touches a device.

  CPU processes exchange data through gloo (XLA:CPU's cross-process collectives).
  """
  env = os.environ
  coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
  if num_processes is None and env.get("JAX_NUM_PROCESSES"):
    num_processes = int(env["JAX_NUM_PROCESSES"])
  if process_id is None and env.get("JAX_PROCESS_ID"):
    process_id = int(env["JAX_PROCESS_ID"])
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes: expected >= 1, found {num_processes}")
  if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"process_id: expected in [0, {num_processes}), found {process_id}")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id)


__all__ = [
    "MESH_AXES", "BATCH_AXES", "LOGICAL_AXIS_RULES", "axis_rules", "params_over", "MeshConfig", "mesh_shape",
    "make_mesh", "abstract_mesh", "axis_size", "activate", "logical_to_sharding",
    "logical_specs", "param_shardings", "batch_spec", "batch_sharding", "batch_shardings",
    "cache_shardings", "check_shapes", "constrain_activations", "constrain_like_params",
    "put_batch", "uses_mesh", "initialize_distributed",
]
