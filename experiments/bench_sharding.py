"""Scale-out benchmark: compiled memory per device at pod scale, and EP vs replicated MoE.

Part "memory": the full training step (forward + backward + the real optimizer: Per-Head
Muon / AdamW + Quantile Balancing) of the `k3` preset is lowered and compiled — never run —
for a mesh of N devices, from abstract inputs only (`jax.ShapeDtypeStruct` with shardings; no
parameter is ever allocated), and `compiled.memory_analysis()` gives XLA's per-device buffer
plan (arguments = the state shard + the batch shard, outputs, temporaries).
  --target tpu (default): deviceless ahead-of-time compilation for a TPU topology
    (`jax.experimental.topologies.get_topology_desc`, e.g. v5p:8x8x4 = 256 chips). Needs the
    optional `libtpu` package (`pip install -e '.[tpu_aot]'`), but no TPU: the devices are
    compile-only; the process itself stays on JAX_PLATFORMS=cpu.
  --target cpu: N simulated CPU devices of a subprocess
    (`--xla_force_host_platform_device_count=N`); needs tens of GB of RAM at N=256.
  --devices 256 / 2048 apply that count's recommended recipe (`RECIPES`: layout, kernel and
    first-moment dtypes, Muon momentum in host memory or not, tokens per chip); --layout,
    --param_dtype, --mu_dtype, --offload_momentum and --seq_len override its fields.
  --num_layers L compiles a shallower k3 (same widths) — for the depth extrapolation in
    docs/notes/sharding.md, and for quick checks.
  --stage 8K|64K|256K|1M compiles configs/k3.py's curriculum stage as the config gives it
    (`stage_config`: sequence length, sequences per chip, layout with `fsdp_over_context`,
    RunModes, Muon offload; the stage's 4096 chips unless --devices/--topology/--layout say
    otherwise); --stage_modes / --fsdp_over_context override them for the attempts. Each entry
    also has the compiler's cost analysis (flops, bytes accessed) per chip and per token, the
    host-memory figures, and with --stage the stage's tokens per chip.
  --peak_buffers N adds XLA's own account of the plan's peak (`peak_live_buffers`: bytes live
    there on the device and in host memory, the N largest buffers and the ops that made them,
    the heap per memory space), read from a dump of that one compile.
  The model constrains its residual stream to batch sharding at every layer boundary
  (`k3jax.sharding.constrain_activations`). When XLA:TPU refuses a plan larger than the chip's HBM
  (RESOURCE_EXHAUSTED), that message is the result (an entry with "error"). XLA refuses only
  when the temporaries alone exceed the HBM; "fits" counts the arguments (the state) as well.

Part "state": per-device bytes of params + optimizer state from the shardings alone
(AbstractMesh; no compile); with --stage, the stage's layout with and without FSDP over context.

Part "cache": one request's decode cache at --inf_max_len tokens from its shapes (MLA latents,
KDA states), no compile.

Part "inference": the model's cached forward (`k3jax.serve.generate.forward`: one decode step of
--inf_tokens tokens per sequence over a cache of --inf_max_len, --inf_batch sequences) of k3
with **packed MXFP4 experts** (`expert_format="mxfp4"`, kernels and compute in bf16), lowered
from abstract values and compiled deviceless for a v5p slice like part "memory"; the cache is
donated. `INFERENCE_RECIPES` holds the slices tried (chips → layout, topology); with
--devices 0 every recipe is compiled and the smallest slice whose peak fits the chip's HBM is
reported ("smallest_fit"). Experts over `expert`, every other weight over fsdp+expert.

Part "qlora": the training state of a k3 QLoRA fine-tuning recipe (`QLORA_RECIPE`: routed
experts packed MXFP4 and frozen, every other base weight bf16 and frozen, fp32 LoRA adapters on
`--lora_targets` at `--lora_rank` with AdamW's two fp32 moments, k3jax/posttrain/lora.py) per chip,
for each slice of `INFERENCE_RECIPES` (or --devices), from the shardings of the LoRA step's
abstract state on an AbstractMesh (`k3jax.posttrain.lora.build_adapter_step`: no compile, no
devices): base weights, adapters, optimizer state. It is a lower bound of the compiled peak —
activations, gradients and temporaries are not in it; with libtpu installed the part "memory"
route (deviceless TPU compile) gives those, this part does not compile. "smallest_fit" is the
smallest slice whose state leaves at least `QLORA_HEADROOM_GIB` of the 95 GiB free. With
--qlora_compile (libtpu) the LoRA train step is also lowered and compiled for the slice's
compile-only TPU devices (the frozen base in the layouts the compiler chose, as a LoRA run
stores it: `ShardedStep(compiler_layouts=...)`): its peak (arguments + outputs − aliases +
temporaries) decides "fits", and a plan over the chip's HBM is XLA's refusal, reported.

Part "ep": on N simulated CPU devices (--ep_devices, default 8), the `small` preset's jitted
train step with experts sharded over `expert` (all_to_all dispatch) vs. the same step with
experts replicated and the batch split over `data`; one layout per subprocess
(informative only: CPU "devices" share the same cores). Default depth 2 (one dense + one MoE
layer) to fit a small machine's RAM.

Usage:
  .venv/bin/python experiments/bench_sharding.py                  # state + memory (TPU AOT) + ep
  .venv/bin/python experiments/bench_sharding.py --part memory --devices 256
  .venv/bin/python experiments/bench_sharding.py --part memory --devices 256 \
      --offload_momentum false                         # the 256 recipe, momentum on the chip
  .venv/bin/python experiments/bench_sharding.py --part memory --devices 2048 --num_layers 9
  .venv/bin/python experiments/bench_sharding.py --part memory --preset tiny --devices 4
      --layout fsdp=2,expert=2 --topology v5p:2x2x1 --seq_len 64      # a few CPU-minutes
  .venv/bin/python experiments/bench_sharding.py --part ep --ep_devices 4 --steps 5
  .venv/bin/python experiments/bench_sharding.py --part inference          # k3, packed experts
  .venv/bin/python experiments/bench_sharding.py --part inference --devices 32 --num_layers 9
  .venv/bin/python experiments/bench_sharding.py --part qlora              # k3 QLoRA state
  .venv/bin/python experiments/bench_sharding.py --part cache --inf_max_len 1048576
      # one request's decode cache from its shapes (no compile)
  PYTHONPATH=<libtpu dir> .venv/bin/python experiments/bench_sharding.py --part memory \
      --stage 1M                       # configs/k3.py's 1M stage on its 4096 chips
  PYTHONPATH=<libtpu dir> .venv/bin/python experiments/bench_sharding.py --part qlora \
      --devices 64 --qlora_compile                                    # + compiled peak
  --out FILE writes the JSON object too; the last printed line is that JSON.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from absl import app, flags

# Recommended recipes for the k3 preset (docs/notes/sharding.md gives the reasoning): the mesh
# layout, the dtype of the kernels (`param_dtype`) and of the optimizer's first moments
# (`mu_dtype`, "" = the parameters'), Muon's momentum in host memory or not, and tokens per
# chip (per_device_batch x seq_len).
RECIPES = {
    256: dict(layout=dict(data=1, fsdp=4, expert=64, context=1, tensor=1),
              param_dtype="bfloat16", mu_dtype="bfloat16", offload_momentum=True, seq_len=1024),
    2048: dict(layout=dict(data=1, fsdp=16, expert=64, context=1, tensor=2),
               param_dtype="float32", mu_dtype="", offload_momentum=False, seq_len=4096),
}
DEFAULTS = dict(param_dtype="float32", mu_dtype="", offload_momentum=False, seq_len=4096)
LAYOUTS = {n: r["layout"] for n, r in RECIPES.items()}
# TPU v5p slices (95 GiB HBM per chip) with those chip counts, for --target tpu.
TOPOLOGIES = {256: "v5p:8x8x4", 2048: "v5p:16x16x8", 4096: "v5p:16x16x16"}
# Inference with packed MXFP4 experts (1.56 TB of text weights: ≥ 16 chips of 95 GiB for the
# weights alone): experts over `expert`, the rest of the weights over fsdp+expert too.
INFERENCE_RECIPES = {
    16: dict(layout=dict(data=1, fsdp=1, expert=16, context=1, tensor=1), topology="v5p:2x2x4"),
    32: dict(layout=dict(data=1, fsdp=1, expert=32, context=1, tensor=1), topology="v5p:2x4x4"),
    64: dict(layout=dict(data=1, fsdp=1, expert=64, context=1, tensor=1), topology="v5p:4x4x4"),
}
V5P_HBM_GIB = 95.0
# k3 QLoRA fine-tuning (part "qlora"): packed frozen experts, bf16 frozen base, fp32 adapters on
# the attention, gate, shared-expert and latent projections (no per-expert adapters: at rank 16
# those alone are 26.6B parameters, tools/param_count), sequences of 4096 tokens, one per chip.
QLORA_RECIPE = dict(lora_rank=16, lora_targets=("q", "k", "v", "o", "gates", "shared", "latent"),
                    seq_len=4096)
QLORA_HEADROOM_GIB = 32.0   # left for activations (remat), gradients and temporaries
# Parameters sharded over fsdp AND expert (dense weights too), fallbacks to fsdp alone.
PARAM_AXES = ("fsdp", "expert")
LIBTPU_MISSING = (
    "--target tpu needs the optional `libtpu` package for deviceless TPU compilation (no TPU "
    "is needed): pip install -e '.[tpu_aot]' (pins the libtpu release of the installed jax). "
    "Or use --target cpu (simulated CPU devices; needs far more RAM and time).")


def parse_layout(text: str) -> dict[str, int]:
  """'fsdp=2,expert=2' -> {'fsdp': 2, 'expert': 2} (missing mesh axes are 1)."""
  out = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    name, sep, val = item.partition("=")
    if not sep or not val.strip().lstrip("-").isdigit():
      raise ValueError(f"--layout: expected axis=size pairs like 'fsdp=4,expert=64', "
                       f"found {item!r}")
    out[name.strip()] = int(val)
  return out


def parse_modes(text: str | None, flag: str = "--stage_modes") -> dict:
  """'remat_offload=false,mla_key_block=2048' -> {'remat_offload': False, 'mla_key_block':
  2048} (ints, floats, true/false, none; anything else a string); errors name `flag`."""
  out = {}
  for item in filter(None, (t.strip() for t in (text or "").split(","))):
    name, sep, val = item.partition("=")
    if not sep:
      raise ValueError(f"{flag}: expected field=value pairs, found {item!r}")
    v = val.strip().lower()
    if v in ("true", "false", "none"):
      out[name.strip()] = {"true": True, "false": False, "none": None}[v]
      continue
    try:
      out[name.strip()] = int(v)
    except ValueError:
      try:
        out[name.strip()] = float(v)
      except ValueError:
        out[name.strip()] = val.strip()
  return out


def _hbm_required(msg: str) -> dict:
  """XLA:TPU's figure from its refusal ('... HLO temporaries (123.45G) exceeds ...')."""
  import re
  m = re.search(r"temporaries \(([0-9.]+)([KMGT])\)", msg)
  if not m:
    return {}
  scale = {"K": 2 ** -20, "M": 2 ** -10, "G": 1.0, "T": 2 ** 10}[m.group(2)]
  return {"refused_temp_gib": float(m.group(1)) * scale}


