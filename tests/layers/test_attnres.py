"""AttnResMixer module: zero-init pseudo-query, buffer + partial equals the op over the union."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import preset
from k3jax.layers.attnres import AttnResMixer
from k3jax.ops.attnres import attn_res_mix


def test_mixer_init_and_values():
  cfg = preset("tiny")
  rng = np.random.default_rng(0)
  blocks = jnp.asarray(rng.normal(size=(4, 2, 3, cfg.text.d_model)).astype(np.float32))
  partial = jnp.asarray(rng.normal(size=(2, 3, cfg.text.d_model)).astype(np.float32))
  valid = jnp.array([True, True, False, False])
  mod = AttnResMixer(cfg)
  v = nn.unbox(mod.init(jax.random.key(0), blocks, partial, valid))
  np.testing.assert_array_equal(v["params"]["proj"], np.zeros(cfg.text.d_model))
  np.testing.assert_array_equal(v["params"]["norm"], np.ones(cfg.text.d_model))
  # zero pseudo-query: uniform mean over the valid blocks and the partial
  np.testing.assert_allclose(mod.apply(v, blocks, partial, valid),
                             (blocks[0] + blocks[1] + partial) / 3, rtol=1e-5, atol=1e-6)
  # trained values: same as the op over [valid blocks…, partial]
  v = {"params": {"proj": jnp.asarray(rng.normal(size=cfg.text.d_model).astype(np.float32)),
                  "norm": jnp.asarray(rng.uniform(0.5, 1.5, cfg.text.d_model).astype(np.float32))}}
  ref = attn_res_mix(jnp.concatenate([blocks[:2], partial[None]]), v["params"]["proj"],
                     v["params"]["norm"])
  np.testing.assert_allclose(mod.apply(v, blocks, partial, valid), ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(mod.apply(v, None, partial), partial, rtol=1e-6)
