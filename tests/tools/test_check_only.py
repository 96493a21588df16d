"""`convert --check_only` on the full K3 release layout as published (tests/tools/
release_facts.py, typed by hand: never k3jax's tensor map, which is what is checked): 96
safetensors shards, 497,220 entries, 1.561 TB — synthesised as header-only files made the
right size with `os.truncate` (sparse: no data blocks on disk). The published layout passes;
one with a missing, an extra, a mis-shaped and a mis-typed tensor is refused with each of them
named; float tensors in other float dtypes than the release's table (the other readings of
the router's and A_log's dtypes) pass with a warning. The checks read headers (and the A_log
vectors, zeros here); the synthesiser is experiments/bench_check_only.py's, which measures the
speed."""

import pathlib
import subprocess
import sys

import pytest

from experiments.bench_check_only import release_layout, write_layout
from k3jax.convert import convert

ROOT = pathlib.Path(__file__).resolve().parents[2]
M = "language_model.model."


def _edit(shards, name, fn):
  """Replace the entry `name` of `shards` by the entries fn(entry) returns."""
  for entries in shards.values():
    for i, e in enumerate(entries):
      if e[0] == name:
        entries[i:i + 1] = fn(e)
        return
  raise KeyError(name)


def _faults(shards):
  import ml_dtypes
  import numpy as np
  bf16 = np.dtype(ml_dtypes.bfloat16)

  edit = lambda name, fn: _edit(shards, name, fn)  # noqa: E731
  edit(M + "layers.5.self_attn.q_proj.weight", lambda e: [])                   # missing
  edit(M + "layers.6.self_attn.q_proj.weight",                                 # + an extra
       lambda e: [e, (M + "layers.6.self_attn.q_bias", bf16, (12288,))])
  edit(M + "layers.8.self_attn.o_norm.weight", lambda e: [(e[0], e[1], (127,))])  # shape
  edit(M + "layers.9.block_sparse_moe.experts.3.w1.weight_scale",              # dtype
       lambda e: [(e[0], bf16, e[2])])
  edit(M + "layers.10.self_attn.A_log", lambda e: [(e[0], bf16, e[2])])        # a warning


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
  """(directory, {file: entries}) of the published k3 release layout."""
  d = tmp_path_factory.mktemp("release") / "k3"
  return d, release_layout(d)


def test_check_only_passes_the_full_release_layout(layout):
  layout = layout[0]
  size = sum(p.stat().st_size for p in layout.glob("*.safetensors"))
  on_disk = sum(p.stat().st_blocks * 512 for p in layout.glob("*.safetensors"))
  assert size > 1.56e12 and on_disk < 2e8          # sparse: headers only
  lines = []
  assert convert(layout, None, check_only=True, progress=False, log=lines.append) is None
  assert lines[-1].startswith(f"check: {str(layout)!r} matches its config.json (kimi_k3, "
                              "text prefix 'language_model.model.'): 497220 tensors, ")
  assert "MTP layer is initialised" in lines[-1]
  assert "A_log: read as crop (--a_log=auto: the entries past the 96 heads are zero in all 69 " \
         "KDA layers)" in lines
  assert not [l for l in lines if l.startswith("warning")]


def test_check_only_warns_about_other_float_dtypes(layout, tmp_path):
  """The router in fp32 (the reading the published size rules out) and an fp16 A_log: the
  check passes, each named in a warning with the table's dtype and its source."""
  import numpy as np
  d = tmp_path / "k3"
  shards = {f: list(e) for f, e in layout[1].items()}
  f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
  _edit(shards, M + "layers.1.block_sparse_moe.gate.weight", lambda e: [(e[0], f32, e[2])])
  _edit(shards, M + "layers.10.self_attn.A_log", lambda e: [(e[0], f16, e[2])])
  write_layout(d, shards, link_from=layout)
  lines = []
  assert convert(d, None, check_only=True, progress=False, log=lines.append) is None
  assert lines[-1].startswith("check: ")
  assert (f"warning: 2 float tensor(s) in another dtype than the release's table "
          f"(k3jax/convert/dtypes.py) — loaded and converted all the same:\n"
          f"  {M}layers.1.block_sparse_moe.gate.weight: float32, the release's table says "
          f"bfloat16 (size evidence (docs/k3.md §12): 1.561 TB published; bf16 routers give "
          f"1.5609 TB, fp32 ones 1.5620 TB); loaded as float32\n"
          f"  {M}layers.10.self_attn.A_log: float16, the release's table says float32 (docs/k3.md "
          f"§9/§12 and public: A_log is F32 [128] (read from the first shard)); loaded as "
          f"float32") in lines


def test_check_only_names_every_fault(layout, tmp_path):
  d = tmp_path / "k3"
  shards = {f: list(e) for f, e in layout[1].items()}
  _faults(shards)
  write_layout(d, shards, link_from=layout)     # the untouched shards are symlinks
  assert 1 <= sum(not p.is_symlink() for p in d.glob("*.safetensors")) <= 5
  r = subprocess.run([sys.executable, "-m", "tools.convert_from_pytorch", "--src", str(d),
                      "--check_only"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 1, r.stdout + r.stderr[-3000:]
  err = r.stderr
  for line in (
      f"1 missing tensor(s):\n  {M}layers.5.self_attn.q_proj.weight",
      f"1 unexpected tensor(s) (not used by this config; --skip_prefix names prefixes to leave "
      f"out):\n  {M}layers.6.self_attn.q_bias",
      f"1 tensor(s) disagree with config.json (shape):\n  {M}layers.8.self_attn.o_norm.weight: "
      "config.json implies shape [128], found [127]",
      f"1 tensor(s) disagree with config.json (dtype):\n  {M}layers.9.block_sparse_moe.experts."
      "3.w1.weight_scale: expected dtype uint8 (MXFP4), found bfloat16"):
    assert line in err, err[-3000:]
  assert "A_log" not in err
  assert (f"warning: 1 float tensor(s) in another dtype than the release's table "
          f"(k3jax/convert/dtypes.py) — loaded and converted all the same:\n  "
          f"{M}layers.10.self_attn.A_log: bfloat16, the release's table says float32") in r.stdout
