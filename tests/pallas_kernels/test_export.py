"""Lowering checks without hardware: export the Pallas kernels for TPU and CUDA from this CPU.

`jax.export(jax.jit(f), platforms=[...])` runs the Mosaic TPU / Triton lowering of every
kernel, so an op a backend cannot lower fails here, not on the accelerator.
CUDA: the kernels pass `pallas.triton.CompilerParams`, which selects the Triton lowering
(jax's default Mosaic GPU lowering rejects a plain dot on jax 0.10); the Triton custom call
(`__gpu$xla.gpu.triton`) has no serialisation-compatibility guarantee, so that one safety check
is disabled for the export (running in-process on a GPU needs no such step):
`experiments.pallas_smem.capture.export`, which the sm_90 report's capture uses too.
"""

import jax
import jax.numpy as jnp
import pytest

from experiments.pallas_smem import capture
from pallas_kernels.kda_chunk import kda_chunked_pallas

_CUSTOM_CALL = {"tpu": "tpu_custom_call", "cuda": capture.TRITON_CALL}


def _kda_args(dtype, b=1, t=100, h=2, dk=64, dv=128):   # GPU: two V blocks of 64
  s = lambda *shape, d=dtype: jax.ShapeDtypeStruct(shape, d)
  f32 = jnp.float32
  return (s(b, t, h, dk), s(b, t, h, dk), s(b, t, h, dv), s(b, t, h, dk, d=f32), s(b, t, h, d=f32),
          s(b, h, dk, dv, d=f32))


def _kda(target, packed=False, bounded=True):
  def fwd(q, k, v, g, beta, s0):
    seg = jnp.cumsum(jnp.arange(q.shape[1]) % 37 == 0)[None] if packed else None   # 3 documents
    return kda_chunked_pallas(q, k, v, g, beta, initial_state=s0, interpret=False, target=target,
                              segment_ids=seg, lower_bound=-5.0 if bounded else None)

  def fwd_bwd(*args):
    def loss(*a):
      o, s = fwd(*a)
      return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)
    return jax.grad(loss, argnums=tuple(range(6)))(*args)
  return fwd, fwd_bwd


@pytest.mark.parametrize("platform,dtype,packed,bounded", [
    ("tpu", jnp.float32, False, True), ("tpu", jnp.bfloat16, False, True),
    ("cuda", jnp.float32, False, True), ("cuda", jnp.bfloat16, False, True),
    ("tpu", jnp.bfloat16, True, True), ("cuda", jnp.bfloat16, True, True),
    ("tpu", jnp.bfloat16, False, False), ("cuda", jnp.bfloat16, False, False)])
def test_kda_chunk_lowers(platform, dtype, packed, bounded):
  """Forward: the per-chunk and the state kernel; forward+backward: those, the per-chunk kernel
  again (the backward recomputes the intermediates), the state backward and the two per-chunk
  backward kernels. Packed documents (segment ids) add an input to the per-chunk kernels; an
  unbounded gate (Kimi Linear) takes the pairwise diagonal tiles."""
  fwd, fwd_bwd = _kda("gpu" if platform == "cuda" else "tpu", packed, bounded)
  args = _kda_args(dtype)
  text = capture.export_text(fwd, args, platform)
  assert text.count(_CUSTOM_CALL[platform]) == 2
  assert "kda_intra_fwd" in text and "kda_state_fwd" in text
  text = capture.export_text(fwd_bwd, args, platform)
  assert text.count(_CUSTOM_CALL[platform]) == 6
  for name in ("kda_intra_fwd", "kda_state_fwd", "kda_state_bwd", "kda_wy_bwd", "kda_a_bwd"):
    assert name in text
