"""k3jax.runtime: keep_cpu_allocations stops XLA:CPU's per-call page faults."""

import json
import subprocess
import sys


# A jitted function whose temporaries are [2048, 2048] fp32 arrays (16 MiB each), called
# repeatedly; prints the minor page faults per call (getrusage) after warm-up.
_CHILD = r"""
import json, resource, sys
if sys.argv[1] == "keep":
  from k3jax.runtime import keep_cpu_allocations
  assert keep_cpu_allocations() and keep_cpu_allocations()   # idempotent
import jax, jax.numpy as jnp
x = jnp.ones((2048, 2048), jnp.float32)
f = jax.jit(lambda x: jnp.sum(jnp.tanh(x @ x) @ (x * 2.0)))
for _ in range(3):
  f(x).block_until_ready()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
  f(x).block_until_ready()
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 5))
"""


def _faults_per_call(mode):
  env = {"JAX_PLATFORMS": "cpu", "PATH": ""}
  if mode == "default":
    # glibc's starting policy (blocks >= 128 KiB mmap'd), pinned: left alone, glibc raises the
    # threshold after the first frees, and whether our 16 MiB blocks then stay in an arena
    # depends on which threads allocate (62,158 faults per call in a quiet run, 0 once under
    # the parallel test suite's load).
    env["GLIBC_TUNABLES"] = "glibc.malloc.mmap_threshold=131072"
  out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True,
                       timeout=300, env=env)
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_keep_cpu_allocations_removes_per_call_page_faults():
  if not sys.platform.startswith("linux"):      # no glibc: documented as a no-op
    from k3jax.runtime import keep_cpu_allocations
    assert keep_cpu_allocations() is False
    return
  default = _faults_per_call("default")
  keep = _faults_per_call("keep")
  # With mmap'd blocks each 16 MiB buffer is re-faulted every call (4,096 pages of 4 KiB);
  # with the setting, none.
  assert default > 4000, default
  assert keep < default / 20, (keep, default)
