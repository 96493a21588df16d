"""The jitted fp32 K3Model against the float64 numpy reference written from the spec
(tests/reference_model.py), packed, for tiny (with MTP) and tiny_kimi_linear.

Test data: `setup`'s variables (well conditioned: see `random_variables` in
tests/test_model.py), tokens and compiled forward (one jit per config, shared with
tests/test_model.py).

Routing: dropless top-k is discontinuous, so the test also asserts that the smallest gap
between the k-th and (k+1)-th biased router score, over every MoE layer (MTP included) and
token, is far above fp32 rounding of the scores: no routing decision can flip.
"""

import ast
import pathlib

import numpy as np
import pytest

from reference_model import reference_forward
from test_model import PACKED, setup

REL_TOL = 1e-4        # max|model − reference| ≤ REL_TOL · max|reference|
MIN_ROUTE_MARGIN = 1e-5


def _rel_err(got, ref):
  return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear"])
def test_model_matches_float64_reference(name):
  cfg, _, v, tokens, fwd = setup(name)
  mtp = bool(cfg.num_mtp_layers)
  out, _ = fwd(v, tokens, PACKED)
  logits, mtp_logits = out if mtp else (out, None)
  ref = reference_forward(cfg, v, tokens, PACKED, mtp=mtp)

  assert ref["min_route_margin"] > MIN_ROUTE_MARGIN, ref["min_route_margin"]
  b, t = tokens.shape
  assert ref["logits"].shape == logits.shape == (b, t, cfg.vocab_size)
  err = _rel_err(logits, ref["logits"])
  assert err <= REL_TOL, f"{name}: logits max error {err:.3g} of max|ref|"
  if mtp:
    assert ref["mtp_logits"].shape == mtp_logits.shape == (b, t - 1, cfg.vocab_size)
    err = _rel_err(mtp_logits, ref["mtp_logits"])
    assert err <= REL_TOL, f"{name}: MTP logits max error {err:.3g} of max|ref|"
  else:
    assert ref["mtp_logits"] is None


def test_reference_uses_only_k3jax_config():
  """The reference must stay independent of the implementation it checks."""
  src = pathlib.Path(__file__).with_name("reference_model.py").read_text()
  for node in ast.walk(ast.parse(src)):
    if isinstance(node, ast.Import):
      mods = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      mods = [node.module or ""]
    else:
      continue
    for mod in mods:
      assert not mod.startswith("k3jax") or mod == "k3jax.config", mod
