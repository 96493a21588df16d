"""Process-level runtime settings for running k3jax on CPU hosts.

`keep_cpu_allocations()`: XLA:CPU allocates each call's temporary buffers anew. With glibc's
default malloc, blocks of that size come from `mmap` (or from per-thread arenas that trim
themselves) and go back to the OS when freed, so the next call touches fresh pages and takes
one page fault per 4 KiB of temporaries again, a cost per call that grows with the program's
temporary memory. Keeping one arena that never returns memory (the usual advice for CPU
frameworks, like preloading tcmalloc or jemalloc) makes those calls fault-free. The costs: the
process keeps its peak heap mapped, and all threads share one arena, which can slow
multi-threaded work: the KDA op benchmark gains, the `small` CPU training step loses (figures
in docs/notes/kda_ops.md, "Page faults, not arithmetic"): measure for your workload.

Call it first thing in a CLI (before the first JAX computation starts XLA's threads; threads
that already own an arena keep it). Linux/glibc only; elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_KEEP = 1 << 30  # bytes: larger than any block we free, so nothing is trimmed or mmapped

_applied = False


def keep_cpu_allocations() -> bool:
  """One malloc arena, no mmap'd blocks, no trimming (glibc `mallopt`). Returns True when
  applied (now or by an earlier call), False where glibc's mallopt is unavailable."""
  global _applied
  if _applied:
    return True
  name = ctypes.util.find_library("c")
  try:
    mallopt = ctypes.CDLL(name).mallopt if name else None
  except (OSError, AttributeError):
    mallopt = None
  if mallopt is None:
    return False
  mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
  mallopt.restype = ctypes.c_int
  ok = all(mallopt(p, v) == 1 for p, v in ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, _KEEP),
                                              (_M_TRIM_THRESHOLD, _KEEP)))
  _applied = ok
  return ok


__all__ = ["keep_cpu_allocations"]
