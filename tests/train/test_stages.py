"""Curriculum stages with their own mesh, memory settings and data (k3jax/train/stages.py):
the plan, the typed records' errors, and a bit-exact resume across a stage boundary where the
step moves from one device onto a context-parallel mesh (8 simulated CPU devices).

One run config: a 2-layer `tiny` (KDA + dense MLP, MLA + MoE, MTP), 3 steps of 4 × 32 tokens on one device, then 3 steps of
4 × 64 tokens of long-document rows with evidence tasks on a (data 4 × context 2) mesh with
remat; both steps compile once for the whole file."""

import jax
import numpy as np
import pytest

from k3jax.data import corpus as D
from k3jax.train import stages as S
from k3jax.train.checkpoint import Checkpointer
from k3jax.train.optim import optimizer
from k3jax.train.run import Stage, base_config, run_config
from k3jax.train.sharded import PRETRAIN
from k3jax.train.state import init_state, init_variables
from k3jax.train.trainer import train

STAGES = (dict(steps=3, seq_len=32),
          dict(steps=3, seq_len=64, mesh=dict(context=2), modes=dict(remat=True), data="long",
               evidence_fraction=0.5))


def _run(**train_over):
  c = base_config("tiny")
  c.model.num_layers = 2
  c.train.update(dict(steps=6, batch_size=4, seq_len=64, log_every=1, eval_every=0,
                      checkpoint_every=2, progress=False, tensorboard=False, peak_flops=1e11,
                      async_checkpoint=False, **{"stages": STAGES, **train_over}))
  c.optim.lr = 1e-2
  return run_config(c)


def test_plan_stage_runs_and_errors():
  run = _run()
  plan = run.train.stage_plan()
  assert [(s.steps, s.seq_len) for s in plan] == [(3, 32), (3, 64)]
  assert run.train.stage_at(2)[0] == 0 and run.train.stage_at(3)[0] == 1
  second = S.stage_run(run, plan[1])
  assert second.model.modes.remat and not run.model.modes.remat
  assert second.mesh.context == 2 and second.train.seq_len == 64
  assert S.tokens_through(run, 4) == 3 * 4 * 32 + 4 * 64
  # The curriculum string is the same plan of plain stages, the rest at train.seq_len.
  c = _run(stages=(), curriculum="2:16").train
  assert [(s.steps, s.seq_len) for s in c.stage_plan()] == [(2, 16), (4, 64)]
  for bad, match in [
      (dict(stages=STAGES, curriculum="2:16"), "not both"),
      (dict(stages=(dict(steps=7, seq_len=8),)), "train.stages"),
      (dict(stages=(dict(steps=1, seq_len=8, modes=dict(num_layers=2)),)),
       "train.stages.modes"),
      (dict(stages=(dict(steps=1, seq_len=8, mesh=dict(pipeline=2)),)), "train.stages.mesh"),
      (dict(stages=(dict(steps=1, seq_len=8, evidence_fraction=0.5),)), "data='long'"),
      (dict(stages=(dict(steps=1, seq_len=8, colour=1),)), "unknown field"),
  ]:
    with pytest.raises(ValueError, match=match):
      _run(**bad)
  assert Stage.of((5, 128)) == Stage(5, 128)


def test_staged_data_is_the_plain_iterator_in_a_plain_stage():
  run = _run(stages=(), curriculum="2:16")
  corpus = D.load_corpus("stdlib")
  staged = S.StagedData(run, corpus)
  plain = D.DataIterator(corpus, 4, 64, run.seed, D.parse_curriculum("2:16"))
  for _ in range(3):
    a, b = next(staged), next(plain)
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  assert staged.get_state() == plain.get_state()


def test_staged_long_rows_draw_the_configured_evidence_tasks():
  """data.evidence_tasks reaches the long-row iterator: with it ("count",) every evidence row
  asks the count question (SEP ? !), with the default the other tasks appear too."""
  from k3jax.data.tokenizers import SEP
  corpus = D.load_corpus("stdlib")
  stages = (dict(steps=1, seq_len=8), dict(steps=4, seq_len=64, data="long",
                                           evidence_fraction=1.0))

  def questions(tasks):
    c = base_config("tiny")
    c.train.update(dict(steps=5, batch_size=8, seq_len=64, stages=stages))
    c.data.evidence_tasks = tasks
    staged = S.StagedData(run_config(c), corpus)
    out = set()
    for step in range(1, 5):
      for row in staged.batch(step)["inputs"]:
        at = np.flatnonzero(row == SEP)
        out.add(bytes(row[at[-1] + 1:at[-1] + 3].astype(np.uint8)))  # the question's head
    return out

  assert questions("count") == {b"?!"}
  assert len(questions("")) > 1
  with pytest.raises(ValueError, match="data.evidence_tasks"):
    questions("count,recall")


def _losses(records):
  return {r["step"]: r["loss"] for r in records}


def test_resume_across_a_stage_boundary_is_bit_exact(tmp_path):
  run = _run()
  straight = train(run, str(tmp_path / "straight"))
  want = _losses(straight)
  assert [r["stage"] for r in straight] == [0, 0, 0, 1, 1, 1]
  assert [r["seq_len"] for r in straight] == [32] * 3 + [64] * 3
  # Killed after step 2 (stage 0), resumed: crosses the boundary in the resumed run; killed
  # again after step 4 (inside stage 1, on the mesh), resumed from its checkpoint.
  d = str(tmp_path / "resumed")
  got = {**_losses(train(run, d, until=2)), **_losses(train(run, d, until=4)),
         **_losses(train(run, d))}
  assert got == want
  ck = [Checkpointer(p, async_save=False) for p in (tmp_path / "straight", d)]
  try:
    a, b = (c.restore_latest(run.model, *_templates(run)) for c in ck)
  finally:
    for c in ck:
      c.close()
  assert a[0] == b[0] == 6
  for x, y in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1])):
    np.testing.assert_array_equal(x, y)


def _templates(run):
  """(variables, optimizer state) shaped like the run's, for restoring its checkpoints."""
  state = init_state(init_variables(run.model, jax.random.PRNGKey(0)), PRETRAIN,
                     optimizer(run, run.model)[0])
  return state.optimized, state.opt_state
