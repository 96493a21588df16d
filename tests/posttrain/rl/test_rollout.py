"""Rollout log-probs = the trainer's recomputation (fp32, ≤ 1e-5), and partial-rollout
bookkeeping on a 2-layer model (KDA + MLA): no trajectory lost or duplicated, resumed
trajectories continue the same tokens (greedy partial rollouts = uninterrupted greedy), by
recompute and with caches retained in the serving engine; with rl.expert_qat both sides
quantise the experts alike."""

import functools

import jax
import numpy as np
import pytest

from k3jax.config import preset
from k3jax.posttrain.rl import logprobs as L
from k3jax.posttrain.rl import loop
from k3jax.posttrain.rl import rollout as R
from k3jax.posttrain.rl.partial import PartialRollout
from k3jax.data.rl_tasks import STOP_TOKEN, TaskSampler
from k3jax.train.state import init_variables

N, K, MAX_NEW, WIDTH = 2, 2, 8, 120
CONFIG = preset("tiny", num_layers=2, mla_every=2, first_dense_layers=1,
                attn_res_block_size=None, num_mtp_layers=0)


@functools.lru_cache(maxsize=None)
def _variables():
  return init_variables(CONFIG, jax.random.PRNGKey(0))


def test_rollout_logprobs_equal_trainer_logprobs():
  prompts = [t.tokens for t in TaskSampler(seed=1).sample(N * K)]
  out = R.sample(CONFIG, _variables(), prompts, [MAX_NEW, MAX_NEW, 5, 0], width=WIDTH,
                 key=jax.random.PRNGKey(2), stop_tokens=[STOP_TOKEN], temperature=1.0)
  assert out.lengths[3] == 0 and not out.finished[3]          # an idle row
  assert out.lengths[2] <= 5 and out.finished[:3].all()
  seqs, plens = R.sequences(prompts, [out.row(b)[0] for b in range(N * K)], WIDTH)
  lp = L.token_logprobs(CONFIG, _variables(), seqs, plens, MAX_NEW)
  assert out.lengths.sum() >= 10
  assert L.mismatch(out.logprobs, lp, out.lengths) <= 1e-5
  # The mismatch metric sees a difference when there is one.
  assert L.mismatch(out.logprobs + 1e-3, lp, out.lengths) > 5e-4
  with pytest.raises(ValueError, match="width"):
    R.sample(CONFIG, _variables(), prompts, [WIDTH] * 4, width=WIDTH, key=jax.random.PRNGKey(0))


def test_qat_rollout_logprobs_equal_trainer_logprobs():
  """rl.expert_qat: the rollout and the trainer both run the fake-quantised experts (one
  policy config), so their log-probs agree as without QAT — and differ from the unquantised
  model's."""
  qconfig = loop.policy_config(loop.RolloutConfig(expert_qat="mxfp4_mxfp8"), CONFIG)
  assert qconfig.modes.expert_qat == "mxfp4_mxfp8" and loop.policy_config(
      loop.RolloutConfig(expert_qat=None), CONFIG) == CONFIG
  prompts = [t.tokens for t in TaskSampler(seed=3).sample(N * K)]
  out = R.sample(qconfig, _variables(), prompts, [MAX_NEW] * (N * K), width=WIDTH,
                 key=jax.random.PRNGKey(4), stop_tokens=[STOP_TOKEN], temperature=1.0)
  seqs, plens = R.sequences(prompts, [out.row(b)[0] for b in range(N * K)], WIDTH)
  lp = L.token_logprobs(qconfig, _variables(), seqs, plens, MAX_NEW)
  assert out.lengths.sum() >= 10
  assert L.mismatch(out.logprobs, lp, out.lengths) <= 1e-5
  plain = L.token_logprobs(CONFIG, _variables(), seqs, plens, MAX_NEW)
  assert L.mismatch(plain, lp, out.lengths) > 1e-4


