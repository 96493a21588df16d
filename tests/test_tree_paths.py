"""Key-path names (k3jax/tree_paths.py)."""

import jax
import numpy as np

from k3jax.tree_paths import key_names, path_str


def test_key_names_of_dicts_sequences_and_attributes():
  tree = {"params": {"layers_0": [np.zeros(1), (np.zeros(2),)]},
          "state": jax.tree_util.Partial(lambda x: x, np.zeros(3))}
  got = {path_str(p): leaf.shape for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}
  assert got["params/layers_0/0"] == (1,)
  assert got["params/layers_0/1/0"] == (2,)
  paths = [key_names(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
  assert ("params", "layers_0", "1", "0") in paths
  assert all(isinstance(n, str) for p in paths for n in p)
