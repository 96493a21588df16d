"""Sampling: filtered distributions against a plain numpy reference, seeded draws, stop rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.serve.sampling import (SamplingParams, StopChecker, filter_logits, logprobs_rows,
                                  sample, sample_rows, sampling_probs)


def _ref_probs(logits, temperature, top_k, top_p):
  """Obviously-correct reference: loop over the sorted tokens one by one."""
  x = np.asarray(logits, np.float64) / temperature
  order = sorted(range(len(x)), key=lambda i: (-x[i], i))
  keep = order[:top_k] if top_k else order
  p = np.exp(x[keep] - x[keep].max())
  p /= p.sum()
  kept, mass = [], 0.0
  for i, pi in zip(keep, p):
    if mass >= top_p:
      break
    kept.append(i)
    mass += pi
  out = np.zeros(len(x))
  z = np.exp(x[kept] - x[kept].max())
  out[kept] = z / z.sum()
  return out


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.6), (1.3, 5, 0.8), (0.5, 1, 1.0)])
def test_sampling_probs_match_reference(temperature, top_k, top_p):
  logits = jax.random.normal(jax.random.PRNGKey(0), (3, 11)) * 2
  logits = logits.at[1, 4].set(logits[1, 7])  # a tie
  got = sampling_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
  for row in range(3):
    np.testing.assert_allclose(got[row], _ref_probs(logits[row], temperature, top_k, top_p),
                               atol=1e-6)


def test_row_log_probs_of_the_model_or_of_the_sampling_distribution():
  """sample_rows(logprobs="sampling"): each row's log-probs are those of the distribution it
  samples from (the numpy reference: its temperature, top-k, top-p), at the drawn token and
  in its top pairs; greedy rows and logprobs="model" give log_softmax of the raw logits."""
  logits = jax.random.normal(jax.random.PRNGKey(1), (4, 11)) * 2
  temperature = jnp.array([0.7, 1.3, 0.0, 1.0])
  top_k, top_p = jnp.array([0, 5, 0, 3]), jnp.array([1.0, 0.8, 1.0, 1.0])
  seeds, counters = jnp.arange(4, dtype=jnp.uint32), jnp.zeros(4, jnp.int32)
  own = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  tok_m, lp_m, _ = sample_rows(logits, seeds, counters, temperature, top_k, top_p)
  tok_s, lp_s, (top_ids, top_lp) = sample_rows(logits, seeds, counters, temperature, top_k,
                                               top_p, num_top=2, logprobs="sampling")
  np.testing.assert_array_equal(tok_m, tok_s)             # the same draws either way
  for b in range(4):
    t = int(tok_s[b])
    np.testing.assert_allclose(lp_m[b], own[b, t], atol=1e-6)
    if float(temperature[b]) == 0.0:
      ref = own[b]
    else:
      with np.errstate(divide="ignore"):
        ref = np.log(_ref_probs(logits[b], float(temperature[b]), int(top_k[b]),
                                float(top_p[b])))
    np.testing.assert_allclose(lp_s[b], ref[t], atol=1e-5)
    np.testing.assert_allclose(top_lp[b], ref[np.asarray(top_ids[b])], atol=1e-5)
  assert abs(float(lp_s[0]) - float(lp_m[0])) > 1e-3      # tempered ≠ the model's own
  with pytest.raises(ValueError, match="logprobs: expected one of"):
    logprobs_rows(logits, temperature, top_k, top_p, "tempered")


def test_greedy_is_argmax_and_one_hot():
  logits = jnp.array([[0.1, 2.0, 2.0, -1.0], [5.0, 0.0, 1.0, 4.9]])
  params = SamplingParams(temperature=0.0)
  np.testing.assert_array_equal(sample(jax.random.PRNGKey(1), logits, params), [1, 0])
  np.testing.assert_array_equal(sampling_probs(logits, params),
                                [[0, 1, 0, 0], [1, 0, 0, 0]])


def test_sample_frequencies_follow_filtered_distribution_and_are_seeded():
  logits = jnp.array([1.0, 0.5, 0.0, -0.5, -3.0, 2.0])
  params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
  n = 20000
  draws = sample(jax.random.PRNGKey(3), jnp.broadcast_to(logits, (n, 6)), params)
  again = sample(jax.random.PRNGKey(3), jnp.broadcast_to(logits, (n, 6)), params)
  np.testing.assert_array_equal(draws, again)
  freq = np.bincount(np.asarray(draws), minlength=6) / n
  ref = _ref_probs(logits, 0.8, 4, 0.9)
  assert np.all(freq[ref == 0] == 0)
  # 5 standard errors of a binomial proportion.
  np.testing.assert_array_less(np.abs(freq - ref), 5 * np.sqrt(ref * (1 - ref) / n) + 1e-9)


def test_filter_logits_masks_with_minus_inf():
  x = filter_logits(jnp.array([3.0, 2.0, 1.0]), temperature=1.0, top_k=2)
  assert np.isneginf(x[2]) and np.isfinite(x[:2]).all()


def test_bad_params():
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams(temperature=-1)
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)
  with pytest.raises(ValueError, match="top_k"):
    SamplingParams(top_k=-2)


def test_stop_token_and_stop_string():
  decode = lambda ids: "".join(chr(i) for i in ids)
  s = StopChecker(SamplingParams(stop_tokens=(0,)), decode)
  assert [s.add(t) for t in [104, 105, 0, 106]] == [False, False, True, True]
  assert s.tokens == [104, 105] and s.text == "hi" and s.reason == "stop_token"
  s = StopChecker(SamplingParams(stop_strings=("lo w", "zz")), decode)
  out = [s.add(ord(c)) for c in "hello world"]
  assert out.index(True) == 6 and s.text == "hel" and s.reason == "stop_string"
  with pytest.raises(ValueError, match="decode"):
    StopChecker(SamplingParams(stop_strings=("x",)))
