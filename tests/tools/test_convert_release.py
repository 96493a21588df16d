"""The release layout (docs/k3.md §12) both ways: `language_model.model.*` and bare `model.*`
text names, no MTP tensors (a fresh MTP layer, reported), the nested config.json with its
quantization_config (validated), A_log's two readings (--a_log: crop the zero padding, or one
rate per key channel; auto stops with the values when the padding is not zero), unknown names
refused unless under a --skip_prefix, packed MXFP4 experts kept packed. The name listing:
test_checkpoint_names.py; --check_only: test_check_only.py."""

import json
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from convert_helpers import flat, random_variables, write_k3_checkpoint
from k3jax import hf_config
from k3jax.config import preset
from k3jax.convert import convert, export
from k3jax.convert import names as N
from k3jax.convert import pipeline
from k3jax.convert.safetensors_io import Source, write_file
from k3jax.quant import mx
from k3jax.convert.checkpoint import load_pretrained

L0 = "layers.0.self_attn."   # a KDA layer
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _split_mtp(tree):
  """(flat leaves outside `mtp`, flat leaves of `mtp`) of a variables tree."""
  leaves = dict(flat(tree))
  return ({k: v for k, v in leaves.items() if k[1] != "mtp"},
          {k: v for k, v in leaves.items() if k[1] == "mtp"})


@pytest.fixture(scope="module")
def tiny():
  """7 layers (2 unrolled, 2 scanned groups, 1 suffix), AttnRes, latent MoE, an MTP layer;
  random weights with MXFP4-representable experts."""
  config = preset("tiny", num_layers=7, mla_every=2, attn_res_block_size=3)
  assert config.text.num_mtp_layers == 1
  return config, random_variables(config, seed=4)


@pytest.fixture(scope="module")
def tiny_channel():
  """`tiny` with A_log read per key channel: [K] = [16] rates shared by the 2 heads."""
  config = preset("tiny", num_layers=7, mla_every=2, attn_res_block_size=3,
                  kda_a_log_axis="channel")
  return config, random_variables(config, seed=6)


@pytest.fixture(scope="module")
def fresh(tiny):
  """The MTP layer K3Model.init makes for `tiny` with seed 0 (flat, keyed without 'mtp')."""
  return dict(flat(pipeline.fresh_mtp(tiny[0], 0)))


def _logs():
  lines = []
  return lines, dict(progress=False, log=lines.append)


