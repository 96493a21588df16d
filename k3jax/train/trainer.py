"""The training loop: data → state → resume → steps, for every kind of training.

`train(run, workdir, recipe=…)` takes the typed run config (k3jax/train/run.py) and a run
directory. A kind of training is a `Recipe`: which variables are trainable, its step builder
(the loss and the optimizer) and its starting variables. What the loop does is the same for
all of them: it logs every `train.log_every` steps to DIR/metrics.jsonl + TensorBoard,
evaluates every `train.eval_every` steps, checkpoints the trained variables and the optimizer
state every `train.checkpoint_every` steps and at the end, and resumes from the newest complete
checkpoint in DIR. `until` stops early at a step (a simulated preemption: the schedule still
spans `train.steps`). Everything that can be wrong with the inputs (shapes, data path, a
checkpoint of another model or other optimizer settings) raises ValueError before anything is
compiled.

Recipes: `PRETRAINING` here (every weight and the router biases; the language-model loss; a
fresh init of `seed`, or `train.init`'s variables), LoRA (k3jax/posttrain/lora.py) and the
EAGLE-3 draft (k3jax/posttrain/eagle.py).

Data (`make_data`, by `data.source`): text corpora (k3jax/data/corpus.py); "shapes", the
image–caption corpus (k3jax/data/captions.py), whose batches carry a `Media` the model places at
the placeholders, optionally interleaved with text rows (`data.text_fraction`), and whose
evaluations also log `eval_loss_shuffled` (the held-out captions with each other's images);
"sft", packed chat conversations trained on their assistant tokens (k3jax/data/sft.py);
"sft_captions", the image–caption corpus as chat conversations with media (the same loss mask,
the media placed like "shapes": `sft.MediaSFTIterator`).

Sharding: `train(..., mesh=m)` runs the step sharded over `m` (k3jax/train/sharded.py, which
places each host batch); without a mesh the step is jitted on one device, the state donated.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from tqdm import tqdm

from k3jax.config import ModelConfig, config_diff
from k3jax.convert.checkpoint import load_pretrained
from k3jax.data import captions, sft
from k3jax.data import corpus as corpus_lib
from k3jax.data.tokenizers import MEDIA
from k3jax.train import metrics as metrics_lib
from k3jax.train import run as run_lib
from k3jax.train import stages as stages_lib
from k3jax.train.checkpoint import Checkpointer
from k3jax.train.run import RunConfig
from k3jax.train.sharded import PRETRAIN, Step, build_step
from k3jax.train.state import Trainable, TrainState, init_state, init_variables, with_optimized

log = logging.getLogger("k3jax.train")


@dataclasses.dataclass(frozen=True)
class Recipe:
  """A kind of training, as the loop sees it.

  build(run, config, mesh) → Step: the optimizer, schedule, jitted train step and eval step
  (or None). initial(run, config, rng, fresh) → every variable of the model at step 0 (`fresh`:
  no checkpoint will be restored over them). finish(run, config, state, workdir): called once
  when the run reaches train.steps. `lm`: the loss is the language model's (MFU is computed);
  `muon`: Per-Head Muon's Newton–Schulz counts in the hardware FLOPs.
  """
  name: str
  trainable: Trainable
  build: Callable[[RunConfig, ModelConfig, object], Step]
  initial: Callable[[RunConfig, ModelConfig, jax.Array, bool], dict]
  finish: Callable[[RunConfig, ModelConfig, TrainState, str], None] | None = None
  lm: bool = True
  muon: bool = True


def _pretraining_initial(run: RunConfig, config: ModelConfig, rng, fresh: bool) -> dict:
  variables = init_variables(config, rng)
  if fresh and run.train.init:
    variables = init_from(run.train.init, config, variables)
  return variables


PRETRAINING = Recipe("pretraining", PRETRAIN, build_step, _pretraining_initial)


def init_from(path: str, config: ModelConfig, variables: dict) -> dict:
  """`train.init`: the variables of checkpoint `path` (any directory `load_pretrained` reads)
  in place of `variables`; its model config must equal the run's (ValueError listing the
  differing fields), and so must every variable's name, shape and dtype."""
  if not os.path.exists(path):
    raise ValueError(f"config.train.init: {path!r} does not exist")
  saved, loaded = load_pretrained(path)
  diff = config_diff(config, saved)
  if diff:
    raise ValueError(f"config.train.init: {path} was written for another model config; "
                     f"differing fields (run, checkpoint): {diff}")
  loaded = {k: loaded.get(k, {}) for k in variables}
  if jax.tree.map(lambda x: (x.shape, x.dtype), loaded) != jax.tree.map(
      lambda x: (x.shape, x.dtype), variables):
    raise ValueError(f"config.train.init: the variables of {path} do not match the model's "
                     f"(names, shapes or dtypes)")
  log.info("initialised from %s", path)
  return loaded


