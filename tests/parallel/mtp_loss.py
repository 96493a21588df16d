"""The language-model loss with the MTP term that the parallel tests hold sharded against one
device."""

import jax
import jax.numpy as jnp

from k3jax.model import K3Model
from k3jax.train.step import cross_entropy

MTP_WEIGHT = 0.3


def loss_and_grads(config, variables, batch, t: int):
  """(loss, logits, MTP logits [B, t−1, vocab], gradients of the params) over a packed batch
  of length t: next-token loss + MTP_WEIGHT × the MTP layer's loss. The MTP layer runs as the
  trainer runs it (`mtp_full`: all t positions, sharded over context like the trunk; the last,
  a stand-in, masked and dropped from the returned logits)."""
  def loss_fn(params):
    logits, mtp_logits = K3Model(config).apply(
        {"params": params, "balance": variables["balance"]}, batch["inputs"],
        segment_ids=batch["segment_ids"], return_mtp=True, mtp_full=True)
    s, n = cross_entropy(logits, batch["targets"], batch["loss_mask"])
    mask = batch["mtp_mask"] * (jnp.arange(t) < t - 1)
    s2, n2 = cross_entropy(mtp_logits, batch["mtp_targets"], mask)
    return s / n + MTP_WEIGHT * s2 / n2, (logits, mtp_logits[:, :t - 1])

  (loss, (logits, mtp_logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      variables["params"])
  return loss, logits, mtp_logits, grads
