"""Named presets for the frozen config dataclasses (`ModelConfig`, `VisionConfig`).

A leaf module (imports nothing from k3jax) so that both config modules can use it while
`k3jax.config` refers to `k3jax.vision.config` for its optional vision tower.
"""

from __future__ import annotations

import dataclasses


def from_presets(cls, presets: dict, name: str, overrides: dict, label: str = "preset"):
  """`cls` built from `presets[name]()` with `overrides` applied; an unknown name or field
  raises ValueError naming it (`label` names the kind of preset in the message)."""
  if name not in presets:
    raise ValueError(f"unknown {label} {name!r}; expected one of {sorted(presets)}")
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"unknown {cls.__name__} field(s) {unknown}")
  return cls(**{**presets[name](), **overrides})


__all__ = ["from_presets"]
