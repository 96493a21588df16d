"""The teacher pipeline end to end at minimal sizes: cold start, a teacher per (domain,
effort) under its own budget regime, MOPD into one student vs the same rounds without
teachers, evaluation per effort level, outputs on disk (experiments/rl_pipeline.py)."""

import json

from experiments import rl_pipeline


def test_pipeline_smoke(tmp_path):
  s = {"out": str(tmp_path / "run"), "results": str(tmp_path / "results"), "domains": "arith",
       "efforts": "low,max", "layers": 1, "sft_steps": 0, "sft_batch": 4, "teacher_rounds": 2,
       "student_rounds": 1, "n_prompts": 1, "k": 2, "max_new_tokens": 24, "lr": 3e-4,
       "mopd_coef": 1.0, "eval_n": 2, "qat": ""}
  lines = []
  summary = rl_pipeline.run_pipeline(s, log=lines.append)
  out = tmp_path / "run"
  for name in ("cold_start", "teachers/arith_low", "teachers/arith_max", "student_mopd/policy",
               "student_rl/policy"):
    assert (out / name).is_dir(), name
  assert not list(out.rglob("*.tmp"))                   # every output renamed into place
  disk = json.loads((out / "summary.json").read_text())
  assert disk == json.loads((tmp_path / "results" / "summary.json").read_text())
  assert set(disk["teachers"]) == {"arith_low", "arith_max"}
  # Each effort level's regime: low has a budget annealed to 0.5, max none.
  assert disk["teachers"]["arith_low"]["regime"]["tau_end"] == 0.5
  assert disk["teachers"]["arith_max"]["regime"]["enabled"] is False
  low = [json.loads(x) for x in (out / "teachers/arith_low_run/metrics.jsonl").read_text()
         .splitlines()]
  mx = [json.loads(x) for x in (out / "teachers/arith_max_run/metrics.jsonl").read_text()
        .splitlines()]
  assert len(low) == len(mx) == 2
  trained_low = [m for m in low if "tau" in m]
  assert trained_low and all(m["tau"] in (1.0, 0.5) for m in trained_low)
  assert all(m["tau"] != m["tau"] for m in mx if "tau" in m)          # NaN: no budget
  # The student got MOPD rewards from teachers on every trained row; the baseline none.
  st = [json.loads(x) for x in (out / "student_mopd/metrics.jsonl").read_text().splitlines()]
  rl = [json.loads(x) for x in (out / "student_rl/metrics.jsonl").read_text().splitlines()]
  for m in st:
    if "trained" in m:
      assert m["teacher_rows"] == m["trained"] and m["mopd"] != 0.0
  assert all(m.get("teacher_rows", 0) == 0 for m in rl)
  for name in ("student_mopd", "student_rl"):
    ev = disk[name]["eval"]
    assert set(ev) == {"low", "max"}
    for e in ev.values():
      assert e["n"] == 2 and 0 <= e["accuracy"] <= 1 and 0 <= e["thinking"] <= 24
  assert summary["seconds"] > 0 and any("[teacher arith_low]" in x for x in lines)
