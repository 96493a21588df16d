"""experiments/agentic_figure.py: its tasks and demonstrations (the SFT data of the cold
start), its evaluation with the tool and with the tool withheld (a scripted policy through
the real environment and sandbox: the tool decides the accuracy), and the script end to end
at minimal sizes."""

import json
import subprocess
import sys

import numpy as np
import pytest

from cli_env import ROOT, cli_env
from experiments import agentic_figure as A
# Imported before any test patches `engine.Engine`: modules that bind the name at import
# (rl/partial.py through rl/loop.py) must keep the real class for the tests that follow.
from k3jax.posttrain.rl import loop as _loop  # noqa: F401
from k3jax.data import sft, tool_tasks as T
from k3jax.data.chat_tokens import ChatEncoder
from k3jax.data.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
ENC = ChatEncoder(TOK)


@pytest.fixture(autouse=True)
def _flags():
  if not A.FLAGS.is_parsed():
    A.FLAGS(["agentic_figure"])
  saved = A.FLAGS.digits
  A.FLAGS.digits = ["2", "3"]
  yield
  A.FLAGS.digits = saved


def test_tasks_and_demonstrations():
  a = A.BigmulSampler((2, 3), 5).sample(20)
  b = A.BigmulSampler((2, 3), 5).sample(20)
  assert [t.question for t in a] == [t.question for t in b]        # reproducible
  assert len({t.uid for t in a}) == 20
  for t in a:
    x, y = t.spec
    assert 10 <= x < 1000 and 10 <= y < 1000 and t.answer == str(x * y)
    assert t.answer not in TOK.decode(list(t.tokens), specials=True)
    assert T.reference_code(t) == f"print({x}*{y})"
  t = a[0]
  ids = ENC.encode(A.demonstration(t, f"{t.answer}\n"), bos=False).ids
  assert tuple(int(i) for i in ids[:len(t.tokens)]) == t.tokens     # extends the prompt
  mask = sft.assistant_mask(ids)
  # Trained: the assistant's tokens after its header (the thinking opening, which a rollout's
  # prompt already holds, included); not the question, not the tool's output.
  first = int(np.argmax(mask))
  assert TOK.decode([int(i) for i in ids[first:len(t.tokens)]], specials=True) == \
      "[open]think[sep]" and mask[first:len(t.tokens)].all()
  trained = TOK.decode([int(i) for i, m in zip(ids, mask) if m], specials=True)
  x, y = t.spec
  assert trained == (
      '[open]think[sep][close][open]tools[sep][{"arguments":{"code":"print(%d*%d)"},"name":"python"}][close]'
      "[end_of_msg][open]think[sep][close][open]response[sep]= %s[close][end_of_msg]"
      % (x, y, t.answer))
  # the tool message (environment) is not trained
  assert f"[open]tool[sep]{t.answer}\n" in TOK.decode(list(ids), specials=True)


class _Req:
  def __init__(self, tokens):
    self.tokens, self.logprobs = tokens, [-0.1] * len(tokens)
    self.finish_reason, self.cached_tokens, self.error, self.done = "stop", 0, None, True