def test_partial_rollout_bookkeeping_and_resumption():
  # Greedy, no stop token, per-trajectory caps 1..MAX_NEW: rounds end once half the rows
  # finished, so trajectories are resumed across rounds. With fixed parameters the resumed
  # tokens must be exactly an uninterrupted greedy rollout of the same prompt.
  pool = PartialRollout(TaskSampler(seed=5), n_prompts=N, k=K, lam=0.5, max_new_tokens=MAX_NEW,
                        width=WIDTH, stop_tokens=(), temperature=0.0,
                        limit_fn=lambda task, rng: int(rng.integers(1, MAX_NEW + 1)), seed=0)
  handed, resumed_ok, rounds = [], 0, 0
  snapshot = {}
  while len(handed) < 6 * K and rounds < 40:
    before = {t.tid: list(t.tokens) for t in pool.queue}
    groups, stats = pool.round(CONFIG, _variables(), version=rounds, key=jax.random.PRNGKey(0))
    rounds += 1
    pool.check()
    assert stats.resumed == len(before)
    for g in groups:
      assert len(g) == K and len({t.gid for t in g}) == 1 and all(t.finished for t in g)
      handed += g
    for t in list(pool.queue) + [t for g in groups for t in g]:
      if t.tid in before:   # a resumed trajectory: its old tokens are a prefix of the new
        assert t.tokens[:len(before[t.tid])] == before[t.tid]
        resumed_ok += 1
      snapshot[t.tid] = t
  assert resumed_ok > 0, "no trajectory was resumed: the test exercised nothing"
  tids = [t.tid for t in handed]
  assert len(tids) == len(set(tids))
  assert all(len(t.tokens) == t.limit == len(t.logprobs) == len(t.versions) for t in handed)
  assert any(len(set(t.versions)) > 1 for t in handed)     # tokens from several rounds
  rows = handed[:N * K]
  ref = R.sample(CONFIG, _variables(), [t.task.tokens for t in rows], [t.limit for t in rows],
                 width=WIDTH, key=jax.random.PRNGKey(9), temperature=0.0)
  for i, t in enumerate(rows):
    assert t.tokens == ref.row(i)[0]
    np.testing.assert_allclose(t.logprobs, ref.row(i)[1], atol=1e-5)


def test_partial_rollout_with_retained_caches():
  """retain_cache=True: the rounds run through the serving engine, unfinished trajectories
  paused and resumed with their caches. With fixed parameters, greedy, λ = 0.5 and random caps,
  every trajectory equals an uninterrupted greedy rollout (tokens, log-probs ≤ 1e-5); a round
  prefills only its new prompts (no resumed prefix); the bookkeeping holds every round; after
  new weights a resumed trajectory continues from its old cache (`cache_versions`); `close`
  returns every page."""
  pool = PartialRollout(TaskSampler(seed=5), n_prompts=N, k=K, lam=0.5, max_new_tokens=MAX_NEW,
                        width=WIDTH, stop_tokens=(), temperature=0.0,
                        limit_fn=lambda task, rng: int(rng.integers(1, MAX_NEW + 1)), seed=0,
                        retain_cache=True)
  handed, resumed, rounds = [], 0, 0
  while len(handed) < 4 * K and rounds < 30:
    queued = {t.tid: len(t.tokens) for t in pool.queue}
    new_before = pool.created
    groups, stats = pool.round(CONFIG, _variables(), version=0, key=jax.random.PRNGKey(rounds))
    rounds += 1
    pool.check()
    assert stats.resumed == len(queued)
    resumed += stats.resumed
    new = [t for g in pool.pending.values() for t in g if t.tid >= new_before] + [
        t for g in groups for t in g if t.tid >= new_before]
    assert stats.prefill_tokens == sum(len(t.task.tokens) for t in new)
    for g in groups:
      assert len(g) == K and all(t.finished for t in g)
      handed += g
  assert resumed > 0, "no trajectory was resumed: the test exercised nothing"
  assert all(len(t.tokens) == t.limit == len(t.logprobs) == len(t.cache_versions)
             for t in handed)
  assert any(t.rounds > 1 for t in handed)
  for s in range(0, len(handed), N * K):       # the batch of the other tests: one compile
    rows = handed[s:s + N * K]
    ref = R.sample(CONFIG, _variables(), [t.task.tokens for t in rows], [t.limit for t in rows],
                   width=WIDTH, key=jax.random.PRNGKey(9), temperature=0.0)
    for i, t in enumerate(rows):
      assert t.tokens == ref.row(i)[0]
      np.testing.assert_allclose(t.logprobs, ref.row(i)[1], atol=1e-5)
  # New weights: the queued trajectories resume from the caches of version 0.
  assert pool.queue
  waiting = {t.tid: len(t.tokens) for t in pool.queue}
  scaled = jax.tree.map(lambda a: a * 1.01, _variables())
  groups, stats = pool.round(CONFIG, scaled, version=1, key=jax.random.PRNGKey(99))
  pool.check()
  later = [t for t in list(pool.queue) + [t for g in groups for t in g] if t.tid in waiting]
  moved = [t for t in later if len(t.tokens) > waiting[t.tid]]
  assert moved and all(t.versions[-1] == 1 and t.cache_versions[-1] == 0 for t in moved)
  fresh = [t for t in list(pool.queue) + [t for g in groups for t in g] if t.first_version == 1]
  assert all(set(t.cache_versions) == {1} for t in fresh)
  eng = pool.engine
  assert eng.stats()["paused"] == len(pool.queue) > 0 and eng.allocator.num_used > 0
  pool.close()
  pool.check()
  assert eng.stats()["paused"] == 0 and eng.allocator.num_used == 0


