"""Parity with `transformers`' Kimi K2.5 vision tower + projector (a small version of
experiments/vision_parity.py's figure).

A random Kimi_K25VisionModel + Kimi_K25MultimodalProjection with the K2.5 structure (LayerNorm
and biases, fused-then-split q/k/v with rotate-half RoPE, bicubic position table, temporal
pooling, pre-norm projector) but 3 layers of width 64 (4 heads of 16) and an 8×8 position
table, every parameter perturbed; converted by `--only vision --arch kimi_k25` from its
module-name spelling (split q/k/v) and run by `k3jax.vision.encode` on ONE packed batch of two
images of different sizes and a 4-frame clip. fp32 both sides; the full-size figure is
`experiments/vision_parity.py` (docs/notes/vision_convert.md).
"""

import numpy as np
import pytest

from experiments import vision_parity as vp

GRIDS = ((1, 6, 8), (1, 10, 4), (4, 4, 6))     # two images (6×8, 10×4 patches), a 4-frame clip


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
  return vp.run(layers=3, hidden=64, heads=4, intermediate=128, text_hidden=48, pos_emb=8,
                grids=GRIDS, seed=0, workdir=tmp_path_factory.mktemp("parity"))


def test_merged_and_projected_match_transformers(figures):
  f = figures
  n = sum(h * w // 4 for _, h, w in GRIDS)
  assert f["num_patches"] == sum(t * h * w for t, h, w in GRIDS)
  assert f["merged_shape"] == [n, 4, 64] and f["projected_shape"] == [n, 48]
  assert f["config"]["preset_family"] == "moonvit_k25"
  # outputs are not trivially small (a failure of scale would hide in a relative error)
  assert f["max_abs_ref_merged"] > 0.5 and f["max_abs_ref_projected"] > 0.1
  assert f["max_rel_err_merged"] <= 1e-4, f
  assert f["max_rel_err_projected"] <= 1e-4, f


def test_without_the_rope_permutation_parity_fails(monkeypatch, tmp_path):
  # Negative control: the split q/k rows read in transformers' rotate-half order, unpermuted,
  # give clearly different features — the permutation, not luck, makes the test above pass.
  from k3jax.convert import vision_names as vnames
  monkeypatch.setattr(vnames, "rope_half_to_pairs", lambda head_dim: np.arange(head_dim))
  f = vp.run(layers=3, hidden=64, heads=4, intermediate=128, text_hidden=48, pos_emb=8,
             grids=GRIDS, seed=0, workdir=tmp_path)
  assert f["max_rel_err_merged"] > 1e-2 and f["max_rel_err_projected"] > 1e-2, f


def test_rel_err():
  x = np.random.default_rng(0).normal(size=(8, 4, 16)).astype(np.float32)
  y = x.copy()
  y[:, :, [0, 1]] = y[:, :, [1, 0]]
  assert vp.rel_err(x, x) == 0.0 and vp.rel_err(y, x) > 0.1
  with pytest.raises(ValueError, match="shapes differ"):
    vp.rel_err(x[:2], x)
