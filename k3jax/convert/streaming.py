"""Write a converted checkpoint leaf by leaf: parallel worker processes, several hosts, resume.

A conversion's leaves are split into `parts` (balanced by bytes). A worker writes each leaf of
its part straight into the part's own OCDBT database (`ocdbt.process_p<k>`, the per-process
layout orbax uses for multi-host saves) through tensorstore, one slot (one PyTorch tensor, or an
MXFP4 pair) at a time, with zarr chunks the size of a slot: no scratch copy and no whole-leaf
buffer, so a worker holds about one source tensor and its converted copy. When every part is
complete, process 0 saves the checkpoint with orbax, whose NumPy handler is told that those
leaves are already written (`_prewritten`): it moves the part databases into the checkpoint,
writes the metadata and the leaves held in memory (a fresh MTP layer), merges the databases as
it does after a multi-host save, and commits. `k3jax.load_pretrained` reads the result like any
other checkpoint, sharded when given a mesh.

Staging directory `.<dst name>.partial/` beside dst (on a filesystem every host sees):
  plan.json                    what is converted: source files (size, mtime), settings, parts
  parts/ocdbt.process_p<k>/    part k's database
  done/p<k>.txt                part k's completed leaves, one name per line (appended, flushed)
  done/p<k>.complete           part k finished
  done/p<k>.lock               held (flock) by the process writing part k
  out/                         the checkpoint being saved; renamed to dst when complete
A leaf is recorded as done only after the part's files are synced to disk (every SYNC_BYTES of
output, and at the end of the part), so a kill, or a crash of the machine, costs at most that
much work. A rerun with the same source and settings skips completed leaves (the rest are
written again); other settings are refused, naming what differs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import gc
import json
import multiprocessing as mp
import os
import pathlib
import shutil
import time
import traceback
from typing import Callable

import numpy as np
import tensorstore as ts
from orbax.checkpoint import type_handlers as th
from orbax.checkpoint._src.serialization import tensorstore_utils as tsu

from k3jax.convert import names as N
from k3jax.convert.checkpoint import save_pretrained
from k3jax.convert.safetensors_io import Source

PLAN_VERSION = 1
CHUNK_MAX_BYTES = 64 << 20     # zarr chunks at most this big: a host reads only what it holds
BATCH_BYTES = 64 << 20         # slot writes committed together (bounds a worker's memory)
SYNC_BYTES = 256 << 20         # written data synced, then its leaves recorded as done
PART_PREFIX = "ocdbt.process_p"


def param_name(leaf: N.Leaf) -> str:
  """orbax's name of a leaf inside the `variables` item (keys joined by '.')."""
  return ".".join((leaf.collection,) + leaf.path)


def leaf_nbytes(leaf: N.Leaf, store: np.dtype) -> int:
  return int(np.prod(leaf.shape, dtype=np.int64)) * store.itemsize


def storage_dtype(leaf: N.Leaf, dtype: np.dtype) -> np.dtype:
  """What a leaf is stored as: uint8 (packed MXFP4), float32 (vectors, router, decay
  parameters) or the conversion's `dtype` (matmul weights)."""
  return (np.dtype(np.uint8) if leaf.kind == "u8" else
          np.dtype(np.float32) if leaf.fp32 else np.dtype(dtype))


