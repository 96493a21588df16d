"""Parameter count of a preset through `jax.eval_shape` (nothing is allocated).

  python -m tools.param_count --preset k3 [--json] [--vision_preset NAME|none]
  python -m tools.param_count --preset k3 --lora_rank 16 [--lora_targets q,k,v,o,...] [--json]

total: every parameter of the main model (input embedding and lm_head included, untied);
activated: what one token uses — routed experts count k/E of their parameters, the input
embedding table is excluded (a lookup, not a matmul), everything else counts fully. The MTP
module is excluded from both and reported on its own; the selection-only router bias
(collection "balance") is not a parameter and is reported separately. Spec §1: k3 gives
2.7795T total and 104.19B activated.

vision: when the config has a vision tower (`config.vision`; k3 carries MoonViT-V2), its
parameters (`vision_tower/*`) and the projector's (`mm_projector/*`) are reported as
{"preset", "tower", "projector", "total"} beside — never inside — the text totals above.
`--vision_preset none` drops the tower, another `k3jax.vision` preset replaces it (its
projector width set to the text model's d_model). k3: tower 401.21M (docs/k3.md §11: 401M),
projector 46.14M (4096² + 4096·7168 + 7168 post-norm), 447.36M in all.

bytes: the text model's weight bytes (the `total` above) per expert format —
{"bf16": 2 bytes per parameter, "mxfp4": routed experts at 4.25 bits per weight (a 4-bit E2M1
code + one E8M0 byte per 32) and everything else at 2 bytes, "routed_experts": {"bf16",
"mxfp4"}}. Counts always describe the unquantised model, whatever `expert_format` the config
has. (The release also keeps a few vectors in fp32 — A_log, dt_bias, conv kernels: ~10M
parameters for k3 — which this 2-byte figure rounds away.) k3: 5.559 TB in bf16, 1.560 TB with
MXFP4 experts (experts 5.4455 TB → 1.4465 TB; the release is 1.56 TB with its vision tower).

lora (`--lora_rank R`, `count_lora`): the adapters of `--lora_targets` (k3jax.config.LORA_TARGETS,
comma-separated; "all" for every one) at rank R — trainable parameters, in all and per target
— against full fine-tuning of the text model (every parameter of `total` + the MTP module;
the vision tower is not fine-tuned either way), and the optimizer state each needs, from the
optimizers' own `init` under `jax.eval_shape`: LoRA's AdamW over the adapters (two fp32
moments each, k3jax/posttrain/lora.py) vs the pre-training optimizer (Per-Head Muon momentum +
AdamW moments, fp32, k3jax/train/optim.py) and vs AdamW on everything.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

VISION_KEYS = ("vision_tower", "mm_projector")   # top-level params of the vision half
COMPONENTS = ("embedding", "lm_head", "kda", "mla", "dense_mlp", "routed_experts",
              "shared_experts", "router", "latent_projections", "attn_res", "norms")


def _component(keys: list[str]) -> str:
  """Component of one parameter from its Flax path (docs/contracts.md names)."""
  leaf = keys[-1]
  if keys[0] == "embed_tokens":
    return "embedding"
  if keys[0] == "lm_head":
    return "lm_head"
  if any(k in ("self_attention_res", "mlp_res", "output_attn_res") for k in keys):
    return "attn_res"
  if leaf in ("weight", "o_norm"):  # every RMSNorm weight (pre-norms, latent norms, o_norm)
    return "norms"
  if "experts" in keys and "shared_experts" not in keys:
    return "routed_experts"
  if "shared_experts" in keys:
    return "shared_experts"
  if "gate" in keys and "block_sparse_moe" in keys:
    return "router"
  if any(k in ("routed_expert_down_proj", "routed_expert_up_proj") for k in keys):
    return "latent_projections"
  if "mlp" in keys or keys[-2:-1] == ["eh_proj"]:
    return "dense_mlp"
  if "self_attn" in keys:
    return "attn"  # resolved to kda / mla by the caller
  raise ValueError(f"param_count: unclassified parameter {'/'.join(keys)}")


def count_params(config) -> dict:
  """Counts for a ModelConfig: {"total", "activated", "mtp", "router_bias", "components":
  {name: {"total", "activated"}}} (plain ints), and "vision" when config.vision is set."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np

  from k3jax.model import K3Model

  if config.modes.expert_format != "bf16":   # count weights, not packed bytes
    config = config.replace(expert_format="bf16")
  shapes = nn.unbox(jax.eval_shape(K3Model(config).init, jax.random.key(0),
                                   jnp.zeros((1, 2), jnp.int32)))
  frac = config.text.experts_per_token / config.text.num_experts if config.text.num_experts else 0.0
  comps = {c: {"total": 0, "activated": 0} for c in COMPONENTS}
  mtp = 0

  def walk(tree, keys):
    nonlocal mtp
    if keys and keys[0] in VISION_KEYS:
      return
    if not isinstance(tree, dict):
      n = int(np.prod(tree.shape))
      if keys[0] == "mtp":
        mtp += n
        return
      c = _component(keys)
      if c == "attn":  # KDA layers own A_log; MLA layers own kv_a_proj_with_mqa
        i = keys.index("self_attn")
        c = "kda" if "A_log" in _subtree(shapes["params"], keys[:i + 1]) else "mla"
      comps[c]["total"] += n
      comps[c]["activated"] += (0 if c == "embedding" else
                                round(n * frac) if c == "routed_experts" else n)
      return
    for k, v in tree.items():
      walk(v, keys + [k])

  walk(shapes["params"], [])
  balance = {k: v for k, v in shapes.get("balance", {}).items() if k != "mtp"}
  bias = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(balance))
  out = {
      "preset": config.name,
      "total": sum(c["total"] for c in comps.values()),
      "activated": sum(c["activated"] for c in comps.values()),
      "mtp": mtp,
      "router_bias": bias,
      "components": comps,
  }
  routed = comps["routed_experts"]["total"]
  # MXFP4: 4 bits a weight + one scale byte per 32 weights = 17/32 bytes (a multiple of 32
  # weights per expert matrix row, so the division is exact).
  out["bytes"] = {"bf16": 2 * out["total"], "mxfp4": 2 * (out["total"] - routed) + routed * 17 // 32,
                  "routed_experts": {"bf16": 2 * routed, "mxfp4": routed * 17 // 32}}
  if config.vision is not None:
    def n(tree):
      return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
    tower, projector = (n(shapes["params"][k]) for k in VISION_KEYS)
    out["vision"] = {"preset": config.vision.name, "tower": tower, "projector": projector,
                     "total": tower + projector}
  return out


# LoRA target of an adapted module, from its name (k3jax/config.py's LORA_TARGETS table); the
# MLP projections are "dense" or "shared" by their parent, experts by their leaf names.
_TARGET_OF = {"q_proj": "q", "q_a_proj": "q", "q_b_proj": "q", "k_proj": "k", "v_proj": "v",
              "kv_a_proj_with_mqa": "k,v", "kv_b_proj": "k,v", "o_proj": "o",
              "f_a_proj": "gates", "f_b_proj": "gates", "b_proj": "gates", "g_proj": "gates",
              "g_a_proj": "gates", "g_b_proj": "gates", "routed_expert_down_proj": "latent",
              "routed_expert_up_proj": "latent"}


def _lora_target(keys: list[str]) -> str:
  if keys[-1].startswith(("w1_", "w2_", "w3_")):
    return "experts"
  mod = keys[-2]
  if mod in ("gate_proj", "up_proj", "down_proj"):
    return "shared" if "shared_experts" in keys else "dense"
  return _TARGET_OF[mod]


def count_lora(config, rank: int, targets: tuple[str, ...], alpha: float = 16.0) -> dict:
  """Adapter parameters and optimizer bytes of LoRA at `rank` on `targets` vs full
  fine-tuning (module doc), from shapes only. Plain ints; bytes in bytes."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np

  from k3jax.model import K3Model
  from k3jax.posttrain import lora as lora_lib
  from k3jax.train.optim import make_optimizer

  config = config.replace(vision=None, media_placeholder_token_id=None, expert_format="bf16",
                          lora_rank=rank, lora_targets=tuple(targets), lora_alpha=alpha)
  shapes = nn.unbox(jax.eval_shape(K3Model(config).init, jax.random.key(0),
                                   jnp.zeros((1, 2), jnp.int32)))
  size = lambda t: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(t))   # noqa: E731
  nbytes = lambda t: sum(int(np.prod(x.shape)) * x.dtype.itemsize           # noqa: E731
                         for x in jax.tree.leaves(t))
  by_target: dict[str, int] = {}
  mtp = 0
  for path, x in jax.tree_util.tree_leaves_with_path(shapes["lora"]):
    keys = [getattr(k, "key", str(k)) for k in path]
    n = int(np.prod(x.shape))
    if keys[0] == "mtp":
      mtp += n
    t = _lora_target(keys)
    by_target[t] = by_target.get(t, 0) + n
  adapters = size(shapes["lora"])
  full = size(shapes["params"])
  lora_opt = jax.eval_shape(lora_lib.adapter_optimizer(1e-3).init, {"lora": shapes["lora"]})
  variables = {"params": shapes["params"], "balance": shapes.get("balance", {})}
  muon_opt = jax.eval_shape(make_optimizer(1e-3).init, variables)
  adamw_opt = jax.eval_shape(make_optimizer(1e-3, muon=False).init, variables)
  return {
      "preset": config.name, "lora_rank": rank, "lora_targets": list(targets),
      "adapter_params": adapters, "adapter_params_mtp": mtp,
      "adapter_params_by_target": dict(sorted(by_target.items())),
      "full_params": full, "adapter_fraction": adapters / full,
      "adapter_bytes_fp32": 4 * adapters,
      "optimizer_bytes": {"lora_adamw": nbytes(lora_opt),
                          "full_muon_adamw": nbytes(muon_opt),
                          "full_adamw": nbytes(adamw_opt)},
  }


def format_lora(c: dict) -> str:
  o = c["optimizer_bytes"]
  lines = [f"preset {c['preset']}: LoRA rank {c['lora_rank']} on {','.join(c['lora_targets'])}",
           f"adapter params {_fmt(c['adapter_params'])} ({100 * c['adapter_fraction']:.4f}% of "
           f"{_fmt(c['full_params'])} fine-tuned in full; MTP adapters "
           f"{_fmt(c['adapter_params_mtp'])})"]
  lines += [f"  {t:<10}{_fmt(n):>14}" for t, n in c["adapter_params_by_target"].items()]
  lines.append(f"optimizer state: LoRA AdamW {_fmt(o['lora_adamw'])}B vs full fine-tuning "
               f"Muon+AdamW {_fmt(o['full_muon_adamw'])}B, AdamW {_fmt(o['full_adamw'])}B")
  return "\n".join(lines)


def with_vision(config, vision_preset: str = ""):
  """`config` with the tower `--vision_preset` names: "" keeps config.vision; "none" drops it;
  another name is that `k3jax.vision` preset, its projector width set to config.text.d_model (a
  config without a placeholder id gets the byte tokenizer's <media>, 260)."""
  from k3jax.config import vision_preset as make_vision

  if not vision_preset:
    return config
  if vision_preset == "none":
    return config.replace(vision=None, media_placeholder_token_id=None)
  pid = config.media_placeholder_token_id
  return config.replace(vision=make_vision(vision_preset, text_hidden_size=config.text.d_model),
                        media_placeholder_token_id=260 if pid is None else pid)


def _subtree(tree, keys):
  for k in keys:
    tree = tree[k]
  return tree


def _fmt(n: int) -> str:
  for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= div:
      return f"{n / div:.4f}{unit}"
  return str(n)


def format_table(counts: dict) -> str:
  lines = [f"preset {counts['preset']}", f"{'component':<20}{'total':>16}{'activated':>16}"]
  for name, c in counts["components"].items():
    lines.append(f"{name:<20}{_fmt(c['total']):>16}{_fmt(c['activated']):>16}")
  lines.append(f"{'TOTAL':<20}{_fmt(counts['total']):>16}{_fmt(counts['activated']):>16}")
  lines.append(f"(excluded) mtp {_fmt(counts['mtp'])}, router bias (not a parameter) "
               f"{_fmt(counts['router_bias'])}")
  if "bytes" in counts:
    b = counts["bytes"]
    lines.append(f"bytes: bf16 {_fmt(b['bf16'])}B, mxfp4 experts {_fmt(b['mxfp4'])}B (routed "
                 f"experts {_fmt(b['routed_experts']['bf16'])}B → "
                 f"{_fmt(b['routed_experts']['mxfp4'])}B)")
  if "vision" in counts:
    v = counts["vision"]
    lines.append(f"(separate) vision {v['preset']}: tower {_fmt(v['tower'])}, projector "
                 f"{_fmt(v['projector'])}, total {_fmt(v['total'])}")
  return "\n".join(lines)


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Registers the tool's flags. Called when the file runs as a script: importing the module
  registers nothing, so it can share a process with other entry points that also define
  --preset or --json (experiments/generate.py, experiments/bench_moe.py)."""
  flags.DEFINE_string("preset", "k3", "name of a k3jax.config preset")
  flags.DEFINE_bool("json", False, "print JSON instead of a table")
  flags.DEFINE_string("vision_preset", "", "k3jax.vision preset counted as `vision` beside the "
                      "text totals; default: the preset's own tower (k3: moonvit_v2), 'none' "
                      "to omit")
  flags.DEFINE_integer("lora_rank", 0, "> 0: count LoRA adapters of this rank vs full "
                       "fine-tuning instead of the model's parameters")
  flags.DEFINE_string("lora_targets", "q,k,v,o", "LoRA targets, comma-separated "
                      "(k3jax.config.LORA_TARGETS), or 'all'")
  flags.DEFINE_float("lora_alpha", 16.0, "LoRA alpha (the scale is alpha / rank)")


def main(argv):
  del argv
  from k3jax.config import LORA_TARGETS, preset
  if FLAGS.lora_rank:
    targets = (LORA_TARGETS if FLAGS.lora_targets == "all" else
               tuple(t.strip() for t in FLAGS.lora_targets.split(",") if t.strip()))
    c = count_lora(preset(FLAGS.preset), FLAGS.lora_rank, targets, FLAGS.lora_alpha)
    print(json.dumps(c, indent=1) if FLAGS.json else format_lora(c))
    return
  counts = count_params(with_vision(preset(FLAGS.preset), FLAGS.vision_preset))
  print(json.dumps(counts, indent=1) if FLAGS.json else format_table(counts))


if __name__ == "__main__":
  define_flags()
  app.run(main)
