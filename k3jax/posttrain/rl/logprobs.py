"""The trainer's log-probabilities of sampled tokens, through the training forward.

A sequence row holds prompt then response, right-padded: seqs[b, :P_b] is the prompt and
seqs[b, P_b:P_b+L_b] the response. The response token j is predicted at position P_b+j−1, so

  logp[b, j] = log_softmax(logits[b, P_b+j−1] / temperature)[seqs[b, P_b+j]]   (fp32)

for j < L_b (0 elsewhere). The rollout (k3jax/posttrain/rl/rollout.py) records the same quantity from the
decode path (KDA recurrent state and MLA cache); `mismatch` is their largest difference over
the real tokens, the train–inference mismatch RL practitioners watch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.model import K3Model


def response_logprobs(logits: jax.Array, seqs: jax.Array, prompt_lens: jax.Array,
                      resp_width: int, temperature: float = 1.0) -> jax.Array:
  """logits fp32 [B,W,V] of seqs [B,W] → logp [B,resp_width] (module doc; unmasked)."""
  j = jnp.arange(resp_width)
  pos = prompt_lens[:, None].astype(jnp.int32) + j[None] - 1           # predicting position
  w = seqs.shape[1]
  pos_c = jnp.clip(pos, 0, w - 1)
  tgt = jnp.take_along_axis(seqs, jnp.clip(pos + 1, 0, w - 1), axis=1)  # [B, L]
  x = jnp.take_along_axis(logits, pos_c[..., None], axis=1).astype(jnp.float32) / temperature
  lp = jax.nn.log_softmax(x, axis=-1)
  return jnp.take_along_axis(lp, tgt[..., None], axis=-1)[..., 0]


def model_logits(config: ModelConfig, variables, seqs: jax.Array, media=None) -> jax.Array:
  """The training forward's logits fp32 [B,W,V] (router statistics discarded); `media`: the
  rows' media streams (`k3jax.vision.media.Media`) for a multimodal model's placeholders."""
  logits, _ = K3Model(config).apply(variables, seqs, mutable=["stats"], media=media)
  return logits


@functools.lru_cache(maxsize=None)
def _jitted(config: ModelConfig, resp_width: int, temperature: float):
  def f(variables, seqs, prompt_lens, media):
    return response_logprobs(model_logits(config, variables, seqs, media), seqs, prompt_lens,
                             resp_width, temperature)
  return jax.jit(f)


def token_logprobs(config: ModelConfig, variables, seqs, prompt_lens, resp_width: int,
                   temperature: float = 1.0, media=None) -> np.ndarray:
  """logp [B, resp_width] fp32 of the responses in `seqs` [B,W] (module doc). `media`: the
  rows' media (one stream a row, as the update's `batch["media"]`), needed when the rows
  hold media placeholders; the variables then include the vision tower's."""
  seqs = np.asarray(seqs, np.int32)
  prompt_lens = np.asarray(prompt_lens, np.int32)
  if seqs.ndim != 2 or prompt_lens.shape != seqs.shape[:1]:
    raise ValueError(f"seqs/prompt_lens: expected [B,W] and [B], found {seqs.shape} and "
                     f"{prompt_lens.shape}")
  if (prompt_lens < 1).any() or (prompt_lens + resp_width > seqs.shape[1]).any():
    raise ValueError(f"prompt_lens: need 1 <= P and P + resp_width ({resp_width}) <= W "
                     f"({seqs.shape[1]}), found {prompt_lens.tolist()}")
  if seqs.min() < 0 or seqs.max() >= config.text.vocab_size:
    raise ValueError(f"seqs: token ids must be in [0, vocab_size={config.text.vocab_size})")
  if media is not None and config.vision is None:
    raise ValueError("token_logprobs: media given, but the model has no vision tower "
                     "(config.vision is None)")
  variables = {k: v for k, v in dict(variables).items() if k in ("params", "balance")}
  return np.asarray(_jitted(config, int(resp_width), float(temperature))(
      variables, jnp.asarray(seqs), jnp.asarray(prompt_lens),
      None if media is None else jax.tree.map(jnp.asarray, media)))


def mismatch(a, b, lengths) -> float:
  """max |a − b| over the real response tokens (j < lengths[b]); 0 when there are none."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  mask = np.arange(a.shape[1])[None] < np.asarray(lengths)[:, None]
  return float(np.abs(a - b)[mask].max()) if mask.any() else 0.0
