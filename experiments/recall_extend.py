r"""Recall extended by a long-context cool-down, at CPU scale (docs/k3.md §8; issue: a model
cooled down on longer rows recalls across them).

  python -m experiments.recall_extend --out=runs/recall_extend

Two models of equal size (`tiny` shapes, --layers layers, no MTP): the hybrid (the config's
layer pattern: KDA layers, the last one MLA) and a KDA-only model (the same pattern with KDA in
place of MLA: `kda_only`). Each is

  1. pre-trained on short rows (--short_len tokens): long-document rows of the stdlib corpus
     with evidence tasks (k3jax/data/evidence.py: kv lookup, two-hop chain, count) mixed in at
     --pretrain_evidence — a model this small learns the tasks only by seeing them;
  2. cooled down on rows --long_len tokens long (8–16× longer), the same mix at
     --cooldown_evidence — one run: the optimizer state and the warm-up-cosine schedule carry
     across the stage boundary (`train.stages`, `k3jax.train.stages.stage_run`), the step is
     the trainer's own (`k3jax.train.sharded.build_step`).

Evaluated at the long length before (end of stage 1) and after (end of stage 2): for each task
and each evidence–question distance bin (--bins), --eval_rows rows placed at distances drawn
uniformly in the bin (`evidence.make_row(distance=…)`), scored exactly from one forward pass
(`evidence.check_logits`: greedy decoding's verdict on the whole answer) and per answer token.
Writes recall_extend.json (flags, parameter counts, losses, accuracies per model × phase ×
task × bin) and recall_extend.png (accuracy vs distance, before / after, hybrid / KDA-only)
into --out.
"""

from __future__ import annotations

import json
import os
import time

import jax
import matplotlib
import numpy as np
from absl import app, flags

from k3jax.data import corpus as corpus_lib
from k3jax.data import evidence, long_docs
from k3jax.model import K3Model
from k3jax.train import stages as stages_lib
from k3jax.train.run import base_config, run_config
from k3jax.train.sharded import build_step
from k3jax.train.state import Trainable, init_state, init_variables
from tools.param_count import count_params

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FLAGS = flags.FLAGS
MODELS = ("hybrid", "kda_only")


def define_flags(fv: flags.FlagValues = FLAGS) -> None:
  """The experiment's flags, into `fv` (a test passes its own FlagValues)."""
  flags.DEFINE_string("out", "runs/recall_extend", "Output directory.", flag_values=fv)
  for name, default, help_ in (
      ("layers", 4, "Layers of each model (the last one MLA in the hybrid)."),
      ("short_len", 64, "Pre-training row length."),
      ("long_len", 512, "Cool-down and evaluation row length."),
      ("pretrain_steps", 2000, "Pre-training steps."),
      ("cooldown_steps", 400, "Cool-down steps."),
      ("short_batch", 32, "Pre-training rows per step."),
      ("long_batch", 4, "Cool-down rows per step."),
      ("eval_rows", 24, "Rows per task and distance bin."),
      ("eval_batch", 24, "Rows per evaluation forward pass."),
      ("seed", 0, "Seed of the data and the initialisation.")):
    flags.DEFINE_integer(name, default, help_, flag_values=fv)
  for name, default, help_ in (
      ("pretrain_evidence", 0.5, "Share of evidence-task rows in pre-training."),
      ("cooldown_evidence", 0.5, "Share of evidence-task rows in the cool-down."),
      ("lr", 3e-3, "Peak learning rate (warm-up cosine over both stages)."),
      ("answer_weight", 1.0, "Loss weight of an evidence row's answer tokens (the rest 1).")):
    flags.DEFINE_float(name, default, help_, flag_values=fv)
  flags.DEFINE_list("tasks", list(evidence.TASKS), "Evidence tasks trained and evaluated.",
                    flag_values=fv)
  flags.DEFINE_list("bins", ["16", "64", "128", "256", "384", "500"],
                    "Distance bin edges (tokens from the evidence to the question).",
                    flag_values=fv)
  flags.DEFINE_list("models", list(MODELS), "Models to run: hybrid, kda_only.", flag_values=fv)


