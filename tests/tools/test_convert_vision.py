"""Vision tower + projector conversion (docs/k3.md §11): `--only vision` for K3's release names
(moonvit_v2) and Kimi K2.5's spellings (moonvit_k25: original release, transformers'
save_pretrained, transformers' split q/k/v module names), bit-exact round trips, the full
text + vision conversion of a K3-layout checkpoint, and every bad-input error."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

from convert_helpers import flat, moonvit_v2_tensors, random_variables, write_k3_checkpoint
from k3jax.config import preset
from k3jax.convert import convert, export
from k3jax.convert.safetensors_io import Source, write_file
from k3jax.convert.checkpoint import load_pretrained
from k3jax.hf_config import vision_config_to_hf
from k3jax.vision import init_vision, load_vision, vision_preset
from k3jax.convert import vision_names as vnames

QUIET = dict(progress=False, log=lambda s: None)
ROOT = pathlib.Path(__file__).resolve().parents[2]
BF16 = np.dtype(ml_dtypes.bfloat16)


def _assert_trees_equal(a, b):
  fa, fb = dict(flat(a)), dict(flat(b))
  assert sorted(fa) == sorted(fb)
  for k in fa:
    assert fa[k].dtype == fb[k].dtype, "/".join(k)
    np.testing.assert_array_equal(fa[k], fb[k], err_msg="/".join(k))


def _cli(tool, *args):
  r = subprocess.run([sys.executable, "-m", f"tools.{tool}", *args, "--noprogress"],
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stdout + r.stderr


def _arch(vc):
  """The fields of a VisionConfig that a checkpoint's config.json determines."""
  return {f: getattr(vc, f) for f in (
      "num_layers", "hidden_size", "num_heads", "head_dim", "intermediate_size", "norm",
      "norm_eps", "use_bias", "pos_emb_height", "pos_emb_width", "pos_emb_interpolation",
      "rope_layout", "rope_theta", "projector_norm", "projector_norm_eps", "text_hidden_size")}


