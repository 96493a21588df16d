"""The embedded SFT tasks (k3jax/data/sft_tasks.py): gold answers, split, determinism, the
calculator tool, the exact checker — and eval_sft's figures on hand-built replies."""

import collections
import types

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3jax.data import chat
from k3jax.data import tokenizers
from k3jax.data import sft
from k3jax.data import sft_tasks as T

SAMPLES = T.samples(0, 300, T.TRAIN) + T.samples(0, 120, T.HELDOUT)


def _solve(s: T.Sample) -> str:
  """The answer recomputed from the user's text alone (a second, independent solver)."""
  user = s.conversation.messages[0].content
  words = user.rstrip("?.").split()
  if s.task in ("add", "sub", "calculator"):
    expr = words[-1]
    return str(eval(expr))          # noqa: S307 - digits and one operator, from our generator
  if s.task == "reverse":
    return words[-1][::-1]
  if s.task == "upper":
    return words[1].upper()
  return str(words[-1].count(words[4]))      # "How many times does c occur in w"


def test_gold_answers_and_layout():
  for s in SAMPLES:
    assert s.answer == _solve(s), s.key
    msgs = s.conversation.messages
    assert msgs[-1].role == "assistant" and msgs[-1].content == s.answer
    assert T.check(s, msgs[-1])
    assert chat.parse(chat.render(s.conversation)) == s.conversation
    assert sft.conversation_from_json(sft.conversation_to_json(s.conversation)) == s.conversation
    for m in msgs:
      if m.role == "assistant":
        assert (m.think is not None) == s.thinking       # one mode per conversation
        assert s.thinking or m.content is not None       # instruct replies open `response`
    if s.task == "calculator":
      call = msgs[1].tool_calls[0]
      assert s.conversation.options.tools == (T.CALCULATOR,)
      assert [m.role for m in msgs] == ["user", "assistant", "tool", "assistant"]
      assert T.run_tool(call) == msgs[2] == chat.Message("tool", s.answer)
    assert s.prompt().messages == msgs[:1] and s.prompt().options == s.conversation.options
  counts = collections.Counter(s.task for s in SAMPLES)
  assert set(counts) == set(T.TASKS) and min(counts.values()) > 30
  modes = collections.Counter(s.thinking for s in SAMPLES)
  assert 0.4 < modes[True] / len(SAMPLES) < 0.6


def test_split_is_by_problem_and_deterministic():
  train = T.samples(1, 2000, T.TRAIN)
  held = T.samples(1, 300, T.HELDOUT)
  assert not {s.key for s in train} & {s.key for s in held}
  assert all(T.heldout(s.key) for s in held) and not any(T.heldout(s.key) for s in train)
  assert T.samples(1, 50, T.TRAIN) == train[:50]                 # a pure function of the seed
  assert T.samples(2, 50, T.TRAIN) != train[:50]
  frac = np.mean([T.heldout(f"add:{a},{b}") for a in range(100) for b in range(100)])
  assert 0.08 < frac < 0.12
  with pytest.raises(ValueError, match="unknown task 'mul'"):
    T.samples(0, 1, T.TRAIN, tasks=("mul",))
  with pytest.raises(ValueError, match="split"):
    T.sample(0, 2, 0)


@given(st.lists(st.integers(-999, 999), min_size=1, max_size=5),
       st.lists(st.sampled_from("+-*"), min_size=4, max_size=4))
def test_calculator_matches_python(nums, ops):
  expr = "".join(f"{n}{ops[i]}" for i, n in enumerate(nums[:-1])) + str(nums[-1])
  assert T.calculator(expr) == str(eval(expr.replace("--", "- -")))   # noqa: S307


def test_calculator_errors_and_tools():
  for bad in ("", "2+", "2**3", "import os", "1/2", None):
    assert T.calculator(bad).startswith("error:")
  assert T.calculator(" 2 + 3 * 4 ") == "14"
  assert T.run_tool(chat.ToolCall("search", {"q": "x"})).content == "error: unknown tool search"
  assert T.run_tool(chat.ToolCall("calculator", {"expr": "1"})).content.startswith("error:")


def test_check_is_exact():
  s = next(x for x in SAMPLES if x.task == "upper")
  assert T.check(s, chat.Message("assistant", s.answer, "anything"))
  for wrong in (s.answer + " ", s.answer.lower(), "", None):
    assert not T.check(s, chat.Message("assistant", wrong))
  assert not T.check(s, None)
  assert not T.check(s, chat.Message("user", s.answer))


def test_eval_figures_on_hand_built_replies():
  """eval_sft.evaluate with the model replaced by fixed replies: 5 samples, 7 replies."""
  from experiments.eval_sft import evaluate
  pick = {}
  for s in SAMPLES:
    pick.setdefault((s.task, s.thinking), s)
  calc = pick[("calculator", True)]
  add, upper = pick[("add", False)], pick[("upper", True)]
  rev, cnt = pick[("reverse", False)], pick[("count", True)]
  samples = [add, upper, rev, cnt, calc]
  # The texts hold no special name but the markers: the byte tokenizer with specials reads
  # them as the chat encoder writes them.
  tok = lambda text: tokenizers.ByteTokenizer().encode(text, specials=True).tolist()   # noqa: E731
  expr = calc.conversation.messages[1].tool_calls[0].arguments["expression"]
  call = (f'[open]tools[sep][{{"arguments":{{"expression":"{expr}"}},"name":"calculator"}}]'
          f"[close]")
  first = {
      0: (tok(f"{add.answer}[close]"), True),                          # right (instruct)
      1: (tok(f"up[close][open]response[sep]{upper.answer.lower()}[close]"), True),   # wrong
      2: (tok(f"{rev.answer}[close]"), False),                          # cut: does not parse
      3: (tok(f"c[close][open]response[sep]{cnt.answer}[open]"), True),  # malformed
      4: (tok(f"use[close]{call}"), True),                              # a tool call
  }
  calls = []

  def replies(prompts):
    calls.append(prompts)
    if len(calls) == 1:
      assert len(prompts) == 5
      for p, s in zip(prompts, samples):
        want = [tokenizers.BOS] + tok(chat.render_prompt(s.prompt(), s.thinking))
        assert p == want
      return [first[i] for i in range(5)]
    # Round 2: only the calculator sample, with its call and the tool's answer in the prompt.
    (p,) = prompts
    conv = chat.parse(tokenizers.ByteTokenizer().decode(p[1:], specials=True)[:-len(
        chat.reply_prefix(True))])
    assert conv.messages[-1] == chat.Message("tool", calc.answer)
    assert conv.messages[-2].tool_calls == calc.conversation.messages[1].tool_calls
    return [(tok(f"ok[close][open]response[sep]{calc.answer}[close]"), True)]

  out = evaluate(types.SimpleNamespace(text=types.SimpleNamespace(vocab_size=272)), None, samples,
                 replies_fn=replies)
  assert len(calls) == 2
  assert out["replies"] == 6 and out["parse_rate"] == pytest.approx(4 / 6)
  assert out["exact_match"] == pytest.approx(2 / 5)
  assert out["by_task"]["add"] == {"n": 1, "exact_match": 1.0, "constant_answer": 1.0}
  assert out["constant_answer"] == 1.0          # one sample per task
  assert out["by_task"]["upper"]["exact_match"] == 0.0
  assert out["by_task"]["calculator"]["exact_match"] == 1.0
  assert [e["correct"] for e in out["examples"]] == [True, False, False, False, True]
