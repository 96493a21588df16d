"""Parity of k3jax's moonvit_k25 tower + projector with `transformers`' Kimi K2.5 at full size
(the figure in docs/results.md).

  python -m experiments.vision_parity [--json OUT.json] [--layers 27] [--hidden 1152] \
      [--heads 16] [--intermediate 4304] [--text_hidden 7168] [--seed 0]

Builds a random `transformers` Kimi_K25VisionModel and Kimi_K25MultimodalProjection (defaults:
the full moonvit_k25 size), perturbs every parameter (LayerNorm weights ≠ 1, biases ≠ 0), writes
them under transformers' module names (`model.vision_tower.layers.N.attn.{q,k,v}_proj`, q/k in
rotate-half order; `model.mm_projector.{pre_norm,in_proj,out_proj}`) with a kimi_k25
config.json, converts that with `k3jax.convert.convert(..., arch="kimi_k25", only="vision")`,
loads it with `k3jax.vision.load_vision`, and runs both models in fp32 on ONE packed batch: two
images of different sizes and one 4-frame clip (pixel_values [L, 3, 14, 14] + grid_thw, as the
image processor would give them). Reports the max relative error
max|ours − theirs| / max|theirs| of the merged embeddings (`encode(stage="merged")` vs
`pooler_output` [N, 4, hidden]) and of the projected features (`stage="projected"` vs
`mm_projector(pooler_output)` [N, text_hidden]). JSON goes through a temporary file + rename.
"""

from __future__ import annotations

import json
import pathlib
import tempfile
import time

import numpy as np

from experiments import results

# (t, h, w) of the batch: two images of different sizes and a 4-frame clip.
GRIDS = ((1, 16, 20), (1, 24, 12), (4, 10, 14))


def k25_config(layers: int, hidden: int, heads: int, intermediate: int, text_hidden: int,
               pos_emb: int = 64) -> dict:
  """A kimi_k25 config.json dict for the vision tower + projector (text_config: width only)."""
  return {
      "model_type": "kimi_k25", "architectures": ["Kimi_K25ForConditionalGeneration"],
      "projection_hidden_size": hidden, "projection_layer_norm_eps": 1e-5,
      "text_config": {"model_type": "deepseek_v3", "hidden_size": text_hidden},
      "vision_config": {
          "model_type": "kimi_k25_vision", "num_hidden_layers": layers, "hidden_size": hidden,
          "num_attention_heads": heads, "intermediate_size": intermediate, "patch_size": 14,
          "pos_emb_height": pos_emb, "pos_emb_width": pos_emb, "pos_emb_time": 4,
          "merge_kernel_size": [2, 2], "hidden_act": "gelu_pytorch_tanh",
          "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}},
  }


def perturb_(module, seed: int) -> None:
  """Random values for every parameter of a torch module, in place: matrices N(0, 1/fan_in),
  LayerNorm weights 1 + 0.1·N, biases and the position table 0.1·N (so nothing keeps its
  init value and a transposed or mis-ordered tensor shows)."""
  import torch
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in sorted(module.named_parameters()):
      x = torch.randn(p.shape, generator=g, dtype=torch.float32)
      if p.ndim >= 2 and "position_embeddings" not in name:
        x = x / np.sqrt(p[0].numel())
      elif "norm" in name and name.endswith("weight"):
        x = 1 + 0.1 * x
      else:
        x = 0.1 * x
      p.copy_(x)


def build_reference(d: dict, seed: int = 0):
  """(vision tower, projector) of `transformers` for config dict `d`, random, fp32, eval."""
  from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25VisionModel
  from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25MultimodalProjection
  cfg = Kimi_K25Config(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})
  cfg.vision_config._attn_implementation = "eager"
  tower = Kimi_K25VisionModel(cfg.vision_config).eval()
  projector = Kimi_K25MultimodalProjection(cfg).eval()
  perturb_(tower, seed)
  perturb_(projector, seed + 1)
  return tower, projector


def module_state_dict(tower, projector) -> dict:
  """Both modules' tensors under transformers' module names (as a raw state_dict saves them)."""
  out = {f"model.vision_tower.{k}": v for k, v in tower.state_dict().items()}
  out.update({f"model.mm_projector.{k}": v for k, v in projector.state_dict().items()})
  return {k: v.detach().contiguous() for k, v in out.items()}


