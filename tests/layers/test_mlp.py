"""Dense gated MLP (SiTU-GLU / SwiGLU) against numpy."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from k3jax.config import preset
from k3jax.layers.mlp import MLP


def _np_situ(a, b, b1=4.0, b2=25.0):
  return b1 * np.tanh(a / b1) / (1 + np.exp(-a)) * b2 * np.tanh(b / b2)


def _np_swiglu(a, b):
  return a / (1 + np.exp(-a)) * b


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_mlp_matches_numpy(activation):
  cfg = preset("tiny", activation=activation)
  x = np.random.default_rng(0).normal(size=(2, 5, cfg.text.d_model)).astype(np.float32) * 3
  mod = MLP(cfg, 48)
  v = nn.unbox(mod.init(jax.random.key(0), x))
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), v["params"])
  assert p["gate_proj"]["kernel"].shape == (cfg.text.d_model, 48)
  assert p["down_proj"]["kernel"].shape == (48, cfg.text.d_model)
  act = _np_situ if activation == "situ" else _np_swiglu
  ref = act(x @ p["gate_proj"]["kernel"], x @ p["up_proj"]["kernel"]) @ p["down_proj"]["kernel"]
  np.testing.assert_allclose(mod.apply(v, x), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
