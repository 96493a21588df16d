"""Metrics: FLOP model, matmul peak, MFU, router statistics, JSONL + TensorBoard writer.

FLOPs per trained token (forward + backward = 3 × forward; a matmul is 2 FLOPs per MAC):
  6 · N_active
  + MLA:  6 · L_mla · H · (d_qk + d_v) · T/2       (scores and values over the causal prefix,
                                                    average context T/2)
  + KDA:  6 · L_kda · H · (2·dk·dv + C·(dk + dv)/2) (state read q·S and update kᵀv per token,
                                                    plus the intra-chunk causal part, chunk C)
N_active counts every parameter a token multiplies: all kernels except the embedding lookup
(lm_head included, once even if tied), and of the routed experts only k/E of them; the vision
tower and projector are left out (they run per patch, not per text token: MFU counts the
language model's FLOPs only). The MTP
layer (run in training) is included. MFU = FLOPs/token · tokens/s ÷ peak, where the peak is
measured at start-up in the same process: the best of a few jitted matmuls in the model's
compute dtype (`matmul_peak`; 1024² on a CPU, 8192² on an accelerator).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import MLA, ModelConfig
from k3jax.train.optim import muon_blocks, param_label


# ---------------------------------------------------------------------- FLOPs and peak
def _leaf_items(params, prefix=""):
  if isinstance(params, dict) or hasattr(params, "items"):
    for k, v in params.items():
      yield from _leaf_items(v, f"{prefix}/{k}" if prefix else str(k))
  else:
    yield prefix, params


def active_params(config: ModelConfig, params: dict, with_mtp: bool = True) -> float:
  """Parameters multiplied per token (see module docstring); `params` may be abstract."""
  total = 0.0
  frac = config.text.experts_per_token / max(1, config.text.num_experts)
  for path, x in _leaf_items(params):
    parts = path.split("/")
    if "embed_tokens" in parts:
      if config.text.tie_word_embeddings:
        total += float(np.prod(x.shape))   # used as the head
      continue
    if not with_mtp and "mtp" in parts:
      continue
    if "vision_tower" in parts or "mm_projector" in parts:
      continue    # they run per image patch / merged token, not per text token
    n = float(np.prod(x.shape))
    total += n * frac if "experts" in parts else n
  return total


def flops_per_token(config: ModelConfig, params: dict, seq_len: int,
                    with_mtp: bool = True) -> float:
  """Training FLOPs per token (module docstring)."""
  n_mla = sum(1 for m, _ in config.text.layer_types() if m == MLA) + (
      config.text.num_mtp_layers if with_mtp else 0)
  n_kda = config.text.num_layers - sum(1 for m, _ in config.text.layer_types() if m == MLA)
  mla = 6 * n_mla * config.text.num_heads * (config.text.qk_head_dim + config.text.v_head_dim) * seq_len / 2
  dk = dv = config.text.kda_head_dim
  c = min(config.modes.kda_chunk_size, seq_len)
  kda = 6 * n_kda * config.text.kda_num_heads * (2 * dk * dv + c * (dk + dv) / 2)
  return 6 * active_params(config, params, with_mtp) + mla + kda


def muon_flops_per_step(params: dict, ns_steps: int = 5, *,
                        freeze_experts: bool = False) -> float:
  """FLOPs of Per-Head Muon's Newton–Schulz per optimizer step (independent of the batch):
  per block [m ≤ n]: ns_steps · (4·m²·n + 2·m³). With small batches on a CPU this rivals the
  model's own FLOPs, which is why `hfu` (model + optimizer FLOPs) is logged next to `mfu`.
  Frozen experts (`freeze_experts`, packed MXFP4 ones included) take no Muon step."""
  total = 0.0
  for path, x in _leaf_items({"params": params}):
    if param_label(path, x.shape, x.dtype, freeze_experts) != "muon":
      continue
    batch, fin, fout = muon_blocks(path, x.shape)
    m, n = sorted((x.shape[fin], x.shape[fout]))
    blocks = float(np.prod([x.shape[b] for b in batch])) if batch else 1.0
    total += blocks * ns_steps * (4 * m * m * n + 2 * m ** 3)
  return total


def matmul_peak(n: int | None = None, repeats: int = 5, dtype=jnp.float32) -> float:
  """Measured matmul FLOP/s of this process's default device: best of `repeats` jitted
  [n,n]@[n,n] products (after one compile-and-warm-up run). n None: 1024 on a CPU, 8192 on an
  accelerator (where 1024² is far from its peak)."""
  if n is None:
    n = 1024 if jax.default_backend() == "cpu" else 8192
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
  b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
  f = jax.jit(lambda x, y: x @ y)
  f(a, b).block_until_ready()
  best = math.inf
  for _ in range(repeats):
    t = time.perf_counter()
    f(a, b).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2.0 * n ** 3 / best


# ---------------------------------------------------------------------- router statistics
def load_stats(load: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(coefficient of variation, number of idle experts) of loads [..., E] (per row)."""
  load = np.asarray(load, np.float64)
  mean = load.mean(-1)
  cv = load.std(-1) / np.maximum(mean, 1e-12)
  return cv, (load == 0).sum(-1)