# ---------------------------------------------------------------------- data
SHAPES = "shapes"
SFT = "sft"
SFT_CAPTIONS = "sft_captions"


def make_data(run: RunConfig, config: ModelConfig):
  """(train iterator, eval batches, shuffled-media eval batches) of `run.data` (module doc).

  "shapes" (needs model.vision): rows carrying a `Media` of train.batch_size streams of
  data.media_length patches (0: the largest of the vision config's pack_buckets), with
  data.text_fraction of the rows text windows of data.text_source; its eval batches are
  held-out captions, and the same captions with each other's images ("shuffled")."""
  t, d = run.train, run.data
  n_eval = t.eval_batches if t.eval_every else 0
  staged = bool(t.stages or corpus_lib.parse_curriculum(t.curriculum))
  if d.source == SFT:
    if staged:
      raise ValueError("config.train.curriculum: not supported with data.source='sft' (rows "
                       "are packed once, at train.seq_len); nor are train.stages")
    train_convs, held = sft.conversations(d.sft_file, d.eval_percent, run.seed,
                                          d.sft_num_train, d.sft_num_eval)
    it, evals = sft.training_data(train_convs, held, t.seq_len, t.batch_size, run.seed, n_eval)
    return it, evals, []
  if d.source == SFT_CAPTIONS:    # the shapes corpus in chat form (k3jax/data/sft.py)
    if config.vision is None or staged:
      raise ValueError("config.data.source='sft_captions': needs model.vision and no "
                       "train.curriculum / train.stages")
    length = d.media_length or config.vision.pack_buckets[-1]
    it, evals = sft.caption_training_data(config.vision, t.batch_size, t.seq_len, length,
                                          run.seed, n_eval)
    return it, evals, []
  if d.source != SHAPES:
    corpus = corpus_lib.load_corpus(d.source, d.eval_percent, config.text.vocab_size)
    it = stages_lib.StagedData(run, corpus)   # the curriculum's stages (one when none)
    evals = corpus_lib.eval_batches(corpus, n_eval, t.batch_size, t.seq_len, run.seed)
    return it, (evals if n_eval else []), []
  if config.vision is None:
    raise ValueError("config.data.source='shapes': the model has no vision tower "
                     "(model.vision is None); use configs/tiny_multimodal.py or set model.vision")
  if config.media_placeholder_token_id != MEDIA:
    raise ValueError(f"config.model.media_placeholder_token_id: the shapes corpus writes the "
                     f"byte tokenizer's <media> = {MEDIA}, found "
                     f"{config.media_placeholder_token_id}")
  if staged:
    raise ValueError("config.train.curriculum: not supported with data.source='shapes' (one "
                     "row length per run); nor are train.stages")
  length = d.media_length or config.vision.pack_buckets[-1]
  stream = fp = None
  if d.text_fraction > 0:
    corpus = corpus_lib.load_corpus(d.text_source, d.eval_percent, config.text.vocab_size)
    stream, fp = corpus.train, corpus.fingerprint()
  it = captions.ShapesIterator(config.vision, t.batch_size, t.seq_len, length, run.seed,
                               d.text_fraction, stream, fp)
  if not n_eval:
    return it, [], []
  # Enough held-out samples for n_eval batches (about 3 samples per 128-token row).
  samples = captions.eval_samples(run.seed, max(1, n_eval * t.batch_size * t.seq_len // 48))
  evals = captions.eval_batches(config.vision, samples, t.batch_size, t.seq_len, length)
  shuffled = captions.eval_batches(config.vision, samples, t.batch_size, t.seq_len, length,
                                   shuffled=True)
  return it, evals, shuffled


# ---------------------------------------------------------------------- step cache
_STEPS: dict = {}


def _cached_step(recipe: Recipe, run: RunConfig, mesh=None) -> Step:
  """`recipe.build`, cached per process so an in-process resume reuses the compiled step."""
  t = run.train
  key = (recipe.name, run.model, mesh, t.steps, t.mtp_weight, t.grad_accum, t.batch_size,
         t.seq_len, t.freeze_experts, t.lora, run.optim, run.balance, run.mesh)
  if key not in _STEPS:
    _STEPS[key] = recipe.build(run, run.model, mesh)
  return _STEPS[key]


def _check_data_parallel(run: RunConfig) -> None:
  t = run.train
  n_dev = jax.device_count() if t.data_parallel else 1
  if (t.batch_size // t.grad_accum) % n_dev:
    raise ValueError(f"config.train.batch_size: each of the {t.grad_accum} micro-batches "
                     f"(batch_size / grad_accum = {t.batch_size // t.grad_accum}) must be "
                     f"divisible by the {n_dev} data-parallel devices")


# ---------------------------------------------------------------------- loop
def train(run: RunConfig, workdir: str, *, recipe: Recipe = PRETRAINING,
          until: int | None = None, mesh=None, progress: bool | None = None) -> list[dict]:
  """Train (or resume) the run in `workdir`; returns the metric records written this call.
  `mesh`: a `jax.sharding.Mesh` to shard the step over (None: one device); a stage of
  `train.stages` that sets mesh axes runs on its own mesh (k3jax/train/stages.py)."""
  config = run.model
  t = run.train
  plan = t.stage_plan()
  for st in plan:
    _check_data_parallel(stages_lib.stage_run(run, st))
  it, evals, evals_shuffled = make_data(run, config)
  os.makedirs(workdir, exist_ok=True)
  ckpt = Checkpointer(workdir, max_to_keep=t.max_to_keep or None, async_save=t.async_checkpoint)
  ckpt.check_config(config)                      # a checkpoint of another model: fail now
  _check_signature(ckpt, run)

  start_stage = t.stage_at(ckpt.latest_step() or 0)[1]
  tx = _stage_step(recipe, run, start_stage, mesh)[1].tx
  rng = jax.random.PRNGKey(run.seed)
  fresh = ckpt.latest_step() is None
  state = init_state(recipe.initial(run, config, rng, fresh), recipe.trainable, tx)
  restored = None if fresh else ckpt.restore_latest(config, state.optimized, state.opt_state)
  if restored is None and not fresh:   # every checkpoint was unreadable (set aside): start over
    state = init_state(recipe.initial(run, config, rng, True), recipe.trainable, tx)
  start = 0
  if restored is not None:
    start, optimized, opt_state, meta = restored
    state = with_optimized(state, optimized).replace(
        step=jnp.asarray(start, jnp.int32), opt_state=opt_state)
    state = jax.tree.map(jnp.asarray, state)
    it.set_state(meta["data"])
    log.info("resumed from %s/%d", ckpt.directory, start)
  run_lib.write_json(run, os.path.join(workdir, "config.json"))

  end = t.steps if until is None else min(t.steps, until)
  writer = metrics_lib.MetricsWriter(workdir, tensorboard=t.tensorboard)
  # MFU's ceiling: the matmul rate of this device in the model's compute dtype, measured now.
  peak = (t.peak_flops or metrics_lib.matmul_peak(dtype=jnp.dtype(config.modes.dtype))
          if recipe.lm else None)
  params = state.variables["params"]
  muon_fps = (metrics_lib.muon_flops_per_step(params, freeze_experts=t.freeze_experts)
              if run.optim.muon and recipe.muon else 0.0)
  records = []
  show = t.progress if progress is None else progress
  bar = tqdm(total=end, initial=start, desc="train", dynamic_ncols=True) if (
      show and end > start) else None
  tokens_since, t_since, first = 0, time.perf_counter(), True
  current, step_fn, eval_fn, srun, on_mesh = None, None, None, run, False
  try:
    for step in range(start, end):
      index, stage = t.stage_at(step)
      if index != current:   # a new stage: its step, mesh and shapes (module doc)
        smesh, built = _stage_step(recipe, run, stage, mesh)
        srun, step_fn, eval_fn = stages_lib.stage_run(run, stage), built.train, built.eval
        if smesh is None and on_mesh:
          state = stages_lib.on_one_device(state)
        on_mesh, current, first = smesh is not None, index, True
        if len(plan) > 1:
          log.info("stage %d from step %d: %d x %d tokens, mesh %s", index, step,
                   srun.train.batch_size, stage.seq_len,
                   None if smesh is None else dict(smesh.shape))
      batch = next(it)
      state, m = step_fn(state, batch)
      tokens_since += batch["inputs"].size
      done = step + 1
      if first:   # the first step includes compilation: keep it out of tokens/s
        jax.block_until_ready(m["loss"])
        tokens_since, t_since, first = 0, time.perf_counter(), False
      if done % t.log_every == 0 or done == end:
        scalars = _step_scalars(srun, recipe, config, params, m, stage.seq_len, done,
                                tokens_since, time.perf_counter() - t_since, peak, muon_fps)
        scalars["tokens"] = stages_lib.tokens_through(run, done)
        if len(plan) > 1:
          scalars["stage"] = index
        if evals and eval_fn is not None and (done % t.eval_every == 0 or done == end):
          scalars.update(evaluate(eval_fn, state.variables, evals))
          if evals_shuffled:   # the same captions, each with another caption's images
            scalars["eval_loss_shuffled"] = evaluate(eval_fn, state.variables,
                                                     evals_shuffled)["eval_loss"]
        writer.write(done, scalars)
        records.append({"step": done, **scalars})
        tokens_since, t_since = 0, time.perf_counter()
        if bar is not None:
          bar.set_postfix(loss=f"{scalars['loss']:.3f}", tok_s=f"{scalars['tokens_per_s'] or 0:.0f}",
                          mfu=f"{100 * (scalars.get('mfu') or 0):.1f}%")
      if bar is not None:
        bar.update(1)
      if t.checkpoint_every and (done % t.checkpoint_every == 0 or done == end):
        ckpt.save(done, config, state.optimized, state.opt_state,
                  {"step": done, "data": it.get_state(), "rng": np.asarray(
                      jax.random.key_data(rng)).tolist(), "signature": run.signature(),
                   "run_config": run.to_dict()})
  finally:
    if bar is not None:
      bar.close()
    writer.close()
    ckpt.close()
  if recipe.finish is not None and end == t.steps:
    recipe.finish(run, config, state, workdir)
  return records


def _stage_step(recipe: Recipe, run: RunConfig, stage, mesh):
  """(the stage's mesh, its `Step`): built once per process for the same stage settings."""
  smesh = stages_lib.stage_mesh(run, stage, mesh)
  return smesh, _cached_step(recipe, stages_lib.stage_run(run, stage), smesh)


def _step_scalars(run, recipe, config, params, m, seq, done, tokens, seconds, peak,
                  muon_fps) -> dict:
  """The logged scalars of one step's metrics `m` (module doc)."""
  t = run.train
  tps = tokens / seconds if tokens else None   # None: only the compile step
  scalars = {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
             "lr": float(m["lr"]), "tokens_per_s": tps}
  for k, v in m.items():   # the loss's own metrics; a vector's entries as name_0, name_1, …
    if k in ("loss", "grad_norm", "lr", "stats", "rows"):
      continue
    v = np.asarray(v)
    scalars.update({k: float(v)} if v.ndim == 0 else
                   {f"{k}_{i}": float(x) for i, x in enumerate(v.ravel())})
  if recipe.lm:
    fpt = metrics_lib.flops_per_token(config, params, seq, with_mtp=t.mtp_weight > 0)
    tokens_per_step = t.batch_size * seq
    scalars["mfu"] = None if tps is None else tps * fpt / peak
    scalars["hfu"] = None if tps is None else (tps * fpt + tps / tokens_per_step
                                               * muon_fps) / peak
  scalars.update({"seq_len": seq, "tokens": done * t.batch_size * seq})
  scalars.update(metrics_lib.router_metrics(jax.device_get(m["stats"])))
  return scalars


def _check_signature(ckpt: Checkpointer, run: RunConfig) -> None:
  step = ckpt.latest_step()
  if step is None:
    return
  try:
    meta = ckpt.manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]
  except Exception:  # noqa: BLE001 - unreadable: restore_latest will skip it
    return
  saved, mine = meta.get("signature"), run.signature()
  if saved is not None and saved != mine:
    raise ValueError(f"checkpoint {ckpt.directory}/{step} was trained with optimizer settings "
                     f"{saved}, the config asks for {mine}; use a new --workdir")


def evaluate(eval_fn: Callable, variables: dict, batches: list[dict]) -> dict[str, float]:
  """Eval loss (nats/token) and bits per byte (total bits ÷ byte targets) over `batches`."""
  ce, n, nb = 0.0, 0.0, 0.0
  for b in batches:
    out = jax.device_get(eval_fn(variables, b))
    ce, n, nb = ce + float(out["ce_sum"]), n + float(out["tokens"]), nb + float(
        out["byte_tokens"])
  return {"eval_loss": ce / max(n, 1.0), "bits_per_byte": ce / np.log(2) / max(nb, 1.0)}


__all__ = ["Recipe", "PRETRAINING", "train", "make_data", "init_from", "evaluate"]