def test_retained_caches_at_a_temperature_report_the_sampling_log_probs():
  """At temperature 0.7 the engine reports each token's log-prob under the distribution it
  was drawn from: over rounds with pauses and resumes, every trajectory's log-probs equal the
  trainer's `token_logprobs(..., temperature=0.7)` (≤ 1e-5) and not the untempered ones."""
  pool = PartialRollout(TaskSampler(seed=7), n_prompts=N, k=K, lam=0.5, max_new_tokens=MAX_NEW,
                        width=WIDTH, stop_tokens=(), temperature=0.7,
                        limit_fn=lambda task, rng: int(rng.integers(1, MAX_NEW + 1)), seed=1,
                        retain_cache=True)
  handed, resumed, rounds = [], 0, 0
  while len(handed) < N * K and rounds < 20:
    groups, stats = pool.round(CONFIG, _variables(), version=0, key=jax.random.PRNGKey(rounds))
    rounds += 1
    resumed += stats.resumed
    handed += [t for g in groups for t in g]
  assert resumed > 0, "no trajectory was resumed: the test exercised nothing"
  rows = handed[:N * K]
  seqs, plens = R.sequences([t.task.tokens for t in rows], [t.tokens for t in rows], WIDTH)
  lengths = np.array([len(t.tokens) for t in rows])
  behaviour = np.zeros((len(rows), MAX_NEW), np.float32)
  for i, t in enumerate(rows):
    behaviour[i, :len(t.logprobs)] = t.logprobs
  tempered = L.token_logprobs(CONFIG, _variables(), seqs, plens, MAX_NEW, temperature=0.7)
  assert L.mismatch(behaviour, tempered, lengths) <= 1e-5
  plain = L.token_logprobs(CONFIG, _variables(), seqs, plens, MAX_NEW)
  assert L.mismatch(behaviour, plain, lengths) > 1e-3
  pool.close()
  assert loop.RolloutConfig(temperature=0.7).retain_cache
  with pytest.raises(ValueError, match="temperature"):
    PartialRollout(TaskSampler(seed=5), n_prompts=N, k=K, lam=0.5, max_new_tokens=MAX_NEW,
                   width=WIDTH, temperature=-1.0, retain_cache=True)
