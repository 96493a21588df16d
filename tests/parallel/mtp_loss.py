"""The language-model loss with the MTP term that the parallel tests hold sharded against one
device."""

import jax

from k3jax.model import K3Model
from k3jax.train.step import cross_entropy

MTP_WEIGHT = 0.3


def loss_and_grads(config, variables, batch, t: int):
  """(loss, logits, MTP logits [B, t−1, vocab], gradients of the params) over a packed batch
  of length t: next-token loss + MTP_WEIGHT × the MTP layer's loss."""
  def loss_fn(params):
    logits, mtp_logits = K3Model(config).apply(
        {"params": params, "balance": variables["balance"]}, batch["inputs"],
        segment_ids=batch["segment_ids"], return_mtp=True)
    s, n = cross_entropy(logits, batch["targets"], batch["loss_mask"])
    s2, n2 = cross_entropy(mtp_logits, batch["mtp_targets"][:, :t - 1],
                           batch["mtp_mask"][:, :t - 1])
    return s / n + MTP_WEIGHT * s2 / n2, (logits, mtp_logits)

  (loss, (logits, mtp_logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      variables["params"])
  return loss, logits, mtp_logits, grads
