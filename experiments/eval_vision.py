r"""Does a multimodal run see? Caption loss and word accuracy with the true images vs shuffled.

  python -m experiments.eval_vision --workdir=runs/vision --json=runs/vision/eval_vision.json

Loads the newest checkpoint of a run trained on the shapes corpus (configs/tiny_multimodal.py)
and scores `--num_samples` held-out samples (k3jax/data/captions.py, split EVAL of the run's
seed), one per row, twice: with their own images ("true") and with the images of the next
sample ("shuffled": every caption sees another caption's image or clip, and as many
placeholders as that media gives). Reports, for both:
  caption_loss        nats per caption token (bytes and EOS; never placeholders or padding)
  colour_accuracy     fraction of captions whose colour word (the first content word) is
                      predicted byte for byte by the argmax under teacher forcing
  shape_accuracy      the same for the shape word (word 2)
and writes them to --json (through a temporary file + rename) and `vision_loss.png` in the run
directory: the eval caption loss over training with the true and the shuffled images (the
trainer logs both, `eval_loss` and `eval_loss_shuffled`, at every eval step).
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

from experiments import results
from k3jax.data.tokenizers import MEDIA

FLAGS = flags.FLAGS


def _define_flags():
  # Defined only when run as a script (experiments.train also defines --workdir).
  flags.DEFINE_string("workdir", None, "Run directory (checkpoints/, config.json).")
  flags.DEFINE_string("json", None, "Write the figures here (default DIR/eval_vision.json).")
  flags.DEFINE_integer("num_samples", 256, "Held-out samples to score.")
  flags.DEFINE_integer("batch_size", 16, "Rows per forward.")
  flags.mark_flags_as_required(["workdir"])


def _word_positions(s, encoded, word: int):
  """Target positions [start, end) of caption word `word` (0-based) of sample s."""
  words = s.caption.rstrip(".").split(" ")
  start = sum(len(w) + 1 for w in words[:word])
  name = s.shape if word == 2 else s.colour
  merged = int((encoded.arrays["inputs"] == MEDIA).sum())
  # Caption byte j is token 1 + merged + j, i.e. the target of position merged + j.
  return merged + start, merged + start + len(name)


def score(config, variables, samples, seq_len: int, length: int, batch_size: int = 16,
          shuffled: bool = False) -> dict:
  """Caption loss and colour / shape word accuracy of `samples` (module doc)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from k3jax.model import K3Model
  from k3jax.data import captions

  model = K3Model(config)

  @jax.jit
  def fwd(variables, batch):
    logits, _ = model.apply(variables, batch["inputs"], segment_ids=batch["segment_ids"],
                            media=batch["media"], mutable=["stats"])
    lse = jax.nn.logsumexp(logits, -1)
    tgt = jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    return lse - tgt, jnp.argmax(logits, -1)

  n = len(samples)
  items = [captions.encode(config.vision, samples[i], samples[(i + 1) % n] if shuffled else None)
           for i in range(n)]
  ce_sum = tokens = 0.0
  colour_ok, shape_ok, by_kind = [], [], {}
  for s0 in range(0, n, batch_size):
    part = items[s0:s0 + batch_size]
    rows = [[e] for e in part] + [[part[0]]] * (batch_size - len(part))
    batch = captions.pack_rows(config.vision, rows, seq_len, length)
    ce, pred = jax.device_get(fwd(variables, batch))
    for r, e in enumerate(part):
      s = samples[s0 + r]
      mask = e.arrays["loss_mask"] > 0
      k = len(mask)
      row_ce = float(ce[r, :k][mask].sum())
      ce_sum, tokens = ce_sum + row_ce, tokens + float(mask.sum())
      kc = by_kind.setdefault(s.kind, [0.0, 0.0])
      kc[0], kc[1] = kc[0] + row_ce, kc[1] + float(mask.sum())
      for word, out in ((1, colour_ok), (2, shape_ok)):
        a, b = _word_positions(s, e, word)
        out.append(bool(np.all(pred[r, a:b] == batch["targets"][r, a:b])))
  return {"caption_loss": ce_sum / max(tokens, 1.0),
          "colour_accuracy": float(np.mean(colour_ok)), "shape_accuracy": float(np.mean(shape_ok)),
          "caption_loss_by_kind": {k: v[0] / max(v[1], 1.0) for k, v in sorted(by_kind.items())},
          "caption_tokens": tokens}


