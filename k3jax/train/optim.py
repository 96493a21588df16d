"""The optimizer of docs/k3.md §8: Per-Head Muon + AdamW, QK-Clip, and where each parameter goes.

Parameters are split by Flax path (`param_label`):
  "adam"    embeddings, lm_head, norm weights, vectors (A_log, dt_bias, AttnRes pseudo-queries
            `proj`), conv kernels: AdamW (β1 0.9, β2 0.95), weight decay on embedding/lm_head only.
  "muon"    every other kernel (2-D or 3-D once a scanned layer axis is removed).
  "balance" the router bias (`balance` collection): no gradient; Quantile Balancing sets it
            (k3jax.train.balance).
  "frozen"  with `make_optimizer(freeze_experts=True)` (config `train.freeze_experts`): the
            routed experts (`.../experts/...`, either expert_format) get zero updates and no
            optimizer state — frozen-expert fine-tuning. Integer leaves (the MXFP4 experts'
            `weight_packed` / `weight_scale`, expert_format="mxfp4") are only allowed there:
            without the switch, building the optimizer state is a ValueError naming them.

Per-Head Muon (`scale_by_per_head_muon`): Nesterov momentum (0.95), then Newton–Schulz
orthogonalisation of each *block* separately, then scale 0.2·√max(fan_in, fan_out) of the block
(so the update RMS matches AdamW's and one learning rate serves both). Blocks (`muon_blocks`):
  [in, H, hd]  q/k/v/g projections, f_b, g_b, q_b_proj, kv_b_proj: one [in, hd] matrix per head
  [H, hd, out] o_proj, the vision tower's wo: one [hd, out] matrix per head
  [in, 3, H, hd] the vision tower's fused wqkv: one [in, hd] matrix per (q|k|v, head)
  [E, in, out] experts/w1,w2,w3: one matrix per expert
  [in, out]    any other kernel: the whole matrix
and a scanned parameter (`body/...`) adds its leading [num_groups] axis to the blocks, so every
layer is orthogonalised on its own. Decoupled weight decay 0.1 and the learning rate follow.
We write Newton–Schulz ourselves (20 lines) rather than `optax.contrib.muon` so the block view
is explicit and testable; the maths is the same.

QK-Clip (`qk_clip`): after the update, for an MLA head h with max logit L_h > τ, γ = τ/L_h:
  q_b_proj[..., h, :nope] *= √γ   (query nope part)    kv_b_proj[..., h, :nope] *= √γ (key nope)
  q_b_proj[..., h, nope:] *= γ    (query rope part: it multiplies the shared key part k_r of
                                   kv_a_proj_with_mqa, which is *not* clipped, docs/k3.md §8)
Every logit of head h, q_n·k_n + q_r·k_r, is then multiplied by exactly γ, so its max is τ.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import optax

from k3jax.config import ModelConfig, dtype_of
from k3jax.train import balance as qb
from k3jax.train.run import RunConfig
from k3jax.train.schedule import warmup_cosine
from k3jax.tree_paths import path_str

NS_COEFFS = (3.4445, -4.7750, 2.0315)
ADAM_NAMES = ("A_log", "dt_bias", "proj", "weight")   # leaf names that are vectors/norms
ADAM_MODULES = ("embed_tokens", "lm_head")


def _is_scanned(path: str) -> bool:
  return path.startswith("body/") or "/body/" in path


def _is_integer(dtype) -> bool:
  """Integer leaves, and the float0 gradients `jax.grad(allow_int=True)` gives them."""
  return dtype is not None and (jnp.issubdtype(dtype, jnp.integer) or
                                dtype == jax.dtypes.float0)


def param_label(path: str, shape, dtype=None, freeze_experts: bool = False) -> str:
  """"adam" | "muon" | "balance" | "frozen" for a variable at Flax path `path` (module doc).

  `dtype`: the leaf's dtype; an integer one (packed MXFP4 experts) is "frozen" when
  `freeze_experts`, else a ValueError (they cannot take a gradient step)."""
  parts = path.split("/")
  if parts[0] == "balance":
    return "balance"
  if parts[0] == "params":
    parts = parts[1:]
  if freeze_experts and "experts" in parts:
    return "frozen"
  if _is_integer(dtype):
    raise ValueError(
        f"{path}: {jnp.dtype(dtype)} parameter cannot be trained (packed MXFP4 experts, "
        f"expert_format='mxfp4'); freeze the experts (train.freeze_experts=True, "
        f"make_optimizer(freeze_experts=True)) or train with expert_format='bf16'")
  name = parts[-1]
  ndim = len(shape) - _is_scanned("/".join(parts))
  if (any(m in parts for m in ADAM_MODULES) or name in ADAM_NAMES
      or any("conv" in p for p in parts) or ndim < 2):
    return "adam"
  return "muon"


def _is_vision_wo(parts) -> bool:
  # The vision tower's attention output [H, hd, out] (MoonViT's name for o_proj).
  return "wo" in parts and "vision_tower" in parts


def muon_blocks(path: str, shape) -> tuple[tuple[int, ...], int, int]:
  """(batch axes, fan-in axis, fan-out axis) of a Muon parameter (see module doc)."""
  s = 1 if _is_scanned(path) else 0
  lead = tuple(range(s))
  nd = len(shape) - s
  parts = path.split("/")
  if nd == 2:
    return lead, s, s + 1
  if nd == 3:
    if "experts" in parts or "o_proj" in parts or _is_vision_wo(parts):  # [E|H, in|hd, out]
      return lead + (s,), s + 1, s + 2
    return lead + (s + 1,), s, s + 2               # [in, H, hd]
  if nd == 4 and "wqkv" in parts:
    # The vision tower's fused [in, 3, H, hd]: q, k and v of each head are separate
    # projections, orthogonalised one by one like the decoder's q/k/v heads.
    return lead + (s + 1, s + 2), s, s + 3
  raise ValueError(f"Muon parameter {path}: expected 2-D, 3-D or a 4-D wqkv (plus a scanned "
                   f"layer axis), found shape {tuple(shape)}")


def newton_schulz(g: jax.Array, steps: int = 5, eps: float = 1e-7) -> jax.Array:
  """Approximate U·Vᵀ of G = U·S·Vᵀ for every matrix of g [..., m, n] (fp32, batched)."""
  a, b, c = NS_COEFFS
  x = g.astype(jnp.float32)
  wide = x.shape[-2] <= x.shape[-1]
  if not wide:                       # iterate on the smaller Gram matrix
    x = jnp.swapaxes(x, -1, -2)
  x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + eps)
  for _ in range(steps):
    gram = x @ jnp.swapaxes(x, -1, -2)
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x if wide else jnp.swapaxes(x, -1, -2)


def orthogonalize_blocks(g: jax.Array, path: str, steps: int = 5,
                         scale: float = 0.2) -> jax.Array:
  """Newton–Schulz of each block of `g` (per head / expert / layer), times
  scale·√max(fan_in, fan_out) of the block; same shape and dtype as `g`."""
  batch, fin, fout = muon_blocks(path, g.shape)
  perm = batch + (fin, fout)
  inv = tuple(sorted(range(len(perm)), key=perm.__getitem__))
  out = newton_schulz(jnp.transpose(g, perm), steps)
  out = out * (scale * max(g.shape[fin], g.shape[fout]) ** 0.5)
  return jnp.transpose(out, inv).astype(g.dtype)


class MuonState(NamedTuple):
  mu: Any


def scale_by_per_head_muon(momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                           scale: float = 0.2, mu_dtype=None,
                           offload_momentum: bool = False) -> optax.GradientTransformation:
  """Nesterov momentum + per-block Newton–Schulz + shape scale (no learning rate, no decay).

  Blocks are found from the parameter paths (`muon_blocks`), so apply it to a tree keyed by
  Flax paths (under optax.multi_transform the masked tree keeps the full paths).
  The momentum is stored in `mu_dtype` (None: the parameter's dtype); momentum, direction and
  Newton–Schulz run in fp32, and the update has the gradient's dtype.

  A scanned parameter (`body/...`, [num_groups, ...]) is updated one layer at a time in a
  `fori_loop` whose carries are the gradient and the momentum: layer l's update overwrites
  layer l's gradient in place and its new momentum the old one, so the optimizer needs no
  stacked temporary besides the gradient itself, and the fp32 Gram matrices of one layer at a
  time (all layers at once were f32[22,14,3072,3072] per device for k3, docs/notes/sharding.md).

  `offload_momentum=True`: the momentum lives in host memory (its sharding's memory kind
  "pinned_host", `k3jax.train.sharded.opt_state_shardings(offload_momentum=True)`); each
  parameter, or each layer of a scanned one, is copied to the device, updated and copied back,
  so the device holds one layer's momentum at a time. Needs a jit with explicit in/out
  shardings (`k3jax.train.sharded.build_step` on a mesh).
  """
  f32 = jnp.float32
  to_device = ((lambda x: jax.device_put(x, jax.memory.Space.Device)) if offload_momentum
               else (lambda x: x))
  to_host = ((lambda x: jax.device_put(x, jax.memory.Space.Host)) if offload_momentum
             else (lambda x: x))

  def init_fn(params):
    return MuonState(mu=jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype), params))

  def one(path, g, m):
    """(update, new momentum) of one parameter (or one layer of a scanned one), on device."""
    m32 = momentum * m.astype(f32) + g.astype(f32)
    d = g.astype(f32) + momentum * m32 if nesterov else m32
    u = orthogonalize_blocks(d, path, ns_steps, scale).astype(g.dtype)
    return u, m32.astype(m.dtype)

  def leaf(p, g, m):
    path = path_str(p)
    if not (_is_scanned(path) and g.shape[0] > 1):
      u, m = one(path, g, to_device(m))
      return u, to_host(m)

    def layer(i, carry):
      gs, ms = carry
      # A [1, ...] stack: one layer's blocks, as `muon_blocks` sees a scanned parameter.
      u, mi = one(path, gs[i][None], to_device(ms[i])[None])
      return gs.at[i].set(u[0]), ms.at[i].set(to_host(mi[0]))

    return lax.fori_loop(0, g.shape[0], layer, (g, m))

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
    pairs = [leaf(p, g, m) for (p, g), m in zip(leaves, treedef.flatten_up_to(state.mu))]
    return (treedef.unflatten([u for u, _ in pairs]),
            MuonState(mu=treedef.unflatten([m for _, m in pairs])))

  return optax.GradientTransformation(init_fn, update_fn)


def _decay_mask(tree):
  """AdamW decays only the embedding and lm_head matrices (not norms, vectors, convs)."""
  return jax.tree_util.tree_map_with_path(
      lambda p, _: any(m in path_str(p).split("/") for m in ADAM_MODULES), tree)


def make_optimizer(schedule, *, weight_decay: float = 0.1, momentum: float = 0.95,
                   adam_b1: float = 0.9, adam_b2: float = 0.95, adam_eps: float = 1e-8,
                   muon: bool = True, balance_tx: optax.GradientTransformation | None = None,
                   clip_norm: float = 0.0, mu_dtype=None, offload_momentum: bool = False,
                   freeze_experts: bool = False) -> optax.GradientTransformationExtraArgs:
  """The optimizer over {"params": ..., "balance": ...} (labels: `param_label`).

  `muon=False` sends the Muon group to AdamW too (a baseline). `balance_tx` updates the router
  bias (default: left unchanged). Extra args (`stats=`) reach `balance_tx`. `mu_dtype` stores
  the first moments (Muon momentum, Adam's mu) in that dtype (None: each parameter's dtype);
  Adam's second moment keeps the parameter's dtype. `offload_momentum` keeps Muon's momentum in
  host memory (`scale_by_per_head_muon`). `freeze_experts` gives the routed experts zero
  updates and no state (label "frozen"); integer (packed) leaves need it (`param_label`).
  """
  lr = optax.scale_by_learning_rate(schedule)
  adam = optax.chain(optax.scale_by_adam(adam_b1, adam_b2, adam_eps, mu_dtype=mu_dtype),
                     optax.add_decayed_weights(weight_decay, mask=_decay_mask), lr)
  if muon:
    matrix = optax.chain(scale_by_per_head_muon(momentum, mu_dtype=mu_dtype,
                                                offload_momentum=offload_momentum),
                         optax.add_decayed_weights(weight_decay), lr)
  else:
    matrix = optax.chain(optax.scale_by_adam(adam_b1, adam_b2, adam_eps, mu_dtype=mu_dtype),
                         optax.add_decayed_weights(weight_decay), lr)
  transforms = {"adam": adam, "muon": matrix,
                "balance": balance_tx if balance_tx is not None else optax.set_to_zero()}
  if freeze_experts:   # only then: the state of a run without it keeps its old structure
    transforms["frozen"] = _frozen()

  def labels(tree):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: param_label(path_str(p), x.shape, getattr(x, "dtype", None),
                                 freeze_experts), tree)

  tx = optax.multi_transform(transforms, labels)
  if clip_norm and clip_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(clip_norm), tx)
  return optax.with_extra_args_support(tx)


def _frozen() -> optax.GradientTransformation:
  """Zero updates in the parameters' own dtypes (uint8 for packed experts, whose gradients
  arrive as float0 or zeros), no state: `optax.apply_updates` leaves them bit-identical."""
  def zero(u):
    return jnp.zeros(u.shape, jnp.uint8 if u.dtype == jax.dtypes.float0 else u.dtype)
  return optax.GradientTransformation(
      lambda params: optax.EmptyState(),
      lambda updates, state, params=None: (jax.tree.map(zero, updates), state))


def integer_grads_to_zeros(grads):
  """`jax.grad(..., allow_int=True)` gives integer (packed MXFP4) params float0 gradients,
  which no arithmetic accepts (accumulation, norms, clipping); this turns them into uint8
  zeros of the same shape, so a train step with frozen packed experts can sum, clip and hand
  its gradients to the optimizer (whose "frozen" label ignores them)."""
  return jax.tree.map(
      lambda g: jnp.zeros(g.shape, jnp.uint8) if g.dtype == jax.dtypes.float0 else g, grads)


# ---------------------------------------------------------------------- QK-Clip
def qk_clip_factors(max_logit: jax.Array, tau: float) -> jax.Array:
  """γ = min(1, τ / max_logit) per head (fp32)."""
  m = jnp.asarray(max_logit, jnp.float32)
  return jnp.where(m > tau, tau / jnp.maximum(m, 1e-30), 1.0)


def _clip_attention(attn: dict, max_logit: jax.Array, tau: float, nope: int) -> dict:
  """Scale q_b_proj (or q_proj) and kv_b_proj of one MLA module (leading axes allowed)."""
  gamma = qk_clip_factors(max_logit, tau)          # [..., H]
  sq = jnp.sqrt(gamma)[..., None, :, None]         # broadcast over [..., in, H, dim]
  g = gamma[..., None, :, None]
  attn = dict(attn)
  qname = "q_b_proj" if "q_b_proj" in attn else "q_proj"
  q = attn[qname]["kernel"]
  q = jnp.concatenate([q[..., :nope] * sq, q[..., nope:] * g], axis=-1).astype(q.dtype)
  attn[qname] = {**attn[qname], "kernel": q}
  kv = attn["kv_b_proj"]["kernel"]
  kv = jnp.concatenate([kv[..., :nope] * sq, kv[..., nope:]], axis=-1).astype(kv.dtype)
  attn["kv_b_proj"] = {**attn["kv_b_proj"], "kernel": kv}
  return attn


def qk_clip(params: dict, max_logits: dict[str, jax.Array], tau: float, nope: int) -> dict:
  """Apply QK-Clip to every MLA module of `params`.

  max_logits: {"path/to/self_attn": [..., H] max logit} (paths relative to params, as
  `flat_stats` gives them: "body/layers_3/self_attn", "layers_12/self_attn", ...).
  """
  if tau is None or tau <= 0:
    return params

  def visit(tree, prefix):
    if not isinstance(tree, dict):
      return tree
    if prefix in max_logits and "kv_b_proj" in tree:
      return _clip_attention(tree, max_logits[prefix], tau, nope)
    return {k: visit(v, f"{prefix}/{k}" if prefix else k) for k, v in tree.items()}

  return visit(params, "")


# ---------------------------------------------------------------------- the run's optimizer
def optimizer(run: RunConfig, config: ModelConfig
              ) -> tuple[optax.GradientTransformationExtraArgs, Callable]:
  """(tx, schedule) of pre-training and full fine-tuning: warmup-cosine, Per-Head Muon / AdamW
  over {"params", "balance"}, Quantile Balancing (or the run's other method) of the biases."""
  o = run.optim
  schedule = warmup_cosine(o.lr, run.train.steps, o.warmup_frac, o.final_lr_frac)
  balance_tx = qb.quantile_balancing(run.balance.method, k=config.text.experts_per_token,
                                     value_range=config.modes.qb_range, gamma=run.balance.gamma)
  tx = make_optimizer(schedule, weight_decay=o.weight_decay, momentum=o.momentum,
                      adam_b1=o.adam_b1, adam_b2=o.adam_b2, muon=o.muon, balance_tx=balance_tx,
                      clip_norm=o.clip_norm, mu_dtype=dtype_of(o.mu_dtype) if o.mu_dtype else None,
                      offload_momentum=o.offload_momentum,
                      freeze_experts=run.train.freeze_experts)
  return tx, schedule
