"""experiments/timing.py: every call warmed up once, then timed in turns; per-call repeats;
a failing call reported (or raised) without stopping the others."""

import pytest

from experiments import timing


def test_calls_are_warmed_then_timed_in_turns():
  order = []
  calls = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
  ts = timing.round_robin(calls, {"a": 3, "b": 1, "c": 2})
  assert order == ["a", "b", "c"] + ["a", "b", "c"] + ["a", "c"] + ["a"]
  assert {name: len(v) for name, v in ts.items()} == {"a": 3, "b": 1, "c": 2}
  assert all(t >= 0.0 for v in ts.values() for t in v)


def test_a_failing_call_is_reported_or_raised():
  def broken():
    raise RuntimeError("over the shared-memory limit")
  calls = {"ok": lambda: 1, "broken": broken}
  failed = {}
  ts = timing.round_robin(calls, 2, failed)
  assert list(ts) == ["ok"] and len(ts["ok"]) == 2
  assert failed == {"broken": "RuntimeError: over the shared-memory limit"}
  with pytest.raises(RuntimeError, match="shared-memory"):
    timing.round_robin(calls, 2)


def test_median_seconds_runs_the_function_repeats_plus_one_times():
  runs = []
  assert timing.median_seconds(lambda: runs.append(1), 4) >= 0.0
  assert len(runs) == 5