def chunk_shape(leaf: N.Leaf, itemsize: int, max_bytes: int = CHUNK_MAX_BYTES) -> list[int]:
  """zarr chunks: one slot (1 on the slot axes, the whole slice on the rest), the first slice
  axis cut so a chunk holds at most `max_bytes`. Every slot write then covers whole chunks
  (no read-modify-write), and a sharded reader fetches bounded pieces."""
  lead, rest = leaf.lead, list(leaf.slice_shape)
  if rest and rest[0] > 1:
    row = int(np.prod(rest[1:], dtype=np.int64)) * itemsize
    rest[0] = max(1, min(rest[0], max_bytes // max(row, 1)))
  return [1] * lead + rest


def assign_parts(leaves: list[N.Leaf], sizes: list[int], n: int) -> list[list[int]]:
  """Leaf indices of each of `n` parts: largest first onto the lightest part (deterministic,
  so every host computes the same split)."""
  order = sorted(range(len(leaves)), key=lambda i: (-sizes[i], i))
  parts: list[list[int]] = [[] for _ in range(n)]
  load = [0] * n
  for i in order:
    k = min(range(n), key=lambda j: (load[j], j))
    parts[k].append(i)
    load[k] += sizes[i]
  return [sorted(p) for p in parts]


# ---------------------------------------------------------------------- staging
@dataclasses.dataclass(frozen=True)
class Stage:
  """The staging directory of one conversion (layout in the module docstring)."""
  root: pathlib.Path

  @classmethod
  def of(cls, dst: pathlib.Path) -> "Stage":
    return cls(dst.parent / f".{dst.name}.partial")

  parts = property(lambda self: self.root / "parts")
  done = property(lambda self: self.root / "done")
  out = property(lambda self: self.root / "out")
  plan = property(lambda self: self.root / "plan.json")

  def part_db(self, k: int) -> pathlib.Path:
    return self.parts / f"{PART_PREFIX}{k}"

  def done_names(self, k: int) -> set[str]:
    p = self.done / f"p{k}.txt"
    if not p.exists():
      return set()
    # A line cut off by a kill has no newline: that leaf is not done.
    text = p.read_text()
    lines = text.split("\n")
    return set(lines[:-1]) if not text.endswith("\n") else set(lines) - {""}

  def complete(self, k: int) -> bool:
    return (self.done / f"p{k}.complete").exists()


def open_stage(stage: Stage, plan: dict) -> tuple[dict, bool]:
  """Create the staging directory with `plan`, or check an existing one against it (a
  ValueError naming every differing field). Returns (the stored plan, resumed?)."""
  if stage.plan.exists():
    old = json.loads(stage.plan.read_text())
    diff = sorted(k for k in set(old) | set(plan)
                  if k != "parts" and old.get(k) != plan.get(k))
    if diff:
      raise ValueError(
          f"{str(stage.root)!r} holds an interrupted conversion with other settings "
          f"(differs in: {', '.join(diff)}); rerun with the same source and flags to resume "
          f"it, or delete that directory to start again")
    return old, True
  for d in (stage.root, stage.parts, stage.done):
    d.mkdir(exist_ok=True)
  tmp = stage.root / f"plan.json.tmp-{os.getpid()}"
  tmp.write_text(json.dumps(plan, indent=1, sort_keys=True))
  os.replace(tmp, stage.plan)    # several hosts may race here: they write the same plan
  return json.loads(stage.plan.read_text()), False


def fingerprint(source) -> dict:
  """Source files with size and mtime (a changed source is not resumed)."""
  files = sorted({info.file for info in source.infos.values()}, key=str)
  out = {}
  for f in files:
    st = pathlib.Path(f).stat()
    out[str(pathlib.Path(f).resolve())] = [st.st_size, st.st_mtime_ns]
  return out


# ---------------------------------------------------------------------- one part
@dataclasses.dataclass(frozen=True)
class PartJob:
  """Everything a worker process needs to write part `part` (picklable)."""
  src: str
  allow_torch_pickle: bool
  aliases: tuple[tuple[str, str], ...]     # Source renames (transformers' spellings)
  stage: str
  part: int
  leaves: tuple[N.Leaf, ...]
  dtype: str                               # numpy dtype name of matmul weights


def _ts_context():
  """orbax's tensorstore context for OCDBT, without an fsync per commit: a part's files are
  synced together (`_sync_tree`) before its leaves are recorded as done."""
  spec = tsu.get_ts_context(use_ocdbt=True).spec.to_json()
  spec["file_io_sync"] = False
  return ts.Context(ts.Context.Spec(spec))


def _fsync_path(path: str) -> None:
  try:
    fd = os.open(path, os.O_RDONLY)
  except FileNotFoundError:
    return     # a transient file (tensorstore's `*.__lock`) removed after the listing
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _sync_tree(root: pathlib.Path) -> None:
  """fsync every file and directory under `root` (data to disk before it is called done).
  Runs while the next leaves are written, so entries may vanish between listing and open."""
  for d, _, files in os.walk(root):
    for f in files:
      _fsync_path(os.path.join(d, f))
    _fsync_path(d)


def _write_spec(db_parent: pathlib.Path, part: int, leaf: N.Leaf, store: np.dtype) -> dict:
  """The tensorstore spec orbax would write this leaf with (zarr over the part's OCDBT
  database, uncompressed: weights barely compress), chunked by slot."""
  spec = tsu.ArrayWriteSpec(
      str(db_parent), param_name(leaf), global_shape=leaf.shape, write_shape=leaf.shape,
      dtype=store, use_compression=False, use_ocdbt=True, process_id=f"p{part}").json
  spec["metadata"]["chunks"] = chunk_shape(leaf, store.itemsize)
  return spec


def write_leaf(t, leaf: N.Leaf, source, store: np.dtype, progress: Callable[[int], None]):
  """Fill the open tensorstore `t` (shape leaf.shape) slot by slot from `source`. Slot writes
  are grouped in transactions of about BATCH_BYTES, each one commit of the part's database
  (one commit per slot would cost a manifest update and an fsync per tensor); returns when
  every write is committed."""
  txn, staged = ts.Transaction(), 0
  for slot in leaf.slots:
    raw = [source.get(n, copy=False) for n in slot.names]    # mmap views, no copy
    if leaf.kind == "u8" and len(raw) == 1 and raw[0].dtype == store:
      buf = raw[0].reshape(leaf.slice_shape)     # packed bytes kept as they are: no copy
    else:
      buf = np.empty(leaf.slice_shape, store)
      N.to_ours_into(buf, leaf, raw)
    # `buf` is never modified again: tensorstore may keep it instead of copying it.
    t.with_transaction(txn)[slot.index].write(
        buf, can_reference_source_data_indefinitely=True).result()
    staged += buf.nbytes
    progress(sum(r.nbytes for r in raw))
    del raw, buf
    if staged >= BATCH_BYTES:
      txn.commit_sync()
      txn, staged = ts.Transaction(), 0
  txn.commit_sync()


@contextlib.contextmanager
def _part_lock(stage: Stage, k: int):
  path = stage.done / f"p{k}.lock"
  with open(path, "a+") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      f.seek(0)
      raise RuntimeError(f"part {k} of {str(stage.root)!r} is being written by another process "
                         f"({f.read().strip() or 'unknown'}); wait for it or stop it") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
    f.flush()
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def write_part(job: PartJob, progress: Callable[[int], None] = lambda n: None) -> int:
  """Write every leaf of `job` not already done (resume); mark the part complete. Returns
  the number of leaves written now."""
  gc.freeze()   # the tensor tables are long-lived: keep the collector from rescanning them
  stage = Stage(pathlib.Path(job.stage))
  source = Source(job.src, allow_torch_pickle=job.allow_torch_pickle)
  for old, new in job.aliases:
    source.alias(old, new)
  with _part_lock(stage, job.part), \
       open(stage.done / f"p{job.part}.txt", "a") as log, \
       concurrent.futures.ThreadPoolExecutor(1) as syncer:
    done = stage.done_names(job.part)
    ctx = _ts_context()
    written, unsynced, finished, synced = 0, 0, [], None

    def record(names):   # data on disk first, then the names that say so
      _sync_tree(stage.part_db(job.part))
      log.write("".join(n + "\n" for n in names))
      log.flush()
      os.fsync(log.fileno())

    for leaf in job.leaves:
      name = param_name(leaf)
      if name in done:
        progress(sum(source.infos[n].nbytes for s in leaf.slots for n in s.names))
        continue
      store = storage_dtype(leaf, np.dtype(job.dtype))
      spec = _write_spec(stage.parts, job.part, leaf, store)
      t = ts.open(ts.Spec(spec), create=True, open=True, context=ctx).result()
      write_leaf(t, leaf, source, store, progress)
      del t
      finished.append(name)
      written += 1
      unsynced += leaf_nbytes(leaf, store)
      if unsynced >= SYNC_BYTES:
        # Synced in the background while the next leaves are converted (one sync at a time).
        if synced is not None:
          synced.result()
        synced = syncer.submit(record, finished)
        finished, unsynced = [], 0
    if synced is not None:
      synced.result()
    record(finished)
    (stage.done / f"p{job.part}.complete").touch()
  return written


# ---------------------------------------------------------------------- several parts
def _worker_main(jobs, counter, errors) -> None:
  """Entry point of a worker process: write parts taken from the `jobs` queue until a None,
  counting source bytes in `counter`; an error goes to `errors` and ends the worker."""
  def progress(n):
    with counter.get_lock():
      counter.value += n
  job = None
  try:
    while (job := jobs.get()) is not None:
      write_part(job, progress)
  except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
    part = job.part if job is not None else None
    errors.put((part, type(e).__name__, str(e), traceback.format_exc()))
    raise SystemExit(1) from None


def run_parts(jobs: list[PartJob], workers: int, bar) -> None:
  """Write `jobs` with `workers` processes pulling parts from one queue: this one and
  `workers - 1` spawned ones; updates the byte progress `bar`. A failing part stops the others
  and raises its error (a ValueError stays a ValueError: bad data)."""
  n_spawn = min(workers, len(jobs)) - 1
  if n_spawn <= 0:
    for job in jobs:
      write_part(job, bar.update)
    return
  ctx = mp.get_context("spawn")      # jax is imported here: never fork
  counter, errors, queue = ctx.Value("q", 0), ctx.Queue(), ctx.Queue()
  for job in jobs:
    queue.put(job)
  for _ in range(n_spawn + 1):
    queue.put(None)
  procs = [ctx.Process(target=_worker_main, args=(queue, counter, errors), daemon=True)
           for _ in range(n_spawn)]
  for p in procs:
    p.start()
  seen = 0

  def poll(mine: int = 0) -> bool:
    """Progress of every process; raise a worker's error; True while workers run."""
    nonlocal seen
    with counter.get_lock():
      now = counter.value
    bar.update(mine + now - seen)
    seen = now
    failed = [p for p in procs if p.exitcode not in (None, 0)]
    if failed or not errors.empty():
      try:
        part, kind, msg, tb = errors.get(timeout=5)
      except Exception:  # noqa: BLE001 - died without reporting (killed)
        raise RuntimeError(f"a conversion worker died (exit code {failed[0].exitcode}); "
                           "rerun to resume") from None
      if kind == "ValueError":
        raise ValueError(msg)
      raise RuntimeError(f"conversion worker (part {part}) failed: {kind}: {msg}\n{tb}")
    return any(p.is_alive() for p in procs)

  try:
    while (job := queue.get()) is not None:
      write_part(job, poll)
    while poll():
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.is_alive():
        p.terminate()
    for p in procs:
      p.join()


def wait_for_parts(stage: Stage, n_parts: int, log: Callable[[str], None],
                   timeout_s: float | None, poll_s: float = 2.0) -> None:
  """Block until every part is complete (other hosts write theirs)."""
  t0, said = time.monotonic(), -1
  while True:
    if not stage.plan.exists():
      raise RuntimeError(f"{str(stage.root)!r} was removed while waiting for the other "
                         "processes' parts: one of them failed (see its output)")
    missing = [k for k in range(n_parts) if not stage.complete(k)]
    if not missing:
      return
    if len(missing) != said:
      log(f"waiting for part(s) {missing} (written by other processes)")
      said = len(missing)
    if timeout_s is not None and time.monotonic() - t0 > timeout_s:
      raise TimeoutError(f"part(s) {missing} of {str(stage.root)!r} were not completed within "
                         f"{timeout_s:.0f} s; rerun the processes that own them")
    time.sleep(poll_s)


# ---------------------------------------------------------------------- the orbax save
@contextlib.contextmanager
def _prewritten(names: set[str], part_dbs: list[pathlib.Path]):
  """While active, orbax's NumPy leaves named in `names` are not written: they already are,
  in `part_dbs`, which the handler moves into the checkpoint being saved (once, when orbax
  has made its directory) so that orbax's merge of per-process databases picks them up.
  Other NumPy leaves are written as usual, one at a time and uncompressed. Same handler type
  string, so the checkpoint and its restore are exactly those of a plain save.
  (Relies on NumpyHandler.serialize and ParamInfo.parent_dir of orbax-checkpoint 0.12.)"""

  class PrewrittenNumpyHandler(th.NumpyHandler):
    def __init__(self):
      super().__init__(deepcopy_host_arrays=False)

    async def serialize(self, values, infos, args=None):
      args = list(args) if args else [None] * len(values)
      fresh = [(v, i, a) for v, i, a in zip(values, infos, args) if i.name not in names]
      mine = [i for i in infos if i.name in names]
      if mine:
        await mine[0].await_path_creation()
        into = pathlib.Path(mine[0].parent_dir)
        for db in part_dbs:
          if db.exists():
            os.rename(db, into / db.name)
      for _, info, _ in fresh:   # ParamInfo objects made for this save: ours to change
        info.use_compression = False
      if not fresh:
        return []
      v, i, a = map(list, zip(*fresh))
      return await super().serialize(v, i, None if a[0] is None else a)

  old = th.get_type_handler(np.ndarray)
  th.register_type_handler(np.ndarray, PrewrittenNumpyHandler(), override=True)
  try:
    yield
  finally:
    th.register_type_handler(np.ndarray, old, override=True)


def placeholder(shape, dtype) -> np.ndarray:
  """A zero-stride array of `shape` (no memory): what orbax is handed for a written leaf."""
  return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), tuple(shape), (0,) * len(shape))