@pytest.mark.parametrize("prefix", ["language_model.", ""])
def test_release_layout_round_trip_and_fresh_mtp(tiny, fresh, tmp_path, prefix):
  config, variables = tiny
  src = tmp_path / "src"
  tensors = write_k3_checkpoint(src, config, variables, text_prefix=prefix)
  assert f"{prefix}lm_head.weight" in tensors and not [n for n in tensors if "mtp" in n]
  assert hf_config.check_quantization_config(json.loads((src / "config.json").read_text())) \
      == "mxfp4"
  lines, kw = _logs()
  dst = convert(src, tmp_path / "conv", kda_chunk_size=config.modes.kda_chunk_size, **kw)
  # reported on the terminal and in the output's metadata
  assert [l for l in lines if l.startswith("MTP:")] == [
      "MTP: the source has no MTP tensors; the config's MTP layer is initialised as "
      "K3Model.init does (seed 0)"]
  meta = json.loads((dst / "conversion.json").read_text())
  assert meta["mtp"] == "fresh" and meta["text_prefix"] == prefix + "model."
  assert meta["tensors"] == len(tensors) and meta["skipped_tensors"] == 0
  got_config, got = load_pretrained(dst)
  assert got_config.replace(name=config.name) == config
  rest, mtp = _split_mtp(jax.tree.map(np.asarray, got))
  want_rest, want_mtp = _split_mtp(variables)
  assert sorted(rest) == sorted(want_rest) and sorted(mtp) == sorted(want_mtp)
  for k in rest:
    np.testing.assert_array_equal(rest[k], want_rest[k], err_msg="/".join(k))
  # the MTP layer is K3Model.init's, not the (unavailable) original
  assert sorted(fresh) == sorted(k[:1] + k[2:] for k in mtp)
  for k, v in mtp.items():
    np.testing.assert_array_equal(v, fresh[k[:1] + k[2:]], err_msg="/".join(k))
  assert any(not np.array_equal(v, want_mtp[k]) for k, v in mtp.items())

  # export in the same spelling gives the source back bit for bit, without MTP tensors
  lines, kw = _logs()
  back = export(dst, tmp_path / "back", dtype="float32", text_prefix=prefix,
                max_shard_bytes=300_000, **kw)
  assert any("MTP layer not written" in l for l in lines)
  out = Source(back)
  assert out.names() == sorted(tensors)
  for n in out.names():
    a = out.get(n)
    assert a.dtype == tensors[n].dtype, n
    np.testing.assert_array_equal(a, tensors[n], err_msg=n)
  index = json.loads((back / "model.safetensors.index.json").read_text())
  assert sorted(index["weight_map"]) == sorted(tensors)
  assert len(set(index["weight_map"].values())) > 1
  cfg = json.loads((back / "config.json").read_text())
  assert cfg["model_type"] == "kimi_k3" and "text_config" in cfg
  assert cfg["quantization_config"]["format"] == "mxfp4-pack-quantized"
  assert hf_config.check_quantization_config(cfg) == "mxfp4"
  # A_log read per head: zero padding found (auto), cropped, re-padded by export, and the
  # export converts back to the same leaves (import → export → import)
  n_kda = sum(m == "kda" for m, _ in config.text.layer_types())
  assert meta["a_log"] == {"reading": "crop", "kda_a_log_axis": "head", "layers": n_kda,
                           "decided_by": "--a_log=auto: the entries past the 2 heads are zero "
                                         f"in all {n_kda} KDA layers"}
  assert "a_log_per_channel" not in cfg["text_config"]["linear_attn_config"]
  again = load_pretrained(convert(back, tmp_path / "again",
                                  kda_chunk_size=config.modes.kda_chunk_size, **_logs()[1]))[1]
  again_rest = _split_mtp(jax.tree.map(np.asarray, again))[0]
  for k in rest:
    np.testing.assert_array_equal(again_rest[k], rest[k], err_msg="/".join(k))


def test_export_default_spelling_and_mtp_flag(tiny, tmp_path):
  config, variables = tiny
  quiet = dict(progress=False, log=lambda s: None, dtype="float32")
  bare = Source(export(None, tmp_path / "bare", loaded=(config, variables), **quiet)).names()
  assert "lm_head.weight" in bare and not [n for n in bare if n.startswith(
      ("language_model.", "k3jax_mtp."))]
  with_mtp = export(None, tmp_path / "mtp", loaded=(config, variables), mtp=True, **quiet)
  extra = sorted(set(Source(with_mtp).names()) - set(bare))
  assert extra and all(n.startswith("k3jax_mtp.") for n in extra)
  assert "k3jax_mtp.layer.self_attn.kv_b_proj.weight" in extra
  # a written MTP layer converts back exactly (no fresh one)
  lines, kw = _logs()
  _, got = load_pretrained(convert(with_mtp, tmp_path / "again",
                                   kda_chunk_size=config.modes.kda_chunk_size, **kw))
  assert not [l for l in lines if l.startswith("MTP:")]
  for k, v in dict(flat(variables)).items():
    np.testing.assert_array_equal(dict(flat(jax.tree.map(np.asarray, got)))[k], v,
                                  err_msg="/".join(k))


# ---------------------------------------------------------------------- refusals
def _expect_error(src, tmp_path, match, **kw):
  dst = tmp_path / "out"
  with pytest.raises(ValueError, match=match):
    convert(src, dst, progress=False, log=lambda s: None, **kw)
  assert not dst.exists()
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")], "temp dirs left"


def _release(tiny, tmp_path, edit=None, prefix="language_model."):
  """The release-layout checkpoint of `tiny` in one file, `edit(tensors)` applied."""
  config, variables = tiny
  d = tmp_path / "src"
  tensors = write_k3_checkpoint(d, config, variables, text_prefix=prefix, shards=1)
  if edit:
    edit(tensors)
    for f in d.glob("*.safetensors"):
      f.unlink()
    (d / "model.safetensors.index.json").unlink()
    write_file(d / "model.safetensors", tensors)
  return d


