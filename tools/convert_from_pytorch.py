"""Convert a PyTorch checkpoint (Hugging Face / Moonshot layout) into a k3jax checkpoint.

  python -m tools.convert_from_pytorch --src HF_DIR --dst OUT_DIR \
      [--arch auto|kimi_linear|kimi_k3|kimi_k25] [--only all|vision] [--dtype float32|bfloat16] \
      [--allow_torch_pickle] [--skip_prefix PREFIX ...] [--check_only] [--mtp_seed 0] \
      [--expert_format bf16|mxfp4] [--drop_mtp] [--a_log auto|crop|channel] [--workers N] \
      [--process_index I --process_count N [--wait_timeout_s S]]

HF_DIR holds config.json and model.safetensors, or shards named by
model.safetensors.index.json. OUT_DIR must not exist; it appears only when the conversion is
complete and loads with `k3jax.load_pretrained(OUT_DIR)` → (config, variables) — text model,
plus the vision tower when config.json has a vision_config.

--only vision converts the vision tower + projector alone: `--arch kimi_k3` (K3's release
names, MoonViT-V2) or `--arch kimi_k25` (Kimi K2.5/K2.6: the original release or
`transformers`' spellings); OUT_DIR then loads with `k3jax.vision.load_vision(OUT_DIR)` →
(vision_config, variables).

Text tensors may be spelled `language_model.model.*` (the release) or bare `model.*`. A tensor
the config does not use is an error naming it; --skip_prefix (repeatable or comma-separated)
names prefixes to leave out (`--skip_prefix vision_tower.,mm_projector.` converts the text
model of a multimodal release alone). The release has no MTP tensors: a config with an MTP
layer gets one initialised as K3Model.init does (--mtp_seed), reported here and in
OUT_DIR/conversion.json (--drop_mtp converts without it); an export written with --mtp
carries it under `k3jax_mtp.*`.

Speed: --workers processes convert at once (default: one per CPU core, at most 8), each
writing its share of the leaves straight into the checkpoint. Several hosts: run the same
command on each with --process_index i --process_count n and a --dst on a filesystem all of
them see; process i converts its share and process 0 saves the checkpoint once every share is
written. Resume: an interrupted conversion leaves `.DST_NAME.partial/` beside --dst; the same
command skips what it completed (other flags or a changed source are refused).

K3's A_log has 128 entries for 96 heads (docs/k3.md §12), and how to read them is not settled.
--a_log=crop keeps the first 96 as the heads' rates (ModelConfig.text.kda_a_log_axis="head"),
--a_log=channel all 128 as one rate per key dimension shared by the heads ("channel");
--a_log=auto (default) crops when entries 96-127 are exactly zero in every layer, follows
config.json's `a_log_per_channel` when a k3jax export wrote one, and otherwise stops with the
values' statistics and both flags (docs/notes/convert.md, "When the converter stops on
A_log"). The reading is printed and recorded in the result's config and conversion.json.

Float tensors load whatever their float dtype (bf16, fp16, fp32), cast to the model's
parameter dtypes; each conversion is printed by kind and listed in conversion.json, and a K3
tensor in another dtype than the release's table (k3jax/convert/dtypes.py) is a warning.

--check_only reads config.json, the index and every shard's header (no tensor data) and
reports every missing, unexpected, mis-shaped and mis-typed tensor (MXFP4 bytes not uint8, a
non-float where a float belongs; exit status 1) or a one-line summary, with the dtype
warnings; with --a_log=auto it also reads the A_log vectors (512 bytes each) to decide their
reading; --dst is not needed. A conversion that stops on bad data prints why and exits 1.
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
flags.DEFINE_list("skip_prefix", [], "leave out source tensors whose names start with these "
                  "prefixes (anything else the config does not use is an error)")
flags.DEFINE_bool("check_only", False, "check names, shapes and dtypes from the headers "
                  "against config.json; write nothing")
flags.DEFINE_enum("expert_format", "bf16", ["bf16", "mxfp4"],
                  "routed experts of the result: bf16 (MXFP4 decoded to --dtype) or mxfp4 "
                  "(the release's bytes kept packed: ModelConfig.modes.expert_format='mxfp4')")
flags.DEFINE_integer("mtp_seed", 0, "seed of the fresh MTP layer when the source has none")
flags.DEFINE_integer("workers", None, "processes converting at once (default: one per CPU "
                     "core, at most 8)")
flags.DEFINE_integer("process_index", 0, "this process's index in a multi-host conversion")
flags.DEFINE_integer("process_count", 1, "processes (hosts) converting together")
flags.DEFINE_float("wait_timeout_s", None, "process 0: give up waiting for the other "
                   "processes' shares after this many seconds (default: wait)")
flags.DEFINE_enum("a_log", "auto", ["auto", "crop", "channel"],
                  "K3's 128-entry A_log: crop (first 96 = per-head rates), channel (128 per-key-"
                  "dimension rates shared by the heads), auto (crop when entries 96-127 are "
                  "zero, else stop and show them)")
flags.DEFINE_bool("drop_mtp", False, "convert without the config's MTP layer (num_mtp_layers=0) "
                  "instead of initialising a fresh one")


def main(argv):
  del argv
  import os
  import sys
  import time

  from k3jax.convert import convert
  if FLAGS.dst is None and not FLAGS.check_only:
    raise app.UsageError("--dst is required (unless --check_only)")
  t0 = time.perf_counter()
  try:
    out = convert(FLAGS.src, FLAGS.dst, arch=FLAGS.arch, dtype=FLAGS.dtype,
                  allow_torch_pickle=FLAGS.allow_torch_pickle, progress=FLAGS.progress,
                  only=FLAGS.only, skip_prefix=FLAGS.skip_prefix, check_only=FLAGS.check_only,
                  mtp_seed=FLAGS.mtp_seed, workers=FLAGS.workers or min(8, os.cpu_count() or 1),
                  process_index=FLAGS.process_index, process_count=FLAGS.process_count,
                  wait_timeout_s=FLAGS.wait_timeout_s, a_log=FLAGS.a_log,
                  **({"num_mtp_layers": 0} if FLAGS.drop_mtp else {}),
                  **({"expert_format": "mxfp4"} if FLAGS.expert_format == "mxfp4" else {}))
  except ValueError as e:
    # Bad data or a decision to make (--a_log): the message says what; a traceback would
    # bury it.
    what = "check failed" if FLAGS.check_only else "conversion stopped"
    print(f"{what} ({time.perf_counter() - t0:.1f} s):\n{e}", file=sys.stderr)
    sys.exit(1)
  if FLAGS.check_only:
    print(f"check passed in {time.perf_counter() - t0:.1f} s")
  elif out is not None:   # other processes of a multi-host conversion: logged by convert
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
  # Required only when run as a script: a validator on the global FLAGS would
  # also reject other entry points' flags parsed in the same process.
  flags.mark_flags_as_required(["src"])
  app.run(main)
