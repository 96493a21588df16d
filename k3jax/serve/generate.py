"""Inference orchestration: prefill, decode steps and the sampling loop over `K3Model.extend`.

The model decodes through its own layers (`K3Model.extend`, caches in k3jax/cache.py); this
module only checks inputs, chooses shapes (prefill chunks of one compiled shape, one-token
decode steps), keeps the jitted functions and samples. Speculative decoding with MTP drafts is
`k3jax.serve.speculative`. Serving many requests (slots, paged latents, the prefix cache) is
`k3jax.serve.engine`, which is tested against this module.

Rows of a batch may have different lengths: every call feeds T tokens per row of which the
first num_new[b] are real (right padding); padded tokens change no cache.

Images and videos: `prefill(..., media=)` / `generate(..., media=)` (a multimodal model:
`config.vision`); the prompts hold one placeholder per projected vision token, and the decode
steps that follow are text only.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.cache import Cache, KDACache, MLACache
from k3jax.config import ModelConfig
from k3jax.model import K3Model
from k3jax.serve.sampling import SamplingParams, StopChecker, sample
from k3jax.vision.media import Media, check_placeholders


def unbox(variables) -> dict:
  """Plain arrays (drops flax's logical-partitioning boxes)."""
  return nn.meta.unbox(dict(variables))


def init_cache(config: ModelConfig, batch: int, max_len: int) -> Cache:
  """A zero cache for `batch` sequences of up to `max_len` tokens (`K3Model.init_cache`)."""
  return K3Model(config).init_cache(batch, max_len)


def forward(config: ModelConfig, variables, cache: Cache, tokens, num_new, *,
            path: str = "chunked", media: Media | None = None):
  """Feed tokens [B,T] (the first num_new[b] of row b are real) on top of `cache`; `media`
  (a `k3jax.vision.media.Media`) fills the placeholder tokens among them.

  Returns (logits fp32 [B,T,vocab], hidden fp32 [B,T,d] (the MTP layer's feature input:
  before the final norm, or the EAGLE-3 fusion), new cache, aux). path="chunked": aux is
  None. path="step": the KDA layers run token by token and aux (their "rewind" collection) lets `serving.speculative.rewind` keep
  any prefix of the tokens. The MoE runs dropless (`config.for_inference()`).
  """
  if path not in ("chunked", "step"):
    raise ValueError(f"path: expected 'chunked' or 'step', found {path!r}")
  model = K3Model(config.for_inference())
  args = (variables, tokens.astype(jnp.int32), cache, num_new.astype(jnp.int32), media)
  if path == "step":
    (logits, hidden, cache), aux = model.apply(*args, method=K3Model.extend, mutable=["rewind"])
    return logits, hidden, cache, aux["rewind"]
  logits, hidden, cache = model.apply(*args, method=K3Model.extend)
  return logits, hidden, cache, None


def draft(config: ModelConfig, variables, cache: Cache, hidden, next_tokens, num_new, *,
          return_hidden: bool = False):
  """The MTP layer over new positions (`K3Model.draft`) → (logits fp32 [B,T,vocab], cache),
  with `return_hidden` (logits, the draft's pre-norm hidden [B,T,d], cache)."""
  return K3Model(config.for_inference()).apply(
      variables, hidden, next_tokens.astype(jnp.int32), cache, num_new.astype(jnp.int32),
      return_hidden, method=K3Model.draft)


# One compiled function per (config, path); shapes are kept fixed by the callers below.
@functools.lru_cache(maxsize=None)
def _jitted(config: ModelConfig, path: str):
  return jax.jit(functools.partial(forward, config, path=path))


@functools.lru_cache(maxsize=None)
def _jitted_draft(config: ModelConfig):
  """`draft` with the draft's hidden state (what speculative decoding chains on)."""
  return jax.jit(functools.partial(draft, config, return_hidden=True))


@functools.lru_cache(maxsize=None)
def decode_fn(config: ModelConfig):
  """The jitted one-token decode step of `config` (cached per config): (variables, cache,
  token [B], num_new [B]) → (logits [B,V], hidden [B,d], cache, None)."""
  def one(variables, cache, token, n):
    logits, h, new, _ = forward(config, variables, cache, token[:, None], n)
    return logits[:, 0], h[:, 0], new, None
  return jax.jit(one)


def check_token_ids(config: ModelConfig, tokens, what: str = "tokens") -> None:
  arr = np.asarray(tokens)
  if arr.size and (arr.min() < 0 or arr.max() >= config.text.vocab_size):
    raise ValueError(f"{what}: token ids must be in [0, vocab_size={config.text.vocab_size}), found "
                     f"[{arr.min()}, {arr.max()}]")


def prefill(config: ModelConfig, variables, tokens, lengths, *, max_len: int | None = None,
            cache: Cache | None = None, chunk: int | None = None, return_all: bool = False,
            media: Media | None = None):
  """Feed prompts chunk by chunk of `chunk` tokens (default min(T, 512)).

  Every chunk has the same shape (the last one is padded), so one compilation serves all.
  `media`: the prompts' images/videos (`k3jax.vision.media.Media`), one projected token per
  `config.media_placeholder_token_id` in the prompts, in order (row-major over [B, T]); the
  prompts then go in as one chunk (the placeholders are matched within one `extend` call), and
  the count is checked here (`check_placeholders`) since the jitted forward cannot.

  tokens: [B,T] int, row b's prompt in its first lengths[b] entries (right padding).
  max_len: cache capacity (default T) when `cache` is None; with `cache`, the prompts are
  appended to it (continuing a prefix). Returns (last_logits fp32 [B,vocab] at each prompt's
  last token, cache) — or (logits [B,T,vocab], hidden [B,T,d], cache) with return_all.
  """
  variables = unbox(variables)
  tokens = np.asarray(tokens)
  lengths = np.asarray(lengths, np.int32)
  if tokens.ndim != 2 or lengths.shape != tokens.shape[:1]:
    raise ValueError(f"tokens/lengths: expected [B,T] and [B], found {tokens.shape} and "
                     f"{lengths.shape}")
  b, t = tokens.shape
  if (lengths < 1).any():
    raise ValueError(f"lengths: every prompt needs at least one token, found {lengths.tolist()}")
  if (lengths > t).any():
    raise ValueError(f"lengths: must be <= T={t}, found {lengths.tolist()}")
  check_token_ids(config, np.concatenate([tokens[i, :lengths[i]] for i in range(b)]))
  if cache is None:
    cache = init_cache(config, b, max_len or t)
  have = np.asarray(cache.lengths)
  if (have + lengths > cache.max_len).any():
    raise ValueError(f"tokens: prompt of {(have + lengths).max()} tokens (with the cached "
                     f"prefix) exceeds the cache capacity max_len={cache.max_len}")
  if media is not None:
    if config.vision is None:
      raise ValueError("media: the model has no vision tower (config.vision is None: a "
                       "text-only model)")
    real = np.concatenate([tokens[i, :lengths[i]] for i in range(b)])[None]
    check_placeholders(real, media, config.media_placeholder_token_id, "prefill")
    chunk = t
  fwd = _jitted(config, "chunked")
  chunk = chunk or min(t, 512)
  outs, last = [], None
  for s in range(0, t, chunk):
    part = tokens[:, s:s + chunk]
    n = np.clip(lengths - s, 0, part.shape[1]).astype(np.int32)
    if part.shape[1] < chunk:   # one compiled shape for every chunk (the tail is padded)
      part = np.pad(part, ((0, 0), (0, chunk - part.shape[1])))
    logits, hidden, cache, _ = fwd(variables, cache, jnp.asarray(part), jnp.asarray(n),
                                   media=media)
    if return_all:
      outs.append((logits[:, :min(chunk, t - s)], hidden[:, :min(chunk, t - s)]))
    else:
      idx = np.clip(lengths - 1 - s, 0, part.shape[1] - 1)
      sel = jnp.take_along_axis(logits, jnp.asarray(idx)[:, None, None], 1)[:, 0]
      here = jnp.asarray((lengths - 1 >= s) & (lengths - 1 < s + part.shape[1]))[:, None]
      last = sel if last is None else jnp.where(here, sel, last)
  if return_all:
    return (jnp.concatenate([o[0] for o in outs], 1), jnp.concatenate([o[1] for o in outs], 1),
            cache)
  return last, cache


def decode_step(config: ModelConfig, variables, cache: Cache, token, active=None):
  """Feed one token per sequence ([B] int). Returns (logits fp32 [B,vocab], new cache).

  `active` [B] bool (default all): inactive rows leave their cache untouched. Jitted once per
  (config, batch, max_len): static shapes.
  """
  token = jnp.asarray(token, jnp.int32)
  n = jnp.ones(token.shape, jnp.int32) if active is None else jnp.asarray(active, jnp.int32)
  logits, _, cache, _ = decode_fn(config)(unbox(variables), cache, token, n)
  return logits, cache


def padded_prompts(prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
  """Prompts → (tokens [B, longest] int32 right-padded, lengths [B]); empty prompts refused."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("prompts: expected non-empty prompts, found an empty one")
  lengths = np.array([len(p) for p in prompts], np.int32)
  tokens = np.zeros((len(prompts), int(lengths.max())), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  return tokens, lengths


def generate(config: ModelConfig, variables, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, sampling: SamplingParams = SamplingParams(), seed: int = 0,
             max_len: int | None = None, decode: Callable | None = None,
             on_token: Callable[[int, int], None] | None = None,
             media: Media | None = None) -> list[list[int]]:
  """Sample continuations of a batch of prompts (different lengths allowed); `media` fills
  the prompts' placeholder tokens at prefill (`prefill`).

  Returns the generated tokens of each prompt (without stop tokens). `on_token(row, token)` is
  called for every emitted token (streaming). `decode` (ids → text) is needed for stop strings.
  """
  toks, lengths = padded_prompts(prompts)
  if max_new_tokens < 0:
    raise ValueError(f"max_new_tokens: expected >= 0, found {max_new_tokens}")
  need = int(lengths.max()) + max_new_tokens
  max_len = max_len or need
  if need > max_len:
    raise ValueError(f"prompts: longest prompt ({lengths.max()}) + max_new_tokens "
                     f"({max_new_tokens}) exceeds the cache capacity max_len={max_len}")
  checkers = [StopChecker(sampling, decode) for _ in prompts]
  if max_new_tokens == 0:
    return [[] for _ in prompts]
  variables = unbox(variables)
  logits, cache = prefill(config, variables, toks, lengths, max_len=max_len, media=media)
  key = jax.random.PRNGKey(seed)
  for step in range(max_new_tokens):
    key, sub = jax.random.split(key)
    tok = np.asarray(sample(sub, logits, sampling))
    active = np.zeros(len(prompts), bool)
    for i, c in enumerate(checkers):
      if not c.stopped:
        stopped = c.add(tok[i])
        if not stopped and on_token is not None:
          on_token(i, int(tok[i]))
        active[i] = not stopped
    if not active.any() or step == max_new_tokens - 1:
      break
    logits, cache = decode_step(config, variables, cache, tok, active)
  return [c.tokens for c in checkers]


__all__ = ["Cache", "KDACache", "MLACache", "init_cache", "forward", "draft", "prefill",
           "decode_step", "generate", "padded_prompts", "check_token_ids", "unbox"]