def _random_params(cfg, seed):
  """Random float32 numpy params {'vision_tower', 'mm_projector'} of `cfg` (every leaf,
  norms ≈ 1, biases ≠ 0)."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda k: init_vision(cfg, k), jax.random.PRNGKey(0))["params"]
  return jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), shapes)


# ---------------------------------------------------------------------- K3 (moonvit_v2)
@pytest.fixture(scope="module")
def v2(tmp_path_factory):
  """A K3-layout checkpoint directory with a tiny MoonViT-V2 (bf16, as released) beside a
  text tensor; config.json has the released vision_config keys."""
  cfg = vision_preset("tiny_moonvit_v2")
  params = _random_params(cfg, 0)
  tensors = {n: a.astype(BF16) for n, a in moonvit_v2_tensors(params).items()}
  src = tmp_path_factory.mktemp("v2") / "src"
  src.mkdir()
  write_file(src / "model.safetensors",
             {**tensors, "language_model.model.embed_tokens.weight": np.zeros((4, 48), BF16)})
  (src / "config.json").write_text(json.dumps({
      "model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear", "hidden_size": 48},
      "vision_config": vision_config_to_hf(cfg), "media_placeholder_token_id": 7}))
  return cfg, tensors, src


def test_k3_cli_converts_and_exports_bit_exactly(v2, tmp_path):
  cfg, tensors, src = v2
  assert len(tensors) == 6 * cfg.num_layers + 6      # 168 at 27 layers (§11)
  dst = tmp_path / "conv"
  _cli("convert_from_pytorch", f"--src={src}", f"--dst={dst}", "--arch=kimi_k3", "--only=vision")
  got_cfg, got = load_vision(dst)
  assert _arch(got_cfg) == _arch(cfg)
  # each leaf = the bf16 release value, in k3jax layout, stored float32 (--dtype default)
  want = vnames.from_state_dict(cfg, {n: a.astype(np.float32) for n, a in tensors.items()})
  _assert_trees_equal(jax.tree.map(np.asarray, got), want)
  assert json.loads((dst / "vision_config.json").read_text())["media_placeholder_token_id"] == 7

  back = tmp_path / "back"
  _cli("export_to_pytorch", f"--src={dst}", f"--dst={back}")     # bf16 by default
  out = Source(back)
  assert out.names() == sorted(tensors)
  for n in out.names():
    a = out.get(n)
    assert a.dtype == BF16, n
    np.testing.assert_array_equal(a.view(np.uint16), tensors[n].view(np.uint16), err_msg=n)
  hf = json.loads((back / "config.json").read_text())
  assert hf["vision_config"] == vision_config_to_hf(cfg)
  assert hf["media_placeholder_token_id"] == 7
  # … and the export converts back to the same leaves
  again = convert(back, tmp_path / "again", only="vision", **QUIET)
  _assert_trees_equal(load_vision(again)[1], load_vision(dst)[1])


def test_bfloat16_storage(v2, tmp_path):
  cfg, tensors, src = v2
  _, got = load_vision(convert(src, tmp_path / "bf16", arch="kimi_k3", only="vision",
                               dtype="bfloat16", **QUIET))
  k = got["params"]["vision_tower"]["encoder"]["blocks_1"]["wqkv"]["kernel"]
  assert k.dtype == jax.numpy.bfloat16 and k.shape == (cfg.hidden_size, 3, cfg.num_heads,
                                                       cfg.head_dim)
  np.testing.assert_array_equal(
      np.asarray(k, np.float32).reshape(cfg.hidden_size, -1).T,
      tensors["vision_tower.encoder.blocks.1.wqkv.weight"].astype(np.float32))


# ---------------------------------------------------------------------- K2.5 (moonvit_k25)
def _k25_text_config():
  return dict(model_type="deepseek_v3", vocab_size=64, hidden_size=48, intermediate_size=64,
              moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
              n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
              qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1)


@pytest.fixture(scope="module")
def k25(tmp_path_factory):
  """A tiny random Kimi_K25ForConditionalGeneration (2 vision layers, width 32, 2 heads of
  16; every parameter perturbed) saved by transformers' save_pretrained, and the same weights
  under transformers' module names (split q/k/v in rotate-half order)."""
  import torch
  from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25ForConditionalGeneration

  from experiments.vision_parity import k25_config, perturb_, write_module_checkpoint
  d = k25_config(layers=2, hidden=32, heads=2, intermediate=64, text_hidden=48, pos_emb=8)
  d["text_config"] = _k25_text_config()
  torch.manual_seed(0)
  model = Kimi_K25ForConditionalGeneration(Kimi_K25Config(
      **{k: v for k, v in d.items() if k not in ("model_type", "architectures")}))
  perturb_(model.model.vision_tower, 0)
  perturb_(model.model.mm_projector, 1)
  root = tmp_path_factory.mktemp("k25")
  model.save_pretrained(root / "saved")
  write_module_checkpoint(root / "module", d, model.model.vision_tower, model.model.mm_projector)
  return d, root / "saved", root / "module", model


def test_k25_spellings_convert_to_the_same_leaves(k25, tmp_path):
  d, saved, module, _ = k25
  names = set(Source(saved).infos)
  # transformers 5.x save_pretrained: release names, fused wqkv, except these two modules
  assert "vision_tower.encoder.patch_embed.proj.weight" in names
  assert "model.mm_projector.pre_norm.bias" in names
  assert "vision_tower.encoder.blocks.1.wqkv.weight" in names
  a = tmp_path / "a"
  log = _cli("convert_from_pytorch", f"--src={saved}", f"--dst={a}", "--arch=kimi_k25",
             "--only=vision")
  assert "under transformers' names" in log
  cfg, got = load_vision(a)
  assert (cfg.name, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.text_hidden_size) == (
      "moonvit_k25", 32, 2, 16, 48)
  # the split, rotate-half spelling gives the same leaves bit for bit …
  _, from_module = load_vision(convert(module, tmp_path / "b", arch="kimi_k25", only="vision",
                                       **QUIET))
  _assert_trees_equal(from_module, got)
  # … because the q/k rows are re-ordered (the raw split q rows are not the fused ones)
  q = Source(module).get("model.vision_tower.layers.0.attn.q_proj.weight")
  fused = Source(saved).get("vision_tower.encoder.blocks.0.wqkv.weight")
  assert not np.array_equal(q, fused[:32])
  perm = vnames.rope_half_to_pairs(16)
  np.testing.assert_array_equal(vnames.permute_heads(q, 2, perm), fused[:32])

  # release spelling → same leaves; export writes the release spelling, re-import is exact
  release = tmp_path / "release"
  release.mkdir()
  s = Source(saved)
  rename = {"vision_tower.encoder.patch_embed.": "vision_tower.patch_embed.",
            "model.mm_projector.": "mm_projector."}
  tensors = {}
  for n in s.names():
    if n.startswith(("vision_tower.", "mm_projector.", "model.mm_projector.")):
      new = next((n.replace(o, r, 1) for o, r in rename.items() if n.startswith(o)), n)
      tensors[new] = s.get(n)
  write_file(release / "model.safetensors", tensors)
  shutil.copy(saved / "config.json", release / "config.json")
  _, from_release = load_vision(convert(release, tmp_path / "c", arch="kimi_k25", only="vision",
                                        **QUIET))
  _assert_trees_equal(from_release, got)
  back = export(a, tmp_path / "back", dtype="float32", progress=False)
  out = Source(back)
  assert out.names() == sorted(tensors)
  for n in out.names():
    np.testing.assert_array_equal(out.get(n), tensors[n], err_msg=n)
  _, again = load_vision(convert(back, tmp_path / "again", only="vision", **QUIET))
  _assert_trees_equal(again, got)
  assert json.loads((back / "config.json").read_text())["vision_config"]["hidden_size"] == 32


