"""Capture the Triton IR (TTIR) of every Pallas kernel lowered for CUDA, via jax.export on CPU.

Step 1 of measuring the kernels for sm_90 without a GPU (step 2: measure.py, run with a
separate Python that has `triton` installed; step 3: `pin`, below). Usage, from the repo root
(jax 0.10.x: the Triton lowering runs on a CPU host):
  .venv/bin/python -m experiments.pallas_smem.capture /tmp/ttir \\
      'kda_case(jnp.float32, 128, 128, 16, 64)' \\
      'gmm_case(jnp.float32, 512, 256, 256, 8, (64, 64, 128))'
Each case is a Python call of kda_case(dtype, K, V, chunk, block_v[, packed, bounded]),
gmm_case(dtype, m, k, n, groups, tiling) or gmm_mxfp4_case(same); one .ttir file per kernel
lands in the folder, named `case_tag(spec)__I.ttir` (I: the order of lowering: forward first).

The kernels' own report (docs/results/sm90_kernels.json, checked by
tests/pallas_kernels/test_sm90_report.py) pins each measured figure to the sha256 of the TTIR
it was measured on, so a kernel change without a new measurement fails the tests (gmm*.ttir
holds the MXFP4 gmm too):
  .venv/bin/python -m experiments.pallas_smem.capture /tmp/ttir --report     # REPORT_CASES
  /tmp/tv/bin/python experiments/pallas_smem/measure.py 8 1 /tmp/ttir/kda*.ttir > /tmp/kda.jsonl
  /tmp/tv/bin/python experiments/pallas_smem/measure.py 4 2 /tmp/ttir/gmm*.ttir > /tmp/gmm.jsonl
  .venv/bin/python -m experiments.pallas_smem.capture --pin /tmp/ttir /tmp/kda.jsonl /tmp/gmm.jsonl
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import export as export_lib

TRITON_CALL = "__gpu$xla.gpu.triton"
REPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "docs", "results", "sm90_kernels.json")
# The configurations the GPU target runs (pallas_kernels: GPU_MAX_CHUNK, GPU_BLOCK_V,
# GPU_TILING): K3's and Kimi Linear's KDA heads (K = V = 128) in bf16, packed and not, bounded
# gate (K3) and unbounded (Kimi Linear), and fp32 inputs; the grouped matmul's tiles in bf16,
# dense and over MXFP4 experts.
REPORT_CASES = (
    "kda_case(jnp.bfloat16, 128, 128, 16, 64)",
    "kda_case(jnp.bfloat16, 128, 128, 16, 64, packed=True)",
    "kda_case(jnp.bfloat16, 128, 128, 16, 64, bounded=False)",
    "kda_case(jnp.bfloat16, 128, 128, 16, 64, packed=True, bounded=False)",
    "kda_case(jnp.float32, 128, 128, 16, 16)",
    "gmm_case(jnp.bfloat16, 512, 256, 256, 8, (64, 64, 128))",
    "gmm_mxfp4_case(jnp.bfloat16, 512, 256, 256, 8, (64, 64, 128))",
)


@contextlib.contextmanager
def capturing():
  """Collects the TTIR text of every Pallas kernel lowered for Triton inside the block."""
  from jax._src.pallas.triton import lowering as tl
  captured, orig = [], tl.lower_jaxpr_to_triton_module

  def patched(*a, **k):
    res = orig(*a, **k)
    captured.append(res.module.operation.get_asm(enable_debug_info=False))
    return res
  tl.lower_jaxpr_to_triton_module = patched
  try:
    yield captured
  finally:
    tl.lower_jaxpr_to_triton_module = orig


def export(fn, specs, platform: str = "cuda"):
  """`jax.export` of jit(fn) at `specs` for one platform, from this (CPU) host. cuda: the
  Triton custom call has no serialisation-compatibility guarantee, so that one safety check is
  disabled; and jax 0.10 picks Pallas's GPU lowering by the flag `jax_pallas_use_mosaic_gpu`
  (default Mosaic GPU, which rejects a plain dot) for kernels that pass no Triton
  CompilerParams off a GPU, so it is set to False here and restored (jax >= 0.11 dropped the
  flag: Triton is the pallas_call default on GPU there)."""
  kw, flag = {}, "jax_pallas_use_mosaic_gpu"
  prev = getattr(jax.config, flag, None) if platform == "cuda" else None
  if platform == "cuda":
    kw["disabled_checks"] = [export_lib.DisabledSafetyCheck.custom_call(TRITON_CALL)]
  if prev is not None:
    jax.config.update(flag, False)
  try:
    return export_lib.export(jax.jit(fn), platforms=[platform], **kw)(*specs)
  finally:
    if prev is not None:
      jax.config.update(flag, prev)


def export_text(fn, specs, platform: str) -> str:
  """The StableHLO text of `export(fn, specs, platform)` (the lowering tests read it)."""
  exported = export(fn, specs, platform)
  assert exported.platforms == (platform,)
  return exported.mlir_module()


def kda_case(dtype, dk, dv, chunk, block_v, packed=False, bounded=True, t=256):
  """Lowers the KDA kernels of a forward and backward pass (one head, T tokens; `packed`: 3
  documents; `bounded=False`: an unbounded gate, the pairwise diagonal tiles), in the order
  intra fwd, state fwd, intra fwd keeping A_kk (the backward's recompute), state bwd, wy bwd,
  a bwd."""
  from pallas_kernels.kda_chunk import kda_chunked_pallas
  s = lambda *shape, d=dtype: jax.ShapeDtypeStruct(shape, d)
  f32 = jnp.float32
  args = (s(1, t, 1, dk), s(1, t, 1, dk), s(1, t, 1, dv), s(1, t, 1, dk, d=f32), s(1, t, 1, d=f32))

  def loss(*a):
    seg = jnp.cumsum(jnp.arange(t) % 91 == 0)[None] if packed else None
    o, st = kda_chunked_pallas(*a, interpret=False, target="gpu", chunk_size=chunk,
                               block_v=block_v, segment_ids=seg,
                               lower_bound=-5.0 if bounded else None)
    return jnp.sum(o.astype(f32)) + jnp.sum(st)
  export(lambda *a: jax.grad(loss, argnums=tuple(range(5)))(*a), args)


def gmm_case(dtype, m, k, n, g, tiling):
  """Lowers the grouped matmul and its two backward kernels."""
  from pallas_kernels import moe_gmm
  specs = (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((g, k, n), dtype),
           jax.ShapeDtypeStruct((g,), jnp.int32))

  def f(lhs, rhs, sizes):
    return jax.grad(lambda a, b: jnp.sum(moe_gmm.gmm(a, b, sizes, interpret=False,
                                                     tiling=tiling).astype(jnp.float32) ** 2),
                    argnums=(0, 1))(lhs, rhs)
  export(f, specs)


def gmm_mxfp4_case(dtype, m, k, n, g, tiling):
  """Lowers the grouped matmul over MXFP4 experts (forward only: its backward is the dense
  gmm, measured by gmm_case)."""
  from k3jax.ops.moe import MXFP4Weight
  from pallas_kernels import moe_gmm
  specs = (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((g, n, k // 2), jnp.uint8),
           jax.ShapeDtypeStruct((g, n, k // 32), jnp.uint8), jax.ShapeDtypeStruct((g,), jnp.int32))
  export(lambda a, p, s, sizes: moe_gmm.gmm(a, MXFP4Weight(p, s), sizes, interpret=False,
                                             tiling=tiling), specs)


def case_tag(spec: str) -> str:
  for a, b in ((" ", ""), ("jnp.", ""), ("(", "_"), (")", ""), (",", "_"), ("=", "")):
    spec = spec.replace(a, b)
  return spec


def ttir_of(spec: str) -> list[str]:
  """The TTIR texts of one case, in lowering order, under JAX's default matmul precision (a
  `jax_default_matmul_precision` set elsewhere in the process changes the bf16 dots' IR)."""
  with capturing() as captured, jax.default_matmul_precision(None):
    eval(spec, {"kda_case": kda_case, "gmm_case": gmm_case, "gmm_mxfp4_case": gmm_mxfp4_case,
                "jnp": jnp})   # noqa: S307
  return list(captured)


def sha256(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()


def pin(ttir_dir: str, *jsonl: str) -> dict:
  """docs/results/sm90_kernels.json from measure.py's JSON lines: per case and kernel, the TTIR's
  sha256 next to its shared memory, registers and spills."""
  measured = {}
  for path in jsonl:
    with open(path) as fh:
      for line in fh:
        if line.strip().startswith("{"):
          rec = json.loads(line)
          measured[rec["file"]] = rec
  cases = []
  for spec in REPORT_CASES:
    kernels = []
    for i, text in enumerate(ttir_of(spec)):
      name = f"{case_tag(spec)}__{i}.ttir"
      with open(os.path.join(ttir_dir, name)) as fh:
        if fh.read() != text:
          raise SystemExit(f"{name}: the TTIR in {ttir_dir} is not what the kernel lowers to now")
      rec = measured.get(name)
      if rec is None or "error" in rec:
        raise SystemExit(f"{name}: no measurement ({rec and rec.get('error')})")
      kernels.append(dict(ttir_sha256=sha256(text), **{
          k: rec[k] for k in ("num_warps", "num_stages", "shared", "regs", "spill_stores",
                              "spill_loads")}))
    cases.append(dict(case=spec, kernels=kernels))
  triton = sorted({rec.get("triton", "?") for rec in measured.values()})
  return dict(target="cuda sm_90a", jax=jax.__version__, triton=",".join(triton),
              shared_limit=232448, cases=cases)


def main(argv):
  if argv[:1] == ["--pin"]:
    report = pin(argv[1], *argv[2:])
    tmp = REPORT + ".tmp"
    with open(tmp, "w") as fh:
      json.dump(report, fh, indent=1)
      fh.write("\n")
    os.replace(tmp, REPORT)
    print(f"wrote {REPORT}")
    return
  out, specs = argv[0], argv[1:]
  if specs == ["--report"]:
    specs = list(REPORT_CASES)
  os.makedirs(out, exist_ok=True)
  for spec in specs:
    for i, txt in enumerate(ttir_of(spec)):
      p = os.path.join(out, f"{case_tag(spec)}__{i}.ttir")
      with open(p, "w") as fh:
        fh.write(txt)
      print(p, len(txt))


if __name__ == "__main__":
  main(sys.argv[1:])
