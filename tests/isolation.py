"""Bitwise isolation of packed documents: the shared check of the op and model tests.

A document's outputs, and the gradients with respect to its own inputs, must be bit-for-bit the
same whatever the other documents (in the row, or in the batch) hold: changing every other
token's inputs may change nothing of them, not even by rounding. `assert_isolated` runs an op
twice — on the inputs, and on the inputs with every position outside the document replaced by
other values — and compares with `==`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _where_doc(doc, a, b):
  """a at the document's positions, b elsewhere; doc [*token_dims] bool, a/b [*token_dims, ...]."""
  return jnp.where(doc.reshape(doc.shape + (1,) * (a.ndim - doc.ndim)), a, b)


def assert_isolated(fn, args, alt_args, doc, *, per_token, seed=0):
  """Asserts that the document `doc` of `fn`'s inputs is bitwise isolated from the others.

  fn: (*args) → array whose leading dims are the token dims (doc.shape).
  args, alt_args: two input lists of the same shapes; the positions outside `doc` of every
    per-token argument are taken from `alt_args` in the second run.
  doc: bool [*token_dims] — e.g. [B,T] for a packed row, [N] for flattened tokens.
  per_token: one bool per argument: True for inputs indexed by token (perturbed outside the
    document, and whose gradient is checked at the document's positions), False for shared
    ones (weights, initial states: left as they are).
  The cotangent is one fixed random array over all positions, so the other documents' outputs
  are differentiated too. Gradients are taken for every floating per-token argument.
  """
  doc = jnp.asarray(doc, bool)
  mixed = [_where_doc(doc, a, b) if pt else a for a, b, pt in zip(args, alt_args, per_token)]
  diff = [i for i, (a, pt) in enumerate(zip(args, per_token))
          if pt and jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating)]

  @jax.jit
  def run(*xs):
    def f(*d):
      full = list(xs)
      for i, x in zip(diff, d):
        full[i] = x
      return fn(*full)

    out, vjp = jax.vjp(f, *(xs[i] for i in diff))
    ct = jax.random.normal(jax.random.key(seed), out.shape, out.dtype)
    return out, vjp(ct)

  out0, grads0 = run(*args)
  out1, grads1 = run(*mixed)
  d = np.asarray(doc)
  np.testing.assert_array_equal(np.asarray(out1)[d], np.asarray(out0)[d])
  for i, g0, g1 in zip(diff, grads0, grads1):
    np.testing.assert_array_equal(np.asarray(g1)[d], np.asarray(g0)[d],
                                  err_msg=f"gradient of argument {i}")
  # The other documents did change (else the check above proves nothing).
  assert not np.array_equal(np.asarray(out1)[~d], np.asarray(out0)[~d])
