"""AttnRes depth mixer module (docs/k3.md §5): owns a pseudo-query and an RMSNorm weight.

Params: `proj` [d] (the pseudo-query w, zeros init ⇒ uniform averaging at start) and
`norm` [d] (ones init). The math is `k3jax.ops.attnres`.
"""

from __future__ import annotations

import flax.linen as nn

from k3jax.layers.linear import param
from k3jax.ops import attnres as ar


class AttnResMixer(nn.Module):
  """Mixes a fixed-size block buffer and the running partial.

  __call__(blocks [N,B,T,d] or None, partial [B,T,d], valid [N] bool or None) → fp32 [B,T,d].
  Computed as the online-softmax merge of the mix over valid blocks and the partial, so the
  buffer is never concatenated with the partial.
  """
  config: object

  def setup(self):
    d = self.config.text.d_model
    self.proj = param(self, "proj", nn.initializers.zeros, (d,), ("embed",))
    self.norm = param(self, "norm", nn.initializers.ones, (d,), ("embed",))

  def __call__(self, blocks, partial, valid=None):
    w, n = self.proj, self.norm
    eps = self.config.text.rms_norm_eps
    mix = ar.attn_res_partial(partial[None], w, n, eps)
    if blocks is not None:
      mix = ar.attn_res_merge(ar.attn_res_partial(blocks, w, n, eps, valid), mix)
    return ar.attn_res_finalize(mix)


__all__ = ["AttnResMixer"]
