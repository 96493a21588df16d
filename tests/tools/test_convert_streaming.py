"""Conversion at scale (k3jax/convert/streaming.py): parallel workers and several processes
give the very checkpoint one process writes; a conversion killed with SIGKILL leaves nothing
that loads and resumes where it stopped; a resume with other settings is refused; the result
loads sharded over a mesh. Throughput and memory: experiments/bench_convert.py."""

import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from cli_env import ROOT, cli_env
from convert_helpers import flat, random_variables, write_k3_checkpoint
from k3jax import sharding
from k3jax.config import preset
from k3jax.convert import convert, streaming
from k3jax.convert import names as N
from k3jax.convert.checkpoint import load_pretrained

QUIET = dict(progress=False, log=lambda s: None)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
  """A tiny K3 in the release layout (no MTP), and its conversion by one process."""
  config = preset("tiny", num_layers=7, mla_every=2, attn_res_block_size=3, num_mtp_layers=0)
  root = tmp_path_factory.mktemp("streaming")
  write_k3_checkpoint(root / "src", config, random_variables(config, seed=3))
  ref = convert(root / "src", root / "ref", expert_format="mxfp4", **QUIET)
  return root / "src", load_pretrained(ref)


def _assert_same(a, b):
  fa, fb = dict(flat(a)), dict(flat(b))
  assert sorted(fa) == sorted(fb)
  for k in fa:
    np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg="/".join(k))


def _python(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, timeout=timeout,
                        capture_output=True, text=True, env=cli_env())


def test_workers_and_processes_write_the_same_checkpoint(release, tmp_path):
  src, (config, ref) = release
  # two worker processes (4 parts each)
  out = convert(src, tmp_path / "w2", expert_format="mxfp4", workers=2, **QUIET)
  got_config, got = load_pretrained(out)
  assert got_config == config
  _assert_same(got, ref)
  # two "hosts": process 1 in another interpreter, process 0 here (it waits for 1's part)
  dst = tmp_path / "p2"
  other = subprocess.Popen(
      [sys.executable, "-m", "tools.convert_from_pytorch", f"--src={src}", f"--dst={dst}",
       "--expert_format=mxfp4", "--workers=1", "--process_index=1", "--process_count=2",
       "--noprogress"], cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)
  logs = []
  assert convert(src, dst, expert_format="mxfp4", workers=1, process_index=0,
                 process_count=2, wait_timeout_s=240, progress=False, log=logs.append) == dst
  text = other.communicate(timeout=120)[0]
  assert other.returncode == 0, text
  assert "process 1 of 2: part(s) [1] written; process 0 saves the checkpoint" in text
  _assert_same(load_pretrained(dst)[1], ref)
  assert not (tmp_path / ".p2.partial").exists()
  # … and sharded over a mesh, each device holding its piece of the same values
  mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "expert": 2})
  _, sharded = load_pretrained(dst, mesh=mesh)
  _assert_same(sharded, ref)
  split = [x for x in jax.tree.leaves(sharded) if x.addressable_shards[0].data.shape != x.shape]
  assert len(split) > len(jax.tree.leaves(sharded)) // 2


def test_killed_conversion_resumes(release, tmp_path):
  src, (config, ref) = release
  dst = tmp_path / "out"
  stage = streaming.Stage.of(dst)
  # Record every leaf as it completes, and SIGKILL the converter as it starts its 40th.
  r = _python(f"""
      import os, signal
      from k3jax.convert import convert, streaming
      streaming.SYNC_BYTES = 0
      write, calls = streaming.write_leaf, [0]
      def dying(*a, **k):
        calls[0] += 1
        if calls[0] == 40:
          os.kill(os.getpid(), signal.SIGKILL)
        return write(*a, **k)
      streaming.write_leaf = dying
      convert({str(src)!r}, {str(dst)!r}, expert_format="mxfp4", progress=False)
      """)
  assert r.returncode == -9, r.stderr[-2000:]
  assert not dst.exists() and stage.root.exists()
  with pytest.raises(ValueError, match="does not exist"):
    load_pretrained(dst)
  # 39 leaves were written; the last one's record may have been cut off (synced in the
  # background, then named in the done list)
  done = len(stage.done_names(0))
  assert done in (38, 39)
  # other settings: refused, naming them; the partial conversion is kept
  with pytest.raises(ValueError, match=r"other settings \(differs in: config, dtype\)"):
    convert(src, dst, expert_format="mxfp4", dtype="bfloat16", **QUIET)
  assert len(stage.done_names(0)) == done
  # the same command resumes: those leaves skipped, the checkpoint equals the uninterrupted one
  logs, written = [], []
  write = streaming.write_leaf
  def counting(t, leaf, *a, **k):
    written.append(leaf)
    return write(t, leaf, *a, **k)
  streaming.write_leaf = counting
  try:
    convert(src, dst, expert_format="mxfp4", progress=False, log=logs.append)
  finally:
    streaming.write_leaf = write
  n = len(N.leaves(config, "kimi_k3", "mxfp4", mtp=False))
  assert any(f"{done} of {n} leaves already written" in line for line in logs), logs
  assert len(written) == n - done
  _assert_same(load_pretrained(dst)[1], ref)
  assert not stage.root.exists()


def test_parts_and_chunks():
  config = preset("tiny", num_layers=7, mla_every=2, attn_res_block_size=3)
  leaves = N.leaves(config, "kimi_k3", "mxfp4")
  sizes = [streaming.leaf_nbytes(l, streaming.storage_dtype(l, np.dtype(np.float32)))
           for l in leaves]
  parts = streaming.assign_parts(leaves, sizes, 3)
  assert sorted(i for p in parts for i in p) == list(range(len(leaves)))
  loads = [sum(sizes[i] for i in p) for p in parts]
  assert max(loads) - min(loads) <= max(sizes)            # balanced to within one leaf
  assert streaming.assign_parts(leaves, sizes, 3) == parts   # same split on every host
  for leaf in leaves:
    chunk = streaming.chunk_shape(leaf, 2, max_bytes=4096)
    assert chunk[:leaf.lead] == [1] * leaf.lead             # a slot write covers whole chunks
    assert chunk[leaf.lead + 1:] == list(leaf.slice_shape[1:])
    rows = leaf.slice_shape[0] if leaf.slice_shape else 1
    row_bytes = 2 * int(np.prod(leaf.slice_shape[1:], dtype=np.int64))
    assert chunk[leaf.lead:leaf.lead + 1] in ([], [max(1, min(rows, 4096 // row_bytes))])


def test_sync_tree_tolerates_files_removed_while_it_runs(tmp_path, monkeypatch):
  """The background sync walks a database tensorstore is still writing: its transient
  `*.__lock` files can vanish between the listing and the open."""
  (tmp_path / "db").mkdir()
  (tmp_path / "db" / "kept").write_bytes(b"x")
  walk = streaming.os.walk
  monkeypatch.setattr(streaming.os, "walk",
                      lambda root: [(d, s, f + ["manifest.ocdbt.__lock"]) for d, s, f in walk(root)])
  opened = []
  real_open = streaming.os.open
  monkeypatch.setattr(streaming.os, "open", lambda p, *a: opened.append(p) or real_open(p, *a))
  streaming._sync_tree(tmp_path)
  assert str(tmp_path / "db" / "kept") in opened           # the real file was synced
  with pytest.raises(PermissionError):                      # other errors still surface
    monkeypatch.setattr(streaming.os, "open", lambda p, *a: (_ for _ in ()).throw(PermissionError(p)))
    streaming._sync_tree(tmp_path)
