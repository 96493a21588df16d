"""Print the tensors `tools.export_to_pytorch` would write for a config: name, shape, dtype.

  python -m tools.checkpoint_names --preset k3                 # the release: 497,220 lines
  python -m tools.checkpoint_names --preset tiny --mtp         # + the k3jax_mtp.* layer
  python -m tools.checkpoint_names --config_json /path/to/config.json --count

One line per tensor, `name<TAB>[d0, d1, …]<TAB>DTYPE` (safetensors dtype names: BF16, F32, U8),
in the order export writes them (natural order: layers.2 before layers.10). Everything comes
from the config alone (the converter's tensor map, `k3jax.convert.names`): no tensor is
allocated, so the full K3 listing takes seconds. --count prints only the number of tensors
and their bytes.
"""

from __future__ import annotations

import math
import os
import sys

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Registers the tool's flags, only when it runs as a script (importing it must not
  clash with other entry points that define --preset)."""
  flags.DEFINE_string("preset", None, "a ModelConfig preset (k3, tiny, tiny_multimodal, …)")
  flags.DEFINE_string("config_json", None, "or a config.json (Hugging Face / release layout)")
  flags.DEFINE_enum("arch", None, ["kimi_linear", "kimi_k3"],
    "target layout (default: kimi_k3 when the config uses any K3 feature)")
  flags.DEFINE_enum("expert_format", None, ["mxfp4", "bf16"],
    "routed experts (default: mxfp4 for kimi_k3)")
  flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"],
    "dtype of the tensors the release stores in bf16 (the fp32 and uint8 ones stay so)")
  flags.DEFINE_enum("text_prefix", "auto", ["auto", "language_model", "bare"],
    "text tensor names (auto: language_model.* with a vision tower)")
  flags.DEFINE_bool("mtp", False, "include the MTP layer (k3jax_mtp.*; the release has none)")
  flags.DEFINE_bool("count", False, "print only the tensor count and total bytes")


PREFIX = {"auto": None, "language_model": "language_model.", "bare": ""}


def names_for(config, arch=None, expert_format=None, dtype="bfloat16", text_prefix=None,
              mtp=False):
  """[(name, numpy dtype, shape)] that `export` writes for `config` (same arguments)."""
  import ml_dtypes
  import numpy as np

  from k3jax import hf_config
  from k3jax.convert import names as N
  arch = arch or ("kimi_k3" if hf_config.is_k3_style(config) else "kimi_linear")
  store = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
  return N.tensor_plan(N.leaves(config, arch, expert_format, text_prefix=text_prefix, mtp=mtp),
                       store)


def format_line(name: str, dtype, shape) -> str:
  """One output line: `name<TAB>[d0, d1, …]<TAB>DTYPE` (safetensors dtype name)."""
  from k3jax.convert.safetensors_io import DTYPE_NAMES
  return f"{name}\t{list(shape)}\t{DTYPE_NAMES[dtype]}"


def main(argv):
  del argv
  import json
  import pathlib

  if (FLAGS.preset is None) == (FLAGS.config_json is None):
    raise app.UsageError("pass exactly one of --preset and --config_json")
  if FLAGS.preset:
    from k3jax.config import preset
    config = preset(FLAGS.preset)
  else:
    from k3jax import hf_config
    config = hf_config.from_hf_config(json.loads(pathlib.Path(FLAGS.config_json).read_text()))
  plan = names_for(config, FLAGS.arch, FLAGS.expert_format, FLAGS.dtype,
                   PREFIX[FLAGS.text_prefix], FLAGS.mtp)
  if FLAGS.count:
    nbytes = sum(math.prod(s) * d.itemsize for _, d, s in plan)
    print(f"{len(plan)} tensors, {nbytes} bytes ({nbytes / 1e12:.3f} TB)")
    return
  try:
    sys.stdout.writelines(format_line(*e) + "\n" for e in plan)
    sys.stdout.flush()
  except BrokenPipeError:   # `… | head`: the reader is gone; stop quietly
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
  define_flags()
  app.run(main)
