"""Test helpers: random K3Model weights and an independent, hand-written K3-layout writer.

`write_k3_checkpoint` spells every PyTorch name and transpose out explicitly (docs/k3.md §9,
and §11 for a MoonViT-V2 vision tower), without k3jax.convert's tensor map or
k3jax.convert.vision_names, so the converter is checked against a second reading of the spec rather
than against itself.
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np

from k3jax import hf_config
from k3jax.config import KDA, MLA, MOE, ModelConfig
from k3jax.convert.safetensors_io import write_file
from k3jax.quant import mx


def flat(tree, prefix=()):
  """(path tuple, numpy array) of every leaf of a nested dict, in iteration order."""
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from flat(v, prefix + (k,))
  else:
    yield prefix, np.asarray(tree)


def random_variables(config: ModelConfig, seed: int = 0) -> dict:
  """Random float32 numpy leaves for every variable of K3Model(config) (shapes from
  jax.eval_shape, so nothing is compiled): unit-scale projections, norms ≈ 1, A_log in
  log[1, 16], non-zero pseudo-queries and router bias; routed experts rounded to MXFP4
  along their input axis."""
  from k3jax.convert.names import model_paths
  rng = np.random.default_rng(seed)
  out: dict = {}
  for path, shape in sorted(model_paths(config).items()):
    name = path[-1]
    if name == "A_log":
      x = np.log(rng.uniform(1, 16, shape))
    elif name in ("weight", "norm", "o_norm") or path[-2].endswith("norm"):
      x = 1 + 0.1 * rng.normal(size=shape)
    elif name in ("kernel", "w1", "w2", "w3") and len(shape) >= 2:
      fan_in = shape[-2] if name != "kernel" or path[-2] not in ("o_proj",) else (
          shape[-3] * shape[-2])
      x = rng.normal(size=shape) / np.sqrt(fan_in)
      if name in ("w1", "w3", "w2"):     # [.., in, out]: MXFP4 groups run along `in`
        x = np.swapaxes(mx.mx_round(np.ascontiguousarray(
            np.swapaxes(x, -1, -2).astype(np.float32)), "mxfp4"), -1, -2)
    else:                                # embeddings, convs, dt_bias, pseudo-queries, router bias
      x = 0.5 * rng.normal(size=shape)
    tree = out
    for p in path[:-1]:
      tree = tree.setdefault(p, {})
    tree[name] = np.ascontiguousarray(x, np.float32)
  return out


def _get(tree, *path):
  """tree[path]; a trailing 'kernel'/'weight' may be absent (bare parameters)."""
  for i, p in enumerate(path):
    if p in tree:
      tree = tree[p]
    elif i == len(path) - 1 and p in ("kernel", "weight"):
      return tree
    else:
      raise KeyError("/".join(path))
  return tree


def _lin(kernel, n_in: int = 1):
  """Our kernel [in axes…, out axes…] → PyTorch Linear weight [out, in]."""
  k = np.asarray(kernel, np.float32)
  n = int(np.prod(k.shape[:n_in]))
  return np.ascontiguousarray(k.reshape(n, -1).T)


def _layer_tensors(c: ModelConfig, params: dict, balance: dict, mixer: str, mlp: str,
                   attn_res: bool, prefix: str, out: dict) -> None:
  p = lambda *path: np.asarray(_get(params, *path), np.float32)  # noqa: E731
  out[prefix + "input_layernorm.weight"] = p("input_layernorm", "weight")
  out[prefix + "post_attention_layernorm.weight"] = p("post_attention_layernorm", "weight")
  if attn_res:
    for name in ("self_attention_res", "mlp_res"):
      out[prefix + f"{name}_proj.weight"] = p(name, "proj")[None, :]
      out[prefix + f"{name}_norm.weight"] = p(name, "norm")
  a = prefix + "self_attn."
  if mixer == KDA:
    for n in ("q", "k", "v"):
      out[a + f"{n}_proj.weight"] = _lin(p("self_attn", f"{n}_proj", "kernel"))
      w = p("self_attn", f"{n}_conv1d", "kernel")            # [W, H, K]
      out[a + f"{n}_conv1d.weight"] = np.ascontiguousarray(w.reshape(w.shape[0], -1).T[:, None, :])
    out[a + "f_a_proj.weight"] = _lin(p("self_attn", "f_a_proj", "kernel"))
    out[a + "f_b_proj.weight"] = _lin(p("self_attn", "f_b_proj", "kernel"))
    out[a + "b_proj.weight"] = _lin(p("self_attn", "b_proj", "kernel"))
    out[a + "g_proj.weight"] = _lin(p("self_attn", "g_proj", "kernel"))
    a_log = p("self_attn", "A_log")
    if c.text.kda_a_log_axis == "channel":     # one rate per key dimension: stored as it is, [K]
      out[a + "A_log"] = a_log
    else:                                 # per head: [128], zero past the heads
      out[a + "A_log"] = np.concatenate([a_log, np.zeros(128 - a_log.shape[0], np.float32)])
    out[a + "dt_bias"] = p("self_attn", "dt_bias").reshape(-1)
    out[a + "o_norm.weight"] = p("self_attn", "o_norm", "weight")
    out[a + "o_proj.weight"] = _lin(p("self_attn", "o_proj", "kernel"), 2)
  else:
    for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj"):
      out[a + f"{n}.weight"] = _lin(p("self_attn", n, "kernel"))
    for n in ("q_a_layernorm", "kv_a_layernorm"):
      out[a + f"{n}.weight"] = p("self_attn", n, "weight")
    out[a + "o_proj.weight"] = _lin(p("self_attn", "o_proj", "kernel"), 2)
  if mlp != MOE:
    for n in ("gate_proj", "up_proj", "down_proj"):
      out[prefix + f"mlp.{n}.weight"] = _lin(p("mlp", n, "kernel"))
    return
  m = prefix + "block_sparse_moe."
  out[m + "gate.weight"] = _lin(p("block_sparse_moe", "gate", "kernel"))
  out[m + "gate.e_score_correction_bias"] = np.asarray(
      balance["block_sparse_moe"]["gate"]["e_score_correction_bias"], np.float32)
  out[m + "routed_expert_down_proj.weight"] = _lin(p("block_sparse_moe", "routed_expert_down_proj",
                                                     "kernel"))
  out[m + "routed_expert_norm.weight"] = p("block_sparse_moe", "routed_expert_norm", "weight")
  out[m + "routed_expert_up_proj.weight"] = _lin(p("block_sparse_moe", "routed_expert_up_proj",
                                                   "kernel"))
  for n in ("gate_proj", "up_proj", "down_proj"):
    out[m + f"shared_experts.{n}.weight"] = _lin(p("block_sparse_moe", "shared_experts", n, "kernel"))
  for wn in ("w1", "w2", "w3"):
    w = p("block_sparse_moe", "experts", wn)                   # [E, in, out]
    for e in range(w.shape[0]):
      packed, scale = mx.mxfp4_pack(np.ascontiguousarray(w[e].T))   # [out, in], blocks along in
      out[m + f"experts.{e}.{wn}.weight_packed"] = packed
      out[m + f"experts.{e}.{wn}.weight_scale"] = scale


def moonvit_v2_tensors(params: dict) -> dict[str, np.ndarray]:
  """The §11 release tensors of a MoonViT-V2 tower + projector, from k3jax params
  {'vision_tower', 'mm_projector', …} (no biases; conv [D, 3, 14, 14]; fused wqkv [3·H·Dh, D]
  with q, k, v outermost; wo [D, H·Dh])."""
  vt, mp = params["vision_tower"], params["mm_projector"]
  f = lambda x: np.asarray(x, np.float32)  # noqa: E731
  out = {}
  k = f(vt["patch_embed"]["proj"]["kernel"])                        # [3·14·14, D]
  out["vision_tower.patch_embed.proj.weight"] = np.ascontiguousarray(k.T.reshape(-1, 3, 14, 14))
  out["vision_tower.patch_embed.pos_emb.weight"] = f(vt["patch_embed"]["pos_emb"]["weight"])
  enc = vt["encoder"]
  n = sum(1 for name in enc if name.startswith("blocks_"))
  for i in range(n):
    b, t = enc[f"blocks_{i}"], f"vision_tower.encoder.blocks.{i}."
    out[t + "norm0.weight"] = f(b["norm0"]["weight"])
    out[t + "norm1.weight"] = f(b["norm1"]["weight"])
    out[t + "wqkv.weight"] = _lin(b["wqkv"]["kernel"])               # [D, 3, H, Dh]
    out[t + "wo.weight"] = _lin(b["wo"]["kernel"], 2)                # [H, Dh, D]
    out[t + "mlp.fc0.weight"] = _lin(b["mlp"]["fc0"]["kernel"])
    out[t + "mlp.fc1.weight"] = _lin(b["mlp"]["fc1"]["kernel"])
  out["vision_tower.encoder.final_layernorm.weight"] = f(enc["final_layernorm"]["weight"])
  out["mm_projector.proj.0.weight"] = _lin(mp["proj_0"]["kernel"])
  out["mm_projector.proj.2.weight"] = _lin(mp["proj_2"]["kernel"])
  out["mm_projector.post_norm.weight"] = f(mp["post_norm"]["weight"])
  return out


def k3_tensors(c: ModelConfig, variables: dict, text_prefix: str = "language_model.",
               mtp: bool = False) -> dict[str, np.ndarray]:
  """The K3 checkpoint tensors (PyTorch names) of our variables: text under
  `{text_prefix}model.` (§12: 'language_model.' or ''), no MTP tensors (the release has none)
  unless `mtp`, then under the k3jax-only `k3jax_mtp.` prefix."""
  params, balance = variables["params"], variables.get("balance", {})
  pre, groups, suf = c.text.stack_layout()
  types = c.text.layer_types()
  attn_res = c.text.attn_res_block_size is not None
  out: dict[str, np.ndarray] = {}
  root = f"{text_prefix}model."
  for i in range(c.text.num_layers):
    if pre <= i < c.text.num_layers - suf:
      g, j = divmod(i - pre, c.text.mla_every)
      take = lambda t: jax.tree.map(lambda x: x[g], t)  # noqa: E731
      lp, lb = take(params["body"][f"layers_{j}"]), take(balance.get("body", {}).get(f"layers_{j}", {}))
    else:
      lp, lb = params[f"layers_{i}"], balance.get(f"layers_{i}", {})
    _layer_tensors(c, lp, lb, *types[i], attn_res, f"{root}layers.{i}.", out)
  out[root + "embed_tokens.weight"] = np.asarray(params["embed_tokens"]["embedding"])
  out[root + "norm.weight"] = np.asarray(params["norm"]["weight"])
  if attn_res:
    out[root + "output_attn_res_proj.weight"] = np.asarray(params["output_attn_res"]["proj"])[None]
    out[root + "output_attn_res_norm.weight"] = np.asarray(params["output_attn_res"]["norm"])
  out[f"{text_prefix}lm_head.weight"] = _lin(params["lm_head"]["kernel"])
  if c.text.num_mtp_layers and mtp:
    mp = "k3jax_mtp."
    out[mp + "enorm.weight"] = np.asarray(params["mtp"]["enorm"]["weight"])
    out[mp + "hnorm.weight"] = np.asarray(params["mtp"]["hnorm"]["weight"])
    out[mp + "eh_proj.weight"] = _lin(params["mtp"]["eh_proj"]["kernel"])
    out[mp + "norm.weight"] = np.asarray(params["mtp"]["norm"]["weight"])
    _layer_tensors(c, params["mtp"]["layer"], balance["mtp"]["layer"], MLA, MOE, False,
                   mp + "layer.", out)
  if c.vision is not None:
    out.update(moonvit_v2_tensors(params))
  return out


def write_k3_checkpoint(directory: pathlib.Path, config: ModelConfig, variables: dict,
                        shards: int = 2, text_prefix: str = "language_model.",
                        mtp: bool = False) -> dict[str, np.ndarray]:
  """Write `variables` as a sharded K3-layout checkpoint (+ index + config.json with the
  release's quantization_config)."""
  tensors = k3_tensors(config, variables, text_prefix, mtp)
  directory.mkdir(parents=True, exist_ok=True)
  names = sorted(tensors)
  per = -(-len(names) // shards)
  weight_map = {}
  for s in range(shards):
    part = names[s * per:(s + 1) * per]
    fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    write_file(directory / fname, {n: tensors[n] for n in part})
    weight_map.update({n: fname for n in part})
  (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  (directory / "config.json").write_text(
      json.dumps(hf_config.to_hf_config(config, "kimi_k3", "mxfp4")))
  return tensors
