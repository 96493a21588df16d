"""The crop tool in the environment (k3jax/posttrain/rl/env.py) on the visual task
(k3jax/data/visual_tasks.py): scripted replies (the crop comes back as a tool message with a
media block, errors as text, the loss mask), the trajectory equals the SFT demonstration, the
crop's pixels reach the model after the tool message and only there, and a later turn with
media resumes from the engine's prefix cache with engine log-probs = the forward's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import preset
from k3jax.data import chat, sft
from k3jax.data import visual_tasks as V
from k3jax.data.tokenizers import CHAT_END, MEDIA
from k3jax.model import K3Model
from k3jax.posttrain.rl import env as E
from k3jax.serve.engine import Engine, EngineConfig, RequestParams
from k3jax.train.state import init_variables

CONFIG = preset("tiny_multimodal", num_layers=2, mla_every=2, first_dense_layers=2,
                attn_res_block_size=None, num_mtp_layers=0)
TASK = V.make_task(np.random.default_rng(7), 0)


def _env(**kw):
  return E.ToolEnv(max_turns=3, max_tokens=384, max_reply_tokens=64, tools=("crop",),
                   vision_config=CONFIG.vision, media_id=MEDIA, media_length=64, **kw)


def _reply(env, msg):
  ids = env.encoder.segments(chat.message_segments(msg))
  assert ids[:len(env.opening)] == list(env.opening)
  return ids[len(env.opening):]


def _call(cell):
  return chat.Message("assistant", None, "", (chat.ToolCall("crop", {"cell": cell}),))


def _scripted(env, cell=TASK.cell, answer=TASK.answer):
  traj = E.Trajectory(TASK, list(TASK.tokens), len(TASK.tokens), images=list(TASK.images))
  r1 = _reply(env, _call(cell))
  nxt = env.after_reply(traj, r1, [-0.5] * len(r1), "stop", 0, len(traj.tokens))
  r2 = _reply(env, chat.Message("assistant", answer, ""))
  end = None if nxt is None else env.after_reply(traj, r2, [-0.25] * len(r2), "stop", 0,
                                                 len(nxt))
  return traj, r1, r2, nxt, end


@functools.lru_cache(maxsize=None)
def _variables():
  return init_variables(CONFIG, jax.random.PRNGKey(0))


def test_crop_returns_the_cell_as_media_and_the_trajectory_is_the_demonstration():
  env = _env()
  traj, r1, r2, nxt, end = _scripted(env)
  assert nxt is not None and end is None and traj.finish == "answer"
  assert traj.response == TASK.answer and V.is_correct(TASK, traj.response)
  assert len(traj.images) == 2 and np.array_equal(traj.images[1], V.crop(TASK.image, TASK.cell))
  after = np.asarray(traj.tokens[len(TASK.tokens) + len(r1):])
  ph = np.nonzero(after == MEDIA)[0]
  assert len(ph) == V.MERGED and after[ph[0] - 1] == env.ids[chat.SEP]
  assert env.tokenizer.decode([int(i) for i in after[ph[-1] + 1:] if i < 256]).startswith(
      f"cell {TASK.cell}")
  # Only the policy's replies carry loss; the tool message and openings are the env's.
  want = [True] * len(r1) + [False] * (len(traj.policy) - len(r1) - len(r2)) + [True] * len(r2)
  assert traj.policy == want and traj.logprobs[:len(r1)] == [-0.5] * len(r1)
  assert traj.argument_tokens == len(f'{{"cell":"{TASK.cell}"}}') and traj.tool_calls == 1
  # The cold start's SFT demonstration is this very token sequence, with these images.
  conv, images = V.demonstration(TASK)
  e = sft.encode_media(CONFIG.vision, conv, images, bos=False)
  assert np.array_equal(np.concatenate([e.arrays["inputs"], e.arrays["targets"][-1:]]),
                        traj.tokens)
  pv, _, _ = env.media_pixels(traj.images)
  assert np.array_equal(pv, e.pixel_values)
  seqs, plens, mask, _ = E.training_rows([traj], 384, 384 - len(TASK.tokens))
  assert mask.sum() == len(r1) + len(r2) and plens[0] == len(TASK.tokens)
  media = env.batch_media([traj, E.Trajectory(TASK, [1], 1)])
  assert media.num_merged.tolist() == [8, 0] and media.patches.shape[:2] == (2, 64)


def test_tool_errors_withheld_tool_and_a_sampled_placeholder():
  env = _env()
  for cell, text in (("Z9", "error: cell: expected"), ("B", "error: cell:")):
    traj, r1, *_ = _scripted(env, cell=cell)
    tail = env.tokenizer.decode([i for i in traj.tokens[len(TASK.tokens) + len(r1):]
                                 if i < 256])
    assert tail.startswith("tool" + text) and len(traj.images) == 1
    assert MEDIA not in traj.tokens[len(TASK.tokens):]
  traj, r1, *_ = _scripted(_env(withheld=("crop",)))
  tail = env.tokenizer.decode([i for i in traj.tokens[len(TASK.tokens) + len(r1):] if i < 256])
  assert tail.startswith("tool" + V.WITHHELD) and len(traj.images) == 1
  call = chat.ToolCall("python", {"code": "print(1)"})
  assert env.run_tool(call, None) == ("error: unknown tool 'python' (available: crop)", ())
  traj = E.Trajectory(TASK, list(TASK.tokens), len(TASK.tokens), images=list(TASK.images))
  reply = [97, 98, MEDIA, 99, CHAT_END]
  assert env.after_reply(traj, reply, [-1.0] * 5, "stop", 0, len(TASK.tokens)) is None
  assert traj.finish == "media_token" and traj.tokens[len(TASK.tokens):] == [97, 98]
  assert traj.logprobs == [-1.0, -1.0]
  with pytest.raises(ValueError, match="vision_config"):
    E.ToolEnv(tools=("crop",))
  with pytest.raises(ValueError, match="tools"):
    E.ToolEnv(tools=("shell",))


def test_the_crop_reaches_the_model_and_a_later_turn_resumes_with_media():
  env = _env()
  traj, r1, r2, nxt, _ = _scripted(env)
  v = _variables()
  model = K3Model(CONFIG)
  seqs = jnp.asarray([traj.tokens], jnp.int32)
  other = E.Trajectory(TASK, traj.tokens, traj.prompt_len,
                       images=[traj.images[0], np.zeros_like(traj.images[1])])
  fwd = jax.jit(lambda m: model.apply(v, seqs, media=m, mutable=["stats"])[0])
  a = np.asarray(fwd(env.batch_media([traj])))[0]
  b = np.asarray(fwd(env.batch_media([other])))[0]
  first = int(np.nonzero(np.asarray(traj.tokens) == MEDIA)[0][V.MERGED])  # the crop's first
  # Causal: the same before the crop's placeholders (up to float rounding of the batched
  # media encoding), different at every position after them.
  assert np.abs(a[:first] - b[:first]).max() < 1e-5
  after = np.abs(a[first:] - b[first:]).max(-1)
  assert after.min() > 1e-4 and after.max() > 1e-2, (after.min(), after.max())
  # The engine: turn 1's prompt, then turn 2's (the env's prompt after the crop) with the
  # overview and the crop as media: resumed from the cache, log-probs = the forward's.
  ec = EngineConfig(num_slots=2, tile_rows=2, max_len=384, page_size=16, prefill_chunk=64,
                    checkpoint_interval=64, boundary_token=CHAT_END, step_tokens=256,
                    num_checkpoints=8)
  engine = Engine(CONFIG, jax.tree.map(jnp.array, {"params": v["params"],
                                                   "balance": v.get("balance", {})}), ec)
  p1 = E.Trajectory(TASK, list(TASK.tokens), len(TASK.tokens), images=list(TASK.images))
  m1, k1 = env.media(p1)
  rid = engine.submit(p1.tokens, RequestParams(max_tokens=2), media=m1, media_keys=k1)
  while not engine.requests[rid].done:
    engine.step()
  engine.pop(rid)
  p2 = E.Trajectory(TASK, list(nxt), len(nxt), images=traj.images)
  m2, k2 = env.media(p2)
  rid = engine.submit(p2.tokens, RequestParams(max_tokens=3), media=m2, media_keys=k2)
  while not engine.requests[rid].done:
    engine.step()
  req = engine.pop(rid)
  assert req.cached_tokens >= len(TASK.tokens) - len(env.opening)    # through the user turn
  full = jnp.asarray([list(nxt) + req.tokens], jnp.int32)
  logits = np.asarray(model.apply(v, full, media=env.batch_media([p2]),
                                  mutable=["stats"])[0])[0]
  lp = jax.nn.log_softmax(logits[len(nxt) - 1:len(nxt) - 1 + len(req.tokens)], -1)
  want = np.asarray([lp[j, t] for j, t in enumerate(req.tokens)])
  np.testing.assert_allclose(req.logprobs, want, atol=1e-4)