def test_both_prefixes_are_refused(tiny, tmp_path):
  def dup(t):
    t["model.norm.weight"] = t["language_model.model.norm.weight"]
  d = _release(tiny, tmp_path, dup)
  _expect_error(d, tmp_path, r"spells its text tensors both ways: "
                r"'language_model\.model\.[^']+' .* and 'model\.norm\.weight'")


def _a_log_stats(x):
  """Independent of the converter: the statistics its message must show."""
  x = np.asarray(x, np.float64)
  return f"mean {x.mean():.4g}, std {x.std():.4g}, min {x.min():.4g}, max {x.max():.4g}"


def _release_channel(tiny_channel, tmp_path):
  """The release's situation: A_log holds more values than heads, none of them zero, and
  config.json says nothing about them (k3jax's `a_log_per_channel` key removed)."""
  d = tmp_path / "src"
  tensors = write_k3_checkpoint(d, *tiny_channel, shards=1)
  cfg = json.loads((d / "config.json").read_text())
  del cfg["text_config"]["linear_attn_config"]["a_log_per_channel"]
  (d / "config.json").write_text(json.dumps(cfg))
  return d, tensors


def test_a_log_auto_stops_with_the_values_and_both_flags(tiny_channel, tmp_path):
  """--a_log=auto on non-zero padding: no output; the error shows the first such layer's
  padding and all its entries (mean, std, min, max), how many layers, and both flags — by the
  API and by the CLI (exit status 1, no traceback), --check_only included."""
  d, tensors = _release_channel(tiny_channel, tmp_path)
  name = "language_model.model." + L0 + "A_log"
  a = tensors[name]
  assert a.shape == (16,) and np.count_nonzero(a[2:]) == 14
  expected = (
      f"A_log: {name} has 16 entries for 2 heads, and entries 2–15 are not zero padding "
      f"(non-zero in 3 of 3 KDA layers), so reading it is a decision the converter does not "
      f"make for you.\n"
      f"  layer 0, entries 2–15: {_a_log_stats(a[2:])} (14 of 14 non-zero)\n"
      f"  layer 0, all 16 entries: {_a_log_stats(a)}\n"
      f"Convert again with one of:\n"
      f"  --a_log=channel  the 16 values are one decay rate per key dimension, shared by the 2 "
      f"heads; nothing is dropped\n"
      f"  --a_log=crop     the first 2 values are the heads' rates; entries 2–15 are dropped "
      f"(counted in the log and conversion.json)\n")
  _expect_error(d, tmp_path, re.escape(expected))
  for extra in (["--check_only"], [f"--dst={tmp_path / 'cli'}"]):
    r = subprocess.run([sys.executable, "-m", "tools.convert_from_pytorch", f"--src={d}",
                        "--progress=false", *extra], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and expected in r.stderr and "Traceback" not in r.stderr, \
        r.stderr[-3000:]
  assert not (tmp_path / "cli").exists()


def test_a_log_per_channel_round_trips(tiny_channel, tmp_path):
  """--a_log=channel: A_log [K] kept whole (ModelConfig.text.kda_a_log_axis="channel", recorded in
  the checkpoint's config and conversion.json); export writes the same bytes and
  config.json's `a_log_per_channel`, so the export converts back (auto) to the same leaves;
  a flag contradicting that key is refused."""
  config, variables = tiny_channel
  d, tensors = _release_channel(tiny_channel, tmp_path)
  lines, kw = _logs()
  dst = convert(d, tmp_path / "conv", a_log="channel", kda_chunk_size=config.modes.kda_chunk_size, **kw)
  assert "A_log: read as channel (--a_log=channel)" in lines
  got_config, got = load_pretrained(dst)
  assert got_config.text.kda_a_log_axis == "channel"
  assert json.loads((dst / "conversion.json").read_text())["a_log"] == {
      "reading": "channel", "kda_a_log_axis": "channel", "decided_by": "--a_log=channel",
      "layers": 3}
  rest = _split_mtp(jax.tree.map(np.asarray, got))[0]
  want = _split_mtp(variables)[0]
  assert sorted(rest) == sorted(want)
  for k in rest:
    np.testing.assert_array_equal(rest[k], want[k], err_msg="/".join(k))
  back = export(dst, tmp_path / "back", dtype="float32", text_prefix="language_model.",
                progress=False, log=lambda s: None)
  out = Source(back)
  assert out.names() == sorted(tensors)
  for n in out.names():
    np.testing.assert_array_equal(out.get(n), tensors[n], err_msg=n)
  cfg = json.loads((back / "config.json").read_text())
  assert cfg["text_config"]["linear_attn_config"]["a_log_per_channel"] is True
  lines, kw = _logs()
  again = convert(back, tmp_path / "again", kda_chunk_size=config.modes.kda_chunk_size, **kw)
  assert "A_log: read as channel (config.json: linear_attn_config.a_log_per_channel)" in lines
  again_rest = _split_mtp(jax.tree.map(np.asarray, load_pretrained(again)[1]))[0]
  for k in rest:
    np.testing.assert_array_equal(again_rest[k], rest[k], err_msg="/".join(k))
  _expect_error(back, tmp_path, r"--a_log=crop contradicts config\.json: linear_attn_config\."
                r"a_log_per_channel is true \(A_log read per channel\); pass --a_log=auto or "
                r"--a_log=channel", a_log="crop")


def test_a_log_crop_drops_nonzero_padding_only_when_asked(tiny, tmp_path):
  """A [128] A_log with non-zero entries past the heads: auto stops (and says --a_log=channel
  cannot apply: tiny has 16 key dimensions, not 128); --a_log=crop converts, keeping the
  first 2 entries and counting what it dropped in the log and conversion.json."""
  name = "language_model.model." + L0 + "A_log"
  def pad(t):
    t[name] = t[name].copy()
    t[name][5], t[name][127] = 0.25, -1.5
  d = _release(tiny, tmp_path, pad)
  _expect_error(d, tmp_path, r"(?s)entries 2–127 are not zero padding \(non-zero in 1 of 3 KDA "
                r"layers\).*--a_log=channel  not possible here: it needs 16 entries "
                r"\(kda_head_dim\), found 128\n")
  lines, kw = _logs()
  dst = convert(d, tmp_path / "crop", a_log="crop", kda_chunk_size=tiny[0].modes.kda_chunk_size, **kw)
  assert ("A_log: read as crop (--a_log=crop); dropped 2 non-zero entries past the heads in 1 "
          "layer(s), max |value| 1.5") in lines
  assert json.loads((dst / "conversion.json").read_text())["a_log"] == {
      "reading": "crop", "kda_a_log_axis": "head", "decided_by": "--a_log=crop", "layers": 3,
      "dropped": {"layers": 1, "nonzero_entries": 2, "max_abs": 1.5}}
  got = load_pretrained(dst)[1]["params"]["layers_0"]["self_attn"]["A_log"]
  np.testing.assert_array_equal(got, tiny[1]["params"]["layers_0"]["self_attn"]["A_log"])
  _expect_error(d, tmp_path, r"--a_log: expected one of \['auto', 'crop', 'channel'\], found "
                r"'heads'", a_log="heads")


def test_float_tensors_load_in_any_float_dtype(tiny, tmp_path):
  """The small tensors' dtypes are partly a guess (§12): a bf16 A_log, conv and router bias,
  fp16 dt_bias and o_norm and an fp32 router (every tensor of this source is fp32 but these)
  all load, cast exactly to the model's fp32, each conversion listed in conversion.json; the
  ones that differ from the release's table are warnings; an integer where a float belongs
  is still an error. Export writes the table's dtypes, which --check_only then finds clean."""
  import ml_dtypes
  config, variables = tiny
  bf16 = np.dtype(ml_dtypes.bfloat16)
  a, r = "language_model.model." + L0, "language_model.model.layers.1.block_sparse_moe.gate."
  casts = {a + "A_log": bf16, a + "q_conv1d.weight": bf16, r + "e_score_correction_bias": bf16,
           a + "dt_bias": np.dtype(np.float16), a + "o_norm.weight": np.dtype(np.float16)}
  src = {}
  def edit(t):
    for n, dt in casts.items():
      t[n] = t[n].astype(dt)
    src.update(t)
  d = _release(tiny, tmp_path, edit)
  lines, kw = _logs()
  dst = convert(d, tmp_path / "conv", kda_chunk_size=config.modes.kda_chunk_size, **kw)
  meta = json.loads((dst / "conversion.json").read_text())
  assert meta["dtype_conversions"] == {
      "bfloat16 -> float32": [a + "A_log", a + "q_conv1d.weight",
                              r + "e_score_correction_bias"],
      "float16 -> float32": [a + "dt_bias", a + "o_norm.weight"]}
  assert ("dtypes: 5 float tensor(s) converted to the model's parameter dtypes (bfloat16 -> "
          "float32 ×3, float16 -> float32 ×2); each listed in conversion.json") in lines
  warned = meta["dtype_warnings"]
  for line in (
      f"{a}A_log: bfloat16, the release's table says float32 (docs/k3.md §9/§12 and public: A_log "
      "is F32 [128] (read from the first shard)); loaded as float32",
      f"{a}dt_bias: float16, the release's table says float32 (docs/k3.md §9: dt_bias fp32); "
      "loaded as float32",
      f"{r}weight: float32, the release's table says bfloat16 (size evidence (docs/k3.md §12): "
      "1.561 TB published; bf16 routers give 1.5609 TB, fp32 ones 1.5620 TB); loaded as float32"):
    assert line in warned
  assert any(w.startswith(a + "q_conv1d.weight: bfloat16, the release's table says float32")
             for w in warned)
  assert any(l.startswith(f"warning: {len(warned)} float tensor(s) in another dtype than the "
                          "release's table") for l in lines)
  _, got = load_pretrained(dst)
  kda = got["params"]["layers_0"]["self_attn"]
  for name, leaf in (("A_log", kda["A_log"]), ("dt_bias", kda["dt_bias"].reshape(-1)),
                     ("o_norm.weight", kda["o_norm"])):
    assert leaf.dtype == np.float32
    np.testing.assert_array_equal(leaf, src[a + name][:leaf.shape[0]].astype(np.float32),
                                  err_msg=name)
  # --dtype bfloat16: the fp32 matmul weights are rounded, listed too (check_only: no data)
  lines, kw = _logs()
  convert(d, None, check_only=True, dtype="bfloat16", **kw)
  assert any(re.search(r"float32 -> bfloat16 ×\d+\)$", l) for l in lines)

  def as_int(t):
    t[a + "A_log"] = np.zeros(128, np.int32)
  _expect_error(_release(tiny, tmp_path / "int", as_int), tmp_path,
                re.escape(f"{a}A_log: expected a float dtype, found int32"))

  exported = export(None, tmp_path / "bf16", loaded=(config, variables), progress=False,
                    text_prefix="language_model.", log=lambda s: None)
  out = Source(exported).infos
  for name, dt in ((a + "A_log", "float32"), (a + "dt_bias", "float32"),
                   (a + "q_conv1d.weight", "float32"), (a + "o_norm.weight", "float32"),
                   (r + "e_score_correction_bias", "float32"), (r + "weight", "bfloat16"),
                   (a + "q_proj.weight", "bfloat16"),
                   ("language_model.model.layers.0.input_layernorm.weight", "bfloat16"),
                   ("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed",
                    "uint8")):
    assert out[name].dtype.name == dt, name
  lines, kw = _logs()
  convert(exported, None, check_only=True, **kw)
  assert not [l for l in lines if l.startswith("warning")] and lines[-1].startswith("check: ")


def test_unknown_names_are_errors_unless_skipped(tiny, tmp_path):
  def add(t):
    t["vision_tower.extra.weight"] = np.zeros(3, np.float32)
    t["optimizer.step"] = np.zeros(1, np.float32)
  d = _release(tiny, tmp_path, add)
  _expect_error(d, tmp_path, r"(?s)2 unexpected tensor\(s\).*\n  optimizer\.step\n  "
                r"vision_tower\.extra\.weight")
  _expect_error(d, tmp_path, r"(?s)1 unexpected tensor\(s\).*\n  optimizer\.step",
                skip_prefix=["vision_tower."])
  # (check_only runs the same skipping and checks as a conversion, without writing)
  lines, kw = _logs()
  assert convert(d, None, skip_prefix=["vision_tower.", "optimizer."], check_only=True,
                 **kw) is None
  assert any(l.startswith("skipping 2 tensor(s) under --skip_prefix ['vision_tower.', "
                          "'optimizer.'] (e.g. ") for l in lines)
  assert lines[-1].startswith("check: ")
  with pytest.raises(ValueError, match="empty prefix"):
    convert(d, tmp_path / "x", skip_prefix=[""], progress=False)


def test_quantization_config_is_validated(tiny, tmp_path):
  good = hf_config.release_quantization_config()
  def check(edit, match):
    qc = json.loads(json.dumps(good))
    edit(qc)
    with pytest.raises(ValueError, match=match):
      hf_config.check_quantization_config({"quantization_config": qc})
  check(lambda q: q.update(format="nvfp4-pack-quantized"),
        r"'quantization_config\.format': expected 'mxfp4-pack-quantized', found "
        r"'nvfp4-pack-quantized'")
  check(lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=16),
        r"'quantization_config\.config_groups\.group_0\.weights\.group_size': expected 32")
  check(lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}),
        r"input_activations': expected null")
  check(lambda q: q["ignore"].remove("re:.*shared_experts.*"),
        r"'quantization_config\.ignore': expected entries covering \['shared_experts'\]")
  check(lambda q: q["ignore"].append("re:.*experts.*"),
        r"expected no entry covering the routed experts")
  assert hf_config.check_quantization_config({}) is None
  # the spellings the release may use for its ignore entries are accepted
  qc = {**good, "ignore": ["language_model.lm_head", "re:.*self_attn.*",
                           "re:.*shared_experts.*", "re:vision_tower.*"]}
  assert hf_config.check_quantization_config({"quantization_config": qc}) == "mxfp4"
  # through the converter: refused before anything is written
  d = _release(tiny, tmp_path)
  cfg = json.loads((d / "config.json").read_text())
  cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64
  (d / "config.json").write_text(json.dumps(cfg))
  _expect_error(d, tmp_path, r"group_size': expected 32 .*found 64")


