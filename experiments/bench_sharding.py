"""Scale-out benchmark: compiled memory per device at pod scale, and EP vs replicated MoE.

Part "memory": the full `k3` training step (forward + backward + the real optimizer: Per-Head
Muon / AdamW + Quantile Balancing) is lowered and compiled — never run — for a mesh of N
devices, from abstract inputs only (`jax.ShapeDtypeStruct` with shardings; no parameter is
ever allocated). The N devices are simulated CPU devices of a subprocess
(`--xla_force_host_platform_device_count=N`), so `compiled.memory_analysis()` reports XLA's
per-device buffer plan (arguments = the state shard + the batch shard, outputs, temporaries).

Part "ep": on 8 simulated CPU devices, the `small` preset's jitted train step with experts
sharded over `expert` (all_to_all dispatch) vs. the same step with experts replicated and the
batch split over `data` (informative only: CPU "devices" share the same cores).

Usage:
  .venv/bin/python experiments/bench_sharding.py                  # both parts, table + JSON
  .venv/bin/python experiments/bench_sharding.py --part memory --devices 256
  .venv/bin/python experiments/bench_sharding.py --part ep --steps 5
  --out FILE writes the JSON object too; the last printed line is that JSON.
"""

from __future__ import annotations

import argparse
import math
import json
import os
import subprocess
import sys
import time

# Recommended layouts for the k3 preset (see docs/notes/sharding.md for the reasoning).
LAYOUTS = {
    256: dict(data=1, fsdp=4, expert=64, context=1, tensor=1),
    2048: dict(data=1, fsdp=32, expert=64, context=1, tensor=1),
}
# Parameters sharded over fsdp AND expert (dense weights too), fallbacks to fsdp alone.
PARAM_AXES = ("fsdp", "expert")


def _k3_config(seq_len: int):
  from k3jax.config import preset
  return preset("k3", dtype="bfloat16", remat=True, scan_layers=True,
                moe_capacity_factor=1.25)