# ---------------------------------------------------------------------- text + vision
def test_full_k3_checkpoint_converts_text_and_vision(tmp_path):
  config = preset("tiny_multimodal")
  variables = random_variables(config, seed=3)
  src = tmp_path / "src"
  tensors = write_k3_checkpoint(src, config, variables, mtp=True)
  assert sum(n.startswith(("vision_tower.", "mm_projector.")) for n in tensors) == (
      6 * config.vision.num_layers + 6)
  dst = convert(src, tmp_path / "conv", arch="kimi_k3", kda_chunk_size=config.modes.kda_chunk_size,
                **QUIET)
  got_config, got = load_pretrained(dst)
  assert _arch(got_config.vision) == _arch(config.vision)
  _assert_trees_equal(jax.tree.map(np.asarray, got), variables)
  vcfg, vvars = load_vision(dst)
  assert vcfg == got_config.vision
  _assert_trees_equal(jax.tree.map(np.asarray, vvars),
                      {"params": {k: variables["params"][k]
                                  for k in ("vision_tower", "mm_projector")}})
  back = export(dst, tmp_path / "back", arch="kimi_k3", dtype="float32", progress=False,
                mtp=True)
  out = Source(back)
  assert out.names() == sorted(tensors)
  for n in out.names():
    if n.startswith(("vision_tower.", "mm_projector.")):
      np.testing.assert_array_equal(out.get(n), tensors[n], err_msg=n)
  hf = json.loads((back / "config.json").read_text())
  assert hf["vision_config"]["vt_num_hidden_layers"] == config.vision.num_layers
  assert hf["media_placeholder_token_id"] == config.media_placeholder_token_id
  only = export(dst, tmp_path / "only", only="vision", dtype="float32", progress=False)
  assert Source(only).names() == sorted(n for n in tensors
                                        if n.startswith(("vision_tower.", "mm_projector.")))

  # with a vision_config, an unknown vision name is an error (not skipped), as is a missing one
  bad = _edit(src, tmp_path, lambda t: t.update(
      {"vision_tower.encoder.blocks.0.wqkv.bias": np.zeros(96, np.float32)}), name="bad_full")
  with pytest.raises(ValueError, match=r"(?s)1 unexpected tensor\(s\).*\n  vision_tower\."
                     r"encoder\.blocks\.0\.wqkv\.bias"):
    convert(bad, tmp_path / "out", arch="kimi_k3", **QUIET)
  bad = _edit(src, tmp_path, lambda t: t.pop("mm_projector.post_norm.weight"), name="bad_full2")
  with pytest.raises(ValueError, match=r"1 missing tensor\(s\):\n  mm_projector\.post_norm"):
    convert(bad, tmp_path / "out", arch="kimi_k3", **QUIET)
  assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- bad inputs
