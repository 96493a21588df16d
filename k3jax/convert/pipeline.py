"""PyTorch checkpoint directory ⇄ k3jax checkpoint (orbax, `k3jax.load_pretrained` layout).

convert(src, dst): config.json → ModelConfig; validate every tensor's presence, shape and dtype
against what the config implies (errors list the offending names); then write our leaves one
PyTorch tensor at a time straight into the checkpoint, by parallel workers or several hosts,
resumable (`k3jax.convert.streaming`). The result is assembled beside `dst` and renamed to it
only when complete, so an interrupted run never leaves a directory that looks like a
checkpoint.

export(src, dst): the inverse, to sharded safetensors + index + config.json (MXFP4 or unquantised
experts; K3's A_log padded to 128 when read per head, whole when read per key channel), also
via a temporary directory.

K3's A_log has 128 entries for 96 heads (§12): how to read them is decided before anything is
converted (`resolve_a_log`, --a_log auto|crop|channel) and recorded.

A config with a vision tower (`ModelConfig.vision`) converts and exports its 168 (MoonViT-V2)
`vision_tower.*` / `mm_projector.*` tensors with the text model (`names.vision_leaves`);
`only="vision"` converts or exports the tower + projector alone (`k3jax.convert.vision`, which
also reads Kimi K2.5's spellings: arch "kimi_k25").
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import re
import shutil
import threading
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax import hf_config
from k3jax.config import ModelConfig, config_to_dict
from k3jax.convert import names as N
from k3jax.convert import streaming
from k3jax.convert import vision as cv
from k3jax.convert.checkpoint import load_pretrained
from k3jax.convert.dtypes import release_dtype, release_rule
from k3jax.convert.output import STORE, check_dst, progress_bar, staged_dir
from k3jax.convert.safetensors_io import ShardedWriter, Source, read_config
from k3jax.convert.vision import ARCHS, convert_vision
from k3jax.model import K3Model



def resolve_arch(d: dict, arch: str) -> str:
  found = hf_config.detect_arch(d)
  if arch == "auto":
    return found
  if arch not in N.ARCHS:
    raise ValueError(f"--arch: expected auto, kimi_linear or kimi_k3, found {arch!r}")
  if arch != found:
    raise ValueError(f"--arch {arch}: config.json describes a {found} checkpoint "
                     f"(model_type {d.get('model_type')!r})")
  return arch


def _fmt_list(items: list, limit: int = 20) -> str:
  s = "\n  ".join(str(x) for x in items[:limit])
  more = f"\n  … and {len(items) - limit} more" if len(items) > limit else ""
  return "\n  " + s + more


# ml_dtypes' float types (numpy's dtype.kind is not "f" for them).
_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def _is_float(dt: np.dtype) -> bool:
  return dt.kind == "f" or dt.name in _FLOATS


def problems(infos: dict, leaves: list[N.Leaf]) -> dict[str, list[str]]:
  """Every difference between a checkpoint's tensors (`infos`: name → TensorInfo, headers
  only) and what `leaves` expect: {"missing", "unexpected", "shape", "dtype"} → lines naming
  each tensor with the expected and found value. A float tensor may have any float dtype
  (`dtype_report` lists conversions and departures from the release's table); MXFP4 bytes must
  be uint8. Nothing is read but the headers."""
  expected = {}
  for leaf in leaves:
    for slot in leaf.slots:
      for name, shape, kind in zip(slot.names, slot.shapes, slot.dtypes):
        expected[name] = (shape, kind)
  out = {"missing": sorted((n for n in expected if n not in infos), key=N._natural_key),
         "unexpected": sorted((n for n in infos if n not in expected), key=N._natural_key),
         "shape": [], "dtype": []}
  u8 = np.dtype(np.uint8)
  for name, (shape, kind) in expected.items():
    info = infos.get(name)
    if info is None:
      continue
    dt = info.dtype
    if tuple(info.shape) != tuple(shape):
      out["shape"].append(f"{name}: config.json implies shape {list(shape)}, found "
                          f"{list(info.shape)}")
    if kind == "uint8":
      if dt is not u8 and dt != u8:
        out["dtype"].append(f"{name}: expected dtype uint8 (MXFP4), found {dt}")
    elif not _is_float(dt):
      out["dtype"].append(f"{name}: expected a float dtype, found {dt}")
  out["shape"].sort(key=N._natural_key)
  out["dtype"].sort(key=N._natural_key)
  return out


def dtype_report(infos: dict, leaves: list[N.Leaf], arch: str,
                 store: np.dtype) -> tuple[dict[str, list[str]], list[str]]:
  """How a checkpoint's float tensors load, from the headers: (conversions, warnings).

  conversions: {"<found> -> <stored>": [names]}, every float tensor whose dtype differs from
  what the model keeps it as (`streaming.storage_dtype`: float32 for vectors, norms and the
  router, `store` for matmul weights). warnings (K3 only): one line per float tensor whose
  dtype differs from the release's table (`dtypes.RELEASE_DTYPES`): loaded all the same, since
  the small tensors' dtypes are partly a guess (§12). MXFP4 bytes (decoded or kept) and tensors
  absent from `infos` are `problems`' business.
  """
  conversions: dict[str, list[str]] = {}
  warnings = []
  for leaf in leaves:
    if leaf.mx or leaf.kind == "u8":
      continue
    stored = streaming.storage_dtype(leaf, store)
    for slot in leaf.slots:
      for name in slot.names:
        info = infos.get(name)
        if info is None or not _is_float(info.dtype):
          continue
        if info.dtype != stored:
          conversions.setdefault(f"{info.dtype.name} -> {stored.name}", []).append(name)
        if arch == "kimi_k3" and info.dtype != (table := release_dtype(name)):
          warnings.append(f"{name}: {info.dtype.name}, the release's table says {table.name} "
                          f"({release_rule(name).source}); loaded as {stored.name}")
  for names in conversions.values():
    names.sort(key=N._natural_key)
  return dict(sorted(conversions.items())), sorted(warnings, key=N._natural_key)


def report(found: dict[str, list[str]], limit: int = 20) -> str:
  """The text of `problems(...)`: one section per kind, empty when the checkpoint matches."""
  titles = {"missing": "missing tensor(s)", "unexpected": "unexpected tensor(s) (not used by "
            "this config; --skip_prefix names prefixes to leave out)",
            "shape": "tensor(s) disagree with config.json (shape)",
            "dtype": "tensor(s) disagree with config.json (dtype)"}
  return "\n".join(f"{len(v)} {titles[k]}:{_fmt_list(v, limit)}" for k, v in found.items() if v)


def validate(infos: dict, leaves: list[N.Leaf], arch: str, where: str) -> None:
  """Raise ValueError listing missing / unexpected / wrong-shape / wrong-dtype tensors."""
  text = report(problems(infos, leaves))
  if text:
    raise ValueError(f"checkpoint {where!r} does not match its config.json ({arch}):\n{text}")


_HF_DENSE_ALIAS = re.compile(r"^(.*layers\.\d+\.)block_sparse_moe\.((gate|up|down)_proj\.weight)$")


def normalize_names(source: Source) -> list[tuple[str, str]]:
  """Accept transformers' spelling of the dense MLP as Moonshot's. Returns the renames done.

  transformers 5.x `save_pretrained` of KimiLinearForCausalLM inverts its load-time rename
  `.block_sparse_moe.` → `.mlp.` on every layer, so the *dense* layer 0 comes out as
  `layers.0.block_sparse_moe.{gate,up,down}_proj.weight` instead of Moonshot's
  `layers.0.mlp.*` (a transformers bug). A name is aliased only when it cannot be a MoE
  tensor (MoE layers have no bare `block_sparse_moe.gate_proj`).
  """
  renames = []
  for name in list(source.infos):
    if not name.endswith("_proj.weight") or ".block_sparse_moe." not in name:
      continue   # cheap filter first: a release has ~500k names
    m = _HF_DENSE_ALIAS.match(name)
    if m:
      new = f"{m.group(1)}mlp.{m.group(2)}"
      if new not in source.infos:
        source.alias(name, new)
        renames.append((name, new))
  return renames


ONLY = ("all", "vision")
PARTS_PER_WORKER = 8   # more parts than workers: the last ones finish together


def fresh_mtp(config: ModelConfig, seed: int = 0) -> dict:
  """{"params": {...}, "balance": {...}} of the MTP layer exactly as
  `K3Model(config).init(jax.random.key(seed), tokens)` creates it (numpy float32 leaves).

  The whole init is traced but only the MTP subtree is returned from the jitted function, so
  XLA computes (and allocates) nothing else: the rest of the model is dead code.
  """
  def init(key):
    v = nn.unbox(K3Model(config).init(key, jnp.zeros((1, 2), jnp.int32)))
    return {c: v[c]["mtp"] for c in ("params", "balance") if c in v and "mtp" in v[c]}
  out = jax.jit(init)(jax.random.key(seed))
  return jax.tree.map(np.asarray, out)


def _skip(infos: dict, skip_prefix: tuple[str, ...]) -> tuple[dict, list[str]]:
  """(infos without the names under `skip_prefix`, the skipped names)."""
  if not skip_prefix:
    return infos, []
  skipped = [n for n in infos if n.startswith(skip_prefix)]
  return {n: i for n, i in infos.items() if not n.startswith(skip_prefix)}, skipped


# ---------------------------------------------------------------------- A_log's reading
# --a_log: how K3's 128-entry A_log is read for 96 heads (§12; docs/notes/convert.md, "When the
# converter stops on A_log"): "crop" keeps the first H entries as the heads' rates
# (kda_a_log_axis "head"), "channel" takes all of them as one rate per key dimension shared by
# the heads ("channel"), "auto" follows config.json's `a_log_per_channel` when it has one (a
# k3jax export) and otherwise crops only when every entry past the heads is exactly zero.
A_LOG_FLAGS = ("auto", "crop", "channel")
_AXIS = {"crop": "head", "channel": "channel"}
_READING = {"head": "crop", "channel": "channel"}


def _stats(x: np.ndarray) -> str:
  x = np.asarray(x, np.float64)
  return f"mean {x.mean():.4g}, std {x.std():.4g}, min {x.min():.4g}, max {x.max():.4g}"


def _layer_of(name: str) -> str:
  m = re.search(r"layers\.(\d+)\.", name)
  return f"layer {m.group(1)}" if m else name


def resolve_a_log(flag: str, declared: str | None, config: ModelConfig, source: Source,
                  infos: dict, names: list[str]) -> tuple[str, dict]:
  """The axis K3's A_log is read along (`ModelConfig.text.kda_a_log_axis`) and the record of the
  decision for the log and conversion.json: {"reading": "crop" | "channel" ("head" for Kimi
  Linear's layout), "kda_a_log_axis", "decided_by"[, "layers", "dropped"]}.

  flag: --a_log (A_LOG_FLAGS). declared: config.json's `a_log_per_channel` as an axis, or None
  (the release says nothing). names: the A_log tensors (`names.a_log_names`, [] for Kimi
  Linear's layout); each one present with one axis is read (512 bytes each for the release),
  the others are left to `validate`'s report. "auto" without a declaration crops when every
  entry past the heads is exactly zero and otherwise stops with a ValueError showing the
  values' statistics and both flags; an explicit "crop" drops non-zero entries, counted in the
  record ("dropped"). A flag that contradicts the declaration is a ValueError.
  """
  if flag not in A_LOG_FLAGS:
    raise ValueError(f"--a_log: expected one of {list(A_LOG_FLAGS)}, found {flag!r}")
  if not names:   # Kimi Linear's A_log [1,1,H,1]: one rate per head, nothing to decide
    if flag != "auto":
      raise ValueError(f"--a_log={flag}: applies to K3's 128-entry A_log; this checkpoint "
                       "stores A_log per head ([1,1,H,1], Kimi Linear)")
    axis = declared or "head"
    return axis, {"reading": "head" if axis == "head" else "channel", "kda_a_log_axis": axis,
                  "decided_by": "the layout: A_log [1,1,H,1], one rate per head"}
  if declared is not None and flag != "auto" and _AXIS[flag] != declared:
    raise ValueError(
        f"--a_log={flag} contradicts config.json: linear_attn_config.a_log_per_channel is "
        f"{str(declared == 'channel').lower()} (A_log read per {declared}); pass --a_log=auto "
        f"or --a_log={_READING[declared]}")
  h, k = config.text.kda_num_heads, config.text.kda_head_dim
  values = [(n, source.get(n)) for n in names if n in infos and len(infos[n].shape) == 1]
  nonzero = [(n, a) for n, a in values if np.any(a[h:])]
  record: dict = {"layers": len(values)}
  if flag != "auto":
    axis, record["decided_by"] = _AXIS[flag], f"--a_log={flag}"
  elif declared is not None:
    axis, record["decided_by"] = declared, "config.json: linear_attn_config.a_log_per_channel"
  elif not nonzero:
    axis = "head"
    record["decided_by"] = (f"--a_log=auto: the entries past the {h} heads are zero in all "
                            f"{len(values)} KDA layers")
  else:
    name, a = nonzero[0]
    p = a.shape[0]
    channel = (f"the {p} values are one decay rate per key dimension, shared by the {h} heads; "
               "nothing is dropped" if p == k else
               f"not possible here: it needs {k} entries (kda_head_dim), found {p}")
    raise ValueError(
        f"A_log: {name} has {p} entries for {h} heads, and entries {h}–{p - 1} are not zero "
        f"padding (non-zero in {len(nonzero)} of {len(values)} KDA layers), so reading it is a "
        f"decision the converter does not make for you.\n"
        f"  {_layer_of(name)}, entries {h}–{p - 1}: {_stats(a[h:])} "
        f"({np.count_nonzero(a[h:])} of {p - h} non-zero)\n"
        f"  {_layer_of(name)}, all {p} entries: {_stats(a)}\n"
        f"Convert again with one of:\n"
        f"  --a_log=channel  {channel}\n"
        f"  --a_log=crop     the first {h} values are the heads' rates; entries {h}–{p - 1} are "
        f"dropped (counted in the log and conversion.json)\n"
        f"(docs/notes/convert.md, \"When the converter stops on A_log\")")
  if axis == "head" and nonzero:
    dropped = np.concatenate([a[h:] for _, a in nonzero]).astype(np.float64)
    record["dropped"] = {"layers": len(nonzero), "nonzero_entries": int(np.count_nonzero(dropped)),
                         "max_abs": float(np.abs(dropped).max())}
  return axis, {"reading": _READING[axis], "kda_a_log_axis": axis, **record}


def _a_log_line(record: dict) -> str:
  """One log line for `resolve_a_log`'s record."""
  line = f"A_log: read as {record['reading']} ({record['decided_by']})"
  if "dropped" in record:
    d = record["dropped"]
    line += (f"; dropped {d['nonzero_entries']} non-zero entries past the heads in "
             f"{d['layers']} layer(s), max |value| {d['max_abs']:.4g}")
  return line


def convert(src: str | os.PathLike, dst: str | os.PathLike | None, arch: str = "auto",
            dtype: str = "float32", allow_torch_pickle: bool = False, progress: bool = True,
            log: Callable[[str], None] = print, only: str = "all",
            skip_prefix: tuple[str, ...] | list[str] = (), check_only: bool = False,
            mtp_seed: int = 0, workers: int = 1, process_index: int = 0,
            process_count: int = 1, wait_timeout_s: float | None = None, a_log: str = "auto",
            **config_overrides) -> pathlib.Path | None:
  """Convert a PyTorch checkpoint directory into a k3jax checkpoint at `dst`. Returns `dst`
  (None for --check_only, and for processes other than 0 of a multi-process conversion).

  dtype: storage of matmul weights ("float32" or "bfloat16"); norms, A_log, dt_bias, convs and
  the router stay float32 whatever it says; vision tensors follow it. Source float tensors may
  be in any float dtype (bf16, fp16, fp32, fp8): each one converted is logged by kind and
  listed in `dst/conversion.json` ("dtype_conversions"); a K3 tensor whose dtype differs from
  the release's table (k3jax/convert/dtypes.py) is a warning ("dtype_warnings"), never an
  error. MXFP4 pairs must be uint8 with their exact shapes.
  only: "all" (text model, and the vision tower when config.json has a vision_config) or
  "vision" (the tower + projector alone, `k3jax.convert.vision.convert_vision`; arch
  kimi_k3 or kimi_k25, "auto" reads config.json's model_type).
  Text tensors may be spelled `language_model.model.*` or bare `model.*` (not both).
  skip_prefix: source tensors whose names start with one of these are left out (reported);
  any other tensor the config does not use is an error. Skipping `vision_tower.` and
  `mm_projector.` converts the text model alone (the vision tower is dropped from the config).
  a_log: how K3's 128-entry A_log is read (`resolve_a_log`, A_LOG_FLAGS): "auto" (crop when
  the entries past the heads are zero, else stop with their statistics), "crop" (per head) or
  "channel" (per key dimension, shared by the heads). The reading becomes the result's
  `kda_a_log_axis`; it is logged and recorded in `dst/conversion.json` ("a_log"), with a count
  of any non-zero entry "crop" drops.
  MTP: the release has no MTP tensors. When the config has an MTP layer and the source holds
  none of its `k3jax_mtp.*` tensors, the layer is initialised as `K3Model.init` does (seed
  `mtp_seed`), reported through `log` and in `dst/conversion.json`.
  check_only: read config.json, the index and every shard's header (no tensor data but K3's
  A_log vectors, 512 bytes each, when `a_log` is "auto"), report every problem (ValueError) or
  log a summary; nothing is written and `dst` is not used.
  workers: processes converting at once (1: this process, plus workers − 1 spawned); the
  leaves are split into parts (`process_count × workers`, × PARTS_PER_WORKER when workers > 1;
  fixed when the conversion starts), each written straight into the checkpoint by one worker
  (`k3jax.convert.streaming`).
  process_index, process_count: process i of n (one per host, `dst` on a filesystem all of
  them see) converts parts k ≡ i (mod n); process 0 then waits for the others' parts
  (`wait_timeout_s`, None: forever) and saves the checkpoint. The others return None.
  Resume: an interrupted conversion leaves `.<dst name>.partial/` beside dst; rerunning with
  the same source and settings skips the leaves it completed. A data error (ValueError)
  removes it: nothing is left behind.
  """
  src = pathlib.Path(src)
  if only not in ONLY:
    raise ValueError(f"--only: expected one of {list(ONLY)}, found {only!r}")
  if dtype not in STORE:
    raise ValueError(f"--dtype: expected one of {sorted(STORE)}, found {dtype!r}")
  skip_prefix = tuple(skip_prefix)
  if any(not p for p in skip_prefix):
    raise ValueError("--skip_prefix: an empty prefix would skip every tensor")
  if not 0 <= process_index < process_count:
    raise ValueError(f"--process_index {process_index} must be in [0, --process_count "
                     f"{process_count})")
  if workers < 1:
    raise ValueError(f"--workers must be ≥ 1, found {workers}")
  if not check_only:
    dst = pathlib.Path(dst)
    check_dst(dst)
  d = read_config(src)
  if only == "vision" or arch == "kimi_k25":
    if only != "vision":
      raise ValueError("--arch kimi_k25: only the vision tower converts (pass --only vision); "
                       "the K2.5 text model (DeepSeek-V3 layout) is not a k3jax model")
    if check_only or skip_prefix or a_log != "auto":
      raise ValueError("--only vision: --check_only, --skip_prefix and --a_log apply to full "
                       "conversions")
    if arch == "auto":
      arch = d.get("model_type") if d.get("model_type") in ARCHS else "?"
      if arch == "?":
        raise ValueError(f"--only vision --arch auto: config.json model_type "
                         f"{d.get('model_type')!r} is not one of {list(ARCHS)}")
    if config_overrides:
      raise ValueError(f"--only vision: config overrides {sorted(config_overrides)} apply to "
                       "the text model only")
    return convert_vision(src, dst, arch=arch, dtype=dtype,
                          allow_torch_pickle=allow_torch_pickle, progress=progress, log=log)
  arch = resolve_arch(d, arch)
  if "kda_a_log_axis" in config_overrides:
    raise ValueError("kda_a_log_axis: K3's A_log reading is chosen with --a_log "
                     f"({'|'.join(A_LOG_FLAGS)}), not a config override")
  config = hf_config.from_hf_config(d, **{"param_dtype": dtype, "dtype": dtype,
                                          **config_overrides})
  for key, why in hf_config.ignored_keys(d).items():
    log(f"config.json: ignoring {key!r}: {why}")
  source = Source(src, allow_torch_pickle=allow_torch_pickle)
  renamed = normalize_names(source)
  if renamed:
    log(f"read {len(renamed)} tensor(s) under transformers' names (e.g. {renamed[0][0]})")
  infos, skipped = _skip(source.infos, skip_prefix)
  if skipped:
    log(f"skipping {len(skipped)} tensor(s) under --skip_prefix {list(skip_prefix)} "
        f"(e.g. {skipped[0]})")
  if config.vision is not None and all(
      n.startswith(skip_prefix) for leaf in N.vision_leaves(config.vision)
      for s in leaf.slots for n in s.names):
    log("the vision tower is skipped (--skip_prefix): converting the text model alone")
    config = config.replace(vision=None, media_placeholder_token_id=None)
  text_prefix = N.detect_text_prefix(infos)
  # The source's routed experts: MXFP4 pairs when config.json says so (the release), else
  # unquantised (Kimi Linear; a K3 export with --expert_format bf16).
  source_experts = hf_config.check_quantization_config(d) or "bf16"
  if config.modes.expert_format == "mxfp4" and source_experts != "mxfp4":
    raise ValueError("--expert_format mxfp4 keeps the source's MXFP4 bytes, but its "
                     "config.json has no quantization_config: its experts are unquantised "
                     "(convert with --expert_format bf16)")
  axis, a_log_record = resolve_a_log(a_log, hf_config.declared_a_log_axis(d), config, source,
                                     infos, N.a_log_names(config, text_prefix))
  config = config.replace(kda_a_log_axis=axis)
  log(_a_log_line(a_log_record))
  leaves = N.leaves(config, arch, source_experts, text_prefix=text_prefix)
  mtp_names = {n for leaf in leaves if N.is_mtp(leaf) for s in leaf.slots for n in s.names}
  new_mtp = bool(mtp_names) and not any(n in infos for n in mtp_names)
  if new_mtp:   # the release: no MTP tensors at all (some but not all is a `missing` error)
    leaves = [leaf for leaf in leaves if not N.is_mtp(leaf)]
  store = STORE[dtype]
  conversions, dtype_warnings = dtype_report(infos, leaves, arch, store)
  if dtype_warnings:
    log(f"warning: {len(dtype_warnings)} float tensor(s) in another dtype than the release's "
        f"table (k3jax/convert/dtypes.py) — loaded and converted all the same:"
        f"{_fmt_list(dtype_warnings)}")
  validate(infos, leaves, arch, str(source.dir))
  if conversions:
    log(f"dtypes: {sum(map(len, conversions.values()))} float tensor(s) converted to the "
        "model's parameter dtypes (" + ", ".join(f"{k} ×{len(v)}" for k, v in conversions.items())
        + ")" + ("" if check_only else "; each listed in conversion.json"))
  n_tensors = sum(len(s.names) for leaf in leaves for s in leaf.slots)
  total = sum(infos[n].nbytes for leaf in leaves for s in leaf.slots for n in s.names)
  mtp_note = (f"the source has no MTP tensors; the config's MTP layer is initialised as "
              f"K3Model.init does (seed {mtp_seed})") if new_mtp else None
  if check_only:
    log(f"check: {str(source.dir)!r} matches its config.json ({arch}, text prefix "
        f"{text_prefix + 'model.'!r}): {n_tensors} tensors, {total / 2**30:.2f} GiB"
        + (f"; {mtp_note}" if mtp_note else ""))
    return None
  # The checkpoint matches the config. That our map builds exactly the model's variables is
  # checked from jax.eval_shape of the model (seconds of tracing), in a thread while the
  # leaves are written: a mismatch is a bug of this converter, reported before saving.
  def check_map():
    # Lowest CPU priority for this thread: the writers come first on a busy machine.
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    model_tree = N.model_paths(config)
    if new_mtp:
      model_tree = {k: v for k, v in model_tree.items() if k[1:2] != ("mtp",)}
    N.check_paths(leaves, model_tree)
  checker = concurrent.futures.ThreadPoolExecutor(1)
  map_checked = checker.submit(check_map)
  checker.shutdown(wait=False)

  source_bytes = [sum(infos[n].nbytes for s in leaf.slots for n in s.names) for leaf in leaves]
  stage = streaming.Stage.of(dst)
  plan, resumed = streaming.open_stage(stage, {
      "version": streaming.PLAN_VERSION, "source_files": streaming.fingerprint(source),
      "arch": arch, "dtype": dtype, "text_prefix": text_prefix,
      "config": config_to_dict(config), "skip_prefix": list(skip_prefix),
      "mtp": "fresh" if new_mtp else "converted", "mtp_seed": mtp_seed if new_mtp else None,
      "leaves": [streaming.param_name(leaf) for leaf in leaves],
      "parts": process_count * workers * (PARTS_PER_WORKER if workers > 1 else 1)})
  n_parts = plan["parts"]
  parts = streaming.assign_parts(leaves, source_bytes, n_parts)
  mine = [k for k in range(n_parts) if k % process_count == process_index]
  if resumed:
    done = sum(len(stage.done_names(k)) for k in range(n_parts))
    log(f"resuming the conversion in {str(stage.root)!r}: {done} of {len(leaves)} leaves "
        "already written")
  jobs = [streaming.PartJob(src=str(source.dir), allow_torch_pickle=allow_torch_pickle,
                            aliases=tuple(renamed), stage=str(stage.root), part=k,
                            leaves=tuple(leaves[i] for i in parts[k]), dtype=store.name)
          for k in mine if not stage.complete(k)]
  todo = sum(source_bytes[i] for k in mine if not stage.complete(k) for i in parts[k])
  try:
    with progress_bar(todo, "convert", progress) as bar:
      bar.set_postfix_str(f"{len(jobs)} part(s), {min(max(1, workers), len(jobs) or 1)} "
                          "worker(s)", refresh=False)
      streaming.run_parts(jobs, workers, bar)
    map_checked.result()
    if process_index != 0:
      log(f"process {process_index} of {process_count}: part(s) {mine} written; process 0 "
          "saves the checkpoint")
      return None
    streaming.wait_for_parts(stage, n_parts, log, wait_timeout_s)
    in_memory: dict = {}
    if new_mtp:
      log(f"MTP: {mtp_note}")
      in_memory = {coll: {"mtp": tree} for coll, tree in fresh_mtp(config, mtp_seed).items()}
    meta = {"source": str(source.dir.resolve()), "arch": arch,
            "text_prefix": text_prefix + "model.", "tensors": n_tensors, "source_bytes": total,
            "skipped_prefixes": list(skip_prefix), "skipped_tensors": len(skipped),
            "mtp": ("fresh" if new_mtp else "converted") if config.text.num_mtp_layers else "none",
            "mtp_note": mtp_note, "a_log": a_log_record, "dtype_conversions": conversions,
            "dtype_warnings": dtype_warnings, "parts": n_parts, "resumed": resumed}
    log(f"writing orbax checkpoint ({len(leaves)} leaves)")
    streaming.save(stage, config, leaves, store, n_parts, in_memory, meta, dst)
  except ValueError:
    # Bad data (not an interruption): rerunning cannot help, so leave nothing behind.
    shutil.rmtree(stage.root, ignore_errors=True)
    raise
  return dst


# ---------------------------------------------------------------------- export
def _get(tree: dict, path: tuple):
  for p in path:
    if not isinstance(tree, dict) or p not in tree:
      return None
    tree = tree[p]
  return tree


def _flat_paths(tree, prefix=()):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _flat_paths(v, prefix + (k,))
  else:
    yield prefix


def export(src: str | os.PathLike, dst: str | os.PathLike, arch: str | None = None,
           expert_format: str | None = None, dtype: str = "bfloat16",
           max_shard_bytes: int = 4 << 30, progress: bool = True,
           loaded: tuple[ModelConfig, dict] | None = None, only: str = "all",
           text_prefix: str | None = None, mtp: bool = False,
           log: Callable[[str], None] = print) -> pathlib.Path:
  """Write a k3jax checkpoint (`src`, or an already `loaded` (config, variables)) as a
  PyTorch-layout directory: safetensors shards of at most `max_shard_bytes` +
  `model.safetensors.index.json` + config.json (with the release's `quantization_config` when
  experts are MXFP4).

  Dtypes are the release's table (`dtypes.RELEASE_DTYPES`: uint8 MXFP4 bytes, fp32 A_log,
  dt_bias, convs, o_norm and router bias, everything else — router included — bf16), the bf16
  entries written in `dtype` (float32: fp32 masters exactly).
  Names are the release's (§12): `language_model.model.*` / `language_model.lm_head.weight`
  when the config has a vision tower, bare `model.*` / `lm_head.weight` otherwise
  (`text_prefix` "language_model." or "" overrides). The release has no MTP tensors, so the
  MTP layer is left out unless `mtp=True`, which writes it under `k3jax_mtp.*` (a name no
  release loader reads; `convert` reads it back). With a vision tower its tensors are written
  too (release names, `dtype`). only="vision", or `src` a vision-only conversion
  (`vision_config.json`): the tower + projector alone (`k3jax.convert.vision.export_vision`).
  """
  src, dst = pathlib.Path(src) if src else None, pathlib.Path(dst)
  if only not in ONLY:
    raise ValueError(f"--only: expected one of {list(ONLY)}, found {only!r}")
  if dtype not in STORE:
    raise ValueError(f"--dtype: expected one of {sorted(STORE)}, found {dtype!r}")
  check_dst(dst)
  if loaded is None and src is not None and (src / cv.CONFIG_FILE).exists():
    return cv.export_vision(src, dst, dtype=dtype, progress=progress)
  if loaded is None:
    loaded = load_pretrained(src)
  config, variables = loaded
  if only == "vision":
    if config.vision is None:
      raise ValueError("--only vision: the checkpoint's config has no vision tower")
    params = variables.get("params", {})
    return cv.export_vision(None, dst, dtype=dtype, progress=progress,
                            media_placeholder_token_id=config.media_placeholder_token_id,
                            loaded=(config.vision, {"params": {
                                k: params[k] for k in ("vision_tower", "mm_projector")
                                if k in params}}))
  arch = arch or ("kimi_k3" if hf_config.is_k3_style(config) else "kimi_linear")
  expert_format = expert_format or ("mxfp4" if arch == "kimi_k3" else "bf16")
  have = {p: tuple(np.shape(_get(variables, p))) for c in ("params", "balance")
          if c in variables for p in _flat_paths(variables[c], (c,))}
  if config.text.num_mtp_layers and not mtp:
    have = {p: s for p, s in have.items() if p[1:2] != ("mtp",)}
    log("MTP layer not written (the release has none); export(mtp=True) / --mtp writes it "
        f"under {N.MTP_PREFIX}*")
  leaves = N.leaves(config, arch, expert_format, text_prefix=text_prefix, mtp=mtp)
  # Our tree must hold exactly these leaves with these shapes.
  want = {(l.collection,) + l.path: l.shape for l in leaves}
  missing = sorted("/".join(p) for p in set(want) - set(have))
  extra = sorted("/".join(p) for p in set(have) - set(want))
  wrong = sorted(f"{'/'.join(p)}: expected {list(want[p])}, found {list(have[p])}"
                 for p in set(want) & set(have) if want[p] != have[p])
  if missing or extra or wrong:
    raise ValueError("variables do not match the config:"
                     + (f"\n missing:{_fmt_list(missing)}" if missing else "")
                     + (f"\n unexpected:{_fmt_list(extra)}" if extra else "")
                     + (f"\n wrong shape:{_fmt_list(wrong)}" if wrong else ""))

  store = STORE[dtype]
  plan = N.tensor_plan(leaves, store)
  where = {name: (leaf, slot, k) for leaf in leaves for slot in leaf.slots
           for k, name in enumerate(slot.names)}

  with staged_dir(dst) as tmp:
    writer = ShardedWriter(tmp, plan, max_shard_bytes=max_shard_bytes)
    pending: dict = {}
    with progress_bar(writer.total_bytes, "export", progress) as bar:
      for name, dt, _ in plan:
        leaf, slot, k = where[name]
        if name not in pending:
          x = np.asarray(_get(variables, (leaf.collection,) + leaf.path))[slot.index]
          for n2, a in zip(slot.names, N.from_ours(leaf, slot, x, dt)):
            pending[n2] = a
        a = pending.pop(name)
        writer.write(name, a)
        bar.update(a.nbytes)
    writer.close()
    cfg = hf_config.to_hf_config(config, arch, expert_format)
    tc = hf_config.text_config(cfg)
    tc["torch_dtype"] = dtype
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
  return dst


__all__ = ["convert", "export", "validate", "read_config", "resolve_arch"]
