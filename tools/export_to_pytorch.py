"""Export a k3jax checkpoint to the PyTorch layout (sharded safetensors + index + config.json).

  python -m tools.export_to_pytorch --src CKPT --dst OUT_DIR [--arch kimi_linear|kimi_k3] \
      [--expert_format mxfp4|bf16] [--dtype bfloat16|float32] [--max_shard_gb 4] \
      [--only all|vision] [--text_prefix auto|language_model|bare] [--mtp]

CKPT is anything `k3jax.load_pretrained` accepts, or what `convert_from_pytorch --only vision`
wrote (then only the vision tower + projector are written). A config with a vision tower also
writes its `vision_tower.*` / `mm_projector.*` tensors (release names, --dtype) and
`vision_config` in config.json; --only vision writes those alone.

K3 experts are MXFP4-packed by default (`weight_packed` + `weight_scale`, groups of 32 along
the input axis, low nibble first); K3's A_log is written with 128 entries (zero padding past
the heads), or whole ([kda_head_dim], + `a_log_per_channel: true` in config.json) when the
checkpoint reads it per key channel (`convert_from_pytorch --a_log=channel`). Dtypes come
from the release's table (k3jax/convert/dtypes.py, each entry with its source): A_log,
dt_bias, the short convs, o_norm and the router bias fp32, everything else — the router
matrices included, as the release's published size shows — in --dtype (bf16 by default, as
released; float32 writes fp32 masters exactly).

Names and files are the release's (docs/k3.md §12): `language_model.model.*` +
`language_model.lm_head.weight` with a vision tower, bare `model.*` + `lm_head.weight`
text-only (--text_prefix overrides); shards of at most --max_shard_gb with
`model.safetensors.index.json`; config.json with `quantization_config` when experts are MXFP4.
The release has no MTP tensors, so the MTP layer is not written unless --mtp, which writes it
under `k3jax_mtp.*` (a k3jax-only name that convert_from_pytorch reads back).
`python -m tools.checkpoint_names` lists the names without a checkpoint.
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
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"],
                  "dtype of the tensors the release stores in bf16 (the fp32 ones stay fp32)")
flags.DEFINE_float("max_shard_gb", 4.0, "shard size limit (GiB)")
flags.DEFINE_enum("only", "all", ["all", "vision"],
                  "all: everything the checkpoint holds; vision: the vision tower + projector")
flags.DEFINE_enum("text_prefix", "auto", ["auto", "language_model", "bare"],
                  "text tensor names: language_model.model.* or model.* (auto: the first with "
                  "a vision tower)")
flags.DEFINE_bool("mtp", False, "also write the MTP layer, under k3jax_mtp.* (not a release name)")
flags.DEFINE_bool("progress", True, "show a progress bar")
PREFIX = {"auto": None, "language_model": "language_model.", "bare": ""}


def main(argv):
  del argv
  from k3jax.convert import export
  out = export(FLAGS.src, FLAGS.dst, arch=FLAGS.arch, expert_format=FLAGS.expert_format,
               dtype=FLAGS.dtype, max_shard_bytes=int(FLAGS.max_shard_gb * (1 << 30)),
               progress=FLAGS.progress, only=FLAGS.only,
               text_prefix=PREFIX[FLAGS.text_prefix], mtp=FLAGS.mtp)
  print(f"wrote {out}")


if __name__ == "__main__":
  # Required only when run as a script: a validator on the global FLAGS would
  # also reject other entry points' flags parsed in the same process.
  flags.mark_flags_as_required(["src", "dst"])
  app.run(main)
