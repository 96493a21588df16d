"""Kernel selection: one place, by config field."""

import pytest

from k3jax.config import preset
from k3jax.layers import backend
from k3jax.ops import moe
from k3jax.ops.kda import kda_chunked
from pallas_kernels import moe_gmm


def test_resolve(monkeypatch):
  assert backend.resolve("xla") == "xla" and backend.resolve("pallas") == "pallas"
  assert backend.resolve("auto") == "xla"  # CPU
  # "auto" elsewhere: XLA on GPUs until the Pallas kernels are measured correct there.
  for platform, want in (("cuda", "xla"), ("rocm", "xla"), ("gpu", "xla"), ("tpu", "pallas")):
    monkeypatch.setattr(backend.jax, "default_backend", lambda p=platform: p)
    assert backend.resolve("auto") == want, platform
  monkeypatch.undo()
  with pytest.raises(ValueError, match="kernel_backend"):
    backend.resolve("triton")


def test_kda_functions_are_told_the_gate_bound():
  # Both the XLA op and the kernel get the gate's bound (each picks its diagonal-tile form at
  # trace time from it); the kernel takes unbounded gates and packed documents too.
  for bound in (-5.0, None):
    fn = backend.kda_chunked_fn("xla", lower_bound=bound)
    assert fn.func is kda_chunked and fn.keywords == {"lower_bound": bound}
    fn = backend.kda_chunked_fn("pallas", lower_bound=bound)
    assert fn.func.__name__ == "kda_chunked_pallas" and fn.keywords == {"lower_bound": bound}
  # A Kimi Linear config may now ask for the kernels.
  assert backend.kernels(preset("tiny_kimi_linear", kernel_backend="pallas")).backend == "pallas"


def test_moe_kernel():
  # "xla": expert_mlp's sorted dense-einsum path (no grouped matmul); "pallas": the Pallas
  # grouped matmul, passed to the op as its `gmm` argument.
  xla = backend.kernels(preset("tiny"))
  assert xla.backend == "xla" and xla.gmm is None and xla.expert_mlp is moe.expert_mlp
  pallas = backend.kernels(preset("tiny", kernel_backend="pallas"))
  assert pallas.backend == "pallas" and pallas.gmm is moe_gmm.gmm
  assert pallas.expert_mlp.func is moe.expert_mlp
  assert pallas.expert_mlp.keywords == {"gmm": moe_gmm.gmm}
  assert backend.expert_mlp_fn(preset("tiny", kernel_backend="pallas")) is pallas.expert_mlp
  # Packed MXFP4 experts: the Pallas gmm dequantises them in its kernel; XLA's sorted path
  # dequantises a chunk at a time.
  assert moe_gmm.gmm.takes_mxfp4
  assert backend.expert_mlp_fn(preset("tiny", kernel_backend="pallas",
                                      expert_format="mxfp4")) is pallas.expert_mlp
  assert backend.expert_mlp_fn(preset("tiny", expert_format="mxfp4")) is moe.expert_mlp


def test_kernels_resolved_once_per_config():
  cfg = preset("tiny", kernel_backend="pallas")
  ks = backend.kernels(cfg)
  assert backend.kernels(cfg) is ks and backend.kernels(cfg.replace(dtype="bfloat16")) is ks
  assert backend.kernels(preset("tiny", kernel_backend="auto")) is backend.kernels(
      preset("tiny"))  # CPU: "auto" is "xla"
  # The layers' KDA helper hands out the record's functions.
  assert backend.kda_chunked_fn("pallas", lower_bound=cfg.text.kda_lower_bound) is ks.kda_chunked
