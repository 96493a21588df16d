"""Export a k3jax checkpoint to the PyTorch layout (sharded safetensors + index + config.json).

  python -m tools.export_to_pytorch --src CKPT --dst OUT_DIR [--arch kimi_linear|kimi_k3] \
      [--expert_format mxfp4|bf16] [--dtype bfloat16|float32] [--max_shard_gb 4] [--only all|vision]

CKPT is anything `k3jax.load_pretrained` accepts, or what `convert_from_pytorch --only vision`
wrote (then only the vision tower + projector are written). A config with a vision tower also
writes its `vision_tower.*` / `mm_projector.*` tensors (release names, --dtype) and
`vision_config` in config.json; --only vision writes those alone.

K3 experts are MXFP4-packed by default (`weight_packed` + `weight_scale`, groups of 32 along
the input axis, low nibble first); K3's A_log is written with 128 entries (zero padding). fp32
tensors (A_log, dt_bias, convs, norms, router) stay fp32 whatever --dtype says.
"""

from __future__ import annotations

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("src", None, "k3jax checkpoint (run dir, checkpoints/ dir or step dir)")
flags.DEFINE_string("dst", None, "output directory (must not exist)")
flags.DEFINE_enum("arch", None, ["kimi_linear", "kimi_k3"],
                  "target layout (default: kimi_k3 when the config uses any K3 feature)")
flags.DEFINE_enum("expert_format", None, ["mxfp4", "bf16"],
                  "K3 routed experts: MXFP4-packed (default for kimi_k3) or unquantised")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "storage dtype of matmul weights")
flags.DEFINE_float("max_shard_gb", 4.0, "shard size limit (GiB)")
flags.DEFINE_enum("only", "all", ["all", "vision"],
                  "all: everything the checkpoint holds; vision: the vision tower + projector")
flags.DEFINE_bool("progress", True, "show a progress bar")
flags.mark_flags_as_required(["src", "dst"])


def main(argv):
  del argv
  from k3jax.convert import export
  out = export(FLAGS.src, FLAGS.dst, arch=FLAGS.arch, expert_format=FLAGS.expert_format,
               dtype=FLAGS.dtype, max_shard_bytes=int(FLAGS.max_shard_gb * (1 << 30)),
               progress=FLAGS.progress, only=FLAGS.only)
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
