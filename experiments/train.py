r"""Train a k3jax model.

  python -m experiments.train --config=configs/tiny.py --workdir=runs/tiny \
      --config.train.steps=300 --config.train.batch_size=8 --config.optim.lr=3e-3

Every field of the config file can be overridden with --config.<group>.<field>=value (unknown
keys are an error). The run directory receives metrics.jsonl (one JSON object per logged
step), TensorBoard events, config.json and checkpoints/; rerunning the same command with a
larger --config.train.steps resumes from the newest complete checkpoint.

Scale-out (k3jax/sharding.py): --config.mesh.{data,fsdp,expert,context,tensor} lay the devices
out as a mesh (product = device count, -1 fills), e.g. --config.mesh.expert=4; params and
optimizer state are sharded by the logical-axis table, the step is jitted with those shardings
and the layers take the expert-/context-parallel paths. --multihost calls
jax.distributed.initialize (--coordinator_address/--num_processes/--process_id or the
JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID variables): every process runs this
same command, builds the same global batch and feeds only its own devices' slices.

With --config.train.lora.rank > 0 the run trains LoRA adapters on a frozen base
(k3jax/posttrain/lora.py); every other kind of training goes through the same loop.

The terminal shows the progress bar, the per-step summary and warnings; absl's and orbax's
INFO messages are hidden unless --verbosity=0 (absl's own flag) asks for them.
"""

from __future__ import annotations

import logging

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (configs/*.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (metrics, checkpoints).")
_MULTIHOST = flags.DEFINE_bool("multihost", False,
                                "Multi-process run: call jax.distributed.initialize first.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0 (--multihost).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Process count (--multihost).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's id (--multihost).")
_KEEP_ALLOCS = flags.DEFINE_bool(
    "keep_cpu_allocations", False,
    "One glibc malloc arena that keeps its pages, so XLA:CPU's temporaries are not "
    "page-faulted afresh every call (k3jax.runtime.keep_cpu_allocations; a no-op without "
    "glibc). Off by default: the `small` CPU training step measured 10-15% slower with it "
    "(one arena for all of XLA's threads), unlike the KDA op benchmark (faster).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    # absl's default (INFO) lets orbax and jax print ~125 lines around the progress bar.
    absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("k3jax.train").setLevel(logging.INFO)
  if _KEEP_ALLOCS.value:  # before the first JAX computation starts XLA's threads
    from k3jax.runtime import keep_cpu_allocations
    keep_cpu_allocations()
  if _MULTIHOST.value:
    from k3jax import sharding
    sharding.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  from k3jax.posttrain import lora
  from k3jax.train.run import run_config
  from k3jax.train.sharded import run_mesh
  from k3jax.train.trainer import PRETRAINING, train
  run = run_config(_CONFIG.value)     # the one read of the command line's config
  recipe = lora.RECIPE if run.train.lora.rank else PRETRAINING
  records = train(run, _WORKDIR.value, recipe=recipe, mesh=run_mesh(run))
  if records:
    last = records[-1]
    print(f"step {last['step']}: loss {last['loss']:.4f}, "
          f"{last['tokens_per_s'] or 0:.0f} tokens/s, MFU {100 * (last['mfu'] or 0):.1f}%")


if __name__ == "__main__":
  # Required only when run as a script: a validator on the global FLAGS would
  # also reject other entry points' flags parsed in the same process.
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)