def _set(tree: dict, path: tuple, value) -> None:
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def recover_parts(stage: Stage) -> None:
  """Move part databases back from an interrupted save in `stage.out`, and drop it."""
  if not stage.out.exists():
    return
  for db in stage.out.rglob(f"{PART_PREFIX}*"):
    if db.is_dir() and not (stage.parts / db.name).exists():
      os.rename(db, stage.parts / db.name)
  shutil.rmtree(stage.out)


def save(stage: Stage, config, written: list[N.Leaf], dtype: np.dtype, n_parts: int,
         in_memory: dict, meta: dict, dst: pathlib.Path) -> None:
  """Save the checkpoint: written leaves (placeholders) + `in_memory` ({collection: tree}
  merged in), `conversion.json` = `meta`; renamed to `dst`; the staging directory removed."""
  recover_parts(stage)
  variables: dict = {"params": {}, "balance": {}}
  for leaf in written:
    _set(variables[leaf.collection], leaf.path,
         placeholder(leaf.shape, storage_dtype(leaf, dtype)))
  for coll, tree in in_memory.items():
    variables[coll].update(tree)
  if not variables["balance"]:
    del variables["balance"]
  dbs = [stage.part_db(k) for k in range(n_parts)]
  stage.out.mkdir()
  with _prewritten({param_name(l) for l in written}, dbs):
    save_pretrained(stage.out, config, variables)
  (stage.out / "conversion.json").write_text(json.dumps(meta, indent=2))
  os.rename(stage.out, dst)
  shutil.rmtree(stage.root)


__all__ = ["Stage", "PartJob", "assign_parts", "chunk_shape", "fingerprint", "open_stage",
           "param_name", "run_parts", "save", "storage_dtype", "wait_for_parts", "write_part"]
