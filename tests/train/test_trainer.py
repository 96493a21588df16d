"""The training loop end to end (in process): bit-exact resume, learning, load_pretrained.

All runs share one run config (a 4-layer `tiny`: KDA ×3 + MLA, dense + MoE, MTP) and the same
`train.steps`, so the jitted step compiles once for the whole file; `until=` stops a run
early (a preemption) without changing the schedule.
"""

import json
import os

import jax
import numpy as np
import pytest

import k3jax
from k3jax.data import corpus as D
from k3jax.data import tokenizers
from k3jax.train.run import base_config, run_config
from k3jax.train.trainer import train

STEPS = 160


def _cfg(**over):
  c = base_config("tiny")
  c.model.num_layers = 4
  c.train.update(dict(steps=STEPS, batch_size=4, seq_len=32, log_every=1, eval_every=0,
                      checkpoint_every=3, progress=False, tensorboard=False,
                      peak_flops=1e11, async_checkpoint=True))
  c.optim.lr = 1e-2
  for k, v in over.items():
    g, f = k.split(".")
    c[g][f] = v
  return c


def _run(**over):
  return run_config(_cfg(**over))


def _losses(records):
  return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  d = tmp_path_factory.mktemp("straight")
  return d, _losses(train(_run(), str(d), until=6))


def test_resume_is_bit_exact(straight, tmp_path):
  _, want = straight
  first = _losses(train(_run(), str(tmp_path), until=3))       # "killed" after step 3
  second = _losses(train(_run(), str(tmp_path), until=6))      # resumes from checkpoint 3
  assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5, 6]
  got = {**first, **second}
  assert got == want        # bit-exact on CPU: same state, same batches, same program
  recs = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
  for key in ("loss", "tokens_per_s", "mfu", "grad_norm", "max_attn_logit", "load_cv_mean",
              "idle_experts_total"):
    assert key in recs[-1], key
  assert 0 < recs[-1]["mfu"] < 1


def test_load_pretrained_gives_logits(straight):
  from k3jax.model import K3Model
  d, _ = straight
  config, variables = k3jax.load_pretrained(d)
  assert config.text.num_layers == 4 and config.name == "tiny"
  tokens = tokenizers.ByteTokenizer().encode("def f(x):\n  return x\n", bos=True)[None, :]
  logits = jax.jit(K3Model(config).apply)(variables, tokens)
  assert logits.shape == (1, tokens.shape[1], config.text.vocab_size)
  assert np.all(np.isfinite(np.asarray(logits)))


def test_tiny_learns_below_unigram_entropy(tmp_path):
  """A few hundred steps of a (4-layer) tiny model beat the best context-free model by far."""
  recs = train(_run(**{"train.checkpoint_every": 0}), str(tmp_path))
  corpus = D.load_corpus("stdlib")
  h = D.unigram_entropy(corpus.train, 272)
  last = np.mean([r["ce"] for r in recs[-10:]])
  assert recs[0]["ce"] > h                      # starts above (random init ≈ ln 272)
  assert last < 0.8 * h, (last, h)


def test_bad_inputs_fail_before_compute(tmp_path, straight):
  d, _ = straight
  with pytest.raises(ValueError, match="train.batch_size"):
    train(_run(**{"train.batch_size": 0}), str(tmp_path / "a"))
  with pytest.raises(ValueError, match="train.seq_len"):
    train(_run(**{"train.seq_len": 10 ** 9}), str(tmp_path / "b"))
  with pytest.raises(ValueError, match=r"train.batch_size: must be divisible by train.grad_accum=3"):
    train(_run(**{"train.grad_accum": 3}), str(tmp_path / "b2"))
  with pytest.raises(ValueError, match="train.grad_accum"):
    train(_run(**{"train.grad_accum": 0}), str(tmp_path / "b3"))
  with pytest.raises(ValueError, match="cannot read"):
    train(_run(**{"data.source": str(tmp_path / "missing.txt")}), str(tmp_path / "c"))
  with pytest.raises(ValueError, match="balance.method"):
    train(_run(**{"balance.method": "median"}), str(tmp_path / "d"))
  with pytest.raises(ValueError, match="optim.mu_dtype"):
    train(_run(**{"optim.mu_dtype": "int8"}), str(tmp_path / "d2"))
  with pytest.raises(ValueError, match="optim.offload_momentum: offloads Per-Head Muon"):
    train(_run(**{"optim.offload_momentum": True, "optim.muon": False}), str(tmp_path / "d3"))
  with pytest.raises(ValueError, match="offload_momentum: host memory needs a jit"):
    train(_run(**{"optim.offload_momentum": True}), str(tmp_path / "d4"))
  c = _cfg()
  c.model.d_model = 32
  with pytest.raises(ValueError, match=r"another model config.*d_model"):
    train(run_config(c), str(d))
  with pytest.raises(ValueError, match="optimizer settings"):
    train(_run(**{"optim.muon": False}), str(d))
