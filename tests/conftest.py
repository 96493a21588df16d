"""Test-wide settings: 8 simulated CPU devices (set before jax is imported) and a fast,
deterministic hypothesis profile."""

import atexit
import importlib.util
import os
import shutil
import tempfile
import time

from cli_env import xla_flags   # no jax import: XLA_FLAGS is set before jax loads

os.environ.setdefault("XLA_FLAGS", xla_flags(devices=8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Many tests build fresh jitted closures of one computation (a tiny model's forward, in several
# files and in commands run in another interpreter): one compilation cache for the test run
# compiles each once. The process that loads this file first (xdist's controller) makes the
# directory; its workers and their subprocesses inherit the variable. A size cap turns on
# jax's lock on the directory (needs filelock), so no process reads another's half-written
# entry; without filelock there is no shared cache.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and importlib.util.find_spec("filelock"):
  _cache = tempfile.mkdtemp(prefix="k3jax-test-jax-cache-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache,
                    JAX_COMPILATION_CACHE_MAX_SIZE=str(8 << 30),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")

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
