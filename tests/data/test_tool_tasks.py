"""Tool tasks (k3jax/data/tool_tasks.py): answers against independent solvers that read only
the question, the reference program run in the sandbox, hidden answers, the prompt's form."""

import re

import numpy as np
import pytest

from k3jax.data import chat, tool_tasks as T
from k3jax.posttrain.rl.sandbox import Limits, run_python


def _solve(question: str) -> str:
  """An independent solver from the question text alone."""
  m = re.fullmatch(r"Compute (\d+)\*(\d+) exactly\.", question)
  if m:
    return str(int(m.group(1)) * int(m.group(2)))
  m = re.fullmatch(r"Take the string ([A-Za-z]+): (.*)\. Give the result\.", question)
  if m:
    s = m.group(1)
    for step in m.group(2).split("; then "):
      if step == "reverse it":
        s = "".join(reversed(s))
      elif step == "swap the case of every letter":
        s = "".join(c.lower() if c.isupper() else c.upper() for c in s)
      elif step.startswith("keep every"):
        k = int(re.search(r"every (\d+)-th", step).group(1))
        s = "".join(c for i, c in enumerate(s) if i % k == 0)
      else:
        n = int(re.search(r"every letter (\d+) places", step).group(1))
        abc = "abcdefghijklmnopqrstuvwxyz"
        s = "".join((abc if c.islower() else abc.upper())[(abc.index(c.lower()) + n) % 26]
                    for c in s)
    return s
  lines = question.split("\n")
  rows = [line.split(",") for line in lines[1:-1]]
  who = re.search(r"everyone in (\w+)'s team", lines[-1]).group(1)
  me = next(r for r in rows if r[1] == who)
  return str(sum(int(r[3]) for r in rows if r[2] == me[2]) * int(me[0]))


def test_answers_match_independent_solvers_and_the_tool_solves_them():
  tasks = T.ToolTaskSampler(seed=0).sample(60)
  assert {t.domain for t in tasks} == set(T.DOMAINS) and {t.effort for t in tasks} == set(
      T.EFFORTS)
  assert len({t.uid for t in tasks}) == 60
  for t in tasks:
    assert _solve(t.question) == t.answer, t.question
    assert t.answer not in t.question          # hidden: the verifier's, not the prompt's
    assert T.is_correct(t, f"thinking done. {t.answer}.") and not T.is_correct(t, None)
    assert not T.is_correct(t, t.answer + "0") and not T.is_correct(t, "")
  big = next(t for t in tasks if t.domain == "bigmul")
  assert len(big.answer) >= 47                # two 24+-digit factors
  # The tool makes each domain solvable: the reference program prints the answer.
  for d in T.DOMAINS:
    t = next(t for t in tasks if t.domain == d)
    r = run_python(T.reference_code(t), Limits(wall_seconds=10))
    assert r.ok and r.stdout.strip() == t.answer, (d, r)


def test_prompt_declares_the_tool_and_opens_thinking():
  t = T.make_task(np.random.default_rng(1), 7, "lookup", "max")
  rendered = chat.render_prompt(t.conversation, thinking=True)
  assert rendered.startswith('[open]options[sep]{"effort":"max","tools":[{"description":')
  assert rendered.endswith("[end_of_msg][open]assistant[sep][open]think[sep]")
  conv = chat.parse(chat.render(t.conversation))
  assert conv.options.tools == (T.PYTHON_TOOL,) and conv.options.effort == "max"
  assert conv.messages[-1].content == t.question
  assert t.tokens == T.prompt_tokens(t.conversation) and len(t.tokens) > len(t.question)
  with pytest.raises(ValueError, match="domain"):
    T.make_task(np.random.default_rng(0), 0, "chess", "low")
  with pytest.raises(ValueError, match="domains/efforts"):
    T.ToolTaskSampler(domains=("bigmul", "nope"))