def memory_part(num_devices: int, seq_len: int, per_device_batch: int) -> dict:
  import jax
  import jax.numpy as jnp
  import flax.linen as nn
  from jax.sharding import NamedSharding, PartitionSpec as P

  from k3jax import sharding
  from k3jax.model import K3Model
  from k3jax.train import trainer
  from k3jax.train.step import TrainState

  if jax.device_count() != num_devices:
    raise ValueError(f"--devices={num_devices}: this process has {jax.device_count()} devices")
  layout = LAYOUTS[num_devices]
  mesh = sharding.make_mesh(layout)
  config = _k3_config(seq_len)
  batch_size = per_device_batch * sharding.axis_size(mesh, sharding.BATCH_AXES)
  sharding.check_shapes(config, mesh, batch_size=batch_size, seq_len=seq_len)
  rules = sharding.axis_rules(param_axes=PARAM_AXES)

  cfg = trainer.base_config("tiny")
  cfg.train.batch_size = batch_size
  cfg.train.seq_len = seq_len
  t0 = time.perf_counter()
  tx, _, step_fn, _ = trainer._build(cfg, config, jit_step=lambda f: f)   # the raw step
  boxed = jax.eval_shape(K3Model(config).init, jax.random.PRNGKey(0),
                         jnp.zeros((1, 8), jnp.int32))
  variables = nn.unbox({c: boxed[c] for c in ("params", "balance")})
  opt_state = jax.eval_shape(tx.init, variables)
  state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=variables["params"],
                     balance=variables["balance"], opt_state=opt_state)
  state_sh = sharding.train_state_shardings(mesh, state, boxed, rules)
  keys = ("inputs", "targets", "segment_ids", "mtp_targets")
  batch = {k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32) for k in keys}
  batch.update({k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32)
                for k in ("loss_mask", "mtp_mask")})
  batch_sh = sharding.batch_shardings(mesh, batch)

  def traced(s, b):
    with sharding.activate(mesh, rules):
      return step_fn(s, b)

  abstract = lambda tree, sh: jax.tree.map(  # noqa: E731
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
  lowered = jax.jit(traced, in_shardings=(state_sh, batch_sh),
                    out_shardings=(state_sh, NamedSharding(mesh, P())),
                    donate_argnums=(0,)).lower(abstract(state, state_sh),
                                               abstract(batch, batch_sh))
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  ma = compiled.memory_analysis()
  n_params = sum(x.size for x in jax.tree.leaves(variables))
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  gib = 2.0 ** 30
  return dict(
      part="memory", devices=num_devices, layout=layout, param_axes=list(PARAM_AXES),
      seq_len=seq_len, global_batch=batch_size, per_device_batch=per_device_batch,
      dtype=config.dtype, remat=config.remat, capacity_factor=config.moe_capacity_factor,
      params=int(n_params), state_gib_total=state_bytes / gib,
      argument_gib=ma.argument_size_in_bytes / gib, output_gib=ma.output_size_in_bytes / gib,
      temp_gib=ma.temp_size_in_bytes / gib, alias_gib=ma.alias_size_in_bytes / gib,
      peak_gib=(ma.argument_size_in_bytes + ma.output_size_in_bytes
                - ma.alias_size_in_bytes + ma.temp_size_in_bytes) / gib,
      lower_s=t1 - t0, compile_s=t2 - t1)


def state_part(num_devices: int) -> dict:
  """Per-device bytes of the training state (params + optimizer state + router bias) under the
  recommended layout, from the shardings' shard shapes on an AbstractMesh: no compile, no
  devices. A lower bound of the compiled figure (no activations, gradients or temporaries)."""
  import jax
  import jax.numpy as jnp
  import flax.linen as nn

  from k3jax import sharding
  from k3jax.model import K3Model
  from k3jax.train import trainer
  from k3jax.train.step import TrainState

  layout = LAYOUTS[num_devices]
  mesh = sharding.abstract_mesh(layout, num_devices)
  config = _k3_config(4096)
  rules = sharding.axis_rules(param_axes=PARAM_AXES)
  tx, _, _, _ = trainer._build(trainer.base_config("tiny"), config, jit_step=lambda f: f)
  boxed = jax.eval_shape(K3Model(config).init, jax.random.PRNGKey(0),
                         jnp.zeros((1, 8), jnp.int32))
  variables = nn.unbox({c: boxed[c] for c in ("params", "balance")})
  state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=variables["params"],
                     balance=variables["balance"], opt_state=jax.eval_shape(tx.init, variables))
  sh = sharding.train_state_shardings(mesh, state, boxed, rules)
  gib = 2.0 ** 30

  def per_device(tree, shs):
    leaves = jax.tree.leaves(tree)
    shs = jax.tree.leaves(shs, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(leaves, shs)) / gib

  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) / gib
  return dict(part="state", devices=num_devices, layout=layout, param_axes=list(PARAM_AXES),
              params=int(sum(x.size for x in jax.tree.leaves(variables))),
              state_gib_total=total,
              params_gib_per_device=per_device(state.params, sh.params),
              opt_gib_per_device=per_device(state.opt_state, sh.opt_state),
              state_gib_per_device=per_device(state, sh))


