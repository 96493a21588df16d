"""The environment of a command a test runs in another interpreter: the tests' XLA flags (see
conftest.py) with the device count the command needs, CPU only, the repository importable."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tests' shapes are tiny, so XLA compilation, not running, is their cost; LLVM's
# optimisation passes are half of it (a tiny K3's gradient: 21.9 s of CPU to compile at the
# default level, 11.3 s at level 0). Level 0 changes no numerics: XLA's own HLO passes and
# emitters, which fix the order of every floating-point operation, run at every level.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int = 1) -> str:
  """XLA_FLAGS for `devices` simulated CPU devices (1: a user's plain run)."""
  if devices > 1:
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
  return FAST_COMPILE


def cli_env(devices: int = 1, **extra: str) -> dict[str, str]:
  """os.environ for a command on `devices` CPU devices, with `extra` variables set."""
  return dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
              **extra)
