"""The tool environment and multi-turn rollouts through the serving engine
(k3jax/posttrain/rl/env.py): scripted replies (tool calls run in the sandbox, errors returned,
the loss mask, T(y)); the tool withheld (`withheld="all"`: every call answered
`TOOL_UNAVAILABLE`, no code runs, the trajectory goes on as with the tool — the "without the
tool" arm of experiments/agentic_figure.py); engine rollouts of a 2-layer model (KDA + MLA):
every later turn resumes from the prefix cache at the previous turn boundary, engine
log-probs = trainer log-probs, pages back to the baseline."""

import functools

import jax
import numpy as np
import pytest

from k3jax.config import preset
from k3jax.data import chat, tool_tasks as T
from k3jax.posttrain.rl import env as E
from k3jax.posttrain.rl import logprobs as L
from k3jax.posttrain.rl.sandbox import Limits
from k3jax.serve.engine import Engine, EngineConfig
from k3jax.train.state import init_variables

CONFIG = preset("tiny", num_layers=2, mla_every=2, first_dense_layers=1,
                attn_res_block_size=None, num_mtp_layers=0)
LIMITS = Limits(cpu_seconds=1, wall_seconds=4)
WIDTH = 576


@functools.lru_cache(maxsize=None)
def _variables():
  return init_variables(CONFIG, jax.random.PRNGKey(0))


def _reply(env, think, calls=None, response=None):
  """A reply's tokens as the policy would emit them after the thinking opening."""
  msg = chat.Message("assistant", response, think, calls)
  ids = env.encoder.segments(chat.message_segments(msg))
  assert ids[:len(env.opening)] == env.opening
  return ids[len(env.opening):]


def test_scripted_tool_turns_mask_and_effort():
  env = E.ToolEnv(limits=LIMITS, max_turns=4, max_tokens=2000)
  task = T.make_task(np.random.default_rng(0), 0, "bigmul", "high")
  traj = E.Trajectory(task, list(task.tokens), len(task.tokens))
  a, b = task.spec
  calls = [chat.ToolCall("python", {"code": f"print({a}*{b})"}),
           chat.ToolCall("python", {"code": "import os\nwhile True: os.fork()"}),
           chat.ToolCall("shell", {"cmd": "ls"})]
  r1 = _reply(env, "use the tool", calls)
  assert env.tokenizer.decode(r1[:12]) == "use the tool"
  nxt = env.after_reply(traj, r1, [-0.5] * len(r1), "stop", 0, len(task.tokens))
  assert nxt == traj.tokens and traj.finish is None
  tail = env.tokenizer.decode(nxt[len(task.tokens) + len(r1):], specials=True)
  assert tail == (f"[open]tool[sep]{task.answer}\n[end_of_msg]"
                  "[open]tool[sep]error (refused): sandbox: os.fork refused (no processes, no "
                  "native code)[end_of_msg][open]tool[sep]error: unknown tool 'shell' "
                  "(available: python)[end_of_msg][open]assistant[sep][open]think[sep]")
  assert [r.kind for r in traj.results] == ["ok", "refused"]
  # Only the reply is the policy's; its log-probs kept, the environment's tokens zero.
  n1 = len(r1)
  assert traj.policy == [True] * n1 + [False] * (len(nxt) - len(task.tokens) - n1)
  assert traj.logprobs[:n1] == [-0.5] * n1 and not any(traj.logprobs[n1:])
  # T(y): 12 thinking tokens + the arguments' JSON tokens of the three calls.
  args = sum(len(chat.canonical_json(c.arguments).encode()) for c in calls)
  assert traj.effort_tokens(agentic=True) == 12 + args and traj.effort_tokens(False) == 12
  # A reply cut at its cap: closed by the environment, the policy told, the turn counted.
  r2 = env.encoder.text("hmm")
  env.after_reply(traj, r2, [-1.0] * 3, "length", 0, len(nxt))
  cut = env.tokenizer.decode(traj.tokens[len(nxt):], specials=True)
  assert cut.startswith("hmm[close][end_of_msg][open]tool[sep]error: the reply was cut at 3")
  assert traj.policy[len(nxt) - len(task.tokens):][:5] == [True] * 3 + [False] * 2
  # The answer ends the trajectory; the hidden verifier accepts it.
  r3 = _reply(env, "done", None, f"The product is {task.answer}")
  assert env.after_reply(traj, r3, [0.0] * len(r3), "stop", 0, 0) is None
  assert traj.finish == "answer" and T.is_correct(task, traj.response)
  assert traj.thinking_tokens == 12 + 3 + 4
  # The turn limit.
  one = E.ToolEnv(limits=LIMITS, max_turns=1, max_tokens=2000)
  t2 = E.Trajectory(task, list(task.tokens), len(task.tokens))
  assert one.after_reply(t2, r1, [0.0] * n1, "stop", 0, 0) is None and t2.finish == "turn_limit"
  assert t2.tokens == list(task.tokens) + r1 and t2.policy == [True] * n1
  # The token limit: the next turn would not fit.
  small = E.ToolEnv(limits=LIMITS, max_turns=4, max_tokens=len(task.tokens) + n1 + 20)
  t3 = E.Trajectory(task, list(task.tokens), len(task.tokens))
  assert small.after_reply(t3, r1, [0.0] * n1, "stop", 0, 0) is None
  assert t3.finish == "token_limit" and len(t3.tokens) == len(task.tokens) + n1


