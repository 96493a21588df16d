r"""Plot a training run: loss curves and an expert-load heatmap (PNG).

  python -m experiments.plot_run --workdir=runs/small [--out=runs/small/plots]

Reads DIR/metrics.jsonl. Writes `loss.png` (train loss, eval loss, the shuffled-image eval loss
of a multimodal run (experiments/eval_vision.py), bits per byte when present)
and `expert_load.png` (per MoE layer × logged step: load coefficient of variation, and idle
experts) into --out (default DIR).
"""

from __future__ import annotations

import os

from absl import app, flags

FLAGS = flags.FLAGS


def _define_flags():
  # Defined only when run as a script, so importing `plot_run` next to experiments.train
  # (which also has --workdir) does not clash.
  flags.DEFINE_string("workdir", None, "Run directory with metrics.jsonl.")
  flags.DEFINE_string("out", None, "Output directory (default: the run directory).")
  flags.mark_flags_as_required(["workdir"])


def plot_run(workdir: str, out: str | None = None) -> list[str]:
  """Write the PNGs; returns their paths."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  from k3jax.train.metrics import read_metrics

  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise ValueError(f"--workdir: no metrics.jsonl in {workdir!r}")
  recs = read_metrics(path)
  if not recs:
    raise ValueError(f"--workdir: {path} has no records")
  out = out or workdir
  os.makedirs(out, exist_ok=True)
  # A resumed run may re-log steps: keep the last record of each step.
  by_step = {r["step"]: r for r in recs}
  recs = [by_step[s] for s in sorted(by_step)]
  steps = np.array([r["step"] for r in recs])

  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(steps, [r["loss"] for r in recs], label="train loss")
  ev = [(r["step"], r["eval_loss"]) for r in recs if "eval_loss" in r]
  if ev:
    ax.plot(*zip(*ev), "o-", label="eval loss")
  shuf = [(r["step"], r["eval_loss_shuffled"]) for r in recs if "eval_loss_shuffled" in r]
  if shuf:   # multimodal runs: the held-out captions with each other's images
    ax.plot(*zip(*shuf), "s--", label="eval loss, shuffled images")
  ax.set_xlabel("step")
  ax.set_ylabel("nats / token")
  ax.legend()
  ax.grid(alpha=0.3)
  files = [os.path.join(out, "loss.png")]
  fig.tight_layout()
  fig.savefig(files[0], dpi=120)
  plt.close(fig)

  layers = sorted({k[len("moe/"):-len("/load_cv")] for r in recs for k in r
                   if k.startswith("moe/") and k.endswith("/load_cv")})
  if layers:
    cv = np.array([[r.get(f"moe/{l}/load_cv", np.nan) for r in recs] for l in layers])
    idle = np.array([[r.get(f"moe/{l}/idle_experts", np.nan) for r in recs] for l in layers])
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.5 + 0.35 * len(layers)))
    for ax, m, title in ((axes[0], cv, "expert-load CV"), (axes[1], idle, "idle experts")):
      im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="viridis",
                     extent=(steps[0], steps[-1], len(layers) - 0.5, -0.5))
      ax.set_yticks(range(len(layers)))
      ax.set_yticklabels(layers, fontsize=7)
      ax.set_xlabel("step")
      ax.set_title(title)
      fig.colorbar(im, ax=ax)
    fig.tight_layout()
    files.append(os.path.join(out, "expert_load.png"))
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)
  return files


def main(argv):
  del argv
  for f in plot_run(FLAGS.workdir, FLAGS.out):
    print(f)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
