"""The run config, typed: frozen dataclasses with every default in one place.

A run config file (configs/*.py) returns an ml_collections ConfigDict, which the command line
overrides field by field (`--config.train.steps=…`). The entry point reads it once,
`run_config(cfg)` → `RunConfig`, and library code takes the typed record: a field name that
does not exist, a wrong type or a value out of range is a ValueError naming `config.<group>.
<field>`, raised before anything is compiled. `base_config(preset)` builds the ConfigDict a
config file starts from out of these dataclasses' defaults (the command line needs every field
present), so a default is written once.

Groups: `model` (every ModelConfig field, flat, plus `preset`: the preset the others
override; k3jax/config.py routes each to its record), `train`, `train.lora`, `optim`,
`balance`, `data`, `mesh`. Kinds of training with groups of their own (RL: `rl`, `loss`,
`budget`) read those themselves (`run_config(cfg, extra=(…))` leaves them to them).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import ml_collections

from k3jax.config import (ModelConfig, as_vision_config, config_to_dict, flat_fields,
                          model_config_from_flat)
from k3jax.config import preset as model_preset
from k3jax.data.corpus import parse_curriculum
from k3jax.data.evidence import TASKS as EVIDENCE_TASKS
from k3jax.data.tokenizers import NUM_BYTES, NUM_SPECIAL
from k3jax.sharding import MeshConfig
from k3jax.train.balance import METHODS


def _need(cond: bool, field: str, msg: str) -> None:
  if not cond:
    raise ValueError(f"config.{field}: {msg}")


def _positive_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _non_negative_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclasses.dataclass(frozen=True)
class LoRARun:
  """`train.lora`: rank > 0 trains adapters on `targets` (k3jax.config.LORA_TARGETS) of a
  frozen base — `base` (a checkpoint load_pretrained reads), or the seed's fresh init when
  empty — with AdamW over the adapters (optim.lr, adam_b1/b2, clip_norm; this weight_decay)."""
  rank: int = 0
  alpha: float = 16.0
  targets: tuple[str, ...] = ("q", "k", "v", "o")
  base: str = ""
  weight_decay: float = 0.0

  def __post_init__(self):
    if isinstance(self.targets, str):   # the command line's form: "q,k,v,o"
      object.__setattr__(self, "targets", tuple(
          t.strip() for t in self.targets.split(",") if t.strip()))
    else:
      object.__setattr__(self, "targets", tuple(self.targets))
    _need(_non_negative_int(self.rank), "train.lora.rank",
          f"expected a non-negative int (0: full fine-tuning), found {self.rank!r}")
    if self.rank and self.base:
      _need(os.path.exists(self.base), "train.lora.base",
            f"checkpoint path {self.base!r} does not exist")


# RunModes fields a stage may set: how the model runs, never what it is (a stage's step reads
# and writes the same variables as every other stage's).
STAGE_MODES = ("remat", "remat_offload", "mla_query_block", "mla_key_block", "kda_chunk_size",
               "moe_capacity_factor", "expert_grad_barrier", "ce_chunks", "kernel_backend")
STAGE_MESH = ("data", "fsdp", "expert", "context", "tensor", "fsdp_over_data",
              "fsdp_over_context")
STAGE_DATA = ("", "long")


def _pairs(value, field: str, allowed: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
  """A mapping (or pairs) of overrides → sorted (name, value) pairs, names checked."""
  if isinstance(value, str):
    raise ValueError(f"config.{field}: expected a mapping of overrides, found {value!r}")
  items = value.items() if hasattr(value, "items") else [tuple(p) for p in value]
  out = {}
  for k, v in items:
    _need(k in allowed, field, f"unknown field {k!r} (allowed: {list(allowed)})")
    out[k] = v
  return tuple(sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage of the context curriculum (`train.stages`): `steps` steps of `batch_size`
  sequences of `seq_len` tokens, on the stage's own mesh, memory settings and data.

  batch_size / grad_accum: 0 takes train's. `mesh`: axis sizes over the run's `mesh` group
  (e.g. {"context": 8, "fsdp": 4}; STAGE_MESH). `modes`: RunModes fields over the model's
  (STAGE_MODES: remat, host offload, attention block, KDA chunk, capacity, kernels) — how the
  step runs, never the variables it trains. `offload_momentum`: None keeps optim's.
  `data`: "" the run's data (data.source), "long" long-document rows of the same corpus
  (k3jax/data/long_docs.py: data.long_threshold, data.long_upsample) with
  `evidence_fraction` of the rows synthetic evidence tasks (k3jax/data/evidence.py).
  """
  steps: int
  seq_len: int
  batch_size: int = 0
  grad_accum: int = 0
  mesh: tuple[tuple[str, Any], ...] = ()
  modes: tuple[tuple[str, Any], ...] = ()
  offload_momentum: bool | None = None
  data: str = ""
  evidence_fraction: float = 0.0

  def __post_init__(self):
    object.__setattr__(self, "mesh", _pairs(self.mesh, "train.stages.mesh", STAGE_MESH))
    object.__setattr__(self, "modes", _pairs(self.modes, "train.stages.modes", STAGE_MODES))
    for f in ("steps", "seq_len"):
      _need(_positive_int(getattr(self, f)), f"train.stages.{f}",
            f"expected a positive int, found {getattr(self, f)!r}")
    for f in ("batch_size", "grad_accum"):
      _need(_non_negative_int(getattr(self, f)), f"train.stages.{f}",
            f"expected a non-negative int (0: train's), found {getattr(self, f)!r}")
    _need(self.data in STAGE_DATA, "train.stages.data",
          f"expected one of {STAGE_DATA}, found {self.data!r}")
    _need(0 <= self.evidence_fraction <= 1, "train.stages.evidence_fraction",
          f"expected a value in [0, 1], found {self.evidence_fraction}")
    _need(not self.evidence_fraction or self.data == "long", "train.stages.evidence_fraction",
          "evidence rows are mixed into long-document rows: set data='long'")

  @classmethod
  def of(cls, value) -> "Stage":
    """A Stage from a Stage, a mapping (ConfigDict) of its fields, or (steps, seq_len)."""
    if isinstance(value, Stage):
      return value
    if hasattr(value, "items"):
      d = _plain(value)
      unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
      _need(not unknown, "train.stages", f"unknown field(s) {unknown}")
      return cls(**{k: (_plain(v) if hasattr(v, "items") else v) for k, v in d.items()})
    steps, seq_len = value
    return cls(int(steps), int(seq_len))

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["mesh"], d["modes"] = dict(self.mesh), dict(self.modes)
    return d


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 300
  batch_size: int = 8
  grad_accum: int = 1            # micro-batches per optimizer step (must divide batch_size)
  seq_len: int = 128
  checkpoint_every: int = 100    # and at the end of the run; 0: never
  eval_every: int = 100
  eval_batches: int = 2
  log_every: int = 10
  mtp_weight: float = 0.3
  max_to_keep: int = 3
  curriculum: str = ""           # "steps:seq_len,…" stages (k3jax/data/corpus.py)
  stages: tuple[Stage, ...] = ()  # or stages with their own mesh / memory / data (Stage)
  progress: bool = True
  tensorboard: bool = True
  async_checkpoint: bool = True
  peak_flops: float = 0.0        # MFU's ceiling; 0: the matmul rate measured at start-up
  data_parallel: bool = False    # split each batch over every device (mesh data = -1)
  freeze_experts: bool = False   # routed experts get zero updates (frozen-expert fine-tuning)
  init: str = ""                 # start a fresh run from this checkpoint's variables
  lora: LoRARun = LoRARun()

  def __post_init__(self):
    for f in ("steps", "batch_size", "seq_len", "log_every", "grad_accum"):
      _need(_positive_int(getattr(self, f)), f"train.{f}",
            f"expected a positive int, found {getattr(self, f)!r}")
    for f in ("checkpoint_every", "eval_every", "max_to_keep", "eval_batches"):
      _need(_non_negative_int(getattr(self, f)), f"train.{f}",
            f"expected a non-negative int, found {getattr(self, f)!r}")
    _need(self.seq_len >= 2, "train.seq_len", f"expected >= 2, found {self.seq_len}")
    _need(self.mtp_weight >= 0, "train.mtp_weight", f"expected >= 0, found {self.mtp_weight}")
    _need(self.batch_size % self.grad_accum == 0, "train.batch_size",
          f"must be divisible by train.grad_accum={self.grad_accum} (micro-batches), found "
          f"{self.batch_size}")
    object.__setattr__(self, "stages", tuple(Stage.of(x) for x in self.stages))
    pairs = parse_curriculum(self.curriculum)
    _need(not (self.stages and pairs), "train.curriculum",
          "set train.curriculum (steps:seq_len pairs) or train.stages, not both")
    planned = sum(st.steps for st in self.stages)
    _need(planned <= self.steps, "train.stages",
          f"the stages' steps add up to {planned}, more than train.steps={self.steps}")
    for st in self.stages:
      b, a = st.batch_size or self.batch_size, st.grad_accum or self.grad_accum
      _need(b % a == 0, "train.stages.batch_size",
            f"must be divisible by the stage's grad_accum={a}, found {b}")
    r = self.lora.rank
    _need(not (r and self.freeze_experts), "train.freeze_experts",
          "LoRA (train.lora.rank > 0) already freezes every base weight; leave it False")
    _need(not (r and self.init), "train.init",
          "a LoRA run (train.lora.rank > 0) starts its adapters on train.lora.base; set that "
          "instead of train.init")

  def stage_plan(self) -> tuple[Stage, ...]:
    """Every step's stage, in order: `stages` (or the curriculum's pairs as plain stages),
    then the rest of `steps` at `seq_len` with the run's own settings."""
    listed = self.stages or tuple(Stage(n, t) for n, t in parse_curriculum(self.curriculum))
    rest = self.steps - sum(st.steps for st in listed)
    return listed + ((Stage(rest, self.seq_len),) if rest > 0 else ())

  def stage_at(self, step: int) -> tuple[int, Stage]:
    """(index into `stage_plan()`, stage) of 0-based `step` (the last stage past the end)."""
    plan, start = self.stage_plan(), 0
    for i, st in enumerate(plan):
      if step < start + st.steps:
        return i, st
      start += st.steps
    return len(plan) - 1, plan[-1]

  def stage_start(self, index: int) -> int:
    """The first step of stage `index` of `stage_plan()`."""
    return sum(st.steps for st in self.stage_plan()[:index])


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  lr: float = 2e-3
  warmup_frac: float = 0.01
  final_lr_frac: float = 0.1
  weight_decay: float = 0.1
  momentum: float = 0.95
  adam_b1: float = 0.9
  adam_b2: float = 0.95
  muon: bool = True              # Per-Head Muon for matrices (False: AdamW for all)
  qk_clip_tau: float | None = 100.0
  clip_norm: float = 0.0         # global-norm gradient clipping (0: off)
  mu_dtype: str = ""             # first moments' dtype ("": the parameters')
  offload_momentum: bool = False  # Per-Head Muon's momentum in host memory

  def __post_init__(self):
    _need(self.lr > 0, "optim.lr", f"expected > 0, found {self.lr}")
    _need(self.mu_dtype in ("", "float32", "bfloat16"), "optim.mu_dtype",
          f"expected '' (the parameters' dtype), 'float32' or 'bfloat16', found "
          f"{self.mu_dtype!r}")
    _need(not self.offload_momentum or self.muon, "optim.offload_momentum",
          "offloads Per-Head Muon's momentum; it needs optim.muon=True")


