"""Test-wide settings: 8 simulated CPU devices (set before jax is imported) and a fast,
deterministic hypothesis profile."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "k3jax", deadline=None, max_examples=12, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("k3jax")

_TIMES = os.environ.get("K3JAX_TEST_TIMES")


def pytest_runtest_logreport(report):
  """With K3JAX_TEST_TIMES=FILE, append "seconds phase test-id" per test phase as it ends
  (partial results survive an interrupted run; `sort -rn FILE | head` finds the slow ones)."""
  if _TIMES and report.duration >= 1.0:
    with open(_TIMES, "a") as f:
      f.write(f"{report.duration:8.1f} {report.when:8s} {report.nodeid}\n")
