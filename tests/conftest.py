"""Test-wide settings: 8 simulated CPU devices (set before jax is imported) and a fast,
deterministic hypothesis profile."""

import os
import time

# The tests' shapes are tiny, so XLA compilation, not running, is their cost; LLVM's
# optimisation passes are half of it (a tiny K3's gradient: 21.9 s of CPU to compile at the
# default level, 11.3 s at level 0). Level 0 changes no numerics: XLA's own HLO passes and
# emitters, which fix the order of every floating-point operation, run at every level.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                      "--xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "k3jax", deadline=None, max_examples=12, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("k3jax")

_TIMES = os.environ.get("K3JAX_TEST_TIMES")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """With K3JAX_TEST_TIMES=FILE, append "cpu_s wall_s test-id" per test (setup, call and
  teardown) as it ends, in the process that ran it. CPU seconds of the process (all threads)
  rank tests fairly on a loaded machine; partial results survive an interrupted run:
  `sort -rn FILE | head -40` lists the costly ones."""
  if not _TIMES:
    yield
    return
  cpu0, wall0 = time.process_time(), time.perf_counter()
  yield
  cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
  if wall >= 1.0:
    with open(_TIMES, "a") as f:
      f.write(f"{cpu:8.1f} {wall:8.1f} {item.nodeid}\n")
