"""Score text with a converted (or trained) checkpoint: per-token log-likelihood.

  python -m experiments.score --ckpt OUT_DIR --text "Hello world"              # UTF-8 bytes
  python -m experiments.score --ckpt OUT_DIR --text "..." --tokenizer HF_DIR   # local tokenizer
  python -m experiments.score --ckpt OUT_DIR --tokens 17,42,5,99 [--json]

One forward pass of K3Model (no generation): log p(token_t | tokens_<t) for t ≥ 1, the total
negative log-likelihood and the perplexity. `--tokenizer bytes` (default) maps UTF-8 bytes to
ids 0–255 (the `tiny`/`small` presets' vocabularies start with the 256 bytes); a directory
loads a Hugging Face tokenizer from disk with `transformers` (nothing is downloaded).
"""

from __future__ import annotations

import json

from absl import app, flags

import jax
import jax.numpy as jnp
import numpy as np

FLAGS = flags.FLAGS


def _define_flags():
  # Defined only when run as a script: importing `token_logprobs` (tests, notebooks) must not
  # register absl flags that other entry points (e.g. --json) also define.
  flags.DEFINE_string("ckpt", None, "checkpoint directory (anything load_pretrained accepts)")
  flags.DEFINE_string("text", None, "text to score")
  flags.DEFINE_string("tokens", None, "comma-separated token ids to score (instead of --text)")
  flags.DEFINE_string("tokenizer", "bytes", "'bytes' or a local Hugging Face tokenizer directory")
  flags.DEFINE_bool("json", False, "print one JSON object as the last line")


def token_logprobs(config, variables, tokens, apply_fn=None) -> np.ndarray:
  """log p(tokens[:, t] | tokens[:, :t]) for t = 1 … T−1: float32 [B, T−1]."""
  from k3jax.model import K3Model
  tokens = jnp.asarray(tokens, jnp.int32)
  if tokens.ndim == 1:
    tokens = tokens[None]
  config = config.for_inference()   # dropless MoE whatever capacity factor it trained with
  apply_fn = apply_fn or jax.jit(K3Model(config).apply)
  logits = apply_fn(variables, tokens).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  return np.asarray(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0])


def _tokenize(text: str, tokenizer: str, vocab_size: int) -> tuple[list[int], list[str]]:
  if tokenizer == "bytes":
    ids = list(text.encode("utf-8"))
    if vocab_size < 256:
      raise ValueError(f"--tokenizer bytes needs vocab_size >= 256, model has {vocab_size}")
    return ids, [repr(bytes([i]))[2:-1] for i in ids]
  from transformers import AutoTokenizer  # optional: only for real tokenizers on disk
  tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
  ids = tok.encode(text, add_special_tokens=False)
  return ids, [tok.decode([i]) for i in ids]


def main(argv):
  del argv
  from k3jax.convert.checkpoint import load_pretrained
  if not FLAGS.ckpt or (FLAGS.text is None) == (FLAGS.tokens is None):
    raise app.UsageError("--ckpt and exactly one of --text / --tokens are required")
  config, variables = load_pretrained(FLAGS.ckpt)
  if FLAGS.tokens is not None:
    ids = [int(t) for t in FLAGS.tokens.split(",")]
    pieces = [str(i) for i in ids]
  else:
    ids, pieces = _tokenize(FLAGS.text, FLAGS.tokenizer, config.text.vocab_size)
  if len(ids) < 2:
    raise app.UsageError("need at least 2 tokens to score")
  lp = token_logprobs(config, variables, np.asarray(ids))[0]
  print(f"{'pos':>4} {'token':>10} {'id':>7} {'log p':>10}")
  for t, (i, piece, v) in enumerate(zip(ids[1:], pieces[1:], lp), start=1):
    print(f"{t:>4} {piece[:10]:>10} {i:>7} {v:>10.4f}")
  nll = float(-lp.sum())
  print(f"tokens scored: {len(lp)}  total NLL: {nll:.4f}  mean: {nll / len(lp):.4f}  "
        f"perplexity: {np.exp(nll / len(lp)):.3f}")
  if FLAGS.json:
    print(json.dumps({"ckpt": FLAGS.ckpt, "tokens": ids, "logprobs": [float(x) for x in lp],
                      "nll": nll, "perplexity": float(np.exp(nll / len(lp)))}))


if __name__ == "__main__":
  _define_flags()
  app.run(main)