def test_packed_experts_stay_packed(tiny, tmp_path):
  """expert_format='mxfp4': experts/<w>/weight_packed + weight_scale hold the release's bytes
  stacked over experts (k3jax/quant/mx.py), nothing decoded; export writes them back."""
  config, variables = tiny
  d = _release(tiny, tmp_path)
  source = Source(d)
  assert any(p[-1] == mx.PACKED for p in N.model_paths(config.replace(expert_format="mxfp4")))
  dst = convert(d, tmp_path / "packed", kda_chunk_size=config.modes.kda_chunk_size,
                expert_format="mxfp4", progress=False, log=lambda s: None)
  got_config, got = load_pretrained(dst)
  assert got_config.modes.expert_format == "mxfp4"
  w1 = got["params"]["layers_1"]["block_sparse_moe"]["experts"]["w1"]
  m = "language_model.model.layers.1.block_sparse_moe.experts."
  want = mx.stack_release_experts(
      [source.get(f"{m}{e}.w1.weight_packed") for e in range(config.text.num_experts)],
      [source.get(f"{m}{e}.w1.weight_scale") for e in range(config.text.num_experts)])
  for leaf, ref in zip((w1[mx.PACKED], w1[mx.SCALE]), want):
    assert np.asarray(leaf).dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(leaf), ref)
  # scanned body: [groups, E, out, in/2]
  body = got["params"]["body"]["layers_0"]["block_sparse_moe"]["experts"]["w2"][mx.PACKED]
  assert body.shape == (2, config.text.num_experts, config.text.latent_moe_dim,
                        config.text.moe_intermediate_size // 2)
  back = export(None, tmp_path / "back", loaded=(got_config, jax.tree.map(np.asarray, got)),
                dtype="float32", text_prefix="language_model.", progress=False,
                log=lambda s: None)
  out = Source(back)
  for n in out.names():
    if ".experts." in n:
      np.testing.assert_array_equal(out.get(n), source.get(n), err_msg=n)
  assert sorted(out.names()) == sorted(source.names())
