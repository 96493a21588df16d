"""Streaming safetensors reader/writer (numpy, one tensor at a time; no whole-file loads).

A safetensors file is: 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the raw
little-endian tensor bytes (offsets relative to the end of the header). Parsing it ourselves
keeps memory at one tensor, supports bf16 / fp8 through ml_dtypes, and lets us check that every
tensor's bytes are really in the file (truncated downloads) before anything is converted.

Directory layouts: `model.safetensors`, or shards `*.safetensors` named by
`model.safetensors.index.json` ({"weight_map": {name: shard file}}). PyTorch pickles
(`*.bin`, `*.pt`) are refused unless `allow_torch_pickle`, and then read with
`torch.load(weights_only=True)` (no arbitrary code).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import pathlib
import struct
from typing import Iterable

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class TensorInfo:
  """Where one tensor lives: file, dtype, shape, absolute byte range."""
  __slots__ = ("file", "dtype", "shape", "start", "end")

  def __init__(self, file, dtype, shape, start, end):
    self.file, self.dtype, self.shape, self.start, self.end = file, dtype, shape, start, end

  @property
  def nbytes(self) -> int:
    return self.end - self.start


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
  """Parse one safetensors header; ValueError if it is malformed or the file is truncated.
  Every TensorInfo's `file` is `path` itself when it is a pathlib.Path (Source compares by
  identity)."""
  path = path if isinstance(path, pathlib.Path) else pathlib.Path(path)
  size = path.stat().st_size
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) < 8:
      raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header)")
    (n,) = struct.unpack("<Q", raw)
    if n > size - 8:
      raise ValueError(f"{path}: truncated safetensors file (header says {n} bytes, file has "
                       f"{size - 8} after the length)")
    try:
      header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ValueError(f"{path}: unreadable safetensors header: {e}") from None
  base = 8 + n
  out = {}
  # Plain-Python arithmetic per entry (a release header has ~5,000 entries per shard and
  # 497,220 in all: numpy scalar calls here dominated `--check_only`).
  for name, h in header.items():
    if name == "__metadata__":
      continue
    dt = DTYPES.get(h.get("dtype"))
    if dt is None:
      raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {h.get('dtype')!r}")
    shape = tuple(map(int, h["shape"]))
    b, e = map(int, h["data_offsets"])
    want = math.prod(shape) * dt.itemsize
    if e - b != want:
      raise ValueError(f"{path}: tensor {name!r} {h['dtype']}{list(shape)} needs {want} bytes, "
                       f"its offsets span {e - b}")
    if base + e > size:
      raise ValueError(f"{path}: truncated safetensors file: tensor {name!r} ends at byte "
                       f"{base + e}, file has {size}")
    out[name] = TensorInfo(path, dt, shape, base + b, base + e)
  return out


def _torch_to_numpy(t) -> np.ndarray:
  import torch  # optional: a test extra; only PyTorch pickles (.bin/.pt) need it
  t = t.detach().cpu().contiguous()
  if t.dtype == torch.bfloat16:
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return t.numpy()


class Source:
  """All tensors of a checkpoint directory, read lazily one at a time.

  `infos`: name → (dtype, shape) known from headers only. `get(name)` reads one tensor.
  """

  def __init__(self, directory: str | os.PathLike, allow_torch_pickle: bool = False):
    self.dir = pathlib.Path(directory)
    if not self.dir.is_dir():
      raise ValueError(f"--src: {str(self.dir)!r} is not a directory")
    self._torch_files: dict[str, pathlib.Path] = {}
    self._torch_cache: tuple[pathlib.Path, dict] | None = None
    self.infos: dict[str, TensorInfo] = {}
    self._aliases: dict[str, str] = {}
    index = self.dir / INDEX_NAME
    st_files = sorted(self.dir.glob("*.safetensors"))
    if index.exists():
      try:
        weight_map = json.loads(index.read_text())["weight_map"]
      except (json.JSONDecodeError, KeyError) as e:
        raise ValueError(f"{index}: not a safetensors index ({e})") from None
      shards = sorted(set(weight_map.values()))
      missing = [s for s in shards if not (self.dir / s).exists()]
      if missing:
        raise ValueError(f"{index} names shard(s) that do not exist: {missing}")
      files = {s: self.dir / s for s in shards}
      for s in shards:
        self.infos.update(read_header(files[s]))
      # Identity of the Path objects (one per shard) is the cheap test for ~500k names.
      infos = self.infos
      listed_elsewhere = sorted(n for n, s in weight_map.items()
                                if n not in infos or infos[n].file is not files[s])
      if listed_elsewhere:
        raise ValueError(f"{index}: tensors not found in the shard it names: "
                         f"{listed_elsewhere[:10]}{' …' if len(listed_elsewhere) > 10 else ''}")
    elif st_files:
      for s in st_files:
        for name, info in read_header(s).items():
          if name in self.infos:
            raise ValueError(f"tensor {name!r} is in both {self.infos[name].file.name} and "
                             f"{s.name}")
          self.infos[name] = info
    else:
      pickles = sorted(p for ext in ("*.bin", "*.pt", "*.pth") for p in self.dir.glob(ext))
      if not pickles:
        raise ValueError(f"--src {str(self.dir)!r}: no *.safetensors (or {INDEX_NAME}) found")
      if not allow_torch_pickle:
        raise ValueError(
            f"--src {str(self.dir)!r} holds only PyTorch pickles {[p.name for p in pickles]}; "
            "pickles can run code when loaded. Convert them to safetensors, or pass "
            "--allow_torch_pickle to read them with torch.load(weights_only=True)")
      for p in pickles:
        sd = self._load_pickle(p)
        for name, t in sd.items():
          self._torch_files[name] = p
          arr_dtype = _torch_to_numpy(t[:0] if t.ndim else t).dtype
          self.infos[name] = TensorInfo(p, arr_dtype, tuple(t.shape), 0,
                                        int(t.numel()) * t.element_size())
        self._torch_cache = (p, sd)

  def _load_pickle(self, p: pathlib.Path) -> dict:
    import torch  # optional: a test extra; only PyTorch pickles (.bin/.pt) need it
    sd = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(sd, dict):
      raise ValueError(f"{p}: expected a state dict, found {type(sd).__name__}")
    return sd

  def alias(self, old: str, new: str) -> None:
    """Read tensor `old` under the name `new` from now on."""
    self.infos[new] = self.infos.pop(old)
    self._aliases[new] = old

  def names(self) -> list[str]:
    return sorted(self.infos)

  def get(self, name: str, copy: bool = True) -> np.ndarray:
    """Read one tensor in its stored dtype: a fresh array, or with copy=False a read-only
    view of a memory map of its bytes (no copy; the pages are the page cache's, and leave this
    process when the returned array is garbage-collected, which unmaps them)."""
    info = self.infos[name]
    if self._torch_files:
      orig = self._aliases.get(name, name)
      p = self._torch_files[orig]
      if self._torch_cache is None or self._torch_cache[0] != p:
        self._torch_cache = (p, self._load_pickle(p))
      return _torch_to_numpy(self._torch_cache[1][orig])
    if not copy:
      return map_tensor(info)
    out = np.empty(info.shape, info.dtype)
    with open(info.file, "rb") as f:
      f.seek(info.start)
      n = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
    if n != info.nbytes:
      raise ValueError(f"{info.file}: truncated while reading {name!r}")
    return out


def map_tensor(info: TensorInfo) -> np.ndarray:
  """A read-only numpy view of one tensor's bytes through its own mmap of just that range
  (page-aligned start), so that dropping the array unmaps exactly those pages."""
  if info.nbytes == 0:
    return np.empty(info.shape, info.dtype)
  start = info.start - info.start % mmap.ALLOCATIONGRANULARITY
  with open(info.file, "rb") as f:
    m = mmap.mmap(f.fileno(), info.end - start, access=mmap.ACCESS_READ, offset=start)
  m.madvise(mmap.MADV_SEQUENTIAL)   # read-ahead: tensors are read front to back
  return np.frombuffer(m, info.dtype, math.prod(info.shape), info.start - start).reshape(
      info.shape)


def read_config(src: pathlib.Path) -> dict:
  """The config.json of checkpoint directory `src` as a dict (errors name the file)."""
  p = pathlib.Path(src) / "config.json"
  if not p.exists():
    raise ValueError(f"--src {str(src)!r}: no config.json")
  try:
    return json.loads(p.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{p}: not valid JSON ({e})") from None


# ---------------------------------------------------------------------- writing
def header_bytes(entries: list[tuple[str, np.dtype, tuple]], metadata: dict | None) -> bytes:
  """A safetensors header (length prefix + JSON, padded) for tensors (name, dtype, shape)
  laid out back to back in `entries` order."""
  header, off = {}, 0
  for name, dtype, shape in entries:
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    header[name] = {"dtype": DTYPE_NAMES[np.dtype(dtype)], "shape": list(shape),
                    "data_offsets": [off, off + n]}
    off += n
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)   # data starts 8-byte aligned
  return struct.pack("<Q", len(raw)) + raw


class ShardedWriter:
  """Writes tensors in a planned order into shards, streaming (one tensor in memory).

  plan: [(name, dtype, shape)] in write order. Shards hold up to `max_shard_bytes` (a tensor
  larger than that gets a shard of its own). One shard → `model.safetensors` without index;
  more → `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`.
  """

  def __init__(self, directory: str | os.PathLike, plan: Iterable[tuple[str, np.dtype, tuple]],
               max_shard_bytes: int = 4 << 30, metadata: dict | None = None):
    self.dir = pathlib.Path(directory)
    self.plan = [(n, np.dtype(d), tuple(s)) for n, d, s in plan]
    shards, cur, cur_bytes = [], [], 0
    for e in self.plan:
      nb = int(np.prod(e[2], dtype=np.int64)) * e[1].itemsize
      if cur and cur_bytes + nb > max_shard_bytes:
        shards.append(cur)
        cur, cur_bytes = [], 0
      cur.append(e)
      cur_bytes += nb
    if cur or not shards:
      shards.append(cur)
    self.shards = shards
    k = len(shards)
    self.files = ([SINGLE_NAME] if k == 1 else
                  [f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)])
    self.metadata = {"format": "pt", **(metadata or {})}
    self._shard_of = {e[0]: i for i, s in enumerate(shards) for e in s}
    self._next = 0           # index into self.plan
    self._fh = None
    self._open_shard = -1
    self.total_bytes = sum(int(np.prod(s, dtype=np.int64)) * d.itemsize for _, d, s in self.plan)

  def write(self, name: str, array: np.ndarray) -> None:
    want_name, dtype, shape = self.plan[self._next]
    if name != want_name:
      raise ValueError(f"ShardedWriter: expected tensor {want_name!r} next, got {name!r}")
    if array.shape != shape or array.dtype != dtype:
      raise ValueError(f"ShardedWriter: tensor {name!r} must be {dtype}{list(shape)}, found "
                       f"{array.dtype}{list(array.shape)}")
    shard = self._shard_of[name]
    if shard != self._open_shard:
      if self._fh:
        self._fh.close()
      self._fh = open(self.dir / self.files[shard], "wb")
      self._fh.write(header_bytes(self.shards[shard], self.metadata))
      self._open_shard = shard
    self._fh.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    self._next += 1

  def close(self) -> None:
    if self._fh:
      self._fh.close()
      self._fh = None
    if self._next != len(self.plan):
      raise ValueError(f"ShardedWriter: {len(self.plan) - self._next} planned tensors were not "
                       f"written (next: {self.plan[self._next][0]!r})")
    if len(self.files) > 1:
      index = {"metadata": {"total_size": self.total_bytes},
               "weight_map": {e[0]: self.files[i] for i, s in enumerate(self.shards) for e in s}}
      (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2))


def write_file(path: str | os.PathLike, tensors: dict[str, np.ndarray],
               metadata: dict | None = None) -> None:
  """Write a small dict of arrays as one safetensors file (tests and tools)."""
  path = pathlib.Path(path)
  entries = [(n, a.dtype, a.shape) for n, a in tensors.items()]
  with open(path, "wb") as f:
    f.write(header_bytes(entries, {"format": "pt", **(metadata or {})}))
    for a in tensors.values():
      f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)


__all__ = ["Source", "ShardedWriter", "read_header", "read_config", "write_file", "map_tensor",
           "TensorInfo", "DTYPES", "INDEX_NAME", "SINGLE_NAME"]
