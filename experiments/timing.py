"""Wall-clock timing shared by the benchmarks.

Every call is compiled and warmed up first, then the calls are timed in turns (A B C A B C …)
so that drift of a shared machine hits every row alike; a benchmark reduces the per-run
seconds as it reports them (min, median)."""
from __future__ import annotations

import statistics
import time

import jax


def round_robin(calls: dict, repeats, failed: dict | None = None) -> dict:
  """{name: [seconds of each timed run]}.

  calls: {name: fn}, fn a no-argument callable whose result is waited on
    (`jax.block_until_ready`). repeats: runs per call, an int or {name: int}.
  failed: with a dict, a call whose compile or first run raises (a kernel over a device
    limit) is left out and its error recorded there, and the others are timed; without one
    the error propagates.
  """
  live = {}
  for name, fn in calls.items():
    try:
      jax.block_until_ready(fn())                    # compile + warm-up
    except Exception as e:  # noqa: BLE001 - one call's failure is reported, not fatal
      if failed is None:
        raise
      failed[name] = f"{type(e).__name__}: {str(e)[:300]}"
      continue
    live[name] = fn
  runs = {name: repeats[name] if isinstance(repeats, dict) else repeats for name in live}
  ts = {name: [] for name in live}
  for i in range(max(runs.values(), default=0)):
    for name, fn in live.items():
      if i < runs[name]:
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts[name].append(time.perf_counter() - t0)
  return ts


def median_seconds(fn, repeats: int) -> float:
  """The median wall time of `repeats` runs of fn (no arguments) after a warm-up run."""
  return statistics.median(round_robin({"fn": fn}, repeats)["fn"])