def model_fields(name: str, layers: int) -> dict:
  """The `model` group of `name`: tiny shapes, `layers` layers, no MTP; KDA-only replaces
  the MLA layers by KDA ones (no layer is MLA: mla_every past the stack, mla_last off)."""
  m = dict(preset="tiny", num_layers=layers, num_mtp_layers=0)
  if name == "kda_only":
    m.update(mla_every=layers + 1, mla_last=False, kda_only=True)
  return m


def run_for(name: str, f) -> object:
  """The RunConfig of one model: two stages (short rows, then long rows), both with evidence
  tasks mixed into long-document rows."""
  c = base_config("tiny")
  c.seed = f.seed
  for k, v in model_fields(name, f.layers).items():
    c.model[k] = v
  c.train.steps = f.pretrain_steps + f.cooldown_steps
  c.train.batch_size, c.train.seq_len = f.short_batch, f.short_len
  c.train.stages = (
      dict(steps=f.pretrain_steps, seq_len=f.short_len, batch_size=f.short_batch,
           data="long", evidence_fraction=f.pretrain_evidence),
      dict(steps=f.cooldown_steps, seq_len=f.long_len, batch_size=f.long_batch,
           data="long", evidence_fraction=f.cooldown_evidence))
  c.train.mtp_weight = 0.0
  c.optim.lr = f.lr
  c.data.long_threshold = f.short_len
  c.data.evidence_tasks = ",".join(f.tasks)
  c.data.answer_weight = f.answer_weight
  return run_config(c)


def eval_rows(f, docs: long_docs.LongDocs) -> list[tuple[str, int, evidence.EvidenceRow]]:
  """(task, bin index, row) at the long length: eval_rows per task and bin, distances
  uniform in the bin (clipped to what the task allows); the same rows for every model."""
  edges = [int(b) for b in f.bins]
  out = []
  for ti, task in enumerate(f.tasks):
    lo_t, hi_t = evidence.min_distance(task), evidence.max_distance(task, f.long_len)
    for bi, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
      lo, hi = max(lo, lo_t), min(hi - 1, hi_t)
      for r in range(f.eval_rows):
        rng = np.random.default_rng([f.seed, 0xE7A1, ti, bi, r])
        row = evidence.make_row(rng, task, f.long_len, distance=int(rng.integers(lo, hi + 1)),
                                filler=docs.stream)
        out.append((task, bi, row))
  return out


def evaluate(config, variables, rows, batch: int, forward) -> dict:
  """{task: {"exact": [per bin], "token": [per bin]}} over `rows` (eval_rows' output)."""
  exact, token = {}, {}
  for i in range(0, len(rows), batch):
    chunk = rows[i:i + batch]
    tokens = np.stack([r.tokens[:-2] for _, _, r in chunk])
    pad = batch - len(chunk)
    if pad:
      tokens = np.concatenate([tokens, np.repeat(tokens[-1:], pad, 0)])
    logits = np.asarray(forward(variables, tokens))
    for (task, b, row), lg in zip(chunk, logits):
      pos = np.arange(row.answer_start - 1, row.answer_start - 1 + len(row.answer))
      hit = np.argmax(lg[pos], axis=-1) == np.asarray(row.answer)
      exact.setdefault(task, {}).setdefault(b, []).append(evidence.check_logits(row, lg))
      token.setdefault(task, {}).setdefault(b, []).append(float(np.mean(hit)))
  nb = 1 + max(b for _, b, _ in rows)
  return {t: {"exact": [float(np.mean(exact[t][b])) for b in range(nb)],
              "token": [float(np.mean(token[t][b])) for b in range(nb)]} for t in exact}


