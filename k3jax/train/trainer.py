"""The training loop behind experiments/train.py: validate → data → state → resume → steps.

`train(cfg, workdir)` takes the run config (configs/*.py, an ml_collections ConfigDict) and a
run directory. Everything that can be wrong with the inputs (config fields, shapes, data path,
a checkpoint of another model) raises ValueError before anything is compiled. The loop logs
every `train.log_every` steps to DIR/metrics.jsonl + TensorBoard, evaluates every
`train.eval_every` steps, checkpoints every `train.checkpoint_every` steps and at the end, and
resumes from the newest complete checkpoint in DIR. `until` stops early at a step (a
simulated preemption: the schedule still spans `train.steps`).

Data (`make_data`): text corpora (k3jax/train/data.py), or `data.source="shapes"` — the
image–caption corpus of k3jax/train/shapes.py, whose batches carry a `Media` the step passes
to the model, optionally interleaved with text rows (`data.text_fraction`); its evaluations
also log `eval_loss_shuffled` (the held-out captions with each other's images).

SFT (`data.source="sft"`, k3jax/train/sft.py): packed chat conversations trained on their
assistant tokens; `train.init=CKPT` starts a fresh run from a checkpoint's params (a fresh
optimizer; a resumed run restores its own checkpoint instead).

Sharding: `train(..., mesh=m)` runs the step sharded over `m` (k3jax/train/sharded.py's
`build_step`, which places each host batch); without a mesh the step is jitted on one device
with the state donated.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.train import balance as qb
from k3jax.train import data as data_lib
from k3jax.train import metrics as metrics_lib
from k3jax.train.checkpoint import Checkpointer
from k3jax.train.sharded import Step, build_step
from k3jax.train.step import TrainState, create_state
from k3jax.vision.config import as_vision_config

log = logging.getLogger("k3jax.train")


# ---------------------------------------------------------------------- config
def model_config(cfg) -> ModelConfig:
  """ModelConfig from cfg.model (every ModelConfig field; `preset` names it) and
  cfg.balance.num_bins (the histogram the MoE layers sow)."""
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  m = dict(cfg.model.to_dict() if hasattr(cfg.model, "to_dict") else cfg.model)
  name = m.pop("preset", m.get("name", "custom"))
  unknown = sorted(set(m) - fields)
  if unknown:
    raise ValueError(f"config.model: unknown ModelConfig field(s) {unknown}")
  m["name"] = name
  if "qb_range" in m:
    m["qb_range"] = tuple(m["qb_range"])
  if "lora_targets" in m:
    m["lora_targets"] = tuple(m["lora_targets"])
  lora = cfg.train.get("lora")
  if lora is not None and lora.get("rank", 0):   # train.lora.* → the model's adapters
    m.update(lora_rank=lora.rank, lora_alpha=float(lora.get("alpha", 16.0)),
             lora_targets=lora_targets(lora.get("targets", "q,k,v,o")))
  if "vision" in m:  # a vision preset name or a dict of fields; the projector feeds d_model
    m["vision"] = as_vision_config(m["vision"], text_hidden_size=m.get("d_model"))
  if cfg.balance.get("num_bins"):
    m["qb_num_bins"] = int(cfg.balance.num_bins)
  return ModelConfig(**m)


def lora_targets(value) -> tuple[str, ...]:
  """train.lora.targets as a tuple: "q,k,v,o" (command-line form) or a sequence of names."""
  if isinstance(value, str):
    return tuple(t.strip() for t in value.split(",") if t.strip())
  return tuple(value)


def validate(cfg, config: ModelConfig) -> None:
  """Shape and field checks of the run config (ValueError naming the field)."""
  t = cfg.train

  def need(cond, field, msg):
    if not cond:
      raise ValueError(f"config.{field}: {msg}")

  for f in ("steps", "batch_size", "seq_len", "log_every"):
    v = t[f]
    need(isinstance(v, int) and v > 0, f"train.{f}", f"expected a positive int, found {v!r}")
  for f in ("checkpoint_every", "eval_every", "max_to_keep"):
    need(isinstance(t[f], int) and t[f] >= 0, f"train.{f}",
         f"expected a non-negative int, found {t[f]!r}")
  need(t.seq_len >= 2, "train.seq_len", f"expected >= 2, found {t.seq_len}")
  need(t.mtp_weight >= 0, "train.mtp_weight", f"expected >= 0, found {t.mtp_weight}")
  need(cfg.optim.lr > 0, "optim.lr", f"expected > 0, found {cfg.optim.lr}")
  need(cfg.balance.method in qb.METHODS, "balance.method",
       f"expected one of {qb.METHODS}, found {cfg.balance.method!r}")
  need(config.vocab_size >= data_lib.NUM_BYTES + data_lib.NUM_SPECIAL, "model.vocab_size",
       f"the byte tokenizer needs >= {data_lib.NUM_BYTES + data_lib.NUM_SPECIAL}, found "
       f"{config.vocab_size}")
  mu_dtype = cfg.optim.get("mu_dtype", "")
  need(mu_dtype in ("", "float32", "bfloat16"), "optim.mu_dtype",
       f"expected '' (the parameters' dtype), 'float32' or 'bfloat16', found {mu_dtype!r}")
  need(not cfg.optim.get("offload_momentum", False) or cfg.optim.muon, "optim.offload_momentum",
       "offloads Per-Head Muon's momentum; it needs optim.muon=True")
  data_lib.parse_curriculum(t.curriculum)
  accum = t.get("grad_accum", 1)
  need(isinstance(accum, int) and accum > 0, "train.grad_accum",
       f"expected a positive int, found {accum!r}")
  need(t.batch_size % accum == 0, "train.batch_size",
       f"must be divisible by train.grad_accum={accum} (micro-batches), found {t.batch_size}")
  lora = t.get("lora")
  if lora is not None:
    r = lora.get("rank", 0)
    need(isinstance(r, int) and not isinstance(r, bool) and r >= 0, "train.lora.rank",
         f"expected a non-negative int (0: full fine-tuning), found {r!r}")
    need(not (r and t.get("freeze_experts", False)), "train.freeze_experts",
         "LoRA (train.lora.rank > 0) already freezes every base weight; leave it False")
    if lora.get("base") and r:
      need(os.path.exists(lora.base), "train.lora.base",
           f"checkpoint path {lora.base!r} does not exist")
    need(not (r and t.get("init", "")), "train.init",
         "a LoRA run (train.lora.rank > 0) starts its adapters on train.lora.base; set that "
         "instead of train.init")
  n_dev = jax.device_count() if cfg.train.get("data_parallel", False) else 1
  need((t.batch_size // accum) % n_dev == 0, "train.batch_size",
       f"each of the {accum} micro-batches (batch_size / grad_accum = "
       f"{t.batch_size // accum}) must be divisible by the {n_dev} data-parallel devices")


def _signature(cfg) -> dict:
  """Run-config fields a resume must keep (they change the optimizer state's structure)."""
  sig = {"muon": bool(cfg.optim.muon), "balance": cfg.balance.method,
         "clip": float(cfg.optim.get("clip_norm", 0.0)) > 0}
  lora = cfg.train.get("lora")
  if lora is not None and lora.get("rank", 0):   # adapters only: another state structure
    sig["lora"] = int(lora.rank)
  return sig


# ---------------------------------------------------------------------- data
SHAPES = "shapes"
SFT = "sft"


def make_data(cfg, config: ModelConfig, curriculum=()):
  """(train iterator, eval batches, shuffled-media eval batches) of `cfg.data`.

  data.source "shapes" (k3jax/train/shapes.py, needs model.vision): image/clip–caption rows
  carrying a `Media` of train.batch_size streams of data.media_length patches (0: the largest
  of the vision config's pack_buckets), with data.text_fraction of the rows text windows of
  data.text_source; its eval batches are held-out captions, and the same captions with each
  other's images ("shuffled"). Any other source: text (k3jax/train/data.py), no shuffled set.
  """
  t, d = cfg.train, cfg.data
  n_eval = t.get("eval_batches", 2) if t.eval_every else 0
  if d.source == SFT:          # chat conversations, loss on assistant tokens (train/sft.py)
    from k3jax.train import sft
    it, evals = sft.make_data(cfg, n_eval)
    return it, evals, []
  if d.source != SHAPES:
    corpus = data_lib.load_corpus(d.source, d.eval_percent, config.vocab_size)
    it = data_lib.DataIterator(corpus, t.batch_size, t.seq_len, cfg.seed, curriculum)
    evals = data_lib.eval_batches(corpus, n_eval, t.batch_size, t.seq_len, cfg.seed)
    return it, (evals if n_eval else []), []
  from k3jax.train import shapes
  if config.vision is None:
    raise ValueError("config.data.source='shapes': the model has no vision tower "
                     "(model.vision is None); use configs/tiny_multimodal.py or set model.vision")
  if config.media_placeholder_token_id != data_lib.MEDIA:
    raise ValueError(f"config.model.media_placeholder_token_id: the shapes corpus writes the "
                     f"byte tokenizer's <media> = {data_lib.MEDIA}, found "
                     f"{config.media_placeholder_token_id}")
  if curriculum:
    raise ValueError("config.train.curriculum: not supported with data.source='shapes' (one "
                     "row length per run)")
  length = d.get("media_length", 0) or config.vision.pack_buckets[-1]
  fraction = float(d.get("text_fraction", 0.0))
  stream = fp = None
  if fraction > 0:
    corpus = data_lib.load_corpus(d.get("text_source", "stdlib"), d.eval_percent,
                                  config.vocab_size)
    stream, fp = corpus.train, corpus.fingerprint()
  it = shapes.ShapesIterator(config.vision, t.batch_size, t.seq_len, length, cfg.seed,
                             fraction, stream, fp)
  if not n_eval:
    return it, [], []
  # Enough held-out samples for n_eval batches (about 3 samples per 128-token row).
  samples = shapes.eval_samples(cfg.seed, max(1, n_eval * t.batch_size * t.seq_len // 48))
  evals = shapes.eval_batches(config.vision, samples, t.batch_size, t.seq_len, length)
  shuffled = shapes.eval_batches(config.vision, samples, t.batch_size, t.seq_len, length,
                                 shuffled=True)
  return it, evals, shuffled


# ---------------------------------------------------------------------- step cache
_STEPS: dict = {}


def _cached_step(cfg, config: ModelConfig, mesh=None) -> Step:
  """`build_step`, cached per process so an in-process resume reuses the compiled step."""
  key = (config, mesh, cfg.train.steps, cfg.train.mtp_weight, cfg.train.get("grad_accum", 1),
         cfg.train.batch_size, cfg.train.seq_len,
         *(json.dumps(cfg[g].to_dict(), sort_keys=True) if cfg.get(g) is not None else None
           for g in ("optim", "balance", "mesh")))
  if key not in _STEPS:
    if config.lora_rank:
      from k3jax.train.lora import build_lora_step
      _STEPS[key] = build_lora_step(cfg, config, mesh)
    else:
      _STEPS[key] = build_step(cfg, config, mesh)
  return _STEPS[key]


# ---------------------------------------------------------------------- loop
def train(cfg, workdir: str, *, until: int | None = None, mesh=None,
          progress: bool | None = None) -> list[dict]:
  """Train (or resume) the run in `workdir`; returns the metric records written this call.
  `mesh`: a `jax.sharding.Mesh` to shard the step over (None: one device)."""
  config = model_config(cfg)
  validate(cfg, config)
  t = cfg.train
  curriculum = data_lib.parse_curriculum(t.curriculum)
  it, evals, evals_shuffled = make_data(cfg, config, curriculum)
  os.makedirs(workdir, exist_ok=True)
  ckpt = Checkpointer(workdir, max_to_keep=t.max_to_keep or None,
                      async_save=t.get("async_checkpoint", True))
  ckpt.check_config(config)                      # a checkpoint of another model: fail now
  _check_signature(ckpt, cfg)
  if t.get("init", "") and ckpt.latest_step() is None and not os.path.exists(t.init):
    raise ValueError(f"config.train.init: {t.init!r} does not exist")

  tx, _, step_fn, eval_fn = _cached_step(cfg, config, mesh)
  rng = jax.random.PRNGKey(cfg.seed)
  if config.lora_rank:
    state = _lora_state(cfg, config, rng, tx)
  else:
    state = create_state(config, rng, tx)
  # A LoRA run checkpoints its adapters alone (the base is train.lora.base, or the seed's).
  saved = (lambda s: {"lora": s.lora}) if config.lora_rank else (lambda s: s.variables)
  restored = ckpt.restore_latest(config, saved(state), state.opt_state)
  start = 0
  if restored is None and t.get("init", ""):
    state = init_from(t.init, config, state, tx)
  if restored is not None:
    start, variables, opt_state, meta = restored
    if config.lora_rank:
      state = state.replace(step=jnp.asarray(start, jnp.int32), lora=variables["lora"],
                            opt_state=opt_state)
    else:
      state = TrainState(step=jnp.asarray(start, jnp.int32), params=variables["params"],
                         balance=variables["balance"], opt_state=opt_state)
    state = jax.tree.map(jnp.asarray, state)
    it.set_state(meta["data"])
    log.info("resumed from %s/%d", ckpt.directory, start)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(cfg.to_json(indent=2))

  end = t.steps if until is None else min(t.steps, until)
  writer = metrics_lib.MetricsWriter(workdir, tensorboard=t.get("tensorboard", True))
  # MFU's ceiling: the matmul rate of this device in the model's compute dtype, measured now.
  peak = t.get("peak_flops", 0.0) or metrics_lib.matmul_peak(dtype=jnp.dtype(config.dtype))
  muon_fps = (metrics_lib.muon_flops_per_step(
      state.params, freeze_experts=bool(t.get("freeze_experts", False)))
      if cfg.optim.muon and not config.lora_rank else 0.0)
  records = []
  show = t.get("progress", True) if progress is None else progress
  bar = None
  if show and end > start:
    from tqdm import tqdm
    bar = tqdm(total=end, initial=start, desc="train", dynamic_ncols=True)
  tokens_since, t_since, first = 0, time.perf_counter(), True
  try:
    for step in range(start, end):
      batch = next(it)
      state, m = step_fn(state, batch)
      tokens_since += batch["inputs"].size
      done = step + 1
      if first:   # the first step includes compilation: keep it out of tokens/s
        jax.block_until_ready(m["loss"])
        tokens_since, t_since, first = 0, time.perf_counter(), False
      if done % t.log_every == 0 or done == end:
        loss = float(m["loss"])
        dt = time.perf_counter() - t_since
        tps = tokens_since / dt if tokens_since else None   # None: only the compile step
        seq = it.seq_len_at(step)
        tokens_per_step = t.batch_size * seq
        fpt = metrics_lib.flops_per_token(config, state.params, seq,
                                          with_mtp=t.mtp_weight > 0)
        scalars = {"loss": loss, "ce": float(m["ce"]), "mtp_ce": float(m["mtp_ce"]),
                   "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
                   "tokens_per_s": tps, "mfu": None if tps is None else tps * fpt / peak,
                   "hfu": None if tps is None else (tps * fpt + tps / tokens_per_step
                                                     * muon_fps) / peak,
                   "seq_len": seq, "tokens": done * t.batch_size * seq}
        scalars.update(metrics_lib.router_metrics(jax.device_get(m["stats"])))
        if evals and (done % t.eval_every == 0 or done == end):
          scalars.update(evaluate(eval_fn, state.variables, evals))
          if evals_shuffled:   # the same captions, each with another caption's images
            scalars["eval_loss_shuffled"] = evaluate(eval_fn, state.variables,
                                                     evals_shuffled)["eval_loss"]
        writer.write(done, scalars)
        records.append({"step": done, **scalars})
        tokens_since, t_since = 0, time.perf_counter()
        if bar is not None:
          bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps or 0:.0f}",
                          mfu=f"{100 * (scalars['mfu'] or 0):.1f}%")
      if bar is not None:
        bar.update(1)
      if t.checkpoint_every and (done % t.checkpoint_every == 0 or done == end):
        ckpt.save(done, config, saved(state), state.opt_state,
                  {"step": done, "data": it.get_state(), "rng": np.asarray(
                      jax.random.key_data(rng)).tolist(), "signature": _signature(cfg),
                   "run_config": cfg.to_dict()})
  finally:
    if bar is not None:
      bar.close()
    writer.close()
    ckpt.close()
  if config.lora_rank and end == t.steps:
    from k3jax.train.lora import save_adapters
    save_adapters(os.path.join(workdir, "adapters"), config, state.lora, step=end)
  return records


def init_from(path: str, config: ModelConfig, state: TrainState, tx) -> TrainState:
  """`train.init`: a fresh run starts from the params and router biases of checkpoint `path`
  (any directory `load_pretrained` reads) with a fresh optimizer state; the checkpoint's model
  config must equal the run's (ValueError listing the differing fields)."""
  from k3jax.train.checkpoint import config_diff, load_pretrained
  saved, variables = load_pretrained(path)
  diff = config_diff(config, saved)
  if diff:
    raise ValueError(f"config.train.init: {path} was written for another model config; "
                     f"differing fields (run, checkpoint): {diff}")
  shapes = jax.tree.map(lambda x: (x.shape, x.dtype), state.variables)
  variables = {k: variables.get(k, {}) for k in ("params", "balance")}
  if jax.tree.map(lambda x: (x.shape, x.dtype), variables) != shapes:
    raise ValueError(f"config.train.init: the variables of {path} do not match the model's "
                     f"(names, shapes or dtypes)")
  log.info("initialised from %s", path)
  return TrainState(step=state.step, params=variables["params"], balance=variables["balance"],
                    opt_state=tx.init(variables))


def _lora_state(cfg, config: ModelConfig, rng, tx):
  """A LoRA run's state: fresh adapters on train.lora.base (a pretrained checkpoint of the
  same model without adapters) or, when empty, on the seed's fresh base."""
  from k3jax.train import lora as lora_lib
  from k3jax.train.checkpoint import config_diff, load_pretrained
  base = None
  path = cfg.train.lora.get("base", "")
  if path:
    base_config, base = load_pretrained(path)
    diff = config_diff(lora_lib.without_adapters(config), lora_lib.without_adapters(base_config))
    if diff:
      raise ValueError(f"config.train.lora.base: {path!r} holds another model; differing "
                       f"fields (run, checkpoint): {diff}")
  return lora_lib.create_state(config, rng, tx, base=base)


def _check_signature(ckpt: Checkpointer, cfg) -> None:
  from k3jax.train.checkpoint import _ocp
  step = ckpt.latest_step()
  if step is None:
    return
  try:
    meta = ckpt.manager.restore(step, args=_ocp().args.Composite(
        meta=_ocp().args.JsonRestore()))["meta"]
  except Exception:  # noqa: BLE001 - unreadable: restore_latest will skip it
    return
  saved, mine = meta.get("signature"), _signature(cfg)
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


def base_config(preset_name: str = "tiny"):
  """The run config configs/*.py start from: every field present (command-line overrides
  need them) with the defaults of spec §7–8. `model` holds every ModelConfig field of the
  preset (override any: --config.model.num_layers=5; `preset` only names it)."""
  import ml_collections
  from k3jax.config import preset
  from k3jax.train.checkpoint import config_to_dict

  c = ml_collections.ConfigDict()
  c.seed = 0
  model = config_to_dict(preset(preset_name))
  model.pop("name")
  for f in ("lora_rank", "lora_alpha", "lora_targets"):   # set through train.lora
    model.pop(f)
  model["qb_range"] = tuple(model["qb_range"])
  c.model = ml_collections.ConfigDict({"preset": preset_name, **model})
  c.train = ml_collections.ConfigDict(dict(
      steps=300, batch_size=8, grad_accum=1, seq_len=128, checkpoint_every=100, eval_every=100,
      eval_batches=2, log_every=10, mtp_weight=0.3, max_to_keep=3, curriculum="",
      progress=True, tensorboard=True, async_checkpoint=True, peak_flops=0.0,
      data_parallel=False, freeze_experts=False))
  # LoRA / QLoRA (docs/notes/lora.md): rank > 0 trains adapters on the named targets
  # (k3jax.config.LORA_TARGETS, comma-separated) of a frozen base — `base` (a checkpoint
  # load_pretrained reads), or the seed's fresh init when empty — with AdamW over the adapters
  # (optim.lr, adam_b1/b2, clip_norm; this weight_decay).
  c.train.lora = ml_collections.ConfigDict(dict(rank=0, alpha=16.0, targets="q,k,v,o",
                                                base="", weight_decay=0.0))
  c.optim = ml_collections.ConfigDict(dict(
      lr=2e-3, warmup_frac=0.01, final_lr_frac=0.1, weight_decay=0.1, momentum=0.95,
      adam_b1=0.9, adam_b2=0.95, muon=True, qk_clip_tau=100.0, clip_norm=0.0, mu_dtype="",
      offload_momentum=False))
  c.balance = ml_collections.ConfigDict(dict(method="qb", num_bins=0, gamma=1e-3))
  c.data = ml_collections.ConfigDict(dict(source="stdlib", eval_percent=2.0))
  # Device mesh (k3jax/sharding.py; used by experiments/train.py): product = device count,
  # -1 fills; all 1 with data=-1 and data_parallel=False keeps the single-device step.
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, context=1, tensor=1,
                                          fsdp_over_data=False))
  return c