def write_module_checkpoint(directory: pathlib.Path, d: dict, tower, projector) -> None:
  from safetensors.torch import save_file
  directory.mkdir(parents=True)
  save_file(module_state_dict(tower, projector), str(directory / "model.safetensors"))
  (directory / "config.json").write_text(json.dumps(d))


def batch(grids=GRIDS, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """pixel_values [L, 3, 14, 14] fp32 (N(0, 1)) and grid_thw [n, 3] int for `grids`."""
  grid = np.asarray(grids, np.int64)
  n = int(np.prod(grid, axis=1).sum())
  return np.random.default_rng(seed).normal(size=(n, 3, 14, 14)).astype(np.float32), grid


def reference_outputs(tower, projector, pixel_values, grid_thw):
  """transformers' merged [N, 4, hidden] and projected [N, text_hidden] (numpy fp32)."""
  import torch
  with torch.no_grad():
    out = tower(torch.from_numpy(pixel_values), grid_thw=torch.from_numpy(grid_thw))
    merged = out.pooler_output
    projected = projector(merged).squeeze(1)
  return merged.numpy(), projected.numpy()


def rel_err(ours, theirs) -> float:
  """max |ours − theirs| / max |theirs| (shapes must agree)."""
  ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
  if ours.shape != theirs.shape:
    raise ValueError(f"shapes differ: ours {ours.shape}, transformers {theirs.shape}")
  return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def run(layers=27, hidden=1152, heads=16, intermediate=4304, text_hidden=7168, seed=0,
        pos_emb=64, grids=GRIDS, query_block=None, workdir=None) -> dict:
  """Build, convert, run both; return the figures (dict)."""
  import torch
  from k3jax.convert import convert
  from k3jax.vision import encode, load_vision
  torch.manual_seed(seed)
  d = k25_config(layers, hidden, heads, intermediate, text_hidden, pos_emb)
  t0 = time.time()
  tower, projector = build_reference(d, seed)
  with tempfile.TemporaryDirectory(dir=workdir) as tmp:
    src = pathlib.Path(tmp) / "src"
    write_module_checkpoint(src, d, tower, projector)
    dst = convert(src, pathlib.Path(tmp) / "k3jax", arch="kimi_k25", only="vision",
                  progress=False, log=lambda s: None)
    cfg, variables = load_vision(dst)
  pixel_values, grid_thw = batch(grids, seed)
  t1 = time.time()
  ref_merged, ref_projected = reference_outputs(tower, projector, pixel_values, grid_thw)
  t2 = time.time()
  merged = np.asarray(encode(cfg, variables, pixel_values, grid_thw, stage="merged",
                             query_block=query_block))
  projected = np.asarray(encode(cfg, variables, pixel_values, grid_thw, stage="projected",
                                query_block=query_block))
  t3 = time.time()
  return {
      "config": {"layers": layers, "hidden": hidden, "heads": heads,
                 "intermediate": intermediate, "text_hidden": text_hidden, "pos_emb": pos_emb,
                 "preset_family": cfg.name, "seed": seed},
      "grids_thw": [list(g) for g in grids], "num_patches": int(pixel_values.shape[0]),
      "num_merged": int(ref_merged.shape[0]),
      "merged_shape": list(merged.shape), "projected_shape": list(projected.shape),
      "max_rel_err_merged": rel_err(merged, ref_merged),
      "max_rel_err_projected": rel_err(projected, ref_projected),
      "max_abs_ref_merged": float(np.abs(ref_merged).max()),
      "max_abs_ref_projected": float(np.abs(ref_projected).max()),
      "seconds": {"build_convert": round(t1 - t0, 1), "transformers": round(t2 - t1, 1),
                  "k3jax_two_stages": round(t3 - t2, 1)},
  }


def main(argv=None):
  import argparse
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--json", default=None, help="write the figures here (JSON)")
  ap.add_argument("--layers", type=int, default=27)
  ap.add_argument("--hidden", type=int, default=1152)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--intermediate", type=int, default=4304)
  ap.add_argument("--text_hidden", type=int, default=7168)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--query_block", type=int, default=256,
                  help="k3jax attention in query blocks (bounds the logits' memory)")
  a = ap.parse_args(argv)
  out = run(a.layers, a.hidden, a.heads, a.intermediate, a.text_hidden, a.seed,
            query_block=a.query_block)
  print(json.dumps(out, indent=2))
  if a.json:
    results.write_json(a.json, out, indent=2)


if __name__ == "__main__":
  main()
