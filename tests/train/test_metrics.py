"""Router metrics, FLOP counts, the JSONL writer and the run plots (k3jax/train/metrics.py)."""

import json

import numpy as np
import pytest

from k3jax.config import preset
from k3jax.train import metrics as M


def test_router_metrics_values():
  flat = {"layers_1/block_sparse_moe/load": np.array([4.0, 3.0, 1.0, 0.0]),
          "body/layers_0/block_sparse_moe/load": np.array([[2.0, 2, 2, 2], [8.0, 0, 0, 0]]),
          "body/layers_3/self_attn/max_logit": np.array([[1.0, 7.5], [3.0, 2.0]]),
          "layers_1/block_sparse_moe/dropped": np.array(5)}
  m = M.router_metrics(flat)
  load = np.array([4.0, 3, 1, 0])
  assert m["moe/layers_1/block_sparse_moe/load_cv"] == pytest.approx(load.std() / load.mean())
  assert m["moe/layers_1/block_sparse_moe/idle_experts"] == 1
  assert m["moe/body/layers_0/block_sparse_moe_0/load_cv"] == 0.0
  assert m["moe/body/layers_0/block_sparse_moe_1/idle_experts"] == 3
  assert m["moe/layers_1/block_sparse_moe/dropped"] == 5
  assert m["dropped_fraction"] == pytest.approx(5 / (8 + 8 + 8))   # over all routed pairs
  assert m["max_attn_logit"] == 7.5 and m["idle_experts_total"] == 4
  names, mat = M.load_matrix(flat)
  assert mat.shape == (3, 4) and names[0] == "body/layers_0/block_sparse_moe_0"


def test_active_params_and_flops():
  cfg = preset("tiny", num_layers=4)
  params = {"embed_tokens": {"embedding": np.zeros((272, 64))},
            "lm_head": {"kernel": np.zeros((64, 272))},
            "layers_1": {"block_sparse_moe": {"experts": {"w1": np.zeros((8, 32, 32))},
                                              "gate": {"kernel": np.zeros((64, 8))}}}}
  # Embedding lookup excluded; experts count k/E = 2/8.
  assert M.active_params(cfg, params) == 64 * 272 + 8 * 32 * 32 * 2 / 8 + 64 * 8
  f = M.flops_per_token(cfg, params, seq_len=32, with_mtp=False)
  mla = 6 * 1 * 2 * (24 + 16) * 32 / 2
  kda = 6 * 3 * 2 * (2 * 16 * 16 + 16 * 32 / 2)
  assert f == pytest.approx(6 * M.active_params(cfg, params) + mla + kda)
  # Newton–Schulz FLOPs: 8 square 32×32 expert blocks and one 64×8 router block.
  want = 5 * (8 * (4 * 32 ** 3 + 2 * 32 ** 3) + (4 * 8 * 8 * 64 + 2 * 8 ** 3))
  assert M.muon_flops_per_step(params) == want


def test_writer_and_plots(tmp_path):
  w = M.MetricsWriter(str(tmp_path), tensorboard=True)
  for s in range(1, 5):
    w.write(s, {"loss": 5.0 - s, "tokens_per_s": None, "moe/layers_1/block_sparse_moe/load_cv":
                np.float32(0.5 / s), "moe/layers_1/block_sparse_moe/idle_experts": 4 - s})
  w.write(4, {"loss": 0.5, "eval_loss": 0.7})      # a resumed run re-logging step 4
  w.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 9, "lo')                      # torn by a kill: ignored
  recs = M.read_metrics(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in recs] == [1, 2, 3, 4, 4]
  assert recs[1]["moe/layers_1/block_sparse_moe/load_cv"] == pytest.approx(0.25)
  assert recs[0]["tokens_per_s"] is None
  assert list(tmp_path.glob("events.out.tfevents.*"))
  M.MetricsWriter(str(tmp_path), tensorboard=False).write(10, {"loss": 1.0})
  assert json.loads(open(tmp_path / "metrics.jsonl").read().splitlines()[-1])["step"] == 10

  from experiments.plot_run import plot_run
  import matplotlib.image as mpimg
  files = plot_run(str(tmp_path), str(tmp_path / "plots"))
  assert [f.rsplit("/", 1)[1] for f in files] == ["loss.png", "expert_load.png"]
  for f in files:
    img = mpimg.imread(f)
    assert img.ndim == 3 and img.shape[0] > 100 and img.std() > 0.01   # a drawn picture
