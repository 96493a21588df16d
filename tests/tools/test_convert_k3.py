"""Kimi K3 layout: convert a hand-written K3 checkpoint (MXFP4 experts, A_log padded to 128,
AttnRes and latent-MoE tensors), check exactness, round trips, and every bad-input error."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from convert_helpers import flat, random_variables, write_k3_checkpoint
from experiments.score import token_logprobs
from k3jax.config import preset
from k3jax.convert import convert, export
from k3jax.convert.safetensors_io import Source, write_file
from k3jax.model import K3Model
from k3jax.convert.checkpoint import load_pretrained

QUIET = dict(progress=False, log=lambda s: None)


def _assert_trees_equal(a, b):
  fa, fb = dict(flat(a)), dict(flat(b))
  assert sorted(fa) == sorted(fb)
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg="/".join(k))


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
  """A tiny K3 config (7 layers, MLA every 2nd + last: layers 0–1 unrolled, 2 scanned groups
  [2,3] [4,5], suffix 6; AttnRes blocks of 3; latent MoE; MTP), its random weights (experts
  MXFP4-representable) and their K3-layout checkpoint (with the MTP layer under k3jax_mtp.*,
  so that every leaf round-trips; the release layout without MTP: test_convert_release.py)."""
  config = preset("tiny", num_layers=7, mla_every=2, attn_res_block_size=3)
  assert config.text.stack_layout() == (2, 2, 1)
  variables = random_variables(config, seed=0)
  src = tmp_path_factory.mktemp("k3") / "src"
  tensors = write_k3_checkpoint(src, config, variables, mtp=True)
  return config, variables, src, tensors


def test_convert_is_exact_and_round_trips(k3, tmp_path):
  config, variables, src, tensors = k3
  dst = convert(src, tmp_path / "conv", arch="kimi_k3", dtype="float32",
                kda_chunk_size=config.modes.kda_chunk_size, **QUIET)
  got_config, got = load_pretrained(dst)
  assert got_config.replace(name=config.name) == config
  # every leaf bit-identical to the original (MXFP4-rounded) weights …
  _assert_trees_equal(jax.tree.map(np.asarray, got), variables)
  # … hence the same forward, exactly, in fp32
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, config.text.vocab_size, (2, 24)))
  fwd = jax.jit(K3Model(got_config).apply)
  logits = np.asarray(fwd(got, tokens))
  np.testing.assert_array_equal(logits, np.asarray(fwd(variables, tokens)))
  # experiments/score.py: per-token log-likelihood = log_softmax of the logits, gathered
  lp = token_logprobs(got_config, got, tokens, apply_fn=fwd)
  ref = logits[:, :-1] - np.log(np.exp(logits[:, :-1].astype(np.float64)).sum(-1, keepdims=True))
  ref = np.take_along_axis(ref, np.asarray(tokens)[:, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(lp, ref, rtol=1e-5, atol=1e-5)

  # export(convert(ckpt)) gives back the same tensors: packed experts, padded A_log, fp32
  back = export(dst, tmp_path / "back", arch="kimi_k3", expert_format="mxfp4", dtype="float32",
                max_shard_bytes=200_000, progress=False, text_prefix="language_model.",
                mtp=True, log=lambda s: None)
  out = Source(back)
  assert out.names() == sorted(tensors)
  assert len(list(back.glob("model-*-of-*.safetensors"))) > 1
  assert (back / "model.safetensors.index.json").exists()
  for n in out.names():
    a = out.get(n)
    assert a.dtype == tensors[n].dtype, n
    np.testing.assert_array_equal(a, tensors[n], err_msg=n)
  a_log = out.get("language_model.model.layers.0.self_attn.A_log")
  assert a_log.shape == (128,) and a_log.dtype == np.float32 and not a_log[2:].any()
  assert out.get("language_model.model.layers.0.self_attn.dt_bias").dtype == np.float32
  cfg = json.loads((back / "config.json").read_text())
  assert cfg["model_type"] == "kimi_k3" and cfg["text_config"]["linear_attn_config"][
      "gate_lower_bound"] == -5.0

  # convert(export(p)) == p, with bf16 experts too
  back16 = export(None, tmp_path / "back16", arch="kimi_k3", expert_format="bf16",
                  dtype="float32", progress=False, loaded=(got_config, got), log=lambda s: None)
  # text-only: bare model.* names, no MTP tensors (the release has none)
  assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in Source(back16).infos
  assert not [n for n in Source(back16).infos if n.startswith(("language_model.", "k3jax_mtp."))]
  # (the converter reads MXFP4 K3 checkpoints; bf16 experts are K3 export's option only)
  again = convert(back, tmp_path / "again", **QUIET, kda_chunk_size=config.modes.kda_chunk_size)
  _assert_trees_equal(load_pretrained(again)[1], variables)


def test_bfloat16_storage_keeps_fp32_tensors(k3, tmp_path):
  config, variables, src, _ = k3
  _, got = load_pretrained(convert(src, tmp_path / "bf16", dtype="bfloat16", **QUIET))
  kda = got["params"]["layers_0"]["self_attn"]
  assert kda["q_proj"]["kernel"].dtype == jnp.bfloat16
  for name in ("A_log", "dt_bias"):
    assert kda[name].dtype == jnp.float32
    np.testing.assert_array_equal(kda[name], variables["params"]["layers_0"]["self_attn"][name])
  np.testing.assert_array_equal(
      np.asarray(kda["q_proj"]["kernel"], np.float32),
      np.asarray(variables["params"]["layers_0"]["self_attn"]["q_proj"]["kernel"]
                 .astype(jnp.bfloat16), np.float32))


# ---------------------------------------------------------------------- bad inputs
def _copy(src, tmp_path, name="bad"):
  d = tmp_path / name
  shutil.copytree(src, d)
  return d


def _rewrite(d, edit):
  """Load all tensors of checkpoint d, let `edit` change the dict, write one file + config."""
  s = Source(d)
  tensors = {n: s.get(n) for n in s.names()}
  edit(tensors)
  for f in list(d.glob("*.safetensors")) + [d / "model.safetensors.index.json"]:
    f.unlink()
  write_file(d / "model.safetensors", tensors)


def _expect_error(src, tmp_path, match, **kw):
  dst = tmp_path / "out"
  with pytest.raises(ValueError, match=match):
    convert(src, dst, **QUIET, **kw)
  assert not dst.exists()
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")], "temp dirs left"


L1 = "language_model.model.layers.0."   # a KDA layer


def test_missing_tensor(k3, tmp_path):
  d = _copy(k3[2], tmp_path)
  _rewrite(d, lambda t: t.pop(L1 + "self_attn.f_a_proj.weight"))
  _expect_error(d, tmp_path, r"1 missing tensor\(s\):\n  " + L1 + r"self_attn\.f_a_proj\.weight")


def test_extra_tensor(k3, tmp_path):
  d = _copy(k3[2], tmp_path)
  _rewrite(d, lambda t: t.update({L1 + "self_attn.bogus.weight": np.zeros(3, np.float32)}))
  _expect_error(d, tmp_path, r"(?s)unexpected tensor\(s\).*\n  " + L1 + r"self_attn\.bogus\.weight")


def test_wrong_shape(k3, tmp_path):
  d = _copy(k3[2], tmp_path)
  _rewrite(d, lambda t: t.update({L1 + "self_attn.o_norm.weight": np.ones(17, np.float32)}))
  _expect_error(d, tmp_path, r"o_norm\.weight: config\.json implies shape \[16\], found \[17\]")


def test_truncated_file(k3, tmp_path):
  d = _copy(k3[2], tmp_path)
  shard = sorted(d.glob("model-*.safetensors"))[0]
  with open(shard, "r+b") as f:
    f.truncate(shard.stat().st_size - 100)
  _expect_error(d, tmp_path, r"truncated safetensors file")


def test_index_names_missing_shard(k3, tmp_path):
  d = _copy(k3[2], tmp_path)
  sorted(d.glob("model-*.safetensors"))[1].unlink()
  _expect_error(d, tmp_path, r"names shard\(s\) that do not exist: \['model-00002-of-00002")


def test_config_disagrees_with_tensors(k3, tmp_path):
  d = _copy(k3[2], tmp_path)
  cfg = json.loads((d / "config.json").read_text())
  cfg["text_config"]["linear_attn_config"]["num_heads"] = 4    # tensors have 2 KDA heads
  (d / "config.json").write_text(json.dumps(cfg))
  _expect_error(d, tmp_path, r"(?s)disagree with config\.json.*q_proj\.weight: config\.json implies "
                r"shape \[64, 64\], found \[32, 64\]")


def test_unsupported_config_key_is_refused(k3, tmp_path):
  d = _copy(k3[2], tmp_path)
  cfg = json.loads((d / "config.json").read_text())
  cfg["text_config"].update(num_expert_group=4, topk_group=2)
  (d / "config.json").write_text(json.dumps(cfg))
  _expect_error(d, tmp_path, r"(?s)'topk_group'.*group-limited top-k is not implemented")


def test_ignored_config_key_is_reported(k3, tmp_path):
  config, variables, src, _ = k3
  d = _copy(src, tmp_path)
  cfg = json.loads((d / "config.json").read_text())
  cfg["text_config"]["num_key_value_heads"] = 1     # MLA has no GQA: no weight depends on it
  (d / "config.json").write_text(json.dumps(cfg))
  lines = []
  dst = convert(d, tmp_path / "out", progress=False, log=lines.append,
                kda_chunk_size=config.modes.kda_chunk_size)
  assert [l for l in lines if "num_key_value_heads" in l] == [
      f"config.json: ignoring 'num_key_value_heads': 1 != num_attention_heads "
      f"({config.text.num_heads}); MLA has one latent KV shared by all heads and no GQA, so the "
      f"model has {config.text.num_heads} query/key/value heads"]
  got_config, got = load_pretrained(dst)
  assert got_config.replace(name=config.name) == config
  _assert_trees_equal(jax.tree.map(np.asarray, got), variables)


def test_existing_destination_is_refused(k3, tmp_path):
  (tmp_path / "out").mkdir()
  with pytest.raises(ValueError, match="already exists"):
    convert(k3[2], tmp_path / "out", **QUIET)


def test_torch_pickle_refused_unless_allowed(k3, tmp_path):
  config, variables, src, tensors = k3
  d = tmp_path / "pickle"
  d.mkdir()
  shutil.copy(src / "config.json", d / "config.json")
  torch.save({n: torch.from_numpy(np.array(a)) for n, a in tensors.items()},
             d / "pytorch_model.bin")
  _expect_error(d, tmp_path, r"(?s)pickles can run code.*--allow_torch_pickle")
  dst = convert(d, tmp_path / "from_pickle", allow_torch_pickle=True,
                kda_chunk_size=config.modes.kda_chunk_size, **QUIET)
  _assert_trees_equal(load_pretrained(dst)[1], variables)
  assert os.path.isdir(dst)