@dataclasses.dataclass(frozen=True)
class BalanceConfig:
  method: str = "qb"             # Quantile Balancing, "sign" (the sign rule) or "none"
  num_bins: int = 0              # the margin histogram's bins (0: the model config's)
  gamma: float = 1e-3            # the sign rule's step

  def __post_init__(self):
    _need(self.method in METHODS, "balance.method",
          f"expected one of {METHODS}, found {self.method!r}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """`source`: "stdlib" (this Python's standard library), a path (.txt / .jsonl / .npy /
  .array_record, a directory or a glob: k3jax/data/corpus.py), "shapes" (the image–caption
  corpus: k3jax/data/captions.py), "sft" (chat conversations: k3jax/data/sft.py) or
  "sft_captions" (the shapes corpus as chat conversations with media, loss on the captions)."""
  source: str = "stdlib"
  eval_percent: float = 2.0
  # "shapes": text windows of text_source interleaved at text_fraction; media_length patches
  # per row's media stream (0: the tower's largest bucket).
  text_fraction: float = 0.0
  text_source: str = "stdlib"
  media_length: int = 0
  # "sft": a JSONL file of conversations, or the embedded tasks' sample counts when empty.
  sft_file: str = ""
  sft_num_train: int = 20000
  sft_num_eval: int = 256
  # Stages with data="long" (k3jax/data/long_docs.py): documents of at least long_threshold
  # tokens are "long" (0: a quarter of the stage's seq_len) and anchor rows long_upsample
  # times more often than their share; evidence answers weigh answer_weight in the loss;
  # evidence_tasks names the tasks drawn (k3jax/data/evidence.py TASKS; empty: all of them).
  long_threshold: int = 0
  long_upsample: float = 4.0
  answer_weight: float = 1.0
  evidence_tasks: tuple[str, ...] = ()

  def __post_init__(self):
    _need(0 <= self.text_fraction <= 1, "data.text_fraction",
          f"expected a value in [0, 1], found {self.text_fraction}")
    _need(_non_negative_int(self.long_threshold), "data.long_threshold",
          f"expected a non-negative int, found {self.long_threshold!r}")
    _need(self.long_upsample >= 1, "data.long_upsample",
          f"expected >= 1, found {self.long_upsample}")
    _need(self.answer_weight >= 0, "data.answer_weight",
          f"expected >= 0, found {self.answer_weight}")
    tasks = self.evidence_tasks
    if isinstance(tasks, str):          # the command line's form: "kv,count"
      tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    object.__setattr__(self, "evidence_tasks", tuple(tasks))
    bad = [t for t in self.evidence_tasks if t not in EVIDENCE_TASKS]
    _need(not bad, "data.evidence_tasks",
          f"expected names from {EVIDENCE_TASKS}, found {list(self.evidence_tasks)}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  model: ModelConfig
  seed: int = 0
  train: TrainConfig = TrainConfig()
  optim: OptimConfig = OptimConfig()
  balance: BalanceConfig = BalanceConfig()
  data: DataConfig = DataConfig()
  mesh: MeshConfig = MeshConfig()

  def __post_init__(self):
    _need(self.model.text.vocab_size >= NUM_BYTES + NUM_SPECIAL, "model.vocab_size",
          f"the byte tokenizer needs >= {NUM_BYTES + NUM_SPECIAL}, found "
          f"{self.model.text.vocab_size}")

  def replace(self, **groups: Any) -> "RunConfig":
    return dataclasses.replace(self, **groups)

  def signature(self) -> dict:
    """Fields a resume must keep (they change the optimizer state's structure)."""
    sig = {"muon": self.optim.muon, "balance": self.balance.method,
           "clip": self.optim.clip_norm > 0}
    if self.train.lora.rank:   # adapters only: another state structure
      sig["lora"] = self.train.lora.rank
    return sig

  def to_dict(self) -> dict:
    """JSON-ready (a run directory's config.json, a checkpoint's meta)."""
    out = {f.name: dataclasses.asdict(getattr(self, f.name))
           for f in dataclasses.fields(self) if f.name not in ("model", "seed")}
    out["train"]["lora"]["targets"] = list(self.train.lora.targets)
    out["data"]["evidence_tasks"] = list(self.data.evidence_tasks)
    return {"seed": self.seed, "model": config_to_dict(self.model), **out}


GROUPS = {"train": TrainConfig, "optim": OptimConfig, "balance": BalanceConfig,
          "data": DataConfig, "mesh": MeshConfig}


def _plain(value):
  return value.to_dict() if hasattr(value, "to_dict") else dict(value)


def _group(cls, values: dict, name: str):
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - set(fields))
  _need(not unknown, name, f"unknown field(s) {unknown}")
  kwargs = {}
  for k, v in values.items():
    if k == "lora" and cls is TrainConfig:
      v = _group(LoRARun, _plain(v), f"{name}.lora")
    elif isinstance(v, list):
      v = tuple(v)
    kwargs[k] = v
  return cls(**kwargs)


def run_config(cfg, extra: tuple[str, ...] = ()) -> RunConfig:
  """The typed run config of a ConfigDict (or a plain dict of the same groups).

  `extra`: top-level groups another reader takes (e.g. RL's "rl", "loss", "budget"); any
  other unknown group is a ValueError."""
  d = _plain(cfg)
  unknown = sorted(set(d) - {"seed", "model", *GROUPS} - set(extra))
  _need(not unknown, "<root>", f"unknown group(s) {unknown}")
  groups = {g: _group(cls, _plain(d[g]), g) for g, cls in GROUPS.items() if g in d}
  model = dict(_plain(d["model"])) if "model" in d else {"preset": "tiny"}
  lora = groups.get("train", TrainConfig()).lora
  balance = groups.get("balance", BalanceConfig())
  return RunConfig(model=model_config(model, lora, balance), seed=d.get("seed", 0), **groups)


def model_config(model: dict, lora: LoRARun = LoRARun(),
                 balance: BalanceConfig = BalanceConfig()) -> ModelConfig:
  """The ModelConfig of the `model` group: the fields over the preset `preset` names, the
  adapters of `train.lora` and the histogram bins of `balance.num_bins`."""
  m = dict(model)
  name = m.pop("preset", m.get("name", "custom"))
  m["name"] = name
  if lora.rank:   # train.lora.* → the model's adapters
    m.update(lora_rank=lora.rank, lora_alpha=float(lora.alpha), lora_targets=lora.targets)
  if "vision" in m:   # a vision preset name or a dict of fields; the projector feeds d_model
    m["vision"] = as_vision_config(m["vision"], text_hidden_size=m.get("d_model"))
  if balance.num_bins:
    m["qb_num_bins"] = int(balance.num_bins)
  try:
    return model_config_from_flat(m)
  except ValueError as e:
    raise ValueError(f"config.model: {e}") from None


def base_config(preset_name: str = "tiny") -> ml_collections.ConfigDict:
  """The ConfigDict configs/*.py start from: every field present (command-line overrides need
  them) with the dataclasses' defaults; `model` holds every ModelConfig field of the preset,
  flat (override any: --config.model.num_layers=5; `preset` only names it)."""
  model = flat_model_fields(model_preset(preset_name))
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = ml_collections.ConfigDict({"preset": preset_name, **model})
  for name, cls in GROUPS.items():
    values = dataclasses.asdict(cls())
    if cls is TrainConfig:
      values["lora"]["targets"] = ",".join(values["lora"]["targets"])
    if cls is DataConfig:
      values["evidence_tasks"] = ",".join(values["evidence_tasks"])
    c[name] = ml_collections.ConfigDict(values)
  return c


def flat_model_fields(config: ModelConfig) -> dict:
  """The `model` group's fields of `config` (adapter fields are set through train.lora)."""
  m = flat_fields(config)
  m.pop("name")
  for f in ("lora_rank", "lora_alpha", "lora_targets"):
    m.pop(f, None)
  return m


def write_json(run: RunConfig, path: str) -> None:
  """The run config as JSON at `path` (for people; checkpoints keep their own copy)."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(run.to_dict(), f, indent=2)
    f.write("\n")
  os.replace(tmp, path)


__all__ = ["RunConfig", "Stage", "STAGE_MODES", "STAGE_MESH", "TrainConfig", "LoRARun", "OptimConfig", "BalanceConfig", "DataConfig",
           "MeshConfig", "run_config", "model_config", "base_config", "write_json"]
