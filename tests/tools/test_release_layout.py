"""k3jax's tensor map held to the release as published (tests/tools/release_facts.py, typed by
hand from docs/k3.md §9/§11/§12 and the public facts): every name, shape and dtype that export
writes for the k3 preset (`tools.checkpoint_names.names_for`), the entry count and the size.
`--check_only` against the same facts: test_check_only.py."""

import math

import pytest

import release_facts as facts
from k3jax.config import preset
from k3jax.convert.safetensors_io import DTYPE_NAMES
from tools.checkpoint_names import names_for


@pytest.fixture(scope="module")
def published():
  return {name: (tuple(shape), dtype) for name, shape, dtype in facts.entries()}


@pytest.fixture(scope="module")
def ours():
  return {name: (tuple(shape), DTYPE_NAMES[dt]) for name, dt, shape in names_for(preset("k3"))}


def test_the_facts_add_up(published):
  """The hand-typed templates give the published count and size: 497,220 entries (92 MoE
  layers × 896 experts × 3 matrices × 2 + the rest + 168 vision), 1.561 TB."""
  assert len(facts.entries()) == len(published) == facts.ENTRIES
  assert sum(d == "U8" for _, d in published.values()) == 92 * 896 * 3 * 2
  assert sum(n.startswith(("vision_tower.", "mm_projector.")) for n in published) == 168
  assert sum(n.endswith(".A_log") for n in published) == 69
  total = sum(facts.nbytes(e) for e in facts.entries())
  assert round(total / 1e12, 3) == facts.TERABYTES, total
  # the other reading of the router's dtype would not be the published size
  router = sum(math.prod(s) for n, (s, _) in published.items() if n.endswith("gate.weight"))
  assert router == 92 * 896 * 7168 and round((total + 2 * router) / 1e12, 3) != facts.TERABYTES


def test_export_names_shapes_and_dtypes_are_the_published_ones(published, ours):
  """Exactly the published tensors, each with its published shape and dtype."""
  missing = sorted(set(published) - set(ours))
  extra = sorted(set(ours) - set(published))
  wrong = sorted(f"{n}: ours {ours[n]}, published {published[n]}"
                 for n in set(ours) & set(published) if ours[n] != published[n])
  assert not (missing or extra or wrong), (
      f"missing {len(missing)}: {missing[:10]}\nextra {len(extra)}: {extra[:10]}\n"
      f"differ {len(wrong)}: {wrong[:10]}")
  assert sum(facts.nbytes((n, *ours[n])) for n in ours) == sum(
      facts.nbytes(e) for e in facts.entries())