def ep_part(steps: int, batch_size: int, seq_len: int) -> dict:
  import jax
  import jax.numpy as jnp

  from k3jax import sharding
  from k3jax.model import K3Model
  from k3jax.train import data as data_lib
  from k3jax.train import trainer
  from k3jax.train.step import create_state

  cfg = trainer.base_config("small")
  cfg.train.batch_size = batch_size
  cfg.train.seq_len = seq_len
  config = trainer.model_config(cfg)
  rows = []
  for name, layout in (("replicated experts (data=8)", dict(data=8)),
                       ("expert parallel (expert=8)", dict(data=1, expert=8))):
    mesh = sharding.make_mesh(layout)
    boxed = jax.eval_shape(K3Model(config).init, jax.random.PRNGKey(0),
                           jnp.zeros((1, 8), jnp.int32))
    tx, _, step_fn, _ = trainer._build(cfg, config, sharding.make_jit_step(mesh, boxed))
    state = create_state(config, jax.random.PRNGKey(0), tx)
    rng = __import__("numpy").random.default_rng(0)
    batch = data_lib.pack_windows(rng.integers(0, 256, size=(batch_size, seq_len + 2)))
    t0 = time.perf_counter()
    state, m = step_fn(state, batch)
    jax.block_until_ready(m["loss"])
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
      t0 = time.perf_counter()
      state, m = step_fn(state, batch)
      jax.block_until_ready(m["loss"])
      times.append(time.perf_counter() - t0)
    times.sort()
    med = times[len(times) // 2]
    rows.append(dict(name=name, layout=layout, step_s=med, compile_s=compile_s,
                     tokens_per_s=batch_size * seq_len / med, loss=float(m["loss"])))
  return dict(part="ep", preset="small", batch_size=batch_size, seq_len=seq_len, steps=steps,
              rows=rows)


def _subprocess(args: list[str], devices: int) -> dict:
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, __file__, *args, "--child"], env=env,
                       capture_output=True, text=True)
  if out.returncode:
    raise RuntimeError(f"{args}: exit {out.returncode}\n{out.stderr[-4000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--part", default="all", choices=("all", "memory", "state", "ep"))
  p.add_argument("--devices", type=int, default=0, help="memory part: 256 or 2048 (default both)")
  p.add_argument("--seq_len", type=int, default=4096, help="memory part: tokens per sequence")
  p.add_argument("--per_device_batch", type=int, default=1)
  p.add_argument("--steps", type=int, default=5, help="ep part: timed steps (median)")
  p.add_argument("--ep_batch", type=int, default=16)
  p.add_argument("--ep_seq_len", type=int, default=128)
  p.add_argument("--out", default=None)
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

  if a.child:  # inside a subprocess with the right simulated device count
    res = (memory_part(a.devices, a.seq_len, a.per_device_batch) if a.part == "memory"
           else ep_part(a.steps, a.ep_batch, a.ep_seq_len))
    print(json.dumps(res))
    return

  results = []
  if a.part in ("all", "state"):
    for n in ([a.devices] if a.devices else sorted(LAYOUTS)):
      results.append(state_part(n))
  if a.part in ("all", "memory"):
    for n in ([a.devices] if a.devices else sorted(LAYOUTS)):
      results.append(_subprocess(["--part", "memory", "--devices", str(n), "--seq_len",
                                  str(a.seq_len), "--per_device_batch",
                                  str(a.per_device_batch)], n))
  if a.part in ("all", "ep"):
    results.append(_subprocess(["--part", "ep", "--steps", str(a.steps), "--ep_batch",
                                str(a.ep_batch), "--ep_seq_len", str(a.ep_seq_len)], 8))

  for r in results:
    if r["part"] == "memory":
      print(f"k3 train step, {r['devices']} devices, layout {r['layout']} (params over "
            f"{'+'.join(r['param_axes'])}), {r['global_batch']}x{r['seq_len']} tokens, "
            f"{r['dtype']}, remat={r['remat']}:")
      print(f"  per device: arguments {r['argument_gib']:.1f} GiB, outputs "
            f"{r['output_gib']:.1f} GiB (aliased {r['alias_gib']:.1f}), temporaries "
            f"{r['temp_gib']:.1f} GiB, peak ≈ {r['peak_gib']:.1f} GiB "
            f"(state total {r['state_gib_total']:.0f} GiB; compile {r['compile_s']:.0f} s)")
    elif r["part"] == "state":
      print(f"k3 training state, {r['devices']} devices, layout {r['layout']} (params over "
            f"{'+'.join(r['param_axes'])}): {r['params'] / 1e12:.4f}T params, state "
            f"{r['state_gib_total']:.0f} GiB in all; per device: params "
            f"{r['params_gib_per_device']:.2f} GiB + optimizer {r['opt_gib_per_device']:.2f} GiB"
            f" = {r['state_gib_per_device']:.2f} GiB")
    else:
      print(f"small train step on 8 CPU devices, batch {r['batch_size']}x{r['seq_len']}:")
      print(f"  {'layout':32s} {'step s':>8s} {'tokens/s':>10s} {'compile s':>10s}")
      for row in r["rows"]:
        print(f"  {row['name']:32s} {row['step_s']:8.3f} {row['tokens_per_s']:10.0f} "
              f"{row['compile_s']:10.1f}")
  blob = json.dumps({"results": results})
  if a.out:
    with open(a.out, "w") as f:
      f.write(blob + "\n")
  print(blob)


if __name__ == "__main__":
  main()
