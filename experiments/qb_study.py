r"""Quantile Balancing vs the sign rule vs no balancing (docs/k3.md §7).

  python -m experiments.qb_study --out=runs/qb_study                      # synthetic router
  python -m experiments.qb_study --out=runs/qb_study --train_steps=100    # + small training

Synthetic router: each step draws a fresh batch of m tokens x ~ N(0, I_d); scores
s = sigmoid(x·W + skew) with a fixed random W and a per-expert skew (some experts are far more
attractive: the imbalance a fresh router shows). Each method routes top-k on s + b and updates
b from that step's statistics for the next step: "qb" (histogram quantile, 1000 bins), "sign"
(b += γ·sign(mean − load), γ = --gamma), "none". Training: the same three methods on
`--config_preset` (the loop of experiments/train.py, `balance.method` switched).
Prints a table (load CV and idle experts at chosen steps), writes qb_study.json and
qb_study.png (CV and idle experts over steps).
"""

from __future__ import annotations

import json
import os

from absl import app, flags

FLAGS = flags.FLAGS


def _define_flags():
  # Defined only when run as a script (no clash with other entry points' flags on import).
  flags.DEFINE_string("out", "runs/qb_study", "Output directory.")
  flags.DEFINE_integer("steps", 50, "Synthetic router steps.")
  flags.DEFINE_integer("tokens", 4096, "Tokens per synthetic batch (m).")
  flags.DEFINE_integer("experts", 64, "Experts (n).")
  flags.DEFINE_integer("k", 8, "Experts per token (k).")
  flags.DEFINE_float("gamma", 1e-3, "Sign-rule step γ.")
  flags.DEFINE_integer("train_steps", 0, "Also train this many steps per method "
                       "(0: synthetic only).")
  flags.DEFINE_string("config_preset", "tiny", "Preset of the training comparison.")


METHODS = ("qb", "sign", "none")


def synthetic(steps: int, m: int, n: int, k: int, gamma: float, seed: int = 0,
              d: int = 32, bins: int = 1000, value_range=(-1.0, 1.0)) -> dict:
  """{method: {"cv": [steps], "idle": [steps]}} of the synthetic router (module doc)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from k3jax.ops import balance as ops
  from k3jax.ops.moe import route
  from k3jax.train.metrics import load_stats

  kw, ks = jax.random.split(jax.random.PRNGKey(seed))
  w = jax.random.normal(kw, (d, n)) / np.sqrt(d)
  skew = 2.0 * jax.random.normal(ks, (n,))

  @jax.jit
  def step(bias, key, method_id):
    x = jax.random.normal(key, (m, d))
    s = jax.nn.sigmoid(x @ w + skew)
    _, idx, cutoff = route(s, bias, k)
    load = jnp.zeros(n).at[idx.reshape(-1)].add(1.0)
    hist = ops.margin_histogram(s, cutoff, bins, value_range)
    nxt = jnp.select([method_id == 0, method_id == 1],
                     [ops.qb_bias_from_histogram(hist, k, value_range),
                      ops.sign_rule_update(bias, load, gamma)], jnp.zeros_like(bias))
    return nxt, load

  out = {}
  for mid, method in enumerate(METHODS):
    bias = jnp.zeros(n)
    loads = []
    for t in range(steps):
      bias, load = step(bias, jax.random.fold_in(jax.random.PRNGKey(seed + 1), t), mid)
      loads.append(np.asarray(load))
    cv, idle = load_stats(np.stack(loads))
    out[method] = {"cv": cv.tolist(), "idle": idle.astype(int).tolist()}
  return out


def training(steps: int, preset_name: str, out_dir: str) -> dict:
  """{method: {"step": [...], "cv": [...], "idle": [...], "loss": [...]}} from short runs."""
  from k3jax.train.run import base_config, run_config
  from k3jax.train.trainer import train
  res = {}
  for method in METHODS:
    c = base_config(preset_name)
    c.train.steps, c.train.log_every = steps, 1
    c.train.checkpoint_every = c.train.eval_every = 0
    c.balance.method = method
    recs = train(run_config(c), os.path.join(out_dir, f"train_{method}"), progress=False)
    res[method] = {"step": [r["step"] for r in recs],
                   "cv": [r.get("load_cv_mean") for r in recs],
                   "idle": [r.get("idle_experts_total") for r in recs],
                   "loss": [r["loss"] for r in recs]}
  return res


def plot(results: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [k for k in ("synthetic", "training") if k in results]
  fig, axes = plt.subplots(len(rows), 2, figsize=(11, 3.5 * len(rows)), squeeze=False)
  for r, name in enumerate(rows):
    for method, v in results[name].items():
      x = v.get("step", list(range(1, len(v["cv"]) + 1)))
      axes[r, 0].plot(x, v["cv"], label=method)
      axes[r, 1].plot(x, v["idle"], label=method)
    axes[r, 0].set_title(f"{name}: expert-load CV")
    axes[r, 1].set_title(f"{name}: idle experts")
    for a in axes[r]:
      a.set_xlabel("step")
      a.legend()
      a.grid(alpha=0.3)
    axes[r, 0].set_yscale("log")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  os.makedirs(FLAGS.out, exist_ok=True)
  results = {"synthetic": synthetic(FLAGS.steps, FLAGS.tokens, FLAGS.experts, FLAGS.k,
                                    FLAGS.gamma)}
  if FLAGS.train_steps:
    results["training"] = training(FLAGS.train_steps, FLAGS.config_preset, FLAGS.out)
  show = [s for s in (1, 2, 5, 10, 20, 50, 100, 200) if s <= FLAGS.steps]
  print(f"synthetic router: m={FLAGS.tokens} tokens, n={FLAGS.experts} experts, "
        f"k={FLAGS.k}; load CV (idle experts) after each step's bias update")
  print("method | " + " | ".join(f"step {s}" for s in show))
  for method, v in results["synthetic"].items():
    print(f"{method:6s} | " + " | ".join(f"{v['cv'][s - 1]:.3f} ({v['idle'][s - 1]})"
                                        for s in show))
  if "training" in results:
    print(f"training ({FLAGS.config_preset}, {FLAGS.train_steps} steps): mean load CV / idle "
          "experts, first → last logged step")
    for method, v in results["training"].items():
      print(f"{method:6s} | CV {v['cv'][0]:.3f} → {v['cv'][-1]:.3f} | idle {v['idle'][0]} → "
            f"{v['idle'][-1]} | loss {v['loss'][-1]:.3f}")
  with open(os.path.join(FLAGS.out, "qb_study.json"), "w") as f:
    json.dump(results, f)
  plot(results, os.path.join(FLAGS.out, "qb_study.png"))
  print(json.dumps({m: {"cv_step1": v["cv"][0], "cv_last": v["cv"][-1]}
                    for m, v in results["synthetic"].items()}))


if __name__ == "__main__":
  _define_flags()
  app.run(main)
