"""Test-wide settings: 8 simulated CPU devices (set before jax is imported) and a fast,
deterministic hypothesis profile."""

import ctypes
import gc
import os
import sys
import time

from cli_env import xla_flags   # no jax import: XLA_FLAGS is set before jax loads

os.environ.setdefault("XLA_FLAGS", xla_flags(devices=8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# No persistent compilation cache: writing some executables to it (`executable.serialize()`,
# jax 0.10.2 on CPU) crashed a worker intermittently in the multimodal trainer's step; tests
# share compiled functions within a process instead.
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"

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


def pytest_runtest_teardown(item, nextitem):
  """After a test file's last test, drop every compiled executable and trace cache, and hand
  freed heap back to the system. A worker runs hundreds of test files; without this it keeps
  each file's executables (and the constants baked into them) to the end, growing to several
  GiB, and two such workers plus the CLI tests' subprocesses crowd a 24 GiB machine."""
  if nextitem is not None and nextitem.path == item.path:
    return
  jax = sys.modules.get("jax")
  if jax is not None:
    jax.clear_caches()
  gc.collect()
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):   # not glibc: the memory is reused, not returned
    pass