def _model_config(preset_name: str, num_layers: int | None, param_dtype: str = "float32"):
  from k3jax.config import preset
  over = dict(dtype="bfloat16", param_dtype=param_dtype, remat=True, scan_layers=True,
              moe_capacity_factor=1.25, kernel_backend="xla")
  if num_layers:
    over["num_layers"] = num_layers
  return preset(preset_name, **over)


def tpu_devices(topology: str, num_devices: int) -> list:
  """Compile-only TPU devices of `topology` (needs libtpu, not a TPU)."""
  if importlib.util.find_spec("libtpu") is None:
    raise SystemExit(LIBTPU_MISSING)
  from jax.experimental import topologies
  devices = list(topologies.get_topology_desc(topology, "tpu").devices)
  if len(devices) != num_devices:
    raise ValueError(f"--topology {topology} has {len(devices)} devices, --devices={num_devices}")
  return devices


def _shard_gib(tree, shardings, host: bool = False) -> float:
  """GiB of one device's shards of `tree` in host ("pinned_host") or device memory."""
  import jax
  shs = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
             for x, s in zip(jax.tree.leaves(tree), shs)
             if (s.memory_kind == "pinned_host") == host) / 2.0 ** 30


def peak_live_buffers(dump_dir: str, top: int) -> dict:
  """What the compiled step holds at its peak, from XLA's dump of it (`xla_dump_to`): the
  buffer live ranges' peak point, the bytes live there — on the device and in host memory
  (memory space S(5) in the buffer's layout: offloaded layer inputs, Muon momentum) — and the
  `top` largest device buffers (and a quarter as many host ones) live there, with their shapes
  and the jax operation that made each (`op_name`, e.g.
  "…/layers_2/block_sparse_moe/shard_map/ecd,edf->ecf/dot_general" — "rematted_computation"
  in it marks the backward's recomputation; "" where XLA kept no metadata, as for many CPU
  fusions); and the buffer assignment's heap size per memory space ("default (color=0)" is
  the device's HBM). The step's module is the largest `jit_step` live-range file; {} when
  the dump has none."""
  names = [f for f in os.listdir(dump_dir) if "jit_step" in f and f.endswith("live-range.txt")]
  if not names:
    return {}
  path = max((os.path.join(dump_dir, f) for f in names), key=os.path.getsize)
  live, at = [], None
  with open(path) as fh:
    for line in fh:
      if at is None:
        m = re.match(r"\s+Live ranges at (\d+) \(peak\):", line)
        at = int(m.group(1)) if m else None
        continue
      m = re.match(r"\s+(\S+?)(\{[^}]*\})?: (\d+) bytes", line)
      if not m:
        break
      live.append((int(m.group(3)), m.group(1), m.group(2) or ""))
  live.sort(key=lambda x: -x[0])
  want = {name for _, name, _ in live}
  ops = {}
  with open(path[:-len("-live-range.txt")] + ".txt") as fh:
    for line in fh:
      m = re.match(r"\s+(?:ROOT )?%(\S+) = (\S+) ", line)
      if m and m.group(1) in want:
        op = re.search(r'op_name="([^"]*)"', line)
        ops[m.group(1)] = (m.group(2), op.group(1) if op else "")
  rows = [dict(buffer=n + idx, bytes=b, shape=ops.get(n, ("", ""))[0],
               op=ops.get(n, ("", ""))[1]) for b, n, idx in live]
  spaces = {}     # the buffer assignment's heap size per memory space (its memory-usage report)
  report = path[:-len("-live-range.txt")] + "-memory-usage-report.txt"
  if os.path.exists(report):
    with open(report) as fh:
      space = None
      for line in fh:
        m = re.match(r"Memory Space: (.+)$", line)
        if m:
          space = m.group(1).strip()
        m = re.match(r"Total bytes: (\d+)", line)
        if m and space is not None:
          spaces[space] = int(m.group(1))
          space = None
  host = [r for r in rows if "S(5)" in r["shape"]]
  device = [r for r in rows if "S(5)" not in r["shape"]]
  return dict(position=at, bytes=sum(r["bytes"] for r in rows), buffers=len(rows),
              device_bytes=sum(r["bytes"] for r in device),
              host_bytes=sum(r["bytes"] for r in host),
              heap_bytes_by_memory_space=spaces,
              top=device[:top], top_host=host[:max(1, top // 4)] if host else [])


def memory_part(num_devices: int, seq_len: int, per_device_batch: int, *, target: str = "tpu",
                topology: str | None = None, preset_name: str = "k3",
                num_layers: int | None = None, layout: dict | None = None,
                muon: bool = True, param_dtype: str = "float32", mu_dtype: str = "",
                offload_momentum: bool = False, stage: str | None = None,
                stage_modes: dict | None = None, fsdp_over_context: bool | None = None,
                peak_buffers: int = 0) -> dict:
  """The trainer's step compiled for `num_devices` (module doc, part "memory"). With `stage`
  (a name of `STAGES`), the stage's run config from configs/k3.py (`stage_config`) gives the
  sequence length, the tokens per chip, the layout (unless `layout` is given), the run modes
  and the optimizer's offload; `stage_modes` / `fsdp_over_context` override the stage's.
  `peak_buffers` > 0: also the compiler's own account of its peak (`peak_live_buffers`)."""
  import jax

  from k3jax import sharding
  from k3jax.data import corpus as data_lib
  from k3jax.train import sharded
  from k3jax.train.run import OptimConfig, RunConfig, TrainConfig

  stage_run = None
  if stage is not None:
    stage_run, stage_layout, per_device_batch = stage_config(
        stage, num_layers, modes=stage_modes, fsdp_over_context=fsdp_over_context,
        muon=muon, mu_dtype=mu_dtype or None)
    layout = dict(layout or stage_layout)
    seq_len = stage_run.train.seq_len
  layout = dict(layout or LAYOUTS[num_devices])
  if target == "tpu":
    topology = topology or TOPOLOGIES[num_devices]
    devices = tpu_devices(topology, num_devices)
  else:
    devices = jax.devices()
    if len(devices) != num_devices:
      raise ValueError(f"--devices={num_devices}: this process has {len(devices)} devices")
  over_context = bool(layout.pop("fsdp_over_context", False))
  if fsdp_over_context is not None:
    over_context = fsdp_over_context
  mesh = sharding.make_mesh(layout, devices=devices)
  layout = {a: int(s) for a, s in mesh.shape.items()}
  batch_size = per_device_batch * sharding.axis_size(mesh, sharding.BATCH_AXES)
  if stage_run is None:
    config = _model_config(preset_name, num_layers, param_dtype)
    if stage_modes:   # the same overrides without a stage: of the plain recipe's modes
      config = config.replace(**stage_modes)
    # muon False: AdamW for the matrices too (the trainer's baseline).
    run = RunConfig(model=config, train=TrainConfig(batch_size=batch_size, seq_len=seq_len),
                    optim=OptimConfig(muon=muon, mu_dtype=mu_dtype,
                                      offload_momentum=offload_momentum))
  else:
    # The stage's tokens per chip on this mesh: its batch of sequences per batch-axes chip.
    run = stage_run.replace(train=dataclasses.replace(stage_run.train, batch_size=batch_size,
                                                      grad_accum=1))
    config = run.model
    param_dtype, mu_dtype = config.modes.param_dtype, run.optim.mu_dtype
    offload_momentum, preset_name = run.optim.offload_momentum, "k3"
  rules = sharding.axis_rules(param_axes=PARAM_AXES, fsdp_over_context=over_context)
  t0 = time.perf_counter()
  # The trainer's own step on this mesh (shapes checked against it), lowered from abstract
  # values: no parameter is ever allocated.
  step = sharded.build_step(run, config, mesh, rules=rules)
  state, state_sh = step.train.abstract_state, step.train.state_shardings
  lowered = step.train.lower(state, data_lib.abstract_batch(batch_size, seq_len))
  t1 = time.perf_counter()
  peak_live = None
  if peak_buffers:
    with tempfile.TemporaryDirectory() as dump:
      compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
      peak_live = peak_live_buffers(dump, peak_buffers)
  else:
    compiled = lowered.compile()
  t2 = time.perf_counter()
  ma = compiled.memory_analysis()
  cost = _cost(compiled)
  n_params = sum(x.size for x in jax.tree.leaves((state.params, state.balance)))
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  gib = 2.0 ** 30
  peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
          + ma.temp_size_in_bytes)
  return dict(
      part="memory", target=target, topology=topology if target == "tpu" else None,
      device_kind=getattr(devices[0], "device_kind", str(devices[0].platform)),
      optimizer="muon" if muon else "adamw",
      devices=num_devices, layout=layout, param_axes=list(PARAM_AXES), preset=preset_name,
      num_layers=config.text.num_layers, stack_layout=list(config.text.stack_layout()),
      seq_len=seq_len, global_batch=batch_size, per_device_batch=per_device_batch,
      dtype=config.modes.dtype, param_dtype=config.modes.param_dtype, mu_dtype=mu_dtype or "params",
      offload_momentum=offload_momentum,
      remat=config.modes.remat, capacity_factor=config.modes.moe_capacity_factor,
      params=int(n_params), state_gib_total=state_bytes / gib,
      state_gib_per_device=_shard_gib(state, state_sh),
      state_host_gib_per_device=_shard_gib(state, state_sh, host=True),
      argument_bytes=int(ma.argument_size_in_bytes), output_bytes=int(ma.output_size_in_bytes),
      alias_bytes=int(ma.alias_size_in_bytes), temp_bytes=int(ma.temp_size_in_bytes),
      generated_code_bytes=int(ma.generated_code_size_in_bytes), peak_bytes=int(peak),
      argument_gib=ma.argument_size_in_bytes / gib, output_gib=ma.output_size_in_bytes / gib,
      temp_gib=ma.temp_size_in_bytes / gib, alias_gib=ma.alias_size_in_bytes / gib,
      peak_gib=peak / gib, lower_s=t1 - t0, compile_s=t2 - t1,
      host_argument_gib=getattr(ma, "host_argument_size_in_bytes", 0) / gib,
      host_temp_gib=getattr(ma, "host_temp_size_in_bytes", 0) / gib,
      host_output_gib=getattr(ma, "host_output_size_in_bytes", 0) / gib,
      host_alias_gib=getattr(ma, "host_alias_size_in_bytes", 0) / gib,
      generated_code_gib=ma.generated_code_size_in_bytes / gib,
      fits=peak / gib <= V5P_HBM_GIB, fsdp_over_context=over_context,
      **({} if peak_live is None else {"peak_live_buffers": peak_live}),
      **_stage_fields(stage, run, config, num_devices, seq_len, batch_size, cost))


def _cost(compiled) -> dict:
  """The compiler's cost analysis of one device's program: flops, bytes accessed (and
  transcendentals), as XLA reports them ({} when it reports nothing)."""
  try:
    ca = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 - not every backend implements it
    return {}
  if isinstance(ca, (list, tuple)):
    ca = ca[0] if ca else {}
  ca = dict(ca or {})
  return {k: float(ca[k]) for k in ("flops", "bytes accessed", "transcendentals") if k in ca}


def _stage_fields(stage, run, config, num_devices, seq_len, batch_size, cost) -> dict:
  """The stage's identity and modes, the compiler's cost per step and per token (per chip),
  and the tokens of the stage per chip (the schedule's, configs/k3.py)."""
  tokens_step = batch_size * seq_len
  tokens_chip = tokens_step / num_devices
  out = dict(stage=stage, tokens_per_step=tokens_step, tokens_per_chip_per_step=tokens_chip,
             flops_per_chip=cost.get("flops"),
             bytes_accessed_per_chip=cost.get("bytes accessed"),
             flops_per_token=(cost["flops"] / tokens_chip if "flops" in cost else None),
             bytes_per_token=(cost["bytes accessed"] / tokens_chip
                              if "bytes accessed" in cost else None),
             modes=dict(remat=config.modes.remat, remat_offload=config.modes.remat_offload,
                        mla_query_block=config.modes.mla_query_block,
                        mla_key_block=config.modes.mla_key_block,
                        kda_chunk_size=config.modes.kda_chunk_size,
                        moe_capacity_factor=config.modes.moe_capacity_factor,
                        ce_chunks=config.modes.ce_chunks,
                        mtp_full_length=config.modes.mtp_full_length,
                        expert_grad_barrier=config.modes.expert_grad_barrier))
  if stage is not None:
    st = next(x for x in run_stages() if x.seq_len == STAGES[stage])
    stage_tokens = st.steps * (st.batch_size or 0) * st.seq_len
    out.update(stage_steps=st.steps, stage_batch=st.batch_size, stage_tokens=stage_tokens,
               # No duration is published (docs/k3.md §8): the rate a chip must sustain is
               # given for a stage lasting one day; divide by the days it is given.
               stage_tokens_per_chip=stage_tokens / num_devices,
               tokens_per_chip_per_s_if_one_day=stage_tokens / num_devices / 86400.0)
  return out


# The stages of configs/k3.py's curriculum by name (their sequence lengths).
STAGES = {"8K": 8_192, "64K": 65_536, "256K": 262_144, "1M": 1_048_576}


def run_stages():
  """configs/k3.py's `train.stages` (Stage records)."""
  from configs import k3 as k3_config
  from k3jax.train.run import run_config
  return run_config(k3_config.get_config()).train.stages


def stage_config(name: str, num_layers: int | None = None, *, modes: dict | None = None,
                 fsdp_over_context: bool | None = None, muon: bool = True,
                 mu_dtype: str | None = None):
  """(run config of the stage's step, its layout with `fsdp_over_context`, sequences per
  batch-axes chip) for configs/k3.py's stage `name` (`STAGES`), from the config itself
  (`k3jax.train.stages.stage_run`: its seq_len, batch, mesh, RunModes, Muon offload).

  What the config leaves open for a deviceless compile is set as the other parts of this
  benchmark do: scanned layers, the XLA kernels (no Pallas on compile-only TPU devices) and a
  capacity factor of 1.25 where the config's MoE is dropless (a dropless dispatch buffer is
  sized for every local token). `modes` overrides the stage's RunModes (the attempts of
  docs/notes/long_context.md)."""
  import dataclasses as dc

  from configs import k3 as k3_config
  from k3jax import sharding
  from k3jax.train import stages as stages_lib
  from k3jax.train.run import run_config

  if name not in STAGES:
    raise ValueError(f"--stage: expected one of {list(STAGES)}, found {name!r}")
  from k3jax.config import RunModes
  cfg = k3_config.get_config()
  if num_layers:
    cfg.model.num_layers = num_layers
  run_modes = {f.name for f in dc.fields(RunModes)}
  modes = dict(modes or {})
  for k in [k for k in modes if k not in run_modes]:   # the model's own fields (an attempt
    if k not in cfg.model:                              # without the MTP layer, …)
      raise ValueError(f"--stage_modes: unknown model field {k!r}")
    cfg.model[k] = modes.pop(k)
  run = run_config(cfg)
  st = next(x for x in run.train.stages if x.seq_len == STAGES[name])
  srun = stages_lib.stage_run(run, st)
  over = dict(scan_layers=True, kernel_backend="xla")
  if srun.model.modes.moe_capacity_factor is None:
    over["moe_capacity_factor"] = 1.25
  over.update(modes or {})
  optim = dc.replace(srun.optim, muon=muon,
                     **({} if mu_dtype is None else {"mu_dtype": mu_dtype}))
  srun = srun.replace(model=srun.model.replace(**over), optim=optim)
  mesh = srun.mesh
  layout = {a: getattr(mesh, a) for a in sharding.MESH_AXES}
  layout["fsdp_over_context"] = (mesh.fsdp_over_context if fsdp_over_context is None
                                 else fsdp_over_context)
  batch_chips = math.prod(layout[a] for a in sharding.BATCH_AXES)
  if st.batch_size % batch_chips:
    raise ValueError(f"stage {name}: batch {st.batch_size} is not divisible by the batch axes "
                     f"{batch_chips}")
  return srun, layout, st.batch_size // batch_chips


def inference_part(num_devices: int, *, batch: int, max_len: int, tokens: int,
                   target: str = "tpu", topology: str | None = None, preset_name: str = "k3",
                   num_layers: int | None = None, layout: dict | None = None) -> dict:
  """Compiled per-device memory of one cached forward of the packed-expert model (module doc)."""
  import functools

  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  from k3jax import sharding
  from k3jax.serve import generate
  from k3jax.config import preset
  from k3jax.model import K3Model

  recipe = INFERENCE_RECIPES.get(num_devices, {})
  layout = dict(layout or recipe["layout"])
  if target == "tpu":
    topology = topology or recipe["topology"]
    devices = tpu_devices(topology, num_devices)
  else:
    devices = jax.devices()
  mesh = sharding.make_mesh(layout, devices=devices)
  over = dict(dtype="bfloat16", param_dtype="bfloat16", scan_layers=True, remat=False,
              kernel_backend="xla", expert_format="mxfp4", moe_capacity_factor=None)
  if num_layers:
    over["num_layers"] = num_layers
  config = preset(preset_name, **over)
  rules = sharding.axis_rules(param_axes=PARAM_AXES)
  t0 = time.perf_counter()
  abstract = jax.eval_shape(K3Model(config).init, jax.random.key(0),
                            jnp.zeros((1, 2), jnp.int32))
  p_sh = sharding.param_shardings(mesh, abstract, rules)
  shapes = nn.unbox(abstract)
  variables = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                           shapes, p_sh)
  cache = jax.eval_shape(lambda: generate.init_cache(config, batch, max_len))
  per_request = _cache_bytes_per_request(config, max_len)
  c_sh = sharding.cache_shardings(mesh, cache, batch)
  cache = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       cache, c_sh)
  tok = jax.ShapeDtypeStruct((batch, tokens), jnp.int32,
                             sharding=sharding.batch_sharding(mesh, 2, context=False))
  num_new = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=sharding.batch_sharding(mesh, 1))
  # keep_unused: the MTP and vision weights are resident too, though a text decode step
  # does not read them.
  fn = jax.jit(functools.partial(generate.forward, config), donate_argnums=(1,),
               keep_unused=True)
  with jax.set_mesh(mesh):
    lowered = fn.lower(variables, cache, tok, num_new)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  ma = compiled.memory_analysis()
  gib = 2.0 ** 30
  peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
          + ma.temp_size_in_bytes)
  leaves = jax.tree_util.tree_leaves_with_path(shapes["params"])
  expert_bytes = sum(x.size * x.dtype.itemsize for p, x in leaves
                     if "weight_packed" in jax.tree_util.keystr(p)
                     or "weight_scale" in jax.tree_util.keystr(p))
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
  return dict(
      part="inference", target=target, topology=topology if target == "tpu" else None,
      device_kind=getattr(devices[0], "device_kind", str(devices[0].platform)),
      devices=num_devices, layout={a: int(n) for a, n in mesh.shape.items()},
      preset=preset_name, num_layers=config.text.num_layers, expert_format=config.modes.expert_format,
      batch=batch, max_len=max_len, tokens=tokens,
      weights_gib_total=param_bytes / gib, packed_expert_gib_total=expert_bytes / gib,
      weights_gib_per_device=_shard_gib(shapes, p_sh),
      cache_gib_per_device=_shard_gib(cache, c_sh),
      argument_gib=ma.argument_size_in_bytes / gib, output_gib=ma.output_size_in_bytes / gib,
      alias_gib=ma.alias_size_in_bytes / gib, temp_gib=ma.temp_size_in_bytes / gib,
      peak_gib=peak / gib, fits=peak / gib <= V5P_HBM_GIB, lower_s=t1 - t0, compile_s=t2 - t1,
      # The cache from its shapes (one request), and what the compiled arguments hold beyond
      # the weights (the cache shard and the tokens): the two must agree.
      **per_request,
      requests_per_device=batch / max(1, sharding.axis_size(mesh, sharding.BATCH_AXES))
      if batch % sharding.axis_size(mesh, sharding.BATCH_AXES) == 0 else batch,
      arguments_beyond_weights_gib=ma.argument_size_in_bytes / gib - _shard_gib(shapes, p_sh))


