"""The kernels' sm_90 compile report (docs/results/sm90_kernels.json) belongs to the kernels as
they are: each entry's TTIR — lowered here, on CPU, for CUDA with the Triton lowering — hashes to
the sha256 the figures were measured on (experiments/pallas_smem: Triton's pipeline to PTX and
its `ptxas -v`), so changing a kernel without measuring it again fails here. And every kernel
the GPU target runs fits in an H100/H200 block's shared memory (232448 bytes) and its
registers: no spill stores or loads."""

import json

import jax.numpy as jnp
import pytest

from experiments.pallas_smem import capture
from pallas_kernels import kda_chunk, moe_gmm

with open(capture.REPORT) as fh:
  REPORT = json.load(fh)


def test_report_covers_the_configurations_the_gpu_target_runs():
  assert [c["case"] for c in REPORT["cases"]] == list(capture.REPORT_CASES)
  assert REPORT["target"] == "cuda sm_90a" and REPORT["shared_limit"] == 232448
  # the KDA cases use the sizes kda_chunked_pallas picks on the GPU target
  seen = []
  record = lambda dtype, dk, dv, chunk, block_v, **kw: seen.append((dtype, dv, chunk, block_v))
  for spec in capture.REPORT_CASES:
    if spec.startswith("kda_case"):
      eval(spec, {"kda_case": record, "jnp": jnp})   # noqa: S307
  assert {jnp.dtype(d) for d, *_ in seen} == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}
  for dtype, dv, chunk, block_v in seen:
    assert chunk == kda_chunk.GPU_MAX_CHUNK
    assert block_v == min(dv, kda_chunk.GPU_BLOCK_V[jnp.dtype(dtype).itemsize])


@pytest.mark.parametrize("entry", REPORT["cases"], ids=lambda e: capture.case_tag(e["case"]))
def test_measured_ir_is_the_kernels_ir_and_fits_registers_and_shared_memory(entry):
  texts = capture.ttir_of(entry["case"])
  assert [capture.sha256(t) for t in texts] == [k["ttir_sha256"] for k in entry["kernels"]], (
      f"{entry['case']}: the kernels lower to other Triton IR than "
      "docs/results/sm90_kernels.json was measured on; measure again "
      "(experiments/pallas_smem/capture.py's docstring)")
  # measured with the launch parameters the kernels compile with on a GPU
  if entry["case"].startswith("kda_case"):
    params = kda_chunk._compiler_params("gpu")
    want = (params.num_warps, params.num_stages)
  else:
    want = (moe_gmm.GPU_NUM_WARPS, moe_gmm.GPU_NUM_STAGES)
  for k in entry["kernels"]:
    assert (k["num_warps"], k["num_stages"]) == want, (entry["case"], k)
    assert 0 < k["shared"] <= REPORT["shared_limit"], (entry["case"], k)
    assert k["regs"] <= 255, (entry["case"], k)
    assert k["spill_stores"] == 0 and k["spill_loads"] == 0, (entry["case"], k)
