r"""Train–serve gap with and without quantisation-aware training of the routed experts.

  python -m experiments.qat_gap --config=configs/small.py --workdir=runs/qat_gap \
      --config.train.steps=20 --config.train.batch_size=4 --config.train.grad_accum=1 \
      --config.train.seq_len=128 --config.optim.muon=False --config.train.peak_flops=1e12 \
      --eval_batches=4 --out=docs/results/qat_gap_small.json [--data=stdlib]

Two fine-tuning runs of the same model from the same initialisation on the same batches
(k3jax.train.trainer), one with `model.expert_qat=None`, one with "mxfp4_mxfp8" (docs/k3.md §13,
docs/notes/qat.md). Each final checkpoint is then evaluated on the held-out batches:

  train_loss   the forward it was trained with (plain experts, or the QAT forward);
  served_loss  the quantised serving path: experts packed to MXFP4 (`pack_expert_params`, the
               exporter's codes) and `expert_format="mxfp4"`, MXFP8 expert inputs
               (`expert_qat="mxfp4_mxfp8"`) — what generation runs;
  float_loss   the unquantised forward (bf16-format experts, no fake quantisation);
  gap          served_loss − train_loss (nats/token): what deployment costs that training did
               not see;
  mxfp4_rel_err  ‖w − MXFP4(w)‖ / ‖w‖ over every routed expert matrix of the checkpoint.

All losses are mean cross-entropy in nats/token over the same `--eval_batches` held-out
batches, dropless MoE (`ModelConfig.for_inference`). `--data` is the run config's
`data.source` (default: the embedded pre-training corpus; any source k3jax.data.corpus reads;
`sft` with configs/sft_small.py: the embedded chat tasks, losses on assistant tokens of
held-out conversations — the gap after SFT).
A JSON object goes to --out (written to a temporary file and renamed) and to stdout.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile

from absl import app, flags

from experiments import results

ARMS = (("plain", None), ("qat", "mxfp4_mxfp8"))


def define_flags(fv=flags.FLAGS):
  from ml_collections import config_flags
  config_flags.DEFINE_config_file("config", "configs/small.py", "Run config file (configs/*.py)",
                                  lock_config=True, flag_values=fv)
  flags.DEFINE_string("workdir", None, "directory of the two runs (<workdir>/plain, "
                      "<workdir>/qat); default: a new temporary directory", flag_values=fv)
  flags.DEFINE_string("data", "stdlib", "data.source of both runs (k3jax.data.corpus)",
                      flag_values=fv)
  flags.DEFINE_integer("eval_batches", 4, "held-out batches of train.batch_size × seq_len",
                       flag_values=fv)
  flags.DEFINE_string("out", None, "JSON output path (default <workdir>/qat_gap.json)",
                      flag_values=fv)


def _expert_matrices(params):
  """Every float routed expert kernel [..., in, out] of a param tree."""
  from k3jax.quant import mx
  out = []

  def walk(t):
    if isinstance(t, dict):
      for k, v in t.items():
        if k == "experts" and isinstance(v, dict) and set(mx.EXPERT_MATRICES) <= set(v):
          out.extend(v[n] for n in mx.EXPERT_MATRICES)
        else:
          walk(v)
  walk(params)
  return out


def mxfp4_relative_error(params) -> float:
  """‖w − MXFP4(w)‖_F / ‖w‖_F over all routed expert matrices (the exporter's codes)."""
  import jax
  import jax.numpy as jnp
  from k3jax.quant import qat
  ws = _expert_matrices(params)
  if not ws:
    raise ValueError("params: no routed expert matrices (experts/w1,w3,w2) found")
  sq = jax.jit(lambda w: (jnp.sum((w - qat.fake_mxfp4_expert(w)) ** 2), jnp.sum(w * w)))
  num = den = 0.0
  for w in ws:
    a, b = sq(jnp.asarray(w, jnp.float32))
    num, den = num + float(a), den + float(b)
  return (num / den) ** 0.5


@functools.cache
def _eval_step(config):
  """The jitted eval step of a config (the arms share configs: one compile each)."""
  import jax
  from k3jax.train.step import make_eval_step
  return jax.jit(make_eval_step(config))


def eval_loss(config, variables, batches) -> float:
  """Mean held-out cross-entropy (nats/token) of `config`'s forward."""
  import jax
  step = _eval_step(config)
  ce = n = 0.0
  for b in batches:
    out = jax.device_get(step(variables, b))
    ce, n = ce + float(out["ce_sum"]), n + float(out["tokens"])
  return ce / max(n, 1.0)


def served(config, variables):
  """(config, variables) of the quantised serving path: packed MXFP4 experts + MXFP8 inputs."""
  import jax
  from k3jax.quant import mx
  params = jax.jit(mx.pack_expert_params)(variables["params"])
  return (config.replace(expert_format="mxfp4", expert_qat="mxfp4_mxfp8"),
          {**variables, "params": params})


def run(cfg, workdir: str, data: str = "stdlib", eval_batches: int = 4) -> dict:
  """Train both arms in <workdir>/{plain,qat} (resuming what is there) and evaluate them."""
  from k3jax.convert.checkpoint import load_pretrained
  from k3jax.data import corpus as data_lib
  from k3jax.data import sft
  from k3jax.train import trainer
  from k3jax.train.run import run_config
  if eval_batches < 1:
    raise ValueError(f"eval_batches: expected a positive int, found {eval_batches}")
  base = cfg.copy_and_resolve_references()
  base.data.source = data
  base.train.eval_every = 0            # evaluated below, on the same batches for every forward
  base.train.checkpoint_every = base.train.steps
  base.train.async_checkpoint = False
  base.train.tensorboard = False
  base.train.progress = False
  run0 = run_config(base)
  config0 = run0.model
  if data == trainer.SFT:   # held-out conversations, loss on assistant tokens
    d = run0.data
    _, held = sft.conversations(d.sft_file, d.eval_percent, run0.seed, d.sft_num_train,
                                d.sft_num_eval)
    batches = sft.eval_batches(sft.pack([sft.tokenize(c) for c in held], run0.train.seq_len,
                                        None), eval_batches, run0.train.batch_size)
  else:
    corpus = data_lib.load_corpus(data, base.data.eval_percent, config0.text.vocab_size)
    batches = data_lib.eval_batches(corpus, eval_batches, base.train.batch_size,
                                    base.train.seq_len, base.seed)
  if not batches:
    raise ValueError(f"data: source {data!r} has too little held-out text for "
                     f"seq_len={base.train.seq_len}")
  result = {"config": base.to_dict(), "data": data, "eval_batches": eval_batches,
            "eval_tokens": int(sum(b["loss_mask"].sum() for b in batches)), "arms": {}}
  for name, mode in ARMS:
    arm = base.copy_and_resolve_references()
    arm.model.expert_qat = mode
    records = trainer.train(run_config(arm), os.path.join(workdir, name))
    config, variables = load_pretrained(os.path.join(workdir, name))
    config = config.for_inference()
    train_loss = eval_loss(config, variables, batches)
    served_loss = eval_loss(*served(config, variables), batches)
    float_loss = eval_loss(config.replace(expert_qat=None), variables, batches)
    result["arms"][name] = {
        "expert_qat": mode,
        "last_train_batch_loss": records[-1]["ce"] if records else None,
        "train_loss": train_loss, "served_loss": served_loss, "float_loss": float_loss,
        "gap": served_loss - train_loss,
        "mxfp4_rel_err": mxfp4_relative_error(variables["params"]),
    }
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from absl import logging as absl_logging
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("k3jax.train").setLevel(logging.WARNING)
  fv = flags.FLAGS
  workdir = fv.workdir or tempfile.mkdtemp(prefix="qat_gap_")
  result = run(fv.config, workdir, fv.data, fv.eval_batches)
  result["workdir"] = workdir
  results.write_json(fv.out or os.path.join(workdir, "qat_gap.json"), result, indent=2)
  for name, r in result["arms"].items():
    print(f"{name:>5}: train {r['train_loss']:.4f}  served {r['served_loss']:.4f}  "
          f"gap {r['gap']:+.4f} nats/token  (float {r['float_loss']:.4f}, MXFP4 rel err "
          f"{r['mxfp4_rel_err']:.4f})")
  print(json.dumps({k: v for k, v in result.items() if k != "config"}))


if __name__ == "__main__":
  define_flags()
  app.run(main)