def _cache_bytes_per_request(config, max_len: int) -> dict:
  """Bytes of one request's decode cache at `max_len` tokens, from the cache's shapes
  (`generate.init_cache(config, 1, max_len)`): MLA latents (kv_lora_rank + rope numbers a
  token and MLA layer), KDA states and conv tails (fixed), and the rest."""
  import jax

  from k3jax.serve import generate
  cache = jax.eval_shape(lambda: generate.init_cache(config, 1, max_len))
  mla = kda = other = 0
  for path, x in jax.tree_util.tree_leaves_with_path(cache):
    name, nbytes = jax.tree_util.keystr(path), x.size * x.dtype.itemsize
    if "c_kv" in name or "k_rope" in name:
      mla += nbytes
    elif max_len not in x.shape and x.ndim >= 2:
      kda += nbytes
    else:
      other += nbytes
  t = config.text
  return dict(cache_bytes_per_request=mla + kda + other, mla_cache_bytes_per_request=mla,
              kda_cache_bytes_per_request=kda, other_cache_bytes_per_request=other,
              mla_numbers_per_token_per_layer=t.kv_lora_rank + t.qk_rope_head_dim,
              cache_gib_per_request=(mla + kda + other) / 2.0 ** 30)


def state_part(num_devices: int, param_dtype: str, mu_dtype: str,
               offload_momentum: bool = False) -> dict:
  """Per-device bytes of the training state (params + optimizer state + router bias) under the
  recommended layout, from the shardings' shard shapes on an AbstractMesh: no compile, no
  devices; device and host memory apart. A lower bound of the compiled figure (no
  activations, gradients or temporaries)."""
  import jax

  from k3jax import sharding
  from k3jax.train import sharded
  from k3jax.train.run import OptimConfig, RunConfig, TrainConfig

  layout = LAYOUTS[num_devices]
  mesh = sharding.abstract_mesh(layout, num_devices)
  config = _model_config("k3", None, param_dtype)
  run = RunConfig(model=config, train=TrainConfig(   # one sequence each
      batch_size=sharding.axis_size(mesh, sharding.BATCH_AXES)),
                  optim=OptimConfig(mu_dtype=mu_dtype, offload_momentum=offload_momentum))
  step = sharded.build_step(run, config, mesh, rules=sharding.axis_rules(param_axes=PARAM_AXES))
  state, sh = step.train.abstract_state, step.train.state_shardings
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) / 2.0 ** 30
  return dict(part="state", devices=num_devices, layout=layout, param_axes=list(PARAM_AXES),
              param_dtype=param_dtype, mu_dtype=mu_dtype or "params",
              offload_momentum=offload_momentum,
              params=int(sum(x.size for x in jax.tree.leaves((state.params, state.balance)))),
              state_gib_total=total,
              params_gib_per_device=_shard_gib(state.params, sh.params),
              opt_gib_per_device=_shard_gib(state.opt_state, sh.opt_state),
              opt_host_gib_per_device=_shard_gib(state.opt_state, sh.opt_state, host=True),
              state_gib_per_device=_shard_gib(state, sh))


