"""Fold LoRA adapters into their base and write a plain checkpoint (and, optionally, export it).

  python -m tools.merge_lora --base CKPT --adapters DIR --dst OUT [--export_dir DIR \
      [--expert_format mxfp4|bf16] [--dtype bfloat16|float32]]

CKPT: the base model, anything `k3jax.load_pretrained` reads (its routed experts packed MXFP4
or not). DIR: the adapters `k3jax.posttrain.lora.save_adapters` wrote (a LoRA run writes them to
WORKDIR/adapters). Every adapted kernel becomes W + (alpha/r)·A·B; packed experts are
dequantised, summed and quantised again with `k3jax.quant.mx.pack_expert`, the quantiser the
exporter and QAT use, so the merged checkpoint keeps the base's expert format
(`k3jax.posttrain.lora.merge_adapters`). OUT is written by `save_pretrained` (orbax writes a
temporary directory and renames it); --export_dir then runs tools/export_to_pytorch's export
on it (release layout: safetensors + config.json).
"""

from __future__ import annotations

from absl import app, flags

FLAGS = flags.FLAGS


def merge_checkpoint(base: str, adapters: str, dst: str):
  """Merge the adapters in `adapters` into the checkpoint `base` and save it at `dst`.
  Returns (merged ModelConfig, the step directory written)."""
  from k3jax.convert.checkpoint import load_pretrained, save_pretrained
  from k3jax.config import config_diff
  from k3jax.posttrain.lora import load_adapters, merge_adapters, without_adapters

  base_config, variables = load_pretrained(base)
  config, lora = load_adapters(adapters)
  # The adapters fit the base when the models agree on everything but the adapters and the
  # experts' storage (adapters trained on a packed base merge into a bf16 one and back).
  diff = config_diff(without_adapters(config).replace(expert_format="bf16"),
                     without_adapters(base_config).replace(expert_format="bf16"))
  if diff:
    raise ValueError(f"--adapters {adapters!r} were trained for another model than --base "
                     f"{base!r}; differing fields (adapters, base): {diff}")
  config = config.replace(expert_format=base_config.modes.expert_format)
  merged_config, merged = merge_adapters(config, {**variables, "lora": lora})
  return merged_config, save_pretrained(dst, merged_config, merged)


def define_flags() -> None:
  flags.DEFINE_string("base", None, "base checkpoint (run dir, checkpoints/ dir or step dir)")
  flags.DEFINE_string("adapters", None, "adapter checkpoint directory (save_adapters)")
  flags.DEFINE_string("dst", None, "output checkpoint directory")
  flags.DEFINE_string("export_dir", None, "also export the merged model here (PyTorch layout)")
  flags.DEFINE_enum("expert_format", None, ["mxfp4", "bf16"],
                    "export: routed experts' format (default: the exporter's)")
  flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"],
                    "export: storage dtype of matmul weights")


def main(argv):
  del argv
  config, path = merge_checkpoint(FLAGS.base, FLAGS.adapters, FLAGS.dst)
  print(f"wrote {path} ({config.name}, expert_format={config.modes.expert_format})")
  if FLAGS.export_dir:
    from k3jax.convert import export
    out = export(FLAGS.dst, FLAGS.export_dir, expert_format=FLAGS.expert_format,
                 dtype=FLAGS.dtype)
    print(f"exported {out}")


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["base", "adapters", "dst"])
  app.run(main)
