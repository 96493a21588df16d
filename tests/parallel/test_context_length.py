"""Context parallelism at length: a tiny model on a `context` = 8 mesh (8 simulated CPU
devices) at 8192 tokens equals the single-device run — the training step's loss, logits, MTP
logits and every device's shard of every gradient — and a chunked prefill through the serving
path on that mesh equals the full forward.

A 2-layer `tiny` (KDA + dense MLP, MLA + MoE, the MTP layer) keeps each compile short; one
row of 8192 tokens holding three documents (boundaries inside a shard and exactly at a shard's
first token). The step is plain SGD on CE + 0.3 · MTP CE, so the updated parameters compare
the gradients themselves.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax import sharding
from k3jax.config import preset
from k3jax.data import corpus as data_lib
from k3jax.data import tokenizers
from k3jax.model import K3Model
from k3jax.serve import generate

from parallel.mtp_loss import loss_and_grads

T = 8192
CONTEXT = 8


def _config():
  # The long-row attention (latents gathered, keys expanded a block at a time): 1024-query
  # blocks each visit only the key blocks up to their own last position.
  return preset("tiny", num_layers=2, num_mtp_layers=1, mla_key_block=1024,
                mla_query_block=1024)


def _batch():
  rng = np.random.default_rng(0)
  w = rng.integers(0, 256, size=(1, T + 2))
  w[0, 0] = tokenizers.BOS
  w[0, 3001] = tokenizers.BOS                 # inside shard 2 (1024 tokens a shard)
  w[0, 5 * T // CONTEXT] = tokenizers.BOS     # exactly at shard 5's first token
  return {k: jnp.asarray(v) for k, v in data_lib.pack_windows(w).items()}


def _grads(config, variables, batch):
  """(loss, logits, MTP logits, gradients of the params)."""
  return loss_and_grads(config, variables, batch, T)


@functools.lru_cache(maxsize=None)
def _setup():
  config = _config()
  batch = _batch()
  boxed = jax.eval_shape(K3Model(config).init, jax.random.PRNGKey(0),
                         jnp.zeros((1, 8), jnp.int32))
  variables = nn.unbox(jax.jit(K3Model(config).init)(jax.random.PRNGKey(0),
                                                      jnp.zeros((1, 8), jnp.int32)))
  variables = {"params": variables["params"], "balance": variables["balance"]}
  return config, boxed, variables, batch


def _close(a, b, what, tol=1e-5):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  scale = max(float(np.max(np.abs(b))), 1e-6)
  err = float(np.max(np.abs(a - b))) / scale
  assert err <= tol, f"{what}: max error / max |ref| = {err:.2e}"


def test_train_step_at_8k_on_context_8_equals_single_device():
  config, boxed, variables, batch = _setup()
  ref = jax.device_get(jax.jit(functools.partial(_grads, config))(variables, batch))
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, context=CONTEXT))
  sharding.check_shapes(config, mesh, batch_size=1, seq_len=T)
  var_sh = sharding.param_shardings(mesh, {c: boxed[c] for c in ("params", "balance")})
  b_sh = sharding.batch_shardings(mesh, batch)
  fn = jax.jit(functools.partial(_grads, config), in_shardings=(var_sh, b_sh),
               out_shardings=(None, sharding.batch_sharding(mesh, 3), None, var_sh["params"]))
  with jax.set_mesh(mesh):
    loss, logits, mtp_logits, grads = fn(sharding.put_batch(variables, var_sh), batch)
  assert logits.sharding.spec[1] == "context"     # each device holds T / 8 positions
  _close(loss, ref[0], "loss")
  _close(logits, ref[1], "logits")
  assert mtp_logits.shape == (1, T - 1, config.text.vocab_size)
  _close(mtp_logits, ref[2], "mtp_logits")
  flat = jax.tree_util.tree_flatten_with_path(grads)[0]
  for (path, g), r in zip(flat, jax.tree_util.tree_leaves(ref[3])):
    assert len(g.addressable_shards) == CONTEXT
    for shard in g.addressable_shards:   # every device's copy of its slice
      _close(shard.data, r[shard.index], f"grad{jax.tree_util.keystr(path)} on {shard.device}")


def test_chunked_prefill_on_context_8_equals_the_full_forward():
  config, boxed, variables, batch = _setup()
  tokens = batch["inputs"][:, :2048]
  full = jax.jit(lambda v, x: K3Model(config).apply(v, x))(variables, tokens)
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, context=CONTEXT))
  var_sh = sharding.param_shardings(mesh, {c: boxed[c] for c in ("params", "balance")})
  with jax.set_mesh(mesh):
    logits, _, cache = generate.prefill(config, sharding.put_batch(variables, var_sh),
                                        np.asarray(tokens), np.array([2048]), chunk=512,
                                        return_all=True)
  assert int(cache.lengths[0]) == 2048
  _close(logits, full, "prefill logits", tol=1e-4)
