"""Read a converted vision tower + projector: `load_vision(path) -> (VisionConfig, variables)`.

`path` is either what `python -m tools.convert_from_pytorch --only vision` wrote
(`vision_config.json` + `vision_params.safetensors`, see `k3jax.convert.vision`) or a full
k3jax checkpoint (anything `k3jax.load_pretrained` reads) whose config has a vision tower; in
both cases `variables` is {'params': {'vision_tower': …, 'mm_projector': …}} as
`k3jax.vision.init_vision` makes it, ready for `k3jax.vision.encode(vision_config, variables, …)`.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.convert.safetensors_io import Source
from k3jax.vision import names as vnames
from k3jax.vision.config import VisionConfig, as_vision_config

# What `convert_from_pytorch --only vision` writes (k3jax.convert.vision.convert_vision).
CONFIG_FILE = "vision_config.json"     # {"vision_config": {VisionConfig fields},
                                       #  "media_placeholder_token_id": int | null}
PARAMS_FILE = "vision_params.safetensors"   # one tensor per leaf, named by path_name(path)


def path_name(path: tuple[str, ...]) -> str:
  """A leaf's tensor name in PARAMS_FILE: its path under the variables, '/'-joined
  ("params/vision_tower/encoder/blocks_0/wqkv/kernel")."""
  return "/".join(("params",) + tuple(path))


def read_vision_dir(path: pathlib.Path) -> tuple[VisionConfig, dict, int | None]:
  """(VisionConfig, {'params': nested numpy leaves}, placeholder id) of a `convert_vision`
  output. Every leaf is checked against the config (missing / unexpected / wrong shape)."""
  d = json.loads((path / CONFIG_FILE).read_text())
  cfg = as_vision_config(d["vision_config"])
  f = path / PARAMS_FILE
  if not f.exists():
    raise ValueError(f"{str(path)!r}: {PARAMS_FILE} is missing")
  source = Source(path)
  want = {}
  for s in vnames.tensor_specs(cfg):
    want[path_name(s.path)] = (s, vnames.to_k3jax(cfg, s, np.broadcast_to(np.float32(0),
                                                                           s.shape)).shape)
  have = source.infos
  missing = sorted(set(want) - set(have))
  extra = sorted(set(have) - set(want))
  wrong = sorted(f"{n}: expected {list(want[n][1])}, found {list(have[n].shape)}"
                 for n in set(want) & set(have) if tuple(have[n].shape) != tuple(want[n][1]))
  if missing or extra or wrong:
    raise ValueError(f"{str(f)!r} does not match its {CONFIG_FILE} ({cfg.name}):"
                     + (f"\n missing: {missing[:10]}" if missing else "")
                     + (f"\n unexpected: {extra[:10]}" if extra else "")
                     + (f"\n wrong shape: {wrong[:10]}" if wrong else ""))
  params: dict = {}
  for n, (s, _) in want.items():
    node = params
    for k in s.path[:-1]:
      node = node.setdefault(k, {})
    node[s.path[-1]] = source.get(n)
  return cfg, {"params": params}, d.get("media_placeholder_token_id")




def load_vision(path: str | os.PathLike) -> tuple[VisionConfig, dict]:
  """(vision_config, variables) from a vision-only conversion or a full k3jax checkpoint.

  Leaves are jnp arrays in their stored dtype. A full checkpoint without a vision tower, or
  without the `vision_tower` / `mm_projector` params its config implies, raises ValueError.
  """
  p = pathlib.Path(path)
  if not p.exists():
    raise ValueError(f"load_vision: path {str(p)!r} does not exist")
  if (p / CONFIG_FILE).exists():
    cfg, variables, _ = read_vision_dir(p)
    return cfg, jax.tree.map(jnp.asarray, variables)
  from k3jax.train.checkpoint import load_pretrained
  config, variables = load_pretrained(p)
  if config.vision is None:
    raise ValueError(f"load_vision: the checkpoint at {str(p)!r} has no vision tower "
                     f"(its config.vision is None)")
  params = variables.get("params", {})
  missing = [k for k in ("vision_tower", "mm_projector") if k not in params]
  if missing:
    raise ValueError(f"load_vision: the checkpoint at {str(p)!r} has config.vision set but "
                     f"no params {missing}")
  return config.vision, {"params": {k: params[k] for k in ("vision_tower", "mm_projector")}}


__all__ = ["load_vision", "read_vision_dir", "path_name", "CONFIG_FILE", "PARAMS_FILE"]
