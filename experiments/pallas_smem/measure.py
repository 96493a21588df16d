"""Shared memory, registers and spills of Pallas-generated TTIR kernels for CUDA sm_90, with
pip triton. Runs Triton's own pipeline from the TTIR passes (make_ttir: inline, combine,
canonicalize, CSE, LICM) through TTGIR and LLVM IR (where the shared-memory allocation is
final) to PTX, then the `ptxas` Triton ships with (`-v`: registers per thread, spill stores and
loads). No GPU needed.
Usage (a Python with `pip install triton==3.6.0`, e.g. a venv under /tmp):
  python experiments/pallas_smem/measure.py NUM_WARPS NUM_STAGES /tmp/ttir/*.ttir [--no-ptxas]
-> one JSON line per file: "shared" (bytes), "regs", "spill_stores", "spill_loads" (bytes).
Calibration (docs/notes/pallas_kda.md for the KDA kernels, pallas_kernels/moe_gmm.py's
docstring for gmm): the shared figures read 20-53% above what XLA's own Triton requested on
an H200."""
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend, IRSource
from triton._C.libtriton import ir

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def ptxas_report(ptx: str) -> dict:
  """Registers and spill bytes of the PTX's kernel, from `ptxas -v` for sm_90a."""
  with tempfile.TemporaryDirectory() as d:
    src = os.path.join(d, "k.ptx")
    with open(src, "w") as f:
      f.write(ptx)
    r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                       capture_output=True, text=True, check=True)
  text = r.stdout + r.stderr
  regs = re.search(r"Used (\d+) registers", text)
  spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
  return dict(regs=int(regs.group(1)) if regs else None,
              spill_stores=int(spills.group(1)) if spills else 0,
              spill_loads=int(spills.group(2)) if spills else 0)


def main(argv):
  use_ptxas = "--no-ptxas" not in argv
  argv = [a for a in argv if a != "--no-ptxas"]
  nw, ns = int(argv[0]), int(argv[1])
  target = GPUTarget("cuda", 90, 32)
  backend = make_backend(target)
  last = "ptx" if use_ptxas else "llir"
  for f in argv[2:]:
    t0 = time.time()
    rec = dict(file=os.path.basename(f), num_warps=nw, num_stages=ns, triton=triton.__version__)
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
        module = fn(module, metadata)
        if ext == last:
          break
      rec["shared"] = metadata.get("shared")
      if use_ptxas:
        rec.update(ptxas_report(module))
    except Exception as e:   # one bad kernel must not hide the others' figures
      rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rec["secs"] = round(time.time() - t0, 1)
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
