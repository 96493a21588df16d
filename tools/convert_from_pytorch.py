"""Convert a PyTorch checkpoint (Hugging Face / Moonshot layout) into a k3jax checkpoint.

  python -m tools.convert_from_pytorch --src HF_DIR --dst OUT_DIR \
      [--arch auto|kimi_linear|kimi_k3|kimi_k25] [--only all|vision] [--dtype float32|bfloat16] \
      [--allow_torch_pickle]

HF_DIR holds config.json and model.safetensors, or shards named by
model.safetensors.index.json. OUT_DIR must not exist; it appears only when the conversion is
complete and loads with `k3jax.load_pretrained(OUT_DIR)` → (config, variables) — text model,
plus the vision tower when config.json has a vision_config.

--only vision converts the vision tower + projector alone: `--arch kimi_k3` (K3's release
names, MoonViT-V2) or `--arch kimi_k25` (Kimi K2.5/K2.6: the original release or
`transformers`' spellings); OUT_DIR then loads with `k3jax.vision.load_vision(OUT_DIR)` →
(vision_config, variables).
"""

from __future__ import annotations

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("src", None, "PyTorch checkpoint directory (config.json + safetensors)")
flags.DEFINE_string("dst", None, "output directory (must not exist)")
flags.DEFINE_enum("arch", "auto", ["auto", "kimi_linear", "kimi_k3", "kimi_k25"],
                  "source layout; auto reads config.json's model_type (kimi_k25: --only vision)")
flags.DEFINE_enum("only", "all", ["all", "vision"],
                  "all: the text model (+ vision tower if config.json has one); vision: the "
                  "vision tower + projector alone")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                  "storage dtype of matmul weights (norms, A_log, dt_bias, convs, router: fp32)")
flags.DEFINE_bool("allow_torch_pickle", False,
                  "read *.bin/*.pt with torch.load(weights_only=True) when no safetensors exist")
flags.DEFINE_bool("progress", True, "show a progress bar")
flags.mark_flags_as_required(["src", "dst"])


def main(argv):
  del argv
  from k3jax.convert import convert
  out = convert(FLAGS.src, FLAGS.dst, arch=FLAGS.arch, dtype=FLAGS.dtype,
                allow_torch_pickle=FLAGS.allow_torch_pickle, progress=FLAGS.progress,
                only=FLAGS.only)
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