def test_withheld_tool_answers_every_call_with_an_error():
  task = T.make_task(np.random.default_rng(0), 0, "bigmul", "high")
  a, b = task.spec
  calls = [chat.ToolCall("python", {"code": f"print({a}*{b})"}),
           chat.ToolCall("shell", {"cmd": "ls"})]
  arms = {}
  for available in (True, False):
    env = E.ToolEnv(limits=LIMITS, max_turns=3, max_tokens=2000,
                    withheld=() if available else "all")
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
  env = E.ToolEnv(limits=LIMITS, max_turns=3, max_tokens=2000, withheld="all")
  r2 = _reply(env, "", None, f"= {task.answer}")
  assert env.after_reply(traj_without, r2, [0.0] * len(r2), "stop", 0, 0) is None
  assert traj_without.finish == "answer" and T.is_correct(task, traj_without.response)
  assert env.run_call(chat.ToolCall("python", {"code": "print(1)"})) == E.TOOL_UNAVAILABLE
  assert env.withheld == env.tools == ("python",)
  with pytest.raises(ValueError, match="ToolEnv.withheld: tool names or 'all', found 'none'"):
    E.ToolEnv(withheld="none")


def test_engine_rollout_caches_turns_and_matches_trainer_logprobs():
  ec = EngineConfig(num_slots=4, tile_rows=2, max_len=WIDTH, page_size=16, num_pages=160,
                    prefill_chunk=64, prefill_buckets=(64,), checkpoint_interval=64,
                    boundary_token=chat_end(), step_tokens=128, num_checkpoints=16)
  engine = Engine(CONFIG, _variables(), ec)
  env = E.ToolEnv(limits=LIMITS, max_turns=3, max_tokens=WIDTH, max_reply_tokens=6)
  tasks = T.ToolTaskSampler(domains=("bigmul", "strops"), seed=3).sample(3)
  trajs = E.rollout(engine, tasks, env, temperature=1.0, seed=1)
  st = engine.stats()
  assert st["running"] == st["waiting"] == st["pages_in_use"] == 0   # pages released
  engine.clear_cache()
  assert engine.allocator.num_used == 0
  turns = 0
  for t in trajs:
    assert t.finish in E.FINISHES and 1 <= len(t.turns) <= 3 and len(t.tokens) <= WIDTH
    for k, turn in enumerate(t.turns):
      prompt = t.tokens[:turn.prompt_len]
      if k == 0:
        assert turn.cached == 0
        continue
      turns += 1
      # The hit is the previous prompt's last checkpoint point (its last turn boundary, or a
      # later multiple of the checkpoint interval): only the rest of it, the reply, the tool
      # messages and the new opening are prefilled.
      prev = t.tokens[:t.turns[k - 1].prompt_len]
      last_boundary = max(i + 1 for i, x in enumerate(prev) if x == chat_end())
      assert turn.cached == max(last_boundary, len(prev) // 64 * 64)
      assert turn.prompt_len - turn.cached < 100
      assert prompt[:len(prev)] == prev
  assert turns >= 3
  seqs, plens, mask, blp = E.training_rows(trajs, WIDTH + 64, 144)
  assert mask.sum() == sum(len(turn.reply) for t in trajs for turn in t.turns)
  lp = L.token_logprobs(CONFIG, _variables(), seqs, plens, mask.shape[1])
  diff = np.abs(lp - blp)[mask > 0]
  assert diff.max() <= 1e-5 and (blp[mask > 0] < 0).all()
  assert np.abs(lp[mask > 0] + 1e-3 - blp[mask > 0]).max() > 5e-4


def chat_end():
  from k3jax.data.tokenizers import CHAT_END
  return CHAT_END
