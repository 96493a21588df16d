"""The policy-gradient loss over task and MOPD rewards (docs/k3.md §13).

Per prompt, K completions with final rewards R_1..R_K (task reward after the effort budget)
get the group baseline (GRPO):
  A_i = R_i − mean_j R_j            (÷ (std_j R_j + eps) when adv_std_norm)
Per response token t of completion i, the advantage adds the dense MOPD reward:
  Â_t = A_i + β·r_t,  r_t = clip(sg[log π_teacher(y_t) − log π_θ(y_t)], ±R_max)
(β = mopd_coef; r_t = 0 for prompts without a teacher). With ρ_t = exp(log π_θ(y_t) − log μ_t)
the per-token importance weight against the behaviour policy μ that sampled the token (fresh
tokens: the rollout policy, ρ ≈ 1; stale tokens of partial rollouts: an older policy),
  ℓ_t = min(ρ_t Â_t, clip(ρ_t, 1−ε_low, 1+ε_high) Â_t);  for Â_t < 0: ℓ_t = max(ℓ_t, c·Â_t)
(dual clip, c = dual_clip; 0 disables it), and
  loss = −Σ_t m_t ℓ_t / Σ_t m_t  +  kl_coef · Σ_t m_t k3_t / Σ_t m_t,
  k3_t = exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1   (≥ 0; reference = initial policy)
over the mask m of real response tokens. The gradient reaches π_θ only through ρ_t (and k3):
the MOPD reward is a number (stop-gradient), as the spec writes it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.posttrain.rl.rewards import mopd_reward


@dataclasses.dataclass(frozen=True)
class LossConfig:
  eps_low: float = 0.2
  eps_high: float = 0.28
  dual_clip: float = 3.0
  kl_coef: float = 0.0
  mopd_coef: float = 1.0
  r_max: float = 1.0
  adv_std_norm: bool = False
  adv_eps: float = 1e-6

  def __post_init__(self):
    for f in ("eps_low", "eps_high", "kl_coef", "mopd_coef", "adv_eps"):
      if getattr(self, f) < 0:
        raise ValueError(f"loss.{f}: expected >= 0, found {getattr(self, f)}")
    if not self.r_max > 0:
      raise ValueError(f"loss.r_max: expected > 0, found {self.r_max}")
    if self.dual_clip and self.dual_clip <= 1:
      raise ValueError(f"loss.dual_clip: expected 0 (off) or > 1, found {self.dual_clip}")


def group_advantages(rewards, k: int, std_norm: bool = False, eps: float = 1e-6) -> np.ndarray:
  """rewards [G·K] (groups contiguous) → A [G·K] fp32: reward minus its group's mean
  (÷ (group std + eps) with std_norm)."""
  r = np.asarray(rewards, np.float64)
  if r.ndim != 1 or r.size % k:
    raise ValueError(f"rewards: expected [G*K] with K={k}, found shape {r.shape}")
  g = r.reshape(-1, k)
  a = g - g.mean(axis=1, keepdims=True)
  if std_norm:
    a = a / (g.std(axis=1, keepdims=True) + eps)
  return a.reshape(-1).astype(np.float32)


def policy_loss(lp_new: jax.Array, batch: dict, cfg: LossConfig):
  """(loss, aux) from the trainer's log-probs lp_new [B,L] (module doc).

  batch: mask [B,L], behaviour_lp [B,L], adv [B], teacher_lp [B,L], has_teacher [B],
  and ref_lp [B,L] when kl_coef > 0. aux: mopd (mean r_t over teacher-scored tokens),
  clip_frac, ratio_max, kl."""
  m = batch["mask"].astype(jnp.float32)
  n = jnp.maximum(m.sum(), 1.0)
  lp_new = lp_new.astype(jnp.float32)
  rho = jnp.exp(lp_new - batch["behaviour_lp"])
  has_t = batch["has_teacher"].astype(jnp.float32)[:, None]
  r = mopd_reward(batch["teacher_lp"], lp_new, cfg.r_max) * has_t
  adv = batch["adv"][:, None] + cfg.mopd_coef * r
  clipped = jnp.clip(rho, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
  ell = jnp.minimum(rho * adv, clipped * adv)
  if cfg.dual_clip:
    ell = jnp.where(adv < 0, jnp.maximum(ell, cfg.dual_clip * adv), ell)
  loss = -jnp.sum(m * ell) / n
  kl = jnp.zeros([], jnp.float32)
  if cfg.kl_coef > 0:
    d = batch["ref_lp"] - lp_new
    kl = jnp.sum(m * (jnp.exp(d) - d - 1.0)) / n
    loss = loss + cfg.kl_coef * kl
  mt = m * has_t
  aux = {"mopd": jnp.sum(mt * r) / jnp.maximum(mt.sum(), 1.0),
         "clip_frac": jnp.sum(m * (clipped != rho)) / n,
         "ratio_max": jnp.max(jnp.where(m > 0, rho, 0.0)), "kl": kl}
  return loss, aux
