r"""Held-out accuracy of a chat model on the embedded SFT tasks (k3jax/data/sft_tasks.py).

  python -m experiments.eval_sft --checkpoint=runs/sft --json=runs/sft/eval_sft.json
  python -m experiments.eval_sft --config=configs/sft_small.py --json=before.json   # random init

Scores `--num_samples` held-out samples (split HELDOUT of --seed: problems never in any
training set, whatever the seed). Each sample's prompt is its conversation up to the first
assistant message, opened in the sample's mode (`chat.render_prompt(..., thinking)`) after
[BOS], with the markers as single ids — the layout of `generate --chat`. Replies are generated
greedily in batches (k3jax.serve.generate's prefill + decode steps, prompts right-padded to one
width so each shape compiles once) until `[end_of_msg]` or --max_new_tokens. A reply that
calls tools gets the tools' messages (the calculator, `sft_tasks.run_tool`) and the model
replies again, up to --max_rounds replies. Reported:
  exact_match   fraction of samples whose last reply's response channel equals the answer
  parse_rate    fraction of all replies that parse as an XTML assistant message closed by
                `[end_of_msg]` (`chat.parse_reply(..., complete=True)`)
both overall and per task, with `constant_answer`: the exact match of always giving each
task's most frequent held-out answer (what a model that ignores the question can reach), and a
few example replies, written to --json (a temporary file
renamed). --checkpoint: any directory `load_pretrained` reads; --config: a run config whose
model is initialised from its seed (the "before" figure of a run from scratch).
"""

from __future__ import annotations

import collections
import os
import time
from typing import Callable, Sequence

from absl import app, flags

from experiments import results

FLAGS = flags.FLAGS


def _define_flags():
  # Defined only when run as a script (other entry points define --config / --checkpoint).
  flags.DEFINE_string("checkpoint", None, "Run / checkpoint directory to evaluate.")
  flags.DEFINE_string("config", None, "Run config file (random init of its model) instead of "
                      "--checkpoint.")
  flags.DEFINE_string("json", None, "Write the figures here.")
  flags.DEFINE_integer("num_samples", 96, "Held-out samples to score.")
  flags.DEFINE_integer("seed", 0, "Seed of the held-out samples.")
  flags.DEFINE_integer("batch_size", 32, "Prompts per generation batch.")
  flags.DEFINE_integer("max_new_tokens", 112, "Tokens per reply at most.")
  flags.DEFINE_integer("max_rounds", 3, "Replies per sample at most (tool calls).")


