"""Stages of the context curriculum as the loop runs them: each stage's run config, mesh and
data (docs/k3.md §8: 8K → 64K in pre-training, 256K → 1M in the cool-down).

`train.stages` (k3jax/train/run.py, `Stage`) lists stages with their own sequence length,
batch size, mesh, memory settings (RunModes: remat, host offload, attention blocks, …) and
data; `train.curriculum`'s "steps:seq_len" pairs are plain stages. `TrainConfig.stage_plan()`
covers every step. Here:

  - `stage_run(run, stage)`: the RunConfig the stage's step is built from — train's batch
    size, micro-batches and seq_len of the stage, the model with the stage's modes, the mesh
    group with the stage's axis sizes, optim's offload with the stage's. Only how the step
    runs changes: the variables and the optimizer state keep their structure, so the state
    passes from one stage's step to the next as it is (re-laid out on the new mesh).
  - `stage_mesh(run, stage, mesh)`: the stage's mesh — `mesh` (the run's, or None: one device)
    unless the stage sets axis sizes, then a mesh of every device with those sizes.
  - `StagedData`: the batches of every step, each from its stage's source at its stage's
    shape: the run's text corpus (`corpus.sample_batch`, exactly as `corpus.DataIterator`) or
    long-document rows with evidence tasks mixed in (k3jax/data/long_docs.py) built from the
    same corpus. A batch is a pure function of (corpus, seed, step, stage), so the iterator
    state is the step (and the corpus fingerprint), the same record `DataIterator` keeps:
    resuming inside or across a stage boundary continues the exact stream.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

from k3jax import sharding
from k3jax.data import corpus as corpus_lib
from k3jax.data import evidence, long_docs
from k3jax.train.run import RunConfig, Stage


def stage_run(run: RunConfig, stage: Stage) -> RunConfig:
  """The run config of `stage`'s step (module doc)."""
  t = run.train
  train = dataclasses.replace(t, seq_len=stage.seq_len, batch_size=stage.batch_size or t.batch_size,
                              grad_accum=stage.grad_accum or t.grad_accum, curriculum="",
                              stages=())
  model = run.model.replace(**dict(stage.modes)) if stage.modes else run.model
  mesh = dataclasses.replace(run.mesh, **dict(stage.mesh)) if stage.mesh else run.mesh
  optim = run.optim if stage.offload_momentum is None else dataclasses.replace(
      run.optim, offload_momentum=stage.offload_momentum)
  return run.replace(train=train, model=model, mesh=mesh, optim=optim)


def stage_mesh(run: RunConfig, stage: Stage, mesh: Mesh | None) -> Mesh | None:
  """`mesh` unless `stage` sets axis sizes: then a mesh of all devices with the run's mesh
  group updated by them (`sharding.make_mesh`)."""
  if not stage.mesh:
    return mesh
  return sharding.make_mesh(stage_run(run, stage).mesh)


def tokens_through(run: RunConfig, steps: int) -> int:
  """Tokens the first `steps` steps of the plan train on (batch × seq_len per step)."""
  total, start = 0, 0
  for st in run.train.stage_plan():
    n = max(0, min(st.steps, steps - start))
    total += n * (st.batch_size or run.train.batch_size) * st.seq_len
    start += st.steps
  return total


class StagedData:
  """The batches of every step of the plan, from a text corpus (module doc)."""

  def __init__(self, run: RunConfig, corpus: corpus_lib.Corpus):
    self.run, self.corpus, self.seed = run, corpus, run.seed
    self.plan = run.train.stage_plan()
    for st in self.plan:
      if len(corpus.train) < st.seq_len + 2:
        raise ValueError(f"config.train.seq_len={st.seq_len}: the train split of "
                         f"{corpus.source!r} has only {len(corpus.train)} tokens (need ≥ "
                         f"{st.seq_len + 2})")
    self._long: dict[int, long_docs.LongDocIterator] = {}
    self.step = 0

  def stage_at(self, step: int) -> Stage:
    return self.run.train.stage_at(step)[1]

  def seq_len_at(self, step: int) -> int:
    return self.stage_at(step).seq_len

  def batch_size_at(self, step: int) -> int:
    return self.stage_at(step).batch_size or self.run.train.batch_size

  def _long_rows(self, stage: Stage) -> long_docs.LongDocIterator:
    d = self.run.data
    threshold = d.long_threshold or max(2, stage.seq_len // 4)
    key = (threshold, stage.evidence_fraction)
    if key not in self._long:
      docs = long_docs.LongDocs.from_stream(self.corpus.train, long_threshold=threshold,
                                            upsample=d.long_upsample)
      self._long[key] = long_docs.LongDocIterator(
          docs, 1, stage.seq_len, self.seed, evidence_fraction=stage.evidence_fraction,
          tasks=d.evidence_tasks or evidence.TASKS, answer_weight=d.answer_weight)
    return self._long[key]

  def batch(self, step: int) -> dict:
    """The batch of `step` (numpy arrays [B, T] of its stage)."""
    stage = self.stage_at(step)
    b = self.batch_size_at(step)
    if stage.data == "long":
      return self._long_rows(stage).batch(step, b, stage.seq_len)
    return corpus_lib.sample_batch(self.corpus.train, self.seed, step, b, stage.seq_len)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    out = self.batch(self.step)
    self.step += 1
    return out

  def get_state(self) -> dict:
    return {"step": self.step, "seed": self.seed, "data": self.corpus.fingerprint()}

  def set_state(self, state: dict) -> None:
    self.step = corpus_lib.restored_step(state, self.corpus.fingerprint(), self.seed)


def on_one_device(tree):
  """`tree` on the default device (leaving a mesh for a stage that runs unsharded)."""
  return jax.device_put(tree, jax.devices()[0])


__all__ = ["stage_run", "stage_mesh", "tokens_through", "StagedData", "on_one_device"]
