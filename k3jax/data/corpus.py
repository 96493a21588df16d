"""Text training data: corpora, packing into [B, T] rows and a checkpointable iterator.

Tokens are the byte tokenizer's (k3jax/data/tokenizers.py): `[BOS] bytes [EOS]` per document.

Corpora (`load_corpus`). `"stdlib"`: the running Python's standard library sources (every `*.py`
under `sysconfig.get_paths()["stdlib"]`, site-packages excluded, sorted by relative path). A
path: a `.txt` file (one document), a `.jsonl` file (one document per line, field `text`), a
`.npy` file of token ids (1-D, one pre-tokenized shard), an `.array_record` file (one
pre-tokenized document per record: the bytes of `np.save` of a 1-D integer array; needs the
optional `array-record` package), or a directory / glob of those. Text
documents go to the eval split when `md5(name) % 10000 < 100·eval_percent` (by file for
`.txt` and the stdlib, by line number for `.jsonl`), so the split never depends on the order
of discovery; a name is the path relative to the source (a directory, or a glob's fixed
prefix), so neither does it depend on where the data lives. A source that is one `.txt` file
is one document: the last `eval_percent`% of its tokens form the eval split, as for `.npy`
shards, which are already tokens;
array-record documents are split by record like `.jsonl` lines (name `file:index`) and used as
they are (no BOS/EOS added: a tokenizer's own markers are the caller's). A split that leaves
no training tokens is an error naming `data.eval_percent`. Token streams are
stored as uint16 when the vocabulary fits, else uint32.

Packing. Each text document becomes `[BOS] bytes [EOS]`; a split is the concatenation of its
documents: one token stream. A batch row is a window of `T + 2` consecutive stream tokens `w`:
    inputs      = w[0:T]        targets     = w[1:T+1]     mtp_targets = w[2:T+2]
    segment_ids = number of BOS in inputs[0..t]   (the partial first document is segment 0)
    loss_mask   = inputs[t] != EOS                 (no prediction across a document boundary)
    mtp_mask    = loss_mask & targets[t] != EOS
Documents are cut at window edges. The model resets the KDA state where `segment_ids` changes
and MLA attends only within a segment, so packed documents never see each other.

Iteration. The window offsets of step `s` are drawn from `numpy.random.default_rng([seed, s])`:
a batch is a pure function of (data, seed, step, batch_size, seq_len). The iterator state is
therefore just the step (plus a fingerprint of the data checked on restore): resuming continues
the exact stream, and a sequence-length curriculum (stages of (steps, seq_len)) changes T
without disturbing it.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import io
import json
import os
import pathlib
import sysconfig
from typing import Sequence

import jax
import numpy as np

from k3jax.data.tokenizers import BOS, EOS, NUM_BYTES, NUM_SPECIAL


# ---------------------------------------------------------------------- corpora
def in_eval(name: str, eval_percent: float) -> bool:
  """Whether document `name` belongs to the eval split (md5 of the name, module doc)."""
  h = int.from_bytes(hashlib.md5(name.encode("utf-8")).digest()[:8], "little")
  return (h % 10000) < eval_percent * 100


def stdlib_files() -> list[tuple[str, pathlib.Path]]:
  """(relative name, path) of every stdlib `*.py`, sorted by name (deterministic)."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = []
  for p in root.rglob("*.py"):
    rel = p.relative_to(root)
    if "site-packages" in rel.parts or "dist-packages" in rel.parts:
      continue
    files.append((rel.as_posix(), p))
  files.sort()
  if not files:
    raise ValueError(f"data.source='stdlib': no *.py files under {root}")
  return files


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Token streams of the two splits and where they came from."""
  train: np.ndarray      # [N] uint16 or uint32 (by vocabulary size), widened on read
  eval: np.ndarray       # [M]
  source: str
  num_docs: tuple[int, int]

  def fingerprint(self) -> dict:
    """What a resumed run checks: the same data, token for token (by size and hash)."""
    h = hashlib.md5(np.ascontiguousarray(self.train[:: max(1, len(self.train) // 4096)]).tobytes())
    return {"source": self.source, "train_tokens": int(len(self.train)),
            "eval_tokens": int(len(self.eval)), "sample_md5": h.hexdigest()}


def _token_dtype(vocab_size: int):
  return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _stream(docs: Sequence[np.ndarray], dtype) -> np.ndarray:
  if not docs:
    return np.zeros([0], dtype)
  return np.concatenate(docs).astype(dtype)


ARRAY_RECORD_SUFFIX = ".array_record"


def _read_array_record(path: str, name: str) -> list[tuple[str, np.ndarray]]:
  """(name "name:index", 1-D integer token array) per record of the array-record file `path`."""
  try:
    from array_record.python.array_record_module import ArrayRecordReader  # optional: k3jax[data]
  except ImportError:
    raise ValueError(f"data.source: {path!r} is an array-record file; install the optional "
                     f"`array-record` package (pip install 'k3jax[data]')") from None
  try:
    reader = ArrayRecordReader(path)
    records = reader.read_all()
    reader.close()
  except Exception as e:  # noqa: BLE001 - any unreadable file is a user error
    raise ValueError(f"data.source: cannot read array-record file {path!r}: {e}") from None
  docs = []
  for i, rec in enumerate(records):
    try:
      arr = np.load(io.BytesIO(rec), allow_pickle=False)
    except Exception as e:  # noqa: BLE001
      raise ValueError(f"data.source: {path} record {i} is not an np.save'd array ({e})") from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"data.source: {path} record {i} expected a 1-D integer array, found "
                       f"{arr.dtype}{list(arr.shape)}")
    docs.append((f"{name}:{i}", arr))
  return docs


def _check_ids(arr: np.ndarray, what: str, vocab_size: int) -> None:
  if arr.size and (int(arr.max()) >= vocab_size or int(arr.min()) < 0):
    raise ValueError(f"data.source: {what} has ids outside [0, {vocab_size})")


def _read_text_docs(source: str) -> list[tuple[str, str, bytes | np.ndarray | None]]:
  """(path, name, data) of the documents behind a user path (file, directory or glob): name is
  the path relative to the source's root (a file's own name when the source is one file, with
  `:line` / `:record` inside `.jsonl` / `.array_record` files); data is the text's bytes, a
  pre-tokenized array (array-record) or None (an `.npy` shard, read later)."""
  if os.path.isdir(source):
    root = source
    paths = sorted(str(p) for p in pathlib.Path(source).rglob("*")
                   if p.suffix in (".txt", ".jsonl", ".npy", ARRAY_RECORD_SUFFIX)
                   and p.is_file())
  elif glob.has_magic(source):
    # The glob's fixed leading directories are its root.
    parts = pathlib.PurePath(source).parts
    fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    root = str(pathlib.PurePath(*parts[:fixed])) if fixed else "."
    paths = sorted(glob.glob(source, recursive=True))
  else:
    root = os.path.dirname(source) or "."
    paths = [source]
  if not paths:
    raise ValueError(f"data.source={source!r}: no .txt/.jsonl/.npy/.array_record files found")
  docs = []
  for p in paths:
    if not os.path.isfile(p) or not os.access(p, os.R_OK):
      raise ValueError(f"data.source={source!r}: cannot read {p!r} (missing or not readable)")
    name = os.path.relpath(p, root)
    suffix = pathlib.Path(p).suffix
    if suffix == ".jsonl":
      with open(p, "rb") as f:
        for n, line in enumerate(f):
          if not line.strip():
            continue
          try:
            rec = json.loads(line)
          except json.JSONDecodeError as e:
            raise ValueError(f"data.source: {p}:{n + 1} is not valid JSON ({e})") from None
          if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise ValueError(f"data.source: {p}:{n + 1} expected an object with a string "
                             f"'text' field, found {str(rec)[:80]!r}")
          docs.append((p, f"{name}:{n}", rec["text"].encode("utf-8")))
    elif suffix == ".npy":
      docs.append((p, name, None))  # marker: pre-tokenized shard
    elif suffix == ARRAY_RECORD_SUFFIX:
      docs.extend((p, n, a) for n, a in _read_array_record(p, name))  # pre-tokenized
    else:
      with open(p, "rb") as f:
        docs.append((p, name, f.read()))
  return docs


_CORPUS_CACHE: dict = {}


def load_corpus(source: str = "stdlib", eval_percent: float = 2.0,
                vocab_size: int = NUM_BYTES + NUM_SPECIAL) -> Corpus:
  """Tokenize and split a corpus (cached per process). See the module docstring."""
  key = (source, eval_percent, vocab_size)
  if key in _CORPUS_CACHE:
    return _CORPUS_CACHE[key]
  if not 0 <= eval_percent < 100:
    raise ValueError(f"data.eval_percent: expected a value in [0, 100), found {eval_percent}")
  if source == "stdlib":
    named = []
    for name, p in stdlib_files():
      try:
        named.append((str(p), name, p.read_bytes()))
      except OSError:
        continue  # an unreadable stdlib file is skipped, never fatal
  else:
    named = _read_text_docs(source)
  dtype = _token_dtype(vocab_size)
  # One text file is one document: split at its tail like a token shard, not by its name.
  whole_file = len(named) == 1 and isinstance(named[0][2], bytes)
  train, evals = [], []
  for path, name, data in named:
    if data is None:                     # an `.npy` token shard
      try:
        doc = np.load(path, mmap_mode="r")
      except Exception as e:  # noqa: BLE001 - any unreadable shard is a user error
        raise ValueError(f"data.source: cannot load token shard {path!r}: {e}") from None
      if doc.ndim != 1 or not np.issubdtype(doc.dtype, np.integer):
        raise ValueError(f"data.source: shard {path!r} expected a 1-D integer array, found "
                         f"{doc.dtype}{list(doc.shape)}")
      _check_ids(doc, f"shard {path!r}", vocab_size)
    elif isinstance(data, np.ndarray):   # a pre-tokenized document
      _check_ids(data, f"record {name!r}", vocab_size)
      doc = data.astype(dtype)
    else:
      doc = np.concatenate([[BOS], np.frombuffer(data, np.uint8), [EOS]]).astype(dtype)
    if data is None or whole_file:
      cut = len(doc) - int(len(doc) * eval_percent / 100)
      train.append(np.asarray(doc[:cut], dtype))
      evals.append(np.asarray(doc[cut:], dtype))
    else:
      (evals if in_eval(name, eval_percent) else train).append(doc)
  if not sum(len(d) for d in train):
    raise ValueError(f"data.source={source!r}: no training tokens: all {len(named)} documents "
                     f"fell in the eval split (data.eval_percent={eval_percent}); lower "
                     f"data.eval_percent or add documents")
  corpus = Corpus(train=_stream(train, dtype), eval=_stream(evals, dtype), source=source,
                  num_docs=(len(train), len(evals)))
  _CORPUS_CACHE[key] = corpus
  return corpus


# ---------------------------------------------------------------------- packing
def pack_windows(windows: np.ndarray) -> dict[str, np.ndarray]:
  """[B, T+2] stream windows → the batch dict (all [B, T]); see the module docstring."""
  w = windows.astype(np.int32)
  inputs, targets, mtp_targets = w[:, :-2], w[:, 1:-1], w[:, 2:]
  segment_ids = np.cumsum(inputs == BOS, axis=1).astype(np.int32)
  loss_mask = inputs != EOS
  mtp_mask = loss_mask & (targets != EOS)
  return dict(inputs=inputs, targets=targets, segment_ids=segment_ids,
              loss_mask=loss_mask.astype(np.float32), mtp_targets=mtp_targets,
              mtp_mask=mtp_mask.astype(np.float32))


def abstract_batch(batch_size: int, seq_len: int) -> dict:
  """`pack_windows`' batch as `jax.ShapeDtypeStruct`s [batch_size, seq_len] (int32 tokens and
  segment ids, float32 masks): what a train step is lowered with, nothing allocated."""
  masks = ("loss_mask", "mtp_mask")
  return {k: jax.ShapeDtypeStruct((batch_size, seq_len), np.float32 if k in masks else np.int32)
          for k in ("inputs", "targets", "segment_ids", "loss_mask", "mtp_targets", "mtp_mask")}


def sample_batch(stream: np.ndarray, seed: int, step: int, batch_size: int,
                 seq_len: int) -> dict[str, np.ndarray]:
  """The batch of `step`: B random windows of T+2 tokens (pure function of its arguments)."""
  span = seq_len + 2
  if len(stream) < span:
    raise ValueError(f"train.seq_len={seq_len}: needs at least {span} tokens in the split, "
                     f"found {len(stream)}")
  rng = np.random.default_rng([seed, step])
  offsets = rng.integers(0, len(stream) - span + 1, size=batch_size)
  return pack_windows(stream[offsets[:, None] + np.arange(span)[None, :]])


def parse_curriculum(spec: str | Sequence) -> tuple[tuple[int, int], ...]:
  """"steps:seq_len,steps:seq_len" (or a sequence of pairs) → ((steps, seq_len), ...)."""
  if isinstance(spec, str):
    spec = spec.strip()
    if not spec:
      return ()
    try:
      stages = tuple(tuple(int(v) for v in part.split(":")) for part in spec.split(","))
    except ValueError:
      raise ValueError(f"train.curriculum: expected 'steps:seq_len,steps:seq_len,...', "
                       f"found {spec!r}") from None
  else:
    stages = tuple(tuple(int(v) for v in s) for s in spec)
  for s in stages:
    if len(s) != 2 or s[0] <= 0 or s[1] <= 0:
      raise ValueError(f"train.curriculum: each stage must be (steps > 0, seq_len > 0), "
                       f"found {s}")
  return stages


def seq_len_at(step: int, seq_len: int, curriculum: Sequence[tuple[int, int]] = ()) -> int:
  """Sequence length of `step`: the curriculum stage it falls in, else `seq_len` after it."""
  start = 0
  for steps, t in curriculum:
    if step < start + steps:
      return t
    start += steps
  return seq_len


class StepIterator:
  """The protocol of every checkpointable batch source (text, SFT, media, long documents): a
  batch is a pure function of (data, seed, step), so `next(it)` yields `it.batch(it.step)` and
  the state is the step. `get_state()` is JSON-serialisable ({"step", "seed", "data": the
  data's fingerprint}); `set_state()` restores it and refuses data or a seed that differs
  from the checkpointed run's. Subclasses set `seed` and `step` and define `batch(step)`,
  `fingerprint()` and `seq_len_at(step)`."""

  seed: int
  step: int

  def batch(self, step: int) -> dict:
    raise NotImplementedError

  def fingerprint(self) -> dict:
    raise NotImplementedError

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    out = self.batch(self.step)
    self.step += 1
    return out

  def get_state(self) -> dict:
    return {"step": self.step, "seed": self.seed, "data": self.fingerprint()}

  def set_state(self, state: dict) -> None:
    self.step = restored_step(state, self.fingerprint(), self.seed)


class DataIterator(StepIterator):
  """Deterministic, checkpointable batches of a corpus's windows (`StepIterator`), the
  sequence length following the curriculum."""

  def __init__(self, corpus: Corpus, batch_size: int, seq_len: int, seed: int = 0,
               curriculum: Sequence[tuple[int, int]] = ()):
    if batch_size <= 0:
      raise ValueError(f"train.batch_size: expected > 0, found {batch_size}")
    self.corpus, self.batch_size, self.seed = corpus, batch_size, seed
    self.seq_len, self.curriculum = seq_len, tuple(curriculum)
    for t in {seq_len, *(t for _, t in self.curriculum)}:
      if t <= 0:
        raise ValueError(f"train.seq_len: expected > 0, found {t}")
      if len(corpus.train) < t + 2:
        raise ValueError(f"train.seq_len={t}: the train split of {corpus.source!r} has only "
                         f"{len(corpus.train)} tokens (need ≥ {t + 2})")
    self.step = 0

  def seq_len_at(self, step: int) -> int:
    return seq_len_at(step, self.seq_len, self.curriculum)

  def batch(self, step: int) -> dict[str, np.ndarray]:
    return sample_batch(self.corpus.train, self.seed, step, self.batch_size,
                        self.seq_len_at(step))

  def fingerprint(self):
    return self.corpus.fingerprint()


def restored_step(state: dict, fingerprint, seed: int) -> int:
  """The step of a checkpointed iterator state {"step", "seed", "data"}, checked against the
  current data's fingerprint and seed (a ValueError names the mismatch)."""
  if state.get("data") != fingerprint:
    raise ValueError(f"data iterator state: the checkpoint was written for data "
                     f"{state.get('data')}, but the current data is {fingerprint}")
  if state.get("seed") != seed:
    raise ValueError(f"data iterator state: checkpoint seed {state.get('seed')} != "
                     f"config seed {seed}")
  return int(state["step"])


def eval_batches(corpus: Corpus, num_batches: int, batch_size: int, seq_len: int,
                 seed: int = 0) -> list[dict[str, np.ndarray]]:
  """A fixed list of eval batches (the same at every evaluation of a run)."""
  if len(corpus.eval) < seq_len + 2:
    return []
  return [sample_batch(corpus.eval, seed + 1_000_003, i, batch_size, seq_len)
          for i in range(num_batches)]


def unigram_entropy(stream: np.ndarray, vocab_size: int) -> float:
  """Entropy (nats/token) of the token frequencies of a stream: the loss of the best
  context-free model, a yardstick a trained model must beat."""
  counts = np.bincount(np.asarray(stream, np.int64), minlength=vocab_size).astype(np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())