def train_and_evaluate(name: str, f, corpus, docs, rows) -> dict:
  run = run_for(name, f)
  config = run.model
  plan = run.train.stage_plan()
  data = stages_lib.StagedData(run, corpus)
  state = None
  forward = jax.jit(lambda v, t: K3Model(config).apply(v, t))
  result = {"params": count_params(config)["total"], "loss": [], "phases": {}}
  step, t0 = 0, time.time()
  for k, stage in enumerate(plan):
    built = build_step(stages_lib.stage_run(run, stage), stages_lib.stage_run(run, stage).model)
    if state is None:
      variables = init_variables(config, jax.random.PRNGKey(f.seed))
      state = init_state(variables, Trainable(("params",), ("balance",)), built.tx)
    losses = []
    for _ in range(stage.steps):
      state, metrics = built.train(state, data.batch(step))
      losses.append(float(metrics["loss"]))
      step += 1
      if step % 250 == 0:
        print(f"{name}: step {step}, loss {np.mean(losses[-50:]):.3f}, "
              f"{time.time() - t0:.0f} s", flush=True)
    result["loss"].append({"stage": k, "seq_len": stage.seq_len,
                           "first": float(np.mean(losses[:20])),
                           "last": float(np.mean(losses[-20:]))})
    variables = {"params": state.params["params"], "balance": state.balance}
    phase = "before" if k == 0 else "after"
    result["phases"][phase] = evaluate(config, variables, rows, f.eval_batch, forward)
    print(f"{name}: stage {k} (seq_len {stage.seq_len}) done at {time.time() - t0:.0f} s; "
          f"loss {losses[0]:.3f} → {np.mean(losses[-20:]):.3f}; eval at {f.long_len}: "
          + ", ".join(f"{t} {np.round(v['exact'], 2).tolist()}"
                      for t, v in result["phases"][phase].items()), flush=True)
  return result


def plot(results: dict, f, path: str) -> None:
  edges = [int(b) for b in f.bins]
  mids = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
  fig, axes = plt.subplots(1, len(f.tasks), figsize=(4.2 * len(f.tasks), 3.6), squeeze=False)
  style = {"hybrid": "tab:blue", "kda_only": "tab:orange"}
  for ax, task in zip(axes[0], f.tasks):
    for name, r in results["models"].items():
      for phase, ls in (("before", "--"), ("after", "-")):
        ax.plot(mids, r["phases"][phase][task]["exact"], ls, marker="o", color=style[name],
                label=f"{name}, {phase} cool-down")
    ax.axvline(f.short_len, color="grey", lw=0.8)
    ax.set_title(f"{task} (rows of {f.long_len} tokens)")
    ax.set_xlabel("evidence → question distance (tokens)")
    ax.set_ylim(-0.02, 1.02)
  axes[0][0].set_ylabel("exact answer accuracy")
  axes[0][-1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def run_experiment(f) -> dict:
  """Everything (module doc) for the parsed flags `f`; returns what it writes as JSON."""
  os.makedirs(f.out, exist_ok=True)
  t0 = time.time()
  corpus = corpus_lib.load_corpus("stdlib")
  docs = long_docs.LongDocs.from_stream(corpus.train, long_threshold=f.short_len)
  rows = eval_rows(f, docs)
  results = {"flags": {k: getattr(f, k) for k in (
      "layers", "short_len", "long_len", "pretrain_steps", "cooldown_steps", "short_batch",
      "long_batch", "pretrain_evidence", "cooldown_evidence", "lr", "answer_weight", "tasks",
      "bins", "eval_rows", "seed")}, "models": {}}
  for name in f.models:
    results["models"][name] = train_and_evaluate(name, f, corpus, docs, rows)
  results["seconds"] = round(time.time() - t0, 1)
  with open(os.path.join(f.out, "recall_extend.json"), "w") as fh:
    json.dump(results, fh, indent=1)
  plot(results, f, os.path.join(f.out, "recall_extend.png"))
  print(f"wrote {f.out}/recall_extend.json and .png in {results['seconds']} s")
  return results


def main(argv):
  del argv
  run_experiment(FLAGS)


if __name__ == "__main__":
  define_flags()
  app.run(main)