def router_metrics(flat: dict[str, Any]) -> dict[str, float]:
  """Per-layer scalars from `flat_stats`: expert-load CV / idle experts (`moe/<layer>/...`),
  dropped tokens (per layer, and `dropped_fraction` of all routed pairs), and the max attention
  logit (overall and per MLA layer)."""
  out: dict[str, float] = {}
  max_logits = []
  for key, v in sorted(flat.items()):
    module, name = key.rsplit("/", 1)
    v = np.asarray(v)
    if name == "load":
      cv, idle = load_stats(v)
      rows = [(module, cv, idle)] if v.ndim == 1 else [
          (f"{module}_{g}", cv[g], idle[g]) for g in range(v.shape[0])]
      for m, c, i in rows:
        out[f"moe/{m}/load_cv"] = float(c)
        out[f"moe/{m}/idle_experts"] = int(i)
    elif name == "dropped":
      out[f"moe/{module}/dropped"] = int(v.sum())
    elif name == "max_logit":
      out[f"attn/{module}/max_logit"] = float(v.max())
      max_logits.append(float(v.max()))
  if max_logits:
    out["max_attn_logit"] = max(max_logits)
  routed = sum(float(np.asarray(v).sum()) for k, v in flat.items() if k.endswith("/load"))
  if routed:   # (token, expert) pairs over capacity, as a fraction of all routed pairs
    out["dropped_fraction"] = sum(
        v for k, v in out.items() if k.endswith("/dropped")) / routed
  cvs = [v for k, v in out.items() if k.endswith("/load_cv")]
  if cvs:
    out["load_cv_mean"] = float(np.mean(cvs))
    out["idle_experts_total"] = int(sum(v for k, v in out.items() if k.endswith("/idle_experts")))
  return out


def load_matrix(flat: dict[str, Any]) -> tuple[list[str], np.ndarray]:
  """(layer names, loads [layers, E]) of every MoE layer, for the expert-load heatmap."""
  names, rows = [], []
  for key, v in sorted(flat.items()):
    module, name = key.rsplit("/", 1)
    if name != "load":
      continue
    v = np.asarray(v)
    if v.ndim == 1:
      names.append(module)
      rows.append(v)
    else:
      for g in range(v.shape[0]):
        names.append(f"{module}_{g}")
        rows.append(v[g])
  return names, np.stack(rows) if rows else np.zeros((0, 0))


# ---------------------------------------------------------------------- writer
class MetricsWriter:
  """Appends one JSON object per logged step to DIR/metrics.jsonl and mirrors the scalars to
  TensorBoard event files in DIR (tensorboardX)."""

  def __init__(self, workdir: str, tensorboard: bool = True):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(self.path) and os.path.getsize(self.path):
      with open(self.path, "rb+") as f:     # a run killed mid-line: start on a fresh line
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
          f.write(b"\n")
    self.tb = None
    if tensorboard:
      # optional: TensorBoard events (train.tensorboard); tensorboardX loads torch when torch
      # is installed (seconds), so only runs that write events pay for it.
      from tensorboardX import SummaryWriter
      self.tb = SummaryWriter(logdir=workdir)

  def write(self, step: int, scalars: dict[str, Any], extra: dict | None = None) -> None:
    rec = {"step": int(step), **{k: _py(v) for k, v in scalars.items()}, **(extra or {})}
    with open(self.path, "a") as f:
      f.write(json.dumps(rec) + "\n")
      f.flush()
    if self.tb is not None:
      for k, v in scalars.items():
        v = _py(v)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
          self.tb.add_scalar(k, v, int(step))

  def close(self) -> None:
    if self.tb is not None:
      self.tb.flush()
      self.tb.close()


def _py(v):
  if isinstance(v, (np.generic, np.ndarray)) or hasattr(v, "dtype"):
    v = np.asarray(v)
    return v.item() if v.ndim == 0 else v.tolist()
  return v


def read_metrics(path: str) -> list[dict]:
  """The records of a metrics.jsonl (a torn last line from a killed run is ignored)."""
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return out