def _edit(src, tmp_path, edit_tensors=None, edit_config=None, name="bad"):
  d = tmp_path / name
  shutil.copytree(src, d)
  if edit_tensors:
    s = Source(d)
    tensors = {n: s.get(n) for n in s.names()}
    edit_tensors(tensors)
    for f in list(d.glob("*.safetensors")) + list(d.glob("*.index.json")):
      f.unlink()
    write_file(d / "model.safetensors", tensors)
  if edit_config:
    cfg = json.loads((d / "config.json").read_text())
    edit_config(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
  return d


def _expect_error(src, tmp_path, match, arch="kimi_k3"):
  dst = tmp_path / "out"
  with pytest.raises(ValueError, match=match):
    convert(src, dst, arch=arch, only="vision", **QUIET)
  assert not dst.exists()
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")], "temp dirs left"


B0 = "vision_tower.encoder.blocks.0."


def test_missing_tensor(v2, tmp_path):
  d = _edit(v2[2], tmp_path, lambda t: t.pop(B0 + "mlp.fc1.weight"))
  _expect_error(d, tmp_path, r"1 missing vision tensor\(s\):\n  vision_tower\.encoder\.blocks\.0"
                r"\.mlp\.fc1\.weight")


def test_wrong_shape(v2, tmp_path):
  d = _edit(v2[2], tmp_path, lambda t: t.update({B0 + "wo.weight": np.zeros((32, 31), BF16)}))
  _expect_error(d, tmp_path, r"vision_tower\.encoder\.blocks\.0\.wo\.weight: config\.json implies "
                r"shape \[32, 32\], found \[32, 31\]")


def test_wrong_dtype(v2, tmp_path):
  d = _edit(v2[2], tmp_path, lambda t: t.update({B0 + "norm0.weight": np.ones(32, np.int32)}))
  _expect_error(d, tmp_path, r"blocks\.0\.norm0\.weight: expected a float dtype, found int32")


def test_unknown_vision_tensor(v2, tmp_path):
  d = _edit(v2[2], tmp_path, lambda t: t.update({B0 + "wqkv.bias": np.zeros(96, BF16),
                                                 "mm_projector.extra": np.zeros(2, BF16)}))
  _expect_error(d, tmp_path, r"(?s)2 unexpected vision tensor\(s\).*\n  mm_projector\.extra\n"
                r"  vision_tower\.encoder\.blocks\.0\.wqkv\.bias")


def test_two_spellings_of_one_tensor(k25, tmp_path):
  def dup(t):
    t["vision_tower.patch_embed.proj.bias"] = t["vision_tower.encoder.patch_embed.proj.bias"]
  d = _edit(k25[1], tmp_path, dup)
  _expect_error(d, tmp_path, r"(?s)unexpected vision tensor.*vision_tower\.encoder\.patch_embed"
                r"\.proj\.bias", arch="kimi_k25")


def test_config_errors(v2, k25, tmp_path):
  d = _edit(v2[2], tmp_path, edit_config=lambda c: c.pop("vision_config"), name="novision")
  _expect_error(d, tmp_path, r"no vision_config object")
  _expect_error(v2[2], tmp_path, r"--arch kimi_k25: expected vision_config\.model_type "
                r"'kimi_k25_vision', found 'kimi_k3_vision'", arch="kimi_k25")
  with pytest.raises(ValueError, match=r"--arch kimi_k25: only the vision tower converts"):
    convert(k25[1], tmp_path / "out", arch="kimi_k25", **QUIET)
  assert not (tmp_path / "out").exists()


def test_existing_destination_is_refused(v2, tmp_path):
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "keep").write_text("x")
  with pytest.raises(ValueError, match="already exists"):
    convert(v2[2], tmp_path / "out", arch="kimi_k3", only="vision", **QUIET)
  assert os.listdir(tmp_path / "out") == ["keep"]


def test_load_vision_errors(v2, tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    load_vision(tmp_path / "nothing")
  dst = convert(v2[2], tmp_path / "conv", arch="kimi_k3", only="vision", **QUIET)
  s = Source(dst)
  tensors = {n: s.get(n) for n in s.names()}
  tensors.pop("params/mm_projector/proj_2/kernel")
  write_file(dst / "vision_params.safetensors", tensors)
  with pytest.raises(ValueError, match=r"missing: \['params/mm_projector/proj_2/kernel'\]"):
    load_vision(dst)
