"""Tasks, rewards and the loss without a model: checkers, the budget boundary, τ annealing,
MOPD clipping, the stop-gradient through the teacher ratio (gradient value-checked), the group
baseline."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

# experiments.train imported beside experiments.rl on purpose: pytest workers import several
# entry points into one process, and their flags must not collide in absl's FLAGS.
from experiments import train as _train  # noqa: F401
from experiments.rl import parse_teachers
from k3jax.config import preset
from k3jax.posttrain.rl import rewards
from k3jax.data import rl_tasks
from k3jax.posttrain.rl.losses import LossConfig, group_advantages, policy_loss


def _solve(task):
  """An independent solver from the question text."""
  q = task.question
  if task.domain == "arith":
    return str(eval(q[len("Compute "):-1]))          # noqa: S307 - generated digits only
  if task.domain == "sort":
    return ",".join(sorted(q[len("Sort "):-1].split(",")))
  seen = {int(x) for x in q[q.index(":") + 1:-1].split(",")}
  return str(next(d for d in range(10) if d not in seen))


def test_tasks_answers_checkers_and_prompts():
  ts = rl_tasks.TaskSampler(seed=3).sample(60)
  assert {t.domain for t in ts} == set(rl_tasks.DOMAINS)
  assert {t.effort for t in ts} == set(rl_tasks.EFFORTS)
  assert len({t.uid for t in ts}) == 60
  for t in ts:
    assert t.answer == _solve(t)
    text = rl_tasks.decode(t.tokens)     # specials dropped
    assert t.question in text and f'"effort":"{t.effort}"' in text
    assert t.tokens[-1] == 262 and t.tokens.count(261) == 4    # ends with [sep]; 4 [open]
    assert t.tokens[-8:] == (262, 261, *b"think", 262)          # thinking mode
    assert rl_tasks.render(t.question, t.effort).endswith("[open]think[sep]")
    assert rl_tasks.is_correct(t, "..  " + t.answer)
    assert not rl_tasks.is_correct(t, t.answer + " x")
    assert not rl_tasks.is_correct(t, "")
  r = rewards.task_rewards(ts[:2], [ts[0].answer, "nope"])
  np.testing.assert_array_equal(r, [1.0, 0.0])
  with pytest.raises(ValueError, match="domain"):
    rl_tasks.TaskSampler(domains=("chess",))


def test_replies_are_read_for_thinking_tokens_and_the_response_channel():
  t = rl_tasks.make_task(np.random.default_rng(0), 0, "arith", "low")
  ok = rl_tasks.reply_tokens("a b.", t.answer)
  # think text, [close], [open] "response" [sep], the answer, [close], [end_of_msg]
  assert list(ok) == [*b"a b.", 263, 261, *b"response", 262, *t.answer.encode(), 263, 264]
  r = rl_tasks.read_reply(ok)
  assert (r.thinking_tokens, r.response, r.complete) == (4, t.answer, True)
  assert rl_tasks.reply_correct(t, ok) and rl_tasks.thinking_tokens(ok) == 4
  wrong = rl_tasks.reply_tokens("", t.answer + "0")
  assert rl_tasks.read_reply(wrong).thinking_tokens == 0 and not rl_tasks.reply_correct(t, wrong)
  # The answer in the think channel alone is no answer; a cut reply has none either.
  assert not rl_tasks.reply_correct(t, rl_tasks.encode(" " + t.answer) + (263, 264))
  cut = ok[:-1]
  assert rl_tasks.read_reply(cut) == rl_tasks.Reply(4, None, False)
  assert rl_tasks.read_reply(ok[:2]).thinking_tokens == 2
  # A marker typed as bytes inside text is text, and the reply then has no answer.
  spelled = rl_tasks.encode("[close]") + ok
  assert rl_tasks.read_reply(spelled) == rl_tasks.Reply(11, None, True)
  # Tokens after [end_of_msg] are ignored.
  assert rl_tasks.read_reply(ok + (46, 46)).thinking_tokens == 4
  # T(y) of a general task is what the agentic environment counts as thinking.
  from k3jax.posttrain.rl.env import ToolEnv
  for reply in (ok, wrong, cut, rl_tasks.reply_tokens("x" * 9, "5")):
    assert ToolEnv().read_reply(reply).channel_tokens.get("think", 0) == \
        rl_tasks.thinking_tokens(reply)
  # Cold-start replies are correct and think 0..max_filler dots.
  rng = np.random.default_rng(1)
  lens = [rl_tasks.read_reply(rl_tasks.sft_reply(t, rng, 5)) for _ in range(40)]
  assert all(x.response == t.answer for x in lens)
  assert {x.thinking_tokens for x in lens} == set(range(6))
  # By effort: each level its third of 0..8 (low 0–2, high 3–5, max 6–8).
  for effort, want in (("low", {0, 1, 2}), ("high", {3, 4, 5}), ("max", {6, 7, 8})):
    te = rl_tasks.make_task(np.random.default_rng(2), 0, "arith", effort)
    got = {rl_tasks.read_reply(rl_tasks.sft_reply(te, rng, 8, by_effort=True)).thinking_tokens
           for _ in range(60)}
    assert got == want, (effort, got)
  assert rl_tasks.filler_range("max", 2) == (2, 2) and rl_tasks.filler_range(None, 1) == (0, 1)
  with pytest.raises(ValueError, match="max_filler: by effort needs >= 2, found 1"):
    rl_tasks.filler_range("max", 1)
  with pytest.raises(ValueError, match="effort: expected one of"):
    rl_tasks.filler_range("extreme", 8)
  # Without the effort option the prompt has no options block; the task keeps its effort.
  bare = rl_tasks.make_task(np.random.default_rng(0), 0, "arith", "low", effort_option=False)
  assert bare.effort == "low" and bare.question == t.question
  assert bare.tokens == rl_tasks.prompt_tokens(t.question, None) == t.tokens[26:]
  assert rl_tasks.decode(t.tokens[:26]) == 'options{"effort":"low"}'


def test_strip_effort_removes_only_the_effort():
  t = rl_tasks.make_task(np.random.default_rng(0), 0, "sort", "max")
  assert rewards.strip_effort(t.tokens) == list(rl_tasks.prompt_tokens(t.question, None))
  from k3jax.data import chat, tool_tasks
  tt = tool_tasks.ToolTaskSampler(seed=0).sample(1)[0]
  keep = tool_tasks.prompt_tokens(chat.user_conversation(
      tt.question, options=chat.Options((tool_tasks.PYTHON_TOOL,))))
  assert rewards.strip_effort(tt.tokens) == list(keep)          # the tools stay
  assert len(tt.tokens) - len(keep) == len(b',"effort":"') + len(tt.effort) + 1
  # A mid-conversation (turn_options) effort goes too; prompts without one are unchanged.
  from k3jax.data.chat_tokens import ChatEncoder
  from k3jax.data.tokenizers import ByteTokenizer
  enc = ChatEncoder(ByteTokenizer())
  conv = chat.Conversation((chat.Message("user", "a"), chat.Message("user", "b")),
                           options_at=((1, chat.Options(effort="low")),))
  plain = chat.Conversation((chat.Message("user", "a"), chat.Message("user", "b")))
  ids = enc.encode(conv, reply="thinking", bos=False).ids.tolist()
  want = enc.encode(plain, reply="thinking", bos=False).ids.tolist()
  assert rewards.strip_effort(ids) == want and rewards.strip_effort(want) == want


def test_teachers_score_the_prompt_without_the_effort_option():
  """Teacher log-probs on the stripped rows = a direct forward of the teacher on the prompt
  without the option, token for token; they differ from scoring the student's prompt, and the
  MOPD reward is made of them."""
  from k3jax.posttrain.rl import logprobs as L
  from k3jax.posttrain.rl import rollout as R
  from k3jax.train.state import init_variables
  cfg = preset("tiny", num_layers=1, first_dense_layers=1, mla_every=1,
               attn_res_block_size=None, num_mtp_layers=0)
  tv = init_variables(cfg, jax.random.PRNGKey(5))
  rng = np.random.default_rng(2)
  ts = [rl_tasks.make_task(rng, i, "arith", e) for i, e in enumerate(("low", "max", "high"))]
  resp = [rl_tasks.sft_reply(t, rng) for t in ts]
  width, rw = 96, 24
  seqs, plens = R.sequences([t.tokens for t in ts], resp, width)
  teachers = rewards.Teachers({("arith", "low"): (cfg, tv), ("arith", "max"): (cfg, tv)},
                              cfg.text.vocab_size)
  keys = [(t.domain, t.effort) for t in ts]
  tlp, has = teachers.score(keys, seqs, plens, rw)
  np.testing.assert_array_equal(has, [True, True, False])
  bare, bare_lens = R.sequences([rl_tasks.prompt_tokens(t.question, None) for t in ts], resp,
                                width)
  direct = L.token_logprobs(cfg, tv, bare, bare_lens, rw)
  for b in (0, 1):
    n = len(resp[b])
    np.testing.assert_allclose(tlp[b, :n], direct[b, :n], atol=1e-6)
  np.testing.assert_array_equal(tlp[2], 0.0)
  seen, _ = rewards.Teachers(teachers.teachers, cfg.text.vocab_size,
                             strip_effort=False).score(keys, seqs, plens, rw)
  assert np.abs(seen[0, :len(resp[0])] - tlp[0, :len(resp[0])]).max() > 1e-4
  student = np.full_like(tlp, -3.0)
  np.testing.assert_allclose(np.asarray(rewards.mopd_reward(tlp, student, 1.0)),
                             np.clip(tlp + 3.0, -1.0, 1.0), atol=1e-6)


def test_budget_boundary():
  # τ·b₀ = 1.5·8 = 12: length 12 is within budget, 13 is over.
  out = rewards.apply_budget([1.0, 1.0, 0.0, 1.0], [12, 13, 13, 3], [8, 8, 8, 8], 1.5)
  np.testing.assert_array_equal(out, [1.0, -1.0, -1.0, 1.0])
  np.testing.assert_array_equal(rewards.budget_violations([12, 13], 8, 1.5), [False, True])


def test_tau_schedule_anneals_per_domain():
  s = rewards.TauSchedule({"arith": 2.0, "sort": 1.0}, {"arith": 1.0, "sort": 0.5},
                          {"arith": 4, "sort": 0})
  assert [s("arith", r) for r in (0, 2, 4, 9)] == [2.0, 1.5, 1.0, 1.0]
  assert s("sort", 0) == 0.5
  with pytest.raises(ValueError, match="puzzle"):
    s("puzzle", 0)
  with pytest.raises(ValueError, match="tau_end"):
    rewards.TauSchedule.uniform(1.0, 0.0, 3)


@given(st.floats(-20, 20), st.floats(-20, 20), st.floats(0.1, 5))
def test_mopd_reward_clips_at_r_max(t, s, r_max):
  r = float(rewards.mopd_reward(jnp.float32(t), jnp.float32(s), r_max))
  want = min(max(np.float32(t) - np.float32(s), -r_max), r_max)
  assert abs(r - want) <= 1e-5 * max(1.0, abs(want))
  assert -r_max - 1e-6 <= r <= r_max + 1e-6


def _batch(lp, teacher, adv, mask):
  b, l = lp.shape
  return {"mask": jnp.asarray(mask, jnp.float32), "behaviour_lp": jnp.asarray(lp),
          "adv": jnp.asarray(adv, jnp.float32), "teacher_lp": jnp.asarray(teacher),
          "has_teacher": jnp.ones(b, bool), "ref_lp": jnp.asarray(lp)}


def test_stop_gradient_through_teacher_ratio():
  # At the behaviour policy (ρ = 1, inside the clip range) the gradient of the loss w.r.t. the
  # student's log-prob is exactly −m_t·(A + β·r_t)/Σm: the MOPD reward r_t is a constant.
  rng = np.random.default_rng(0)
  lp = jnp.asarray(rng.normal(-2, 1, (3, 5)), jnp.float32)
  teacher = jnp.asarray(rng.normal(-2, 2, (3, 5)), jnp.float32)
  adv = np.array([0.5, -1.0, 0.0])
  mask = (np.arange(5)[None] < np.array([[5], [3], [4]])).astype(np.float32)
  cfg = LossConfig(mopd_coef=0.7, r_max=1.5, dual_clip=0.0)
  batch = _batch(lp, teacher, adv, mask)
  g = jax.grad(lambda x: policy_loss(x, batch, cfg)[0])(lp)
  r = np.clip(np.asarray(teacher) - np.asarray(lp), -1.5, 1.5)
  want = -mask * (adv[:, None] + 0.7 * r) / mask.sum()
  np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-7)
  # Without the stop-gradient the same loss would give a different gradient (−A + β·(2 lp −
  # teacher)-like terms): the check above can fail.
  loss, aux = policy_loss(lp, batch, cfg)
  np.testing.assert_allclose(float(loss), -(mask * (adv[:, None] + 0.7 * r)).sum() / mask.sum(),
                             rtol=1e-5)
  np.testing.assert_allclose(float(aux["mopd"]), (mask * r).sum() / mask.sum(), rtol=1e-5)


def test_importance_ratio_clipping():
  # Stale token: ρ = e^{0.5} > 1 + ε_high with A > 0 → clipped, no gradient; with A < 0 →
  # unclipped branch ρ·A (min) and gradient −ρ·A·m/Σm.
  lp = jnp.zeros((2, 1), jnp.float32)
  batch = _batch(lp - 0.5, lp, [1.0, -1.0], np.ones((2, 1)))
  batch["has_teacher"] = jnp.zeros(2, bool)
  cfg = LossConfig(eps_high=0.2, dual_clip=0.0)
  loss, aux = policy_loss(lp, batch, cfg)
  rho = np.exp(0.5)
  np.testing.assert_allclose(float(loss), -(1.2 * 1.0 + rho * -1.0) / 2, rtol=1e-6)
  g = np.asarray(jax.grad(lambda x: policy_loss(x, batch, cfg)[0])(lp))
  np.testing.assert_allclose(g[:, 0], [0.0, rho / 2], rtol=1e-6)
  assert float(aux["clip_frac"]) == 1.0
  # Dual clip bounds the negative branch at c·A.
  batch["behaviour_lp"] = lp - 3.0
  loss, _ = policy_loss(lp, batch, LossConfig(eps_high=0.2, dual_clip=3.0))
  np.testing.assert_allclose(float(loss), -(1.2 + 3.0 * -1.0) / 2, rtol=1e-6)


def test_group_baseline():
  r = np.array([1, 0, 0, 1, -1, -1, -1, -1, 1, 1, 1, 0], np.float32)
  a = group_advantages(r, 4)
  want = np.concatenate([g - g.mean() for g in r.reshape(3, 4)])
  np.testing.assert_allclose(a, want, atol=1e-7)
  a = group_advantages(r, 4, std_norm=True)
  want = np.concatenate([(g - g.mean()) / (g.std() + 1e-6) for g in r.reshape(3, 4)])
  np.testing.assert_allclose(a, want, rtol=1e-6, atol=1e-7)
  assert np.all(group_advantages(np.ones(8), 4) == 0)
  with pytest.raises(ValueError, match="K=4"):
    group_advantages(np.ones(6), 4)


def test_bad_inputs_name_the_problem():
  with pytest.raises(ValueError, match="r_max"):
    LossConfig(r_max=0.0)
  with pytest.raises(ValueError, match="vocab_size"):
    rewards.Teachers({("arith", "low"): (preset("tiny", vocab_size=300), {})}, 272)
  assert parse_teachers("arith:low=/a,sort:max=/b,bigmul:high=/c") == {
      ("arith", "low"): "/a", ("sort", "max"): "/b", ("bigmul", "high"): "/c"}
  for bad in ("arith=/a", "chess:low=/a", "arith:low=/a,arith:low=/b"):
    with pytest.raises(ValueError, match="--teachers"):
      parse_teachers(bad)
