"""experiments/recall_extend.py at toy size (one layer, a few steps, one row per task and
bin): both stages run through the trainer's step, the JSON and the PNG are written, accuracies
are fractions per task and bin; the KDA-only model has no MLA layer and the hybrid's size;
--tasks and --answer_weight set the training data's (not only the evaluation's)."""

import json

from absl import flags

from experiments import recall_extend
from tools.param_count import count_params


def test_toy_run_writes_json_and_plot(tmp_path):
  fv = flags.FlagValues()
  recall_extend.define_flags(fv)
  fv([
      "recall_extend", f"--out={tmp_path}", "--layers=1", "--short_len=48", "--long_len=128",
      "--pretrain_steps=2", "--cooldown_steps=1", "--short_batch=2", "--long_batch=1",
      "--eval_rows=1", "--eval_batch=6", "--bins=16,64,100", "--models=hybrid"])
  r = recall_extend.run_experiment(fv)
  assert json.loads((tmp_path / "recall_extend.json").read_text()) == r
  assert (tmp_path / "recall_extend.png").stat().st_size > 1000
  h = r["models"]["hybrid"]
  assert [s["seq_len"] for s in h["loss"]] == [48, 128]
  for phase in ("before", "after"):
    assert set(h["phases"][phase]) == {"kv", "chain", "count"}
    for acc in h["phases"][phase].values():
      assert len(acc["exact"]) == 2 and all(0 <= a <= 1 for a in acc["exact"] + acc["token"])
  kinds = {name: [m for m, _ in recall_extend.run_for(name, fv).model.text.layer_types()]
           for name in recall_extend.MODELS}
  assert kinds == {"hybrid": ["mla"], "kda_only": ["kda"]}
  sizes = [count_params(recall_extend.run_for(n, fv).model)["total"]
           for n in recall_extend.MODELS]
  assert abs(sizes[0] - sizes[1]) < 0.01 * sizes[0]


def test_tasks_and_answer_weight_reach_the_training_data():
  fv = flags.FlagValues()
  recall_extend.define_flags(fv)
  fv(["recall_extend", "--tasks=kv", "--answer_weight=4"])
  run = recall_extend.run_for("hybrid", fv)
  assert run.data.evidence_tasks == ("kv",) and run.data.answer_weight == 4.0
