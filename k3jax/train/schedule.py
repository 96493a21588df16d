"""Learning-rate schedule: linear warm-up then cosine decay (docs/k3.md §8: cosine, 1% warm-up)."""

from __future__ import annotations

import jax.numpy as jnp


def warmup_cosine(peak_lr: float, total_steps: int, warmup_frac: float = 0.01,
                  final_frac: float = 0.1):
  """lr(step): 0 → peak linearly over max(1, warmup_frac·total) steps, then a cosine from
  peak down to final_frac·peak at `total_steps` (held there after)."""
  if total_steps <= 0:
    raise ValueError(f"train.steps: expected > 0, found {total_steps}")
  if not 0 <= warmup_frac < 1:
    raise ValueError(f"optim.warmup_frac: expected a value in [0, 1), found {warmup_frac}")
  warmup = max(1, int(round(warmup_frac * total_steps)))

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    # Step 0 already gets a non-zero rate: (step + 1) / warmup.
    warm = peak_lr * jnp.minimum(1.0, (step + 1.0) / warmup)
    frac = jnp.clip((step - warmup) / max(1, total_steps - warmup), 0.0, 1.0)
    cos = final_frac + (1 - final_frac) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
    return jnp.where(step < warmup, warm, peak_lr * cos)

  return schedule
