"""Kernel selection: one place, by config field."""

import pytest

from k3jax.layers import backend
from k3jax.ops.kda import kda_chunked


def test_resolve():
  assert backend.resolve("xla") == "xla" and backend.resolve("pallas") == "pallas"
  assert backend.resolve("auto") == "xla"  # CPU
  with pytest.raises(ValueError, match="kernel_backend"):
    backend.resolve("triton")


def test_kda_falls_back_to_xla_for_unbounded_gates_and_packing():
  # The XLA op, told the gate's bound (it picks its diagonal-tile form at trace time from it).
  for fn, bound in ((backend.kda_chunked_fn("xla", lower_bound=-5.0), -5.0),
                    (backend.kda_chunked_fn("pallas", lower_bound=None), None),
                    (backend.kda_chunked_fn("pallas", lower_bound=-5.0, packed=True), -5.0)):
    assert fn.func is kda_chunked and fn.keywords == {"lower_bound": bound}
  fn = backend.kda_chunked_fn("pallas", lower_bound=-5.0)
  assert fn.func.__name__ == "kda_chunked_pallas"


def test_moe_method():
  assert backend.moe_method("xla") == "sort" and backend.moe_method("pallas") == "gmm"
