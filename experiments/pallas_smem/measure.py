"""Shared memory (bytes) of Pallas-generated TTIR kernels for CUDA sm_90, with pip triton.
Runs Triton's own pipeline from the TTIR passes (make_ttir: inline, combine, canonicalize, CSE,
LICM) through TTGIR to LLVM IR, where the shared-memory allocation is final; skips PTX/cubin.
Usage (a Python with `pip install triton==3.6.0`, e.g. a venv under /tmp; no GPU needed):
  python experiments/pallas_smem/measure.py NUM_WARPS NUM_STAGES /tmp/ttir/*.ttir
-> one JSON line per file with "shared" (bytes). Calibration (docs/notes/pallas_kda.md for the
KDA kernels, pallas_kernels/moe_gmm.py's docstring for gmm): these figures read 20-53% above
what XLA's own Triton requested on an H200."""
import sys, json, os, time
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend, IRSource
from triton._C.libtriton import ir

nw, ns = int(sys.argv[1]), int(sys.argv[2])
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
for f in sys.argv[3:]:
  t0 = time.time()
  rec = dict(file=os.path.basename(f), num_warps=nw, num_stages=ns)
  try:
    context = ir.context()
    src = IRSource(f, context, backend)
    options = backend.parse_options(dict(num_warps=nw, num_stages=ns))
    stages = dict()
    backend.add_stages(stages, options, src.language)
    metadata = {"hash": "x", "target": target, **options.__dict__}
    codegen_fns = backend.get_codegen_implementation(options)
    module = src.make_ir(target, options, codegen_fns, backend.get_module_map(), context)
    for ext, fn in stages.items():
      if ext in ("ttir", "ttgir", "llir"):
        module = fn(module, metadata)
      if ext == "llir":
        break
    rec["shared"] = metadata.get("shared")
  except Exception as e:
    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
  rec["secs"] = round(time.time() - t0, 1)
  print(json.dumps(rec), flush=True)
