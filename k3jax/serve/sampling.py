"""Token sampling: greedy, temperature, top-k, top-p; stop tokens and stop strings.

Everything that turns logits into a distribution lives in `sampling_probs`, so the plain sampler
and speculative decoding's rejection sampler (k3jax/serve/speculative.py) draw from exactly the
same filtered distribution. All of it is fp32 and seeded by an explicit `jax.random` key: the
same key and logits give the same tokens on every run.

Conventions
- `temperature == 0` means greedy (argmax); `top_k == 0` and `top_p == 1.0` disable the filters.
- Filters apply in the order temperature → top-k → top-p (top-p over the top-k survivors,
  renormalised), as in common serving stacks.
- Ties in top-k / top-p are broken by token id (lower id first) via a stable sort, so the kept set
  is deterministic.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to pick the next token and when to stop.

  temperature: 0 = greedy; > 0 divides the logits.
  top_k: keep the k most likely tokens (0 = all).
  top_p: keep the smallest most-likely set whose probability reaches top_p (1.0 = all).
  stop_tokens: generation ends at any of these ids (the stop token is not part of the output).
  stop_strings: generation ends once the decoded text contains one of these (text is cut before it).
  """
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  stop_tokens: tuple[int, ...] = ()
  stop_strings: tuple[str, ...] = ()

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"SamplingParams.temperature: expected >= 0, found {self.temperature}")
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"SamplingParams.top_k: expected an int >= 0, found {self.top_k!r}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SamplingParams.top_p: expected a value in (0, 1], found {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def _descending_order(logits: jax.Array) -> jax.Array:
  """Indices sorting each row by descending logit, ties by ascending token id ([..., V])."""
  # argsort is stable: sorting -logits keeps lower ids first among equal logits.
  return jnp.argsort(-logits, axis=-1, stable=True)