def generate_replies(config, variables, prompts: Sequence[Sequence[int]], *,
                     max_new_tokens: int, batch_size: int, stop_id: int) -> list[tuple[list[int],
                                                                                      bool]]:
  """Greedy replies to `prompts` → [(generated ids without the stop token, stopped)].

  Batches of exactly `batch_size` rows (the last one padded with copies of a prompt), prompts
  right-padded to the longest prompt rounded up to 64, one cache capacity: a handful of
  compiled shapes for any number of prompts."""
  import jax.numpy as jnp
  import numpy as np

  from k3jax.serve import generate as G

  if not prompts:
    return []
  width = -(-max(len(p) for p in prompts) // 64) * 64
  max_len = width + max_new_tokens
  out = []
  for s in range(0, len(prompts), batch_size):
    part = list(prompts[s:s + batch_size])
    real = len(part)
    part += [part[0]] * (batch_size - real)
    tokens = np.zeros((batch_size, width), np.int32)
    lengths = np.array([len(p) for p in part], np.int32)
    for i, p in enumerate(part):
      tokens[i, :len(p)] = p
    logits, cache = G.prefill(config, variables, tokens, lengths, max_len=max_len, chunk=width)
    gen = [[] for _ in range(batch_size)]
    stopped = np.zeros(batch_size, bool)
    for step in range(max_new_tokens):
      tok = np.asarray(jnp.argmax(logits, -1))
      for i in range(batch_size):
        if not stopped[i]:
          if tok[i] == stop_id:
            stopped[i] = True
          else:
            gen[i].append(int(tok[i]))
      if stopped[:real].all() or step == max_new_tokens - 1:
        break
      logits, cache = G.decode_step(config, variables, cache, tok, ~stopped)
    out += [(gen[i], bool(stopped[i])) for i in range(real)]
  return out


def evaluate(config, variables, samples, *, max_new_tokens: int = 112, batch_size: int = 32,
             max_rounds: int = 3, replies_fn: Callable | None = None) -> dict:
  """The figures of the module doc for `samples` (sft_tasks.Sample). `replies_fn(prompts)`
  → [(ids, stopped)] replaces the model (tests)."""
  from k3jax.data import chat
  from k3jax.data import tokenizers
  from k3jax.data.chat_tokens import ChatEncoder
  from k3jax.data import sft_tasks

  tok = tokenizers.ByteTokenizer(config.text.vocab_size)
  encoder = ChatEncoder(tok)
  if replies_fn is None:
    def replies_fn(prompts):
      return generate_replies(config, variables, prompts, max_new_tokens=max_new_tokens,
                              batch_size=batch_size, stop_id=tokenizers.CHAT_END)

  convs = [s.prompt() for s in samples]
  final: list[chat.Message | None] = [None] * len(samples)
  texts: list[list[str]] = [[] for _ in samples]
  replies = parsed = 0
  pending = list(range(len(samples)))
  for round_ in range(max_rounds):
    if not pending:
      break
    prompts = [encoder.encode(convs[i], reply="thinking" if samples[i].thinking
                              else "instruct").ids.tolist() for i in pending]
    outs = replies_fn(prompts)
    nxt = []
    for i, (ids, stopped) in zip(pending, outs):
      text = tok.decode(ids, specials=True) + (chat.END if stopped else "")
      texts[i].append(text)
      replies += 1
      try:
        msg = chat.parse_reply(text, samples[i].thinking, complete=True)
      except ValueError:
        continue                      # unparsable: the sample ends unanswered
      parsed += 1
      final[i] = msg
      if msg.tool_calls and round_ + 1 < max_rounds:
        convs[i] = chat.Conversation(
            convs[i].messages + (msg,) + tuple(sft_tasks.run_tool(c) for c in msg.tool_calls),
            convs[i].options)
        nxt.append(i)
    pending = nxt
  ok = [sft_tasks.check(s, m) for s, m in zip(samples, final)]
  by_task, constant = {}, 0
  for t in sorted({s.task for s in samples}):
    idx = [i for i, s in enumerate(samples) if s.task == t]
    top = max(collections.Counter(samples[i].answer for i in idx).values())
    constant += top
    by_task[t] = {"n": len(idx), "exact_match": sum(ok[i] for i in idx) / len(idx),
                  "constant_answer": top / len(idx)}
  return {"num_samples": len(samples), "exact_match": sum(ok) / max(1, len(samples)),
          "constant_answer": constant / max(1, len(samples)),
          "parse_rate": parsed / max(1, replies), "replies": replies, "by_task": by_task,
          "examples": [{"task": s.task, "answer": s.answer, "replies": texts[i],
                        "correct": ok[i]} for i, s in enumerate(samples[:6])]}


def load(checkpoint: str | None, config_file: str | None):
  """(model config, variables, step or None) of --checkpoint, or a random init of --config."""
  if (checkpoint is None) == (config_file is None):
    raise ValueError("exactly one of --checkpoint / --config is required")
  if checkpoint:
    import k3jax
    config, variables = k3jax.load_pretrained(checkpoint)
    ckpt = os.path.join(checkpoint, "checkpoints")
    step = max((int(c) for c in os.listdir(ckpt) if c.isdigit()), default=None) if (
        os.path.isdir(ckpt)) else None
    return config, {k: variables[k] for k in ("params", "balance") if k in variables}, step
  import importlib.util

  import jax

  from k3jax.train.run import run_config
  from k3jax.train.state import init_variables
  spec = importlib.util.spec_from_file_location("run_config", config_file)
  if spec is None or not os.path.isfile(config_file):
    raise ValueError(f"--config: cannot read {config_file!r}")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  run = run_config(mod.get_config())
  variables = init_variables(run.model, jax.random.PRNGKey(run.seed))
  return run.model, {k: variables[k] for k in ("params", "balance")}, 0


def main(argv):
  del argv
  from absl import logging as absl_logging

  from k3jax.data import sft_tasks
  if not FLAGS["verbosity"].present:     # orbax's INFO lines would bury the result
    absl_logging.set_verbosity(absl_logging.WARNING)
  t0 = time.perf_counter()
  config, variables, step = load(FLAGS.checkpoint, FLAGS.config)
  samples = sft_tasks.samples(FLAGS.seed, FLAGS.num_samples, sft_tasks.HELDOUT)
  out = evaluate(config, variables, samples, max_new_tokens=FLAGS.max_new_tokens,
                 batch_size=FLAGS.batch_size, max_rounds=FLAGS.max_rounds)
  out = {"checkpoint": FLAGS.checkpoint, "config": FLAGS.config, "step": step,
         "seed": FLAGS.seed, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
         "wall_s": round(time.perf_counter() - t0, 1), **out}
  if FLAGS.json:
    results.write_json(FLAGS.json, out, indent=2, ensure_ascii=False)
  tasks = ", ".join(f"{t} {v['exact_match']:.0%}" for t, v in out["by_task"].items())
  print(f"held-out exact match {out['exact_match']:.1%} ({tasks}); replies parsed "
        f"{out['parse_rate']:.1%} of {out['replies']}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