def stage_state_part(stage: str, fsdp_over_context: bool | None = None,
                     num_layers: int | None = None) -> dict:
  """Per-chip bytes of the training state of configs/k3.py's `stage` on its layout, from the
  shardings alone (AbstractMesh; no compile): device and host memory apart."""
  import jax

  from k3jax import sharding
  from k3jax.train import sharded

  run, layout, _ = stage_config(stage, num_layers, fsdp_over_context=fsdp_over_context)
  over = layout.pop("fsdp_over_context")
  n = math.prod(layout.values())
  mesh = sharding.abstract_mesh(layout, n)
  rules = sharding.axis_rules(param_axes=PARAM_AXES, fsdp_over_context=over)
  step = sharded.build_step(run, run.model, mesh, rules=rules)
  state, sh = step.train.abstract_state, step.train.state_shardings
  return dict(part="stage_state", stage=stage, devices=n, layout=layout,
              fsdp_over_context=over, num_layers=run.model.text.num_layers,
              param_dtype=run.model.modes.param_dtype,
              offload_momentum=run.optim.offload_momentum,
              params_gib_per_device=_shard_gib(state.params, sh.params),
              opt_gib_per_device=_shard_gib(state.opt_state, sh.opt_state),
              opt_host_gib_per_device=_shard_gib(state.opt_state, sh.opt_state, host=True),
              state_gib_per_device=_shard_gib(state, sh),
              state_host_gib_per_device=_shard_gib(state, sh, host=True))


