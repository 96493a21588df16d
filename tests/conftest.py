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