class _CopyingPolicy:
  """An engine stand-in: the first reply calls python with the reference program, the next
  answers with the text of the last tool message (what a policy that trusts the tool does)."""

  def __init__(self, config, variables, ec):
    self.ec, self.requests, self.n = ec, {}, 0

  def submit(self, prompt, params, *, media=None, media_keys=None):
    text = TOK.decode(list(prompt), specials=True)
    if "[open]tool[sep]" not in text:
      x, y = (int(v) for v in text.split("Compute ")[1].split(" exactly")[0].split("*"))
      task = T.ToolTask(0, "bigmul", "high", "", "", (x, y), None, ())
      reply = '[close][open]tools[sep][{"arguments":{"code":"print(%d*%d)"},"name":"python"}]' \
          % task.spec
      ids = ENC.text(reply.replace("[close]", "").replace("[open]", "").replace("[sep]", ""))
      ids = ([ENC.marker_ids["[close]"], ENC.marker_ids["[open]"]] + ENC.text("tools")
             + [ENC.marker_ids["[sep]"]] + ENC.text(reply.split("[sep]", 1)[1])
             + [ENC.marker_ids["[close]"], ENC.end_id])
    else:
      last = text.rsplit("[open]tool[sep]", 1)[1].split("[end_of_msg]")[0].strip()
      ids = ([ENC.marker_ids["[close]"], ENC.marker_ids["[open]"]] + ENC.text("response")
             + [ENC.marker_ids["[sep]"]] + ENC.text(f"= {last}")
             + [ENC.marker_ids["[close]"], ENC.end_id])
    rid = str(self.n)
    self.n += 1
    self.requests[rid] = _Req(ids)
    return rid

  def step(self):
    return True

  def pop(self, rid):
    return self.requests.pop(rid)


def test_evaluate_with_and_without_the_tool(monkeypatch):
  from k3jax.serve import engine
  monkeypatch.setattr(engine, "Engine", _CopyingPolicy)
  _, r = A.rl_run_config()
  tasks = A.BigmulSampler((2, 3), 9).sample(4)
  with_tool = A.evaluate(r, None, {"params": {}}, tasks, tool=True)
  without = A.evaluate(r, None, {"params": {}}, tasks, tool=False)
  assert with_tool["accuracy"] == 1.0 and with_tool["ok_tool_runs"] == 4
  assert without["accuracy"] == 0.0 and without["ok_tool_runs"] == 0
  for e in (with_tool, without):
    assert e["n"] == 4 and e["stderr"] == 0.0 and e["called_tool"] == 1.0
    assert e["finish"] == {"answer": 4, "turn_limit": 0, "token_limit": 0}
  assert "error: tool unavailable" in without["example"]
  p = 0.25
  assert np.isclose(np.sqrt(p * (1 - p) / 4), 0.2165, atol=1e-4)   # the s.e. formula used


def test_script_end_to_end_at_minimal_sizes(monkeypatch, tmp_path):
  """main(): cold-start SFT (a real 1-layer model, 2 steps), evaluation before and after,
  one RL round with its update — the rollouts by the scripted policy above (the engine's
  compilation is what the real run adds; test_env.py and test_agentic.py cover it)."""
  from k3jax.posttrain.rl import agentic
  from k3jax.serve import engine

  class Policy(_CopyingPolicy):
    def set_variables(self, variables):
      self.variables = variables

  monkeypatch.setattr(engine, "Engine", Policy)
  monkeypatch.setattr(agentic, "Engine", Policy)
  f = A.FLAGS
  saved = {k: getattr(f, k) for k in ("out", "layers", "sft_steps", "demos", "rounds",
                                      "n_prompts", "k", "eval_n", "max_tokens")}
  try:
    f.out, f.layers, f.sft_steps, f.demos, f.rounds = str(tmp_path), 1, 2, 8, 1
    f.n_prompts, f.k, f.eval_n, f.max_tokens = 1, 2, 3, 448
    A.main([])
  finally:
    for k, v in saved.items():
      setattr(f, k, v)
  got = json.load(open(tmp_path / "agentic_figure.json"))
  assert "--digits=2,3" in got["command"] and got["settings"]["rl"]["expert_qat"] == "mxfp4_mxfp8"
  assert got["cold_start"]["steps"] == 2 and got["cold_start"]["sandbox_checked"] == 8
  assert len(got["cold_start"]["loss"]) == 2 and got["cold_start"]["loss"][0][1] > 0
  for when in ("before", "after"):
    assert got[when]["tool"]["accuracy"] == 1.0 and got[when]["withheld"]["accuracy"] == 0.0
    assert got[when]["tool"]["n"] == got[when]["withheld"]["n"] == 3
  (rnd,) = got["rl_rounds"]
  assert rnd["trajectories"] == 2 and rnd["reward"] == 1.0 and rnd["tool_calls"] == 2