def qlora_part(num_devices: int, lora_rank: int, lora_targets: tuple[str, ...],
               seq_len: int, compile_step: bool = False, num_layers: int | None = None) -> dict:
  """Per-chip bytes of the k3 QLoRA training state (module doc, part "qlora"); with
  `compile_step` also the compiled peak of the LoRA train step on the slice's compile-only TPU
  devices (libtpu), or XLA's refusal when it does not fit."""
  import jax

  from k3jax import sharding
  from k3jax.config import preset
  from k3jax.data import corpus as data_lib
  from k3jax.posttrain import lora as lora_lib
  from k3jax.train.run import RunConfig, TrainConfig

  layout = INFERENCE_RECIPES[num_devices]["layout"]
  topology = INFERENCE_RECIPES[num_devices]["topology"]
  mesh = (sharding.make_mesh(layout, devices=tpu_devices(topology, num_devices)) if compile_step
          else sharding.abstract_mesh(layout, num_devices))
  config = preset("k3", dtype="bfloat16", param_dtype="bfloat16", remat=True, scan_layers=True,
                  moe_capacity_factor=1.25, kernel_backend="xla", expert_format="mxfp4",
                  lora_rank=lora_rank, lora_targets=tuple(lora_targets),
                  **({"num_layers": num_layers} if num_layers else {}))
  run = RunConfig(model=config, train=TrainConfig(   # one sequence each
      batch_size=sharding.axis_size(mesh, sharding.BATCH_AXES), seq_len=seq_len))
  step = lora_lib.build_adapter_step(run, config, mesh,
                                     rules=sharding.axis_rules(param_axes=PARAM_AXES))
  state, sh = step.train.abstract_state, step.train.state_shardings
  gib = 2.0 ** 30
  total = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t)) / gib  # noqa
  per_chip = _shard_gib(state, sh)
  compiled = {"compiled": False}
  if compile_step:
    batch = data_lib.abstract_batch(run.train.batch_size, seq_len)
    t0 = time.perf_counter()
    lowered = step.train.lower(state, batch)
    t1 = time.perf_counter()
    try:
      ma = lowered.compile().memory_analysis()
    except Exception as e:  # noqa: BLE001 - XLA:TPU refuses a plan over the chip's HBM
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      msg = [l for l in str(e).splitlines() if "RESOURCE_EXHAUSTED" in l][-1].strip()
      compiled = dict(compiled=True, error=msg, peak_gib=None, lower_s=t1 - t0,
                      compile_s=time.perf_counter() - t1)
    else:
      peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
              + ma.temp_size_in_bytes)
      compiled = dict(compiled=True, argument_gib=ma.argument_size_in_bytes / gib,
                      output_gib=ma.output_size_in_bytes / gib,
                      alias_gib=ma.alias_size_in_bytes / gib,
                      temp_gib=ma.temp_size_in_bytes / gib, peak_gib=peak / gib,
                      lower_s=t1 - t0, compile_s=time.perf_counter() - t1)
  fits = (compiled["peak_gib"] is not None and compiled["peak_gib"] <= V5P_HBM_GIB
          if compiled["compiled"] else per_chip + QLORA_HEADROOM_GIB <= V5P_HBM_GIB)
  return dict(part="qlora", preset="k3", devices=num_devices, layout=layout,
              topology=topology, num_layers=config.text.num_layers,
              param_axes=list(PARAM_AXES), expert_format=config.modes.expert_format,
              param_dtype=config.modes.param_dtype, compiler_layouts=list(step.train.compiler_layouts),
              lora_rank=lora_rank,
              lora_targets=list(lora_targets), seq_len=seq_len,
              global_batch=run.train.batch_size,
              adapter_params=int(sum(x.size for x in jax.tree.leaves(state.params))),
              base_gib_total=total(state.frozen),
              adapter_gib_total=total(state.params), opt_gib_total=total(state.opt_state),
              base_gib_per_device=_shard_gib(state.frozen, sh.frozen),
              adapter_gib_per_device=_shard_gib(state.params, sh.params),
              opt_gib_per_device=_shard_gib(state.opt_state, sh.opt_state),
              state_gib_per_device=per_chip, fits=fits, **compiled)


def ep_layouts(n: int) -> dict:
  return {"replicated": (f"replicated experts (data={n})", dict(data=n)),
          "expert": (f"expert parallel (expert={n})", dict(data=1, expert=n))}


