"""Capture the Triton IR (TTIR) text of every Pallas kernel lowered for CUDA, via jax.export on CPU.

Step 1 of measuring the kernels' shared memory without a GPU (step 2: measure.py, run with a
separate Python that has `triton` installed). Usage, from the repo root (jax 0.10.x: the Triton
lowering runs on a CPU host):
  .venv/bin/python experiments/pallas_smem/capture.py /tmp/ttir \
      'kda_case(jnp.float32, 128, 128, 16, 64)' 'gmm_case(jnp.float32, 512, 256, 256, 8, (64, 64, 128))'
Each case is a Python call of kda_case(dtype, K, V, chunk, block_v) or
gmm_case(dtype, m, k, n, groups, tiling); one .ttir file per kernel lands in the folder.
"""
import sys, os, json
import jax, jax.numpy as jnp
from jax import export
from jax._src.pallas.triton import lowering as tl
from jax._src.pallas.triton import pallas_call_registration as reg

captured = []
_orig = tl.lower_jaxpr_to_triton_module
def _patched(*a, **k):
  res = _orig(*a, **k)
  captured.append(res.module.operation.get_asm(enable_debug_info=False))
  return res
tl.lower_jaxpr_to_triton_module = _patched

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from pallas_kernels.kda_chunk import kda_chunked_pallas
from pallas_kernels import moe_gmm

if hasattr(jax.config, "jax_pallas_use_mosaic_gpu"):   # jax 0.10: pick the Triton lowering
  jax.config.update("jax_pallas_use_mosaic_gpu", False)
TRITON_CALL = "__gpu$xla.gpu.triton"

def exp(fn, args):
  export.export(jax.jit(fn), platforms=["cuda"],
                disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)

def kda_case(dtype, dk, dv, chunk, block_v, t=256):
  s = lambda *shape, d=dtype: jax.ShapeDtypeStruct(shape, d)
  f32 = jnp.float32
  args = (s(1, t, 1, dk), s(1, t, 1, dk), s(1, t, 1, dv), s(1, t, 1, dk, d=f32), s(1, t, 1, d=f32))
  def loss(*a):
    o, st = kda_chunked_pallas(*a, interpret=False, target="gpu", chunk_size=chunk, block_v=block_v)
    return jnp.sum(o.astype(f32)) + jnp.sum(st)
  exp(lambda *a: jax.grad(loss, argnums=tuple(range(5)))(*a), args)

def gmm_case(dtype, m, k, n, g, tiling):
  specs = (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((g, k, n), dtype),
           jax.ShapeDtypeStruct((g,), jnp.int32))
  def f(lhs, rhs, sizes):
    return jax.grad(lambda a, b: jnp.sum(moe_gmm.gmm(a, b, sizes, interpret=False, tiling=tiling).astype(jnp.float32) ** 2),
                    argnums=(0, 1))(lhs, rhs)
  exp(f, specs)

if __name__ == "__main__":
  out = sys.argv[1]; os.makedirs(out, exist_ok=True)
  for spec in sys.argv[2:]:
    captured.clear()
    eval(spec)
    tag = spec.replace(" ", "").replace("jnp.", "").replace("(", "_").replace(")", "").replace(",", "_").replace("=", "")
    for i, txt in enumerate(captured):
      p = os.path.join(out, f"{tag}__{i}.ttir")
      open(p, "w").write(txt)
      print(p, len(txt))