def filter_logits(logits: jax.Array, *, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> jax.Array:
  """Temperature-scaled fp32 logits with filtered-out tokens set to -inf.

  logits: [..., V]. Returns [..., V] float32. `temperature` must be > 0 here (greedy is handled
  by the callers, which take the argmax of the raw logits).
  """
  if temperature <= 0:
    raise ValueError(f"temperature: filter_logits needs > 0, found {temperature}")
  x = logits.astype(jnp.float32) / jnp.float32(temperature)
  vocab = x.shape[-1]
  if top_k == 0 and top_p >= 1.0:
    return x
  order = _descending_order(x)
  sorted_x = jnp.take_along_axis(x, order, axis=-1)
  rank = jnp.arange(vocab)
  keep_sorted = jnp.ones(sorted_x.shape, bool)
  if top_k:
    keep_sorted &= rank < min(top_k, vocab)
    sorted_x = jnp.where(keep_sorted, sorted_x, -jnp.inf)
  if top_p < 1.0:
    probs = jax.nn.softmax(sorted_x, axis=-1)
    # Keep a token when the mass strictly before it is below top_p: the smallest set reaching
    # top_p, and always at least the most likely token.
    before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted &= before < top_p
  # Scatter the sorted-order mask back to vocabulary order.
  keep = jnp.zeros_like(keep_sorted).at[
      tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(keep_sorted)
  return jnp.where(keep, x, -jnp.inf)


def sampling_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """The distribution the sampler draws from: [..., V] float32 probabilities.

  Greedy gives a one-hot at the argmax (lowest id among ties).
  """
  if params.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(filter_logits(logits, temperature=params.temperature,
                                      top_k=params.top_k, top_p=params.top_p), axis=-1)


def sample(key: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Draw one token per row. logits: [..., V] → int32 [...]."""
  if params.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  x = filter_logits(logits, temperature=params.temperature, top_k=params.top_k,
                    top_p=params.top_p)
  return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)


def _filtered_rows(logits, temperature, top_k, top_p):
  """fp32 logits [B, V] → (temperature-scaled logits with the filtered-out tokens at -inf,
  hot [B]: the rows that sample (temperature > 0)); `filter_logits` per row with traced
  parameters."""
  x = logits.astype(jnp.float32)
  vocab = x.shape[-1]
  hot = temperature > 0
  scaled = x / jnp.where(hot, temperature, 1.0).astype(jnp.float32)[:, None]
  order = _descending_order(scaled)
  sorted_x = jnp.take_along_axis(scaled, order, axis=-1)
  rank = jnp.arange(vocab)[None]
  keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
  probs = jax.nn.softmax(jnp.where(keep, sorted_x, -jnp.inf), axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs
  keep &= (top_p[:, None] >= 1.0) | (before < top_p[:, None])
  keep_vocab = jnp.zeros_like(keep).at[jnp.arange(x.shape[0])[:, None], order].set(keep)
  return jnp.where(keep_vocab, scaled, -jnp.inf), hot


def row_keys(seeds: jax.Array, counters: jax.Array) -> jax.Array:
  """Per-row keys fold_in(PRNGKey(seeds[b]), counters[b]): [B] uint32, [B] int → [B, 2]."""
  return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(
      seeds.astype(jnp.uint32), counters.astype(jnp.int32))


def probs_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
               top_p: jax.Array) -> jax.Array:
  """The distribution each row samples from (`sampling_probs` with per-row parameters):
  logits [B, V] → probabilities [B, V] fp32; greedy rows (temperature 0) a one-hot."""
  filtered, hot = _filtered_rows(logits, temperature, top_k, top_p)
  greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  return jnp.where(hot[:, None], jax.nn.softmax(filtered, axis=-1), greedy)


LOGPROBS = ("model", "sampling")


def logprobs_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array, of: str = "model") -> jax.Array:
  """Log-probabilities [B, V] fp32 that a row reports for its tokens. of="model": the
  model's own distribution, log_softmax(logits); of="sampling": the distribution the row
  samples from (`probs_rows`: temperature, top-k and top-p applied; -inf outside the kept
  tokens), what an RL update needs as the behaviour policy's log-prob at a temperature other
  than 1. Greedy rows (temperature 0) report the model's own in both."""
  x = logits.astype(jnp.float32)
  filtered_hot = _filtered_rows(x, temperature, top_k, top_p) if of == "sampling" else None
  return _logprobs_of(x, filtered_hot, of)


def _logprobs_of(x, filtered_hot, of: str):
  """`logprobs_rows` from fp32 logits and, for of="sampling", `_filtered_rows`' (filtered,
  hot) already computed (the sampler has them)."""
  if of not in LOGPROBS:
    raise ValueError(f"logprobs: expected one of {LOGPROBS}, found {of!r}")
  own = jax.nn.log_softmax(x, axis=-1)
  if of == "model":
    return own
  filtered, hot = filtered_hot
  return jnp.where(hot[:, None], jax.nn.log_softmax(filtered, axis=-1), own)


def sample_rows(logits: jax.Array, seeds: jax.Array, counters: jax.Array,
                temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                num_top: int = 0, keys: jax.Array | None = None, logprobs: str = "model"):
  """Per-row sampling with per-row parameters (the serving engine; traced, one compiled shape).

  logits [B, V]; seeds [B] uint32 and counters [B] int32 (row b draws with the key
  fold_in(PRNGKey(seeds[b]), counters[b]) — a request's n-th token depends on its seed and n
  alone — or with `keys` [B, 2] when given); temperature [B] (0: greedy), top_k [B] int (0:
  off), top_p [B] (1: off) — the semantics of `filter_logits`. Every operation acts on one row
  at a time, so a row's draw never depends on the other rows.

  Returns (tokens [B] int32, logprobs [B] fp32 at the tokens, and with `num_top` the top
  (ids [B, num_top], logprobs [B, num_top]), else None), the log-probs of the distribution
  `logprobs` names (`logprobs_rows`: the model's own by default).
  """
  x = logits.astype(jnp.float32)
  filtered, hot = _filtered_rows(x, temperature, top_k, top_p)
  keys = row_keys(seeds, counters) if keys is None else keys
  drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, filtered)
  tokens = jnp.where(hot, drawn, jnp.argmax(x, axis=-1)).astype(jnp.int32)
  logp = _logprobs_of(x, (filtered, hot), logprobs)
  chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
  if not num_top:
    return tokens, chosen, None
  top_lp, top_ids = jax.lax.top_k(logp, num_top)
  return tokens, chosen, (top_ids.astype(jnp.int32), top_lp)


class StopChecker:
  """Host-side stop detection for one sequence (stop tokens and stop strings).

  Feed generated token ids one at a time with `add`; it returns True once the sequence must stop.
  `tokens` / `text` give the output with the stop token / stop string (and anything after it) cut.
  `decode` maps a list of ids to text (needed only for stop strings).
  """

  def __init__(self, params: SamplingParams, decode=None):
    if params.stop_strings and decode is None:
      raise ValueError("decode: stop_strings need a decode function")
    self._params = params
    self._decode = decode
    self._stop_ids = frozenset(int(t) for t in params.stop_tokens)
    self.tokens: list[int] = []
    self.stopped = False
    self.reason: str | None = None
    self._text: str | None = None

  def add(self, token: int) -> bool:
    if self.stopped:
      return True
    token = int(token)
    if token in self._stop_ids:
      self.stopped, self.reason = True, "stop_token"
      return True
    self.tokens.append(token)
    if self._params.stop_strings:
      text = self._decode(self.tokens)
      cut = _first_stop(text, self._params.stop_strings)
      if cut is not None:
        self.stopped, self.reason, self._text = True, "stop_string", text[:cut]
        return True
    return False

  @property
  def text(self) -> str:
    if self._text is not None:
      return self._text
    if self._decode is None:
      raise ValueError("decode: StopChecker.text needs a decode function")
    return self._decode(self.tokens)


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
  hits = [text.find(s) for s in stops if s]
  hits = [h for h in hits if h >= 0]
  return min(hits) if hits else None


__all__ = ["SamplingParams", "filter_logits", "sampling_probs", "sample", "sample_rows",
           "LOGPROBS", "logprobs_rows", "probs_rows", "row_keys", "StopChecker"]
