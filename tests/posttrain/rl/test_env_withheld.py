"""The tool withheld (`ToolEnv(tool_available=False)`, k3jax/posttrain/rl/env.py): every call is
answered with the tool error `TOOL_UNAVAILABLE`, no code runs, and the trajectory goes on as
with the tool (the "without the tool" arm of experiments/agentic_figure.py)."""

import numpy as np

from k3jax.data import chat, tool_tasks as T
from k3jax.posttrain.rl import env as E
from k3jax.posttrain.rl.sandbox import Limits

LIMITS = Limits(cpu_seconds=1, wall_seconds=4)


def _reply(env, think, calls=None, response=None):
  msg = chat.Message("assistant", response, think, calls)
  ids = env.encoder.segments(chat.message_segments(msg))
  assert ids[:len(env.opening)] == env.opening
  return ids[len(env.opening):]


def test_withheld_tool_answers_every_call_with_an_error():
  task = T.make_task(np.random.default_rng(0), 0, "bigmul", "high")
  a, b = task.spec
  calls = [chat.ToolCall("python", {"code": f"print({a}*{b})"}),
           chat.ToolCall("shell", {"cmd": "ls"})]
  arms = {}
  for available in (True, False):
    env = E.ToolEnv(limits=LIMITS, max_turns=3, max_tokens=2000, tool_available=available)
    traj = E.Trajectory(task, list(task.tokens), len(task.tokens))
    r1 = _reply(env, "use the tool", calls)
    nxt = env.after_reply(traj, r1, [-0.5] * len(r1), "stop", 0, len(task.tokens))
    arms[available] = (env.tokenizer.decode(nxt[len(task.tokens) + len(r1):], specials=True),
                       traj)
  with_tool, traj_with = arms[True]
  without, traj_without = arms[False]
  assert with_tool.startswith(f"[open]tool[sep]{task.answer}\n[end_of_msg]")
  assert [r.kind for r in traj_with.results] == ["ok"]
  # Withheld: both calls (the good one and the unknown tool) get the same error; nothing ran.
  assert without == ("[open]tool[sep]error: tool unavailable[end_of_msg]" * 2
                     + "[open]assistant[sep][open]think[sep]")
  assert E.TOOL_UNAVAILABLE == "error: tool unavailable"
  assert traj_without.results == [] and traj_without.finish is None
  # The policy's own tokens and T(y) are counted as with the tool.
  assert traj_without.policy == traj_with.policy[:len(traj_without.policy)]
  assert traj_without.argument_tokens == traj_with.argument_tokens > 0
  # The answer still ends the trajectory and is checked.
  env = E.ToolEnv(limits=LIMITS, max_turns=3, max_tokens=2000, tool_available=False)
  r2 = _reply(env, "", None, f"= {task.answer}")
  assert env.after_reply(traj_without, r2, [0.0] * len(r2), "stop", 0, 0) is None
  assert traj_without.finish == "answer" and T.is_correct(task, traj_without.response)
  assert env.run_call(chat.ToolCall("python", {"code": "print(1)"})) == E.TOOL_UNAVAILABLE
