"""How the compiled LoRA train step's temporaries grow with the frozen routed experts (CPU).

  python -m experiments.qlora_temps [--out FILE.json]

A check for the k3 QLoRA compile that XLA:TPU refuses (docs/notes/lora.md): a tiny model
(LoRA on q and o only, experts frozen), scanned and rematerialised as the recipe is, its LoRA
step lowered from abstract values and compiled for this CPU, `memory_analysis()` temporaries
read for 16 and 64 experts at two depths and both expert formats. With one chunk of experts
dequantised at a time the packed rows' temporaries do not grow with the experts; the JSON's
`expert_bytes_all_layers_delta` is what every layer's experts take (bf16). The bf16 rows grow
by two copies of it on this CPU, which has no bf16 matmul and keeps f32 copies of the operands.
"""

from __future__ import annotations

import json

from absl import app, flags

from experiments import results

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "also write the JSON here")

F, D = 256, 128    # expert width and (latent) input width


def temps(num_layers: int, num_experts: int, expert_format: str) -> dict:
  import flax.linen as nn
  from k3jax.config import preset
  from k3jax.data import corpus as data_lib
  from k3jax.model import abstract_variables
  from k3jax.posttrain import lora as L
  from k3jax.train.run import RunConfig, TrainConfig
  from k3jax.train.state import abstract_state
  c = preset("tiny", num_layers=num_layers, num_experts=num_experts, expert_format=expert_format,
             moe_intermediate_size=F, latent_moe_dim=D, lora_rank=2, lora_targets=("q", "o"),
             remat=True, scan_layers=True, num_mtp_layers=0, dtype="bfloat16",
             param_dtype="bfloat16", moe_capacity_factor=1.25, kernel_backend="xla")
  run = RunConfig(model=c, train=TrainConfig(batch_size=2, seq_len=64, mtp_weight=0.0))
  step = L.build_adapter_step(run, c, None)
  state = abstract_state(nn.unbox(abstract_variables(c)), L.ADAPTERS, step.tx)
  batch = data_lib.abstract_batch(run.train.batch_size, run.train.seq_len)
  ma = step.train.lower(state, batch).compile().memory_analysis()
  moe_layers = num_layers - c.text.first_dense_layers
  return dict(num_layers=num_layers, stack_layout=list(c.text.stack_layout()),
              num_experts=num_experts, expert_format=expert_format,
              temp_bytes=int(ma.temp_size_in_bytes),
              expert_bytes_all_layers=moe_layers * num_experts * 3 * F * D * 2)


def main(argv):
  del argv
  rows = [temps(n, e, fmt) for fmt in ("mxfp4", "bf16") for n in (5, 9) for e in (16, 64)]
  out = []
  for a, b in zip(rows[0::2], rows[1::2]):
    out.append(dict(expert_format=a["expert_format"], num_layers=a["num_layers"],
                    stack_layout=a["stack_layout"], temp_bytes_16=a["temp_bytes"],
                    temp_bytes_64=b["temp_bytes"],
                    temp_delta=b["temp_bytes"] - a["temp_bytes"],
                    expert_bytes_all_layers_delta=(b["expert_bytes_all_layers"]
                                                   - a["expert_bytes_all_layers"])))
  for r in out:
    print(f"{r['expert_format']:>5} experts, {r['num_layers']} layers {r['stack_layout']}: "
          f"temporaries +{r['temp_delta'] / 2**20:.1f} MiB from 16 to 64 experts; every "
          f"layer's expert bytes +{r['expert_bytes_all_layers_delta'] / 2**20:.1f} MiB")
  if FLAGS.out:
    results.write_json(FLAGS.out, {"rows": out})
  print(json.dumps({"rows": out}))


if __name__ == "__main__":
  app.run(main)
