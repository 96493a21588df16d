"""Loading a model and its tokenizer for the entry points that generate (generate, serve).

No flags here: several entry points import it into one process.
"""

from __future__ import annotations

import os


def load_tokenizer(checkpoint: str | None, tokenizer: str | None, vocab_size: int):
  from k3jax.data.tokenizers import TiktokenTokenizer
  from k3jax.data.tokenizers import ByteTokenizer
  path = tokenizer or (checkpoint and os.path.join(checkpoint, "tiktoken.model"))
  if path and os.path.exists(path):
    return TiktokenTokenizer.from_dir(path)
  if tokenizer:
    raise ValueError(f"--tokenizer: {tokenizer} does not exist")
  return ByteTokenizer(vocab_size)


def load_model(checkpoint: str | None, preset_name: str | None):
  import jax
  import k3jax
  from k3jax.model import K3Model
  if checkpoint:
    return k3jax.load_pretrained(checkpoint)
  if not preset_name:
    raise ValueError("--checkpoint or --preset is required")
  cfg = k3jax.preset(preset_name)
  variables = jax.jit(K3Model(cfg).init)(jax.random.PRNGKey(0),
                                        jax.numpy.zeros((1, 4), jax.numpy.int32))
  return cfg, variables


__all__ = ["load_model", "load_tokenizer"]