def ep_part(layout_key: str, steps: int, batch_size: int, seq_len: int,
            num_layers: int = 0) -> dict:
  """One layout of the EP comparison (each in its own process: peak memory of one compile)."""
  import jax
  import numpy as np

  from k3jax import sharding
  from k3jax.data import corpus as data_lib
  from k3jax.config import preset
  from k3jax.train import sharded
  from k3jax.train.run import RunConfig, TrainConfig
  from k3jax.train.state import init_state, init_variables

  name, layout = ep_layouts(jax.device_count())[layout_key]
  config = preset("small", **({"num_layers": num_layers} if num_layers else {}))
  run = RunConfig(model=config, train=TrainConfig(batch_size=batch_size, seq_len=seq_len))
  tx, _, step_fn, _ = sharded.build_step(run, config, sharding.make_mesh(layout))
  state = init_state(init_variables(config, jax.random.PRNGKey(0)), sharded.PRETRAIN, tx)
  rng = np.random.default_rng(0)
  batch = data_lib.pack_windows(rng.integers(0, 256, size=(batch_size, seq_len + 2)))
  t0 = time.perf_counter()
  state, m = step_fn(state, batch)
  jax.block_until_ready(m["loss"])
  compile_s = time.perf_counter() - t0
  times, losses = [], [float(m["loss"])]
  for _ in range(steps):
    t0 = time.perf_counter()
    state, m = step_fn(state, batch)
    jax.block_until_ready(m["loss"])
    times.append(time.perf_counter() - t0)
    losses.append(float(m["loss"]))
  med = sorted(times)[len(times) // 2]
  return dict(part="ep_row", name=name, layout=layout, preset="small",
              num_layers=config.text.num_layers, batch_size=batch_size,
              seq_len=seq_len, steps=steps, step_s=med, step_s_all=times,
              compile_s=compile_s, tokens_per_s=batch_size * seq_len / med, losses=losses)


def _subprocess(args: list[str], devices: int | None) -> dict:
  """Run this script's `--child` in a fresh process: `devices` simulated CPU devices, or (None)
  one CPU device for deviceless TPU compilation."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if devices:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  out = subprocess.run([sys.executable, __file__, *args, "--child"], env=env,
                       capture_output=True, text=True)
  if out.returncode:
    raise RuntimeError(f"{args}: exit {out.returncode}\n{out.stderr[-4000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def _print(r: dict) -> None:
  if r["part"] == "memory" and r.get("error"):
    print(f"{r['preset']} train step{' (stage ' + r['stage'] + ')' if r.get('stage') else ''}, "
          f"{r['devices']} devices on {r['topology']}, layout "
          f"{r['layout']}, optimizer {r['optimizer']}: XLA refused to compile: {r['error']}")
  elif r["part"] == "memory":
    where = (f"{r['topology']} ({r['device_kind']}, deviceless AOT)" if r["target"] == "tpu"
             else "simulated CPU devices")
    print(f"{r['preset']} train step ({r['num_layers']} layers), {r['devices']} devices on "
          f"{where}, layout {r['layout']} (params over {'+'.join(r['param_axes'])}), "
          f"{r['global_batch']}x{r['seq_len']} tokens, compute {r['dtype']}, kernels "
          f"{r['param_dtype']}, first moments {r['mu_dtype']}"
          f"{' (Muon momentum in host memory)' if r['offload_momentum'] else ''}, "
          f"remat={r['remat']}, optimizer {r['optimizer']}:")
    print(f"  per device: arguments {r['argument_gib']:.2f} GiB, outputs "
          f"{r['output_gib']:.2f} GiB (aliased {r['alias_gib']:.2f}), temporaries "
          f"{r['temp_gib']:.2f} GiB, total {r['peak_gib']:.2f} GiB "
          f"(state {r['state_gib_per_device']:.2f} GiB/device, {r['state_gib_total']:.0f} GiB "
          f"in all; lower {r['lower_s']:.0f} s, compile {r['compile_s']:.0f} s)")
    if r["offload_momentum"] or r.get("host_argument_gib") or r.get("host_temp_gib"):
      print(f"  host memory per device: arguments {r['host_argument_gib']:.2f} GiB, temporaries "
            f"{r['host_temp_gib']:.2f} GiB, outputs {r.get('host_output_gib', 0):.2f} GiB")
    if r.get("flops_per_chip") is not None:
      print(f"  compiler's cost per chip and step: {r['flops_per_chip']:.4g} flops, "
            f"{r['bytes_accessed_per_chip']:.4g} bytes accessed; per token "
            f"{r['flops_per_token']:.4g} flops, {r['bytes_per_token']:.4g} bytes")
    if r.get("stage"):
      print(f"  stage {r['stage']}: {r['stage_tokens']:.4g} tokens ({r['stage_steps']} steps), "
            f"{r['stage_tokens_per_chip']:.4g} per chip: "
            f"{r['tokens_per_chip_per_s_if_one_day']:.0f} tokens/s a chip if it lasts a day")

  elif r["part"] == "inference" and r.get("error"):
    print(f"k3 inference (packed experts), {r['devices']} chips on {r['topology']}: XLA refused "
          f"to compile: {r['error']}")
  elif r["part"] == "inference":
    print(f"{r['preset']} inference ({r['num_layers']} layers, experts {r['expert_format']}), "
          f"{r['devices']} chips on {r['topology'] or 'CPU'}, layout {r['layout']}, batch "
          f"{r['batch']} x {r['tokens']} new tokens over a {r['max_len']}-token cache: weights "
          f"{r['weights_gib_total']:.0f} GiB in all (packed experts "
          f"{r['packed_expert_gib_total']:.0f}), per chip: weights "
          f"{r['weights_gib_per_device']:.2f} GiB, cache {r['cache_gib_per_device']:.2f} GiB, "
          f"temporaries {r['temp_gib']:.2f} GiB, total {r['peak_gib']:.2f} GiB; one request's "
          f"cache {r.get('cache_gib_per_request', 0):.2f} GiB from its shapes "
          f"({'fits' if r['fits'] else 'does not fit'} {V5P_HBM_GIB:.0f} GiB; compile "
          f"{r['compile_s']:.0f} s)")
  elif r["part"] == "inference_summary":
    print(f"smallest slice tried that holds the packed-expert inference step: "
          f"{r['smallest_fit'] or 'none of ' + str(r['tried'])} chips")
  elif r["part"] == "qlora":
    print(f"k3 QLoRA state (experts {r['expert_format']}, base {r['param_dtype']}, LoRA rank "
          f"{r['lora_rank']} on {','.join(r['lora_targets'])}: {r['adapter_params'] / 1e6:.1f}M "
          f"adapter params), {r['devices']} chips ({r['topology']}), layout {r['layout']}: "
          f"per chip base {r['base_gib_per_device']:.2f} GiB + adapters "
          f"{r['adapter_gib_per_device']:.3f} GiB + AdamW {r['opt_gib_per_device']:.3f} GiB = "
          f"{r['state_gib_per_device']:.2f} GiB"
          + (f"; compiled step: {r['error']}" if r.get("error") else
             f"; compiled step peak {r['peak_gib']:.2f} GiB (arguments {r['argument_gib']:.2f}"
             f" + temporaries {r['temp_gib']:.2f}; compile {r['compile_s']:.0f} s), "
             f"{'fits' if r['fits'] else 'does not fit'} {V5P_HBM_GIB:.0f} GiB"
             if r["compiled"] else
             f" ({'fits' if r['fits'] else 'does not fit'} {V5P_HBM_GIB:.0f} GiB with "
             f"{QLORA_HEADROOM_GIB:.0f} GiB left for activations; state only, not compiled)"))
  elif r["part"] == "qlora_summary":
    print(f"smallest v5p slice tried that holds k3 QLoRA (compiled peak, or state + "
          f"{QLORA_HEADROOM_GIB:.0f} GiB): {r['smallest_fit'] or 'none of ' + str(r['tried'])} "
          "chips")
  elif r["part"] == "stage_state":
    print(f"stage {r['stage']} state on {r['devices']} chips {r['layout']}, FSDP over context "
          f"{r['fsdp_over_context']}: per chip params {r['params_gib_per_device']:.2f} GiB + "
          f"optimizer {r['opt_gib_per_device']:.2f} GiB (device {r['state_gib_per_device']:.2f} "
          f"GiB, host {r['state_host_gib_per_device']:.2f} GiB)")
  elif r["part"] == "cache":
    print(f"{r['preset']} ({r['num_layers']} layers) decode cache of one request at "
          f"{r['max_len']} tokens, {r['dtype']}: {r['cache_gib_per_request']:.2f} GiB (MLA "
          f"latents {r['mla_cache_bytes_per_request'] / 2**30:.2f} GiB, "
          f"{r['mla_numbers_per_token_per_layer']} numbers a token and layer; KDA states and "
          f"conv tails {r['kda_cache_bytes_per_request'] / 2**30:.3f} GiB)")
  elif r["part"] == "state":
    print(f"k3 training state, {r['devices']} devices, layout {r['layout']} (params over "
          f"{'+'.join(r['param_axes'])}, kernels {r['param_dtype']}, first moments "
          f"{r['mu_dtype']}): {r['params'] / 1e12:.4f}T params, state "
          f"{r['state_gib_total']:.0f} GiB in all; per device: params "
          f"{r['params_gib_per_device']:.2f} GiB + optimizer {r['opt_gib_per_device']:.2f} GiB"
          f" = {r['state_gib_per_device']:.2f} GiB on the device"
          + (f", + {r['opt_host_gib_per_device']:.2f} GiB of Muon momentum in host memory"
             if r["offload_momentum"] else ""))
  else:
    print(f"small train step ({r['num_layers']} layers) on {r['devices']} simulated CPU "
          f"devices, batch "
          f"{r['batch_size']}x"
          f"{r['seq_len']}, median of {r['steps']} steps:")
    print(f"  {'layout':32s} {'step s':>8s} {'tokens/s':>10s} {'compile s':>10s}")
    for row in r["rows"]:
      print(f"  {row['name']:32s} {row['step_s']:8.3f} {row['tokens_per_s']:10.0f} "
            f"{row['compile_s']:10.1f}")
    if r.get("ep_over_replicated") is not None:
      print(f"  step time EP / replicated = {r['ep_over_replicated']:.2f}")


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Registers the benchmark's flags on `flag_values`.

  Called when the file runs as a script (tests call it with their own FlagValues): importing
  the module registers nothing, so it can share a process with other entry points that also
  define --preset, --steps or --out.
  """
  fv = dict(flag_values=flag_values)
  flags.DEFINE_integer("lora_rank", QLORA_RECIPE["lora_rank"], "qlora part: adapter rank",
                       **fv)
  flags.DEFINE_string("lora_targets", ",".join(QLORA_RECIPE["lora_targets"]),
                      "qlora part: LoRA targets, comma-separated", **fv)
  flags.DEFINE_bool("qlora_compile", False, "qlora part: also compile the LoRA train step for "
                    "the slice's TPU topology (deviceless, needs libtpu) and report its peak",
                    **fv)
  flags.DEFINE_enum("part", "all", ["all", "memory", "state", "ep", "inference", "qlora",
                                     "cache"],
                    "what to measure ('all' = memory + state + ep)", **fv)
  flags.DEFINE_integer("inf_batch", 64, "inference part: sequences", **fv)
  flags.DEFINE_integer("inf_max_len", 8192, "inference part: cache capacity in tokens", **fv)
  flags.DEFINE_integer("inf_tokens", 1, "inference part: new tokens per sequence (1 = a "
                       "decode step)", **fv)
  flags.DEFINE_integer("devices", 0, "memory/state: 256 or 2048 (default both)", **fv)
  flags.DEFINE_enum("target", "tpu", ["tpu", "cpu"], "memory part: deviceless TPU AOT (needs "
                    "libtpu) or simulated CPU devices", **fv)
  flags.DEFINE_string("topology", None, "memory part, --target tpu: TPU topology (default "
                      f"{TOPOLOGIES})", **fv)
  flags.DEFINE_string("preset", "k3", "memory part: model preset (default k3)", **fv)
  flags.DEFINE_integer("num_layers", 0,
                       "memory part: override the preset's depth (0 = the preset's)", **fv)
  flags.DEFINE_string("layout", None, "memory part: mesh sizes 'fsdp=4,expert=64' (default: "
                      "the recommended)", **fv)
  flags.DEFINE_enum("optimizer", "muon", ["muon", "adamw"],
                    "memory part: the trainer's Per-Head Muon (default) or AdamW for all", **fv)
  flags.DEFINE_integer("seq_len", 0,
                       "memory part: tokens per sequence (default: the recipe's)", **fv)
  flags.DEFINE_enum("param_dtype", None, ["float32", "bfloat16"],
                    "memory/state: dtype of the kernels (default: the recipe's)", **fv)
  flags.DEFINE_enum("offload_momentum", None, ["true", "false"],
                    "memory/state: Muon's momentum in host memory (default: the recipe's)", **fv)
  flags.DEFINE_enum("mu_dtype", None, ["", "float32", "bfloat16"],
                    "memory/state: dtype of the first moments, '' = the parameters' "
                    "(default: the recipe's)", **fv)
  flags.DEFINE_integer("per_device_batch", 1, "memory part: sequences per device", **fv)
  flags.DEFINE_integer("steps", 5, "ep part: timed steps (median)", **fv)
  flags.DEFINE_integer("ep_batch", 8, "ep part: global batch size", **fv)
  flags.DEFINE_integer("ep_seq_len", 64, "ep part: tokens per sequence", **fv)
  flags.DEFINE_integer("ep_devices", 8, "ep part: simulated CPU devices (the replicated layout "
                       "holds one full copy of state + step temporaries per device in this "
                       "process's RAM)", **fv)
  flags.DEFINE_integer("ep_num_layers", 2, "ep part: depth of the small model (default 2: one "
                       "dense + one MoE layer; 0 = the preset's 8, whose replicated fp32 state "
                       "on 8 simulated devices alone needs ~11 GB of RAM)", **fv)
  flags.DEFINE_enum("ep_layout", None, ["expert", "replicated"],
                    "internal (--child): the one ep layout to time", **fv)
  flags.DEFINE_enum("stage", None, list(STAGES), "memory part: compile configs/k3.py's "
                    "curriculum stage (its seq_len, tokens per chip, layout, run modes and "
                    "offload; --layout/--devices/--topology for another slice)", **fv)
  flags.DEFINE_string("stage_modes", None, "memory part: RunModes overrides "
                      "'remat_offload=false,mla_key_block=2048' (attempts) of the --stage's "
                      "modes, or without --stage of the preset's", **fv)
  flags.DEFINE_enum("fsdp_over_context", None, ["true", "false"], "memory part: params and "
                    "optimizer state also sharded over `context` (default: the stage's)", **fv)
  flags.DEFINE_integer("peak_buffers", 0, "memory part: also list this many of the largest "
                       "buffers live at the compiled step's peak, with the op that made each "
                       "(from an XLA dump into a temporary directory)", **fv)
  flags.DEFINE_string("out", None, "also write the JSON object to this path", **fv)
  flags.DEFINE_bool("child", False, "internal: run one measurement in this process (the "
                    "parent starts it with the right devices)", **fv)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  run(flags.FLAGS)


def run(a: flags.FlagValues) -> None:
  """The benchmark for parsed flags `a` (the FlagValues define_flags filled)."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  layout = parse_layout(a.layout) if a.layout else None
  if a.stage and a.part not in ("memory", "state"):
    raise app.UsageError("--stage goes with --part memory or --part state")
  if a.stage and not a.devices:   # the stage's own slice
    a.devices = math.prod(v for k, v in stage_config(a.stage, a.num_layers or None)[1].items()
                          if k != "fsdp_over_context")
  if a.part in ("all", "memory") and not a.devices and (layout or a.topology):
    raise app.UsageError("--layout / --topology need --devices")
  if (a.part in ("all", "memory", "inference") and a.target == "tpu"
      and importlib.util.find_spec("libtpu") is None):
    raise app.UsageError(LIBTPU_MISSING)

  def recipe(n: int, field: str):
    """The flag's value if given, else the recipe's for n devices (else the plain default)."""
    given = {"seq_len": a.seq_len or None, "param_dtype": a.param_dtype,
             "mu_dtype": a.mu_dtype, "offload_momentum": None if a.offload_momentum is None
             else a.offload_momentum == "true"}[field]
    if given is not None:
      return given
    return RECIPES.get(n, {}).get(field, DEFAULTS[field])

  if a.child:  # inside a subprocess with the right (simulated) devices
    if a.part == "inference":
      res = inference_part(a.devices, batch=a.inf_batch, max_len=a.inf_max_len,
                           tokens=a.inf_tokens, target=a.target, topology=a.topology,
                           preset_name=a.preset, num_layers=a.num_layers or None, layout=layout)
    elif a.part == "memory":
      res = memory_part(a.devices, recipe(a.devices, "seq_len"), a.per_device_batch,
                        target=a.target, topology=a.topology, preset_name=a.preset,
                        num_layers=a.num_layers or None, layout=layout,
                        muon=a.optimizer == "muon",
                        param_dtype=recipe(a.devices, "param_dtype"),
                        mu_dtype=recipe(a.devices, "mu_dtype"),
                        offload_momentum=recipe(a.devices, "offload_momentum"),
                        stage=a.stage, stage_modes=parse_modes(a.stage_modes),
                        fsdp_over_context=None if a.fsdp_over_context is None
                        else a.fsdp_over_context == "true", peak_buffers=a.peak_buffers)
    else:
      res = ep_part(a.ep_layout, a.steps, a.ep_batch, a.ep_seq_len, a.ep_num_layers)
    print(json.dumps(res))
    return

  results = []
  if a.part == "state" and a.stage:
    over = None if a.fsdp_over_context is None else a.fsdp_over_context == "true"
    results.append(stage_state_part(a.stage, over, a.num_layers or None))
    if over is None and results[-1]["fsdp_over_context"]:   # and without it, to compare
      results.append(stage_state_part(a.stage, False, a.num_layers or None))
  elif a.part in ("all", "state"):
    for n in ([a.devices] if a.devices else sorted(LAYOUTS)):
      results.append(state_part(n, recipe(n, "param_dtype"), recipe(n, "mu_dtype"),
                                recipe(n, "offload_momentum")))
  if a.part in ("all", "memory"):
    for n in ([a.devices] if a.devices else sorted(LAYOUTS)):
      args = ["--part", "memory", "--devices", str(n), "--target", a.target, "--seq_len",
              str(recipe(n, "seq_len")), "--per_device_batch", str(a.per_device_batch),
              "--preset", a.preset, "--num_layers", str(a.num_layers),
              "--param_dtype", recipe(n, "param_dtype"), "--mu_dtype", recipe(n, "mu_dtype"),
              "--offload_momentum", str(recipe(n, "offload_momentum")).lower()]
      args += ["--topology", a.topology] if a.topology else []
      args += ["--layout", a.layout] if a.layout else []
      args += ["--optimizer", a.optimizer]
      args += ["--stage", a.stage] if a.stage else []
      args += ["--stage_modes", a.stage_modes] if a.stage_modes else []
      args += ["--fsdp_over_context", a.fsdp_over_context] if a.fsdp_over_context else []
      args += ["--peak_buffers", str(a.peak_buffers)] if a.peak_buffers else []
      try:
        results.append(_subprocess(args, n if a.target == "cpu" else None))
      except RuntimeError as e:
        # XLA:TPU refuses to compile a plan that does not fit the chip's HBM: that is a result.
        if a.target != "tpu" or "RESOURCE_EXHAUSTED" not in str(e):
          raise
        msg = [l for l in str(e).splitlines() if "RESOURCE_EXHAUSTED" in l][-1].strip()
        what = dict(layout=a.layout or LAYOUTS.get(n), seq_len=recipe(n, "seq_len"),
                    per_device_batch=a.per_device_batch,
                    param_dtype=recipe(n, "param_dtype"),
                    mu_dtype=recipe(n, "mu_dtype") or "params",
                    offload_momentum=recipe(n, "offload_momentum"))
        if a.stage:   # what the child compiled: the stage's own layout, length and batch
          srun, st_layout, st_batch = stage_config(
              a.stage, a.num_layers or None, modes=parse_modes(a.stage_modes),
              fsdp_over_context=None if a.fsdp_over_context is None
              else a.fsdp_over_context == "true")
          what = dict(layout=layout or st_layout, seq_len=srun.train.seq_len,
                      per_device_batch=st_batch, param_dtype=srun.model.modes.param_dtype,
                      mu_dtype=srun.optim.mu_dtype or "params",
                      offload_momentum=srun.optim.offload_momentum)
        results.append(dict(part="memory", target="tpu", devices=n, preset=a.preset,
                            num_layers=a.num_layers or None, layout=what["layout"],
                            topology=a.topology or TOPOLOGIES.get(n),
                            optimizer=a.optimizer, seq_len=what["seq_len"],
                            per_device_batch=what["per_device_batch"],
                            param_dtype=what["param_dtype"], mu_dtype=what["mu_dtype"],
                            offload_momentum=what["offload_momentum"], error=msg,
                            stage=a.stage, stage_modes=parse_modes(a.stage_modes),
                            fsdp_over_context=a.fsdp_over_context, fits=False,
                            **_hbm_required(msg)))
  if a.part == "inference":
    fits = []
    for n in ([a.devices] if a.devices else sorted(INFERENCE_RECIPES)):
      args = ["--part", "inference", "--devices", str(n), "--target", a.target, "--preset",
              a.preset, "--num_layers", str(a.num_layers), "--inf_batch", str(a.inf_batch),
              "--inf_max_len", str(a.inf_max_len), "--inf_tokens", str(a.inf_tokens)]
      args += ["--topology", a.topology] if a.topology else []
      args += ["--layout", a.layout] if a.layout else []
      try:
        r = _subprocess(args, n if a.target == "cpu" else None)
      except RuntimeError as e:
        if a.target != "tpu" or "RESOURCE_EXHAUSTED" not in str(e):
          raise
        msg = [l for l in str(e).splitlines() if "RESOURCE_EXHAUSTED" in l][-1].strip()
        r = dict(part="inference", devices=n, error=msg, fits=False,
                 topology=a.topology or INFERENCE_RECIPES.get(n, {}).get("topology"))
      results.append(r)
      if r["fits"]:
        fits.append(n)
    results.append(dict(part="inference_summary", tried=[r["devices"] for r in results
                                                         if r["part"] == "inference"],
                        smallest_fit=min(fits) if fits else None))
  if a.part == "cache":   # one request's decode cache at --inf_max_len, from shapes only
    from k3jax.config import preset
    cfg = preset(a.preset, dtype="bfloat16", param_dtype="bfloat16", expert_format="mxfp4",
                 **({"num_layers": a.num_layers} if a.num_layers else {}))
    results.append(dict(part="cache", preset=a.preset, num_layers=cfg.text.num_layers,
                        max_len=a.inf_max_len, dtype="bfloat16",
                        **_cache_bytes_per_request(cfg, a.inf_max_len)))
  if a.part == "qlora":
    targets = tuple(t.strip() for t in a.lora_targets.split(",") if t.strip())
    tried = [a.devices] if a.devices else sorted(INFERENCE_RECIPES)
    rows = [qlora_part(n, a.lora_rank, targets, a.seq_len or QLORA_RECIPE["seq_len"],
                       compile_step=a.qlora_compile, num_layers=a.num_layers or None)
            for n in tried]
    results += rows
    fits = [r["devices"] for r in rows if r["fits"]]
    results.append(dict(part="qlora_summary", tried=tried,
                        smallest_fit=min(fits) if fits else None))
  if a.part in ("all", "ep"):
    rows = [_subprocess(["--part", "ep", "--ep_layout", key, "--steps", str(a.steps),
                         "--ep_batch", str(a.ep_batch), "--ep_seq_len", str(a.ep_seq_len),
                         "--ep_num_layers", str(a.ep_num_layers)], a.ep_devices)
            for key in ("replicated", "expert")]
    results.append(dict(part="ep", preset="small", devices=a.ep_devices,
                        num_layers=rows[0]["num_layers"],
                        batch_size=a.ep_batch,
                        seq_len=a.ep_seq_len, steps=a.steps, rows=rows,
                        ep_over_replicated=rows[1]["step_s"] / rows[0]["step_s"]))

  for r in results:
    _print(r)
  if a.out:
    from experiments import results as result_files
    result_files.write_json(a.out, {"results": results})
  print(json.dumps({"results": results}))


if __name__ == "__main__":
  define_flags()
  app.run(main)