def plot(workdir: str, out: str) -> str | None:
  """vision_loss.png: eval caption loss over training, true vs shuffled images."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from k3jax.train.metrics import read_metrics
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    return None
  by_step = {r["step"]: r for r in read_metrics(path)}
  recs = [by_step[s] for s in sorted(by_step) if "eval_loss_shuffled" in by_step[s]]
  if not recs:
    return None
  steps = [r["step"] for r in recs]
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(steps, [r["eval_loss"] for r in recs], "o-", label="true images")
  ax.plot(steps, [r["eval_loss_shuffled"] for r in recs], "s--",
          label="shuffled images (another caption's)")
  ax.set_xlabel("step")
  ax.set_ylabel("held-out caption loss (nats / token)")
  ax.set_title("shapes corpus: does the model see?")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return out


def evaluate_run(workdir: str, num_samples: int = 256, batch_size: int = 16) -> dict:
  """The figures of the module doc for the newest checkpoint in `workdir`."""
  import k3jax
  from k3jax.data import captions

  with open(os.path.join(workdir, "config.json")) as f:
    run = json.load(f)
  if run.get("data", {}).get("source") != "shapes":
    raise ValueError(f"--workdir: {workdir} was not trained on data.source='shapes' "
                     f"(found {run.get('data', {}).get('source')!r})")
  config, variables = k3jax.load_pretrained(workdir)
  if config.vision is None:
    raise ValueError(f"--workdir: the model of {workdir} has no vision tower")
  variables = {k: variables[k] for k in ("params", "balance") if k in variables}
  seq_len = run["train"]["seq_len"]
  length = run["data"].get("media_length") or config.vision.pack_buckets[-1]
  samples = captions.eval_samples(run["seed"], num_samples)
  true = score(config, variables, samples, seq_len, length, batch_size)
  shuf = score(config, variables, samples, seq_len, length, batch_size, shuffled=True)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  step = max((int(c) for c in os.listdir(ckpt_dir) if c.isdigit()), default=None)
  return {
      "workdir": workdir, "step": step, "num_samples": num_samples,
      "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "caption_loss": {"true": true["caption_loss"], "shuffled": shuf["caption_loss"]},
      "colour_accuracy": {"true": true["colour_accuracy"], "shuffled": shuf["colour_accuracy"],
                          "chance": 1 / len(captions.COLOURS)},
      "shape_accuracy": {"true": true["shape_accuracy"], "shuffled": shuf["shape_accuracy"],
                         "chance": 1 / len(captions.SHAPES)},
      "caption_loss_by_kind": {"true": true["caption_loss_by_kind"],
                               "shuffled": shuf["caption_loss_by_kind"]},
  }


def main(argv):
  del argv
  from absl import logging as absl_logging
  if not FLAGS["verbosity"].present:     # orbax's INFO lines would bury the result
    absl_logging.set_verbosity(absl_logging.WARNING)
  out = evaluate_run(FLAGS.workdir, FLAGS.num_samples, FLAGS.batch_size)
  png = plot(FLAGS.workdir, os.path.join(FLAGS.workdir, "vision_loss.png"))
  if png:
    out["plot"] = png
  results.write_json(FLAGS.json or os.path.join(FLAGS.workdir, "eval_vision.json"), out,
                     indent=2)
  cl, ca, sa = out["caption_loss"], out["colour_accuracy"], out["shape_accuracy"]
  print(f"step {out['step']}: caption loss {cl['true']:.3f} (true images) vs "
        f"{cl['shuffled']:.3f} (shuffled) nats/token; colour word {ca['true']:.1%} vs "
        f"{ca['shuffled']:.1%}; shape word {sa['true']:.1%} vs {sa['shuffled']:.1%}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
