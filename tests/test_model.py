"""K3Model: the whole stack against a list-based reference of spec §5, causality, packing,
scan/unroll equality, stats, layout, parameter tree, bad input.

Compile time dominates on CPU, so every config gets ONE jitted forward (always with
segment_ids and stats; all-zero segment ids are the unpacked case) reused by all tests, and
variables are filled from `jax.eval_shape(init)` with numpy (no init compile), except in the
one test that checks `init` itself.
"""

import functools
import time

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import preset
from k3jax.layers.kda import KDA
from k3jax.layers.mla import MLA
from k3jax.layers.mlp import MLP
from k3jax.layers.moe import StableLatentMoE
from k3jax.model import K3Model, layer_kinds, source_counts

B, T = 2, 16


def random_variables(model, tokens, seed=0):
  """Variables with the shapes of `model.init`, filled by numpy by parameter name (fast)."""
  shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens))
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    name = str(getattr(path[-1], "key", path[-1]))
    shape = leaf.shape
    if name in ("weight", "norm", "o_norm"):
      x = 1 + 0.1 * rng.normal(size=shape)
    elif name == "proj":  # AttnRes pseudo-queries: non-zero so that mixing is really tested
      x = 0.3 * rng.normal(size=shape)
    elif name == "A_log":
      x = np.log(rng.uniform(1, 16, size=shape))
    elif name == "e_score_correction_bias":
      x = 0.02 * rng.normal(size=shape)
    elif name == "embedding":
      x = rng.normal(size=shape)
    else:  # kernels, convs, dt_bias, experts
      x = rng.normal(size=shape) / np.sqrt(max(8, shape[-2] if len(shape) > 1 else 8))
    return jnp.asarray(x, leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)


@functools.lru_cache(maxsize=None)
def setup(name, **overrides):
  cfg = preset(name, **overrides)
  model = K3Model(cfg)
  tokens = jax.random.randint(jax.random.key(7), (B, T), 0, cfg.vocab_size)
  v = random_variables(model, tokens)
  mtp = bool(cfg.num_mtp_layers)
  fwd = jax.jit(lambda v, t, s: model.apply(v, t, segment_ids=s, return_mtp=mtp,
                                            mutable=["stats"]))
  return cfg, model, v, tokens, fwd


def _logits(out):
  (res, _) = out
  return res[0] if isinstance(res, tuple) else res


# ------------------------------------------------------------------ reference of spec §5
def _np_rms(x, w, eps=1e-5):
  x = np.asarray(x, np.float64)
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(w, np.float64)


def _np_mix(sources, p):
  v = np.stack([np.asarray(s, np.float64) for s in sources])
  logits = _np_rms(v, p["norm"]) @ np.asarray(p["proj"], np.float64)
  w = np.exp(logits - logits.max(0))
  w /= w.sum(0)
  return (w[..., None] * v).sum(0)


@functools.lru_cache(maxsize=None)
def _sublayers(cfg):
  """Jitted single-module applies, shared by every layer of the reference."""
  kda = jax.jit(lambda p, x, s: KDA(cfg).apply({"params": p}, x, s))
  mla = jax.jit(lambda p, x, s: MLA(cfg).apply({"params": p}, x, s))
  dense = jax.jit(lambda p, x: MLP(cfg, cfg.dense_intermediate_size).apply({"params": p}, x))
  moe = jax.jit(lambda p, b, x: StableLatentMoE(cfg).apply({"params": p, "balance": b}, x))
  return kda, mla, dense, moe


def _layer_vars(cfg, v, i):
  prefix, groups, _ = cfg.stack_layout()
  if prefix <= i < prefix + groups * cfg.mla_every:
    g, j = divmod(i - prefix, cfg.mla_every)
    pick = lambda tree: jax.tree.map(lambda a: a[g], tree["body"][f"layers_{j}"])  # noqa: E731
  else:
    pick = lambda tree: tree.get(f"layers_{i}", {})  # noqa: E731 (dense layers: no balance)
  return pick(v["params"]), pick(v["balance"])


def _np_layer(cfg, lp, lb, kind, seg):
  """(attn, mlp) callables of one layer: jitted modules, float64 numpy in and out."""
  kda, mla, dense, moe = _sublayers(cfg)
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  attn = lambda x: np.asarray(  # noqa: E731
      (kda if kind[0] == "kda" else mla)(lp["self_attn"], f32(x), seg), np.float64)
  mlp = lambda x: np.asarray(  # noqa: E731
      dense(lp["mlp"], f32(x)) if kind[1] == "dense"
      else moe(lp["block_sparse_moe"], lb["block_sparse_moe"], f32(x)), np.float64)
  return attn, mlp


def reference_forward(cfg, v, tokens, seg, mtp=False, layer_cfg=None):
  """Spec §5 with a python list of blocks; layers applied one by one.

  `layer_cfg`: a config with the same layer dimensions whose jitted sublayers can be reused.
  """
  p = v["params"]
  emb = np.asarray(p["embed_tokens"]["embedding"], np.float64)[np.asarray(tokens)]
  bs = cfg.attn_res_block_size
  blocks, partial, h = [], emb, emb
  for i, kind in enumerate(cfg.layer_types()):
    lp, lb = _layer_vars(cfg, v, i)
    attn, mlp = _np_layer(layer_cfg or cfg, lp, lb, kind, seg)
    if bs is None:
      h = h + attn(_np_rms(h, lp["input_layernorm"]["weight"]))
      h = h + mlp(_np_rms(h, lp["post_attention_layernorm"]["weight"]))
      continue
    x = _np_mix(blocks + [partial], lp["self_attention_res"]) if blocks else partial
    if i % bs == 0:
      blocks.append(partial)
      partial = np.zeros_like(partial)
    partial = partial + attn(_np_rms(x, lp["input_layernorm"]["weight"]))
    x = _np_mix(blocks + [partial], lp["mlp_res"])
    partial = partial + mlp(_np_rms(x, lp["post_attention_layernorm"]["weight"]))
  if bs is not None:
    assert len(blocks) + 1 == source_counts(cfg)["output"]
    h = _np_mix(blocks + [partial], p["output_attn_res"])
  head = np.asarray(p["lm_head"]["kernel"], np.float64)
  logits = _np_rms(h, p["norm"]["weight"]) @ head
  if not mtp:
    return logits
  m = p["mtp"]
  x = np.concatenate([_np_rms(emb[:, 1:], m["enorm"]["weight"]),
                      _np_rms(h[:, :-1], m["hnorm"]["weight"])], -1) @ np.asarray(
                          m["eh_proj"]["kernel"], np.float64)
  attn, mlp = _np_layer(cfg, m["layer"], v["balance"]["mtp"]["layer"], ("mla", "moe"),
                        None if seg is None else seg[:, 1:])
  x = x + attn(_np_rms(x, m["layer"]["input_layernorm"]["weight"]))
  x = x + mlp(_np_rms(x, m["layer"]["post_attention_layernorm"]["weight"]))
  return logits, _np_rms(x, m["norm"]["weight"]) @ head


def _tol(x):
  return 1e-4 * np.abs(x).max()


PACKED = jnp.asarray(np.array([[0] * 6 + [1] * 10, [0] * 11 + [1] * 5]), jnp.int32)
UNPACKED = jnp.zeros((B, T), jnp.int32)


def test_tiny_matches_list_reference_with_mtp():
  cfg, _, v, tok, fwd = setup("tiny")
  (logits, mtp_logits), _ = fwd(v, tok, PACKED)
  ref, ref_mtp = reference_forward(cfg, v, tok, PACKED, mtp=True)
  assert logits.dtype == jnp.float32 and logits.shape == (B, T, cfg.vocab_size)
  assert mtp_logits.shape == (B, T - 1, cfg.vocab_size)
  np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=2e-3 * np.abs(ref).max())
  np.testing.assert_allclose(mtp_logits, ref_mtp, rtol=1e-4, atol=2e-3 * np.abs(ref_mtp).max())


def test_kimi_linear_matches_plain_residual_reference():
  cfg, _, v, tok, fwd = setup("tiny_kimi_linear")
  logits = _logits(fwd(v, tok, PACKED))
  ref = reference_forward(cfg, v, tok, PACKED)
  np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=2e-3 * np.abs(ref).max())


@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear"])
def test_causality_and_packing(name):
  cfg, _, v, tok, fwd = setup(name)
  for seg in (UNPACKED, PACKED):
    base_out = fwd(v, tok, seg)
    base = np.asarray(_logits(base_out))
    for t in (2, 8):
      tok2 = tok.at[:, t + 1].set((tok[:, t + 1] + 1) % cfg.vocab_size)
      out = fwd(v, tok2, seg)
      got = np.asarray(_logits(out))
      # not bit-exact: the MoE combine sums a token's experts in expert-sorted order, which
      # another token's routing can permute (fp32 rounding, ~1e-7 per layer); a leak is O(1)
      np.testing.assert_allclose(got[:, :t + 1], base[:, :t + 1], rtol=0, atol=_tol(base))
      assert np.abs(got[:, t + 1] - base[:, t + 1]).max() > 1e-4  # and t+1 itself does change
      if cfg.num_mtp_layers:  # mtp_logits[:, s] sees tokens ≤ s + 1
        np.testing.assert_allclose(np.asarray(out[0][1])[:, :t],
                                   np.asarray(base_out[0][1])[:, :t], rtol=0, atol=_tol(base))
  # packing: changing document 0 of row 0 (tokens 0–5) never touches document 1 (6–15)
  base = np.asarray(_logits(fwd(v, tok, PACKED)))
  got = np.asarray(_logits(fwd(v, tok.at[0, 1].set((tok[0, 1] + 3) % cfg.vocab_size), PACKED)))
  np.testing.assert_allclose(got[0, 6:], base[0, 6:], rtol=0, atol=_tol(base))
  assert np.abs(got[0, 1:6] - base[0, 1:6]).max() > 1e-4


def test_stats_collection():
  cfg, _, v, tok, fwd = setup("tiny")
  _, st = fwd(v, tok, UNPACKED)
  st = st["stats"]
  prefix, groups, _ = cfg.stack_layout()
  e, h = cfg.num_experts, cfg.num_heads
  moe_layers = [f"layers_{i}" for i in range(cfg.first_dense_layers, prefix)] + ["layers_12"]
  for name in moe_layers:
    s = st[name]["block_sparse_moe"]
    np.testing.assert_array_equal(s["load"].sum(), B * T * cfg.experts_per_token)
    assert s["margin_hist"].shape == (e, cfg.qb_num_bins) and s["margin_hist"].dtype == jnp.int32
    np.testing.assert_array_equal(s["margin_hist"].sum(1), np.full(e, B * T))
    assert s["dropped"].shape == () and int(s["dropped"]) == 0
  assert "block_sparse_moe" not in st.get("layers_0", {})  # dense layer 0
  for j in range(cfg.mla_every):
    s = st["body"][f"layers_{j}"]["block_sparse_moe"]
    assert s["load"].shape == (groups, e) and s["margin_hist"].shape == (groups, e,
                                                                         cfg.qb_num_bins)
    np.testing.assert_array_equal(s["load"].sum(1), np.full(groups, B * T * cfg.experts_per_token))
  assert st["body"][f"layers_{cfg.mla_every - 1}"]["self_attn"]["max_logit"].shape == (groups, h)
  for name in ("layers_3", "layers_12"):
    ml = st[name]["self_attn"]["max_logit"]
    assert ml.shape == (h,) and ml.dtype == jnp.float32 and np.all(np.isfinite(ml))
  assert st["mtp"]["layer"]["self_attn"]["max_logit"].shape == (h,)
  # plain apply: logits only (traced, not compiled: the contract is the output structure)
  plain = jax.eval_shape(K3Model(cfg).apply, v, tok)
  assert isinstance(plain, jax.ShapeDtypeStruct) and plain.shape == (B, T, cfg.vocab_size)


SMALL = dict(num_layers=5, first_dense_layers=0, mla_every=2, attn_res_block_size=2)  # body of 2 groups [KDA, MLA] from layer 0, blocks close inside


def test_scan_and_unrolled_are_identical():
  cfg = preset("tiny", **SMALL, num_mtp_layers=0)
  assert cfg.stack_layout() == (0, 2, 1)
  tok = jax.random.randint(jax.random.key(3), (B, T), 0, cfg.vocab_size)
  v = random_variables(K3Model(cfg), tok)
  seg = PACKED
  a = jax.jit(lambda v, t: K3Model(cfg).apply(v, t, segment_ids=seg))(v, tok)
  cfg_u = cfg.replace(scan_layers=False)
  b = jax.jit(lambda v, t: K3Model(cfg_u).apply(v, t, segment_ids=seg))(v, tok)
  # fp32 rounding differs with XLA's fusion of the two programs (2 of 8704 logits differed by
  # 1.2e-5 of the max after KDA's UT transform became an explicit matrix, equally accurate
  # against a float64 recurrence); a wrong layer order or schedule differs by O(max).
  np.testing.assert_allclose(a, b, rtol=0, atol=3e-5 * np.abs(a).max())
  ref = reference_forward(cfg, v, tok, seg, layer_cfg=preset("tiny"))  # the traced-layer-index schedule is spec §5
  np.testing.assert_allclose(a, ref, rtol=1e-4, atol=2e-3 * np.abs(ref).max())


def test_init_tree_and_partitioning():
  """Tree of `init` per docs/contracts.md, traced with eval_shape (init values of each
  module — zero pseudo-queries, unit norms, zero router bias — are tested in tests/layers)."""
  cfg = preset("tiny", **SMALL, num_mtp_layers=0)
  tok = jnp.zeros((1, 4), jnp.int32)
  boxed = jax.eval_shape(K3Model(cfg).init, jax.random.key(0), tok)
  assert set(boxed) == {"params", "balance"}  # init sows no stats
  v = nn.unbox(boxed)
  p = v["params"]
  assert sorted(p) == ["body", "embed_tokens", "layers_4", "lm_head", "norm", "output_attn_res"]
  body = p["body"]
  assert sorted(body) == ["layers_0", "layers_1"]
  assert sorted(body["layers_0"]) == ["block_sparse_moe", "input_layernorm", "mlp_res",
                                      "post_attention_layernorm", "self_attention_res",
                                      "self_attn"]
  assert body["layers_0"]["self_attn"]["A_log"].shape == (2, cfg.kda_num_heads)
  assert "kv_b_proj" in body["layers_1"]["self_attn"] and "kv_b_proj" in p["layers_4"]["self_attn"]
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(v))
  assert v["balance"]["body"]["layers_0"]["block_sparse_moe"]["gate"][
      "e_score_correction_bias"].shape == (2, cfg.num_experts)
  # logical axes on every parameter; the scanned ones gain "layers" in front
  is_box = lambda b: isinstance(b, nn.LogicallyPartitioned)  # noqa: E731
  boxes = jax.tree.leaves(boxed, is_leaf=is_box)
  assert len(boxes) == len(jax.tree.leaves(v)) and all(is_box(b) for b in boxes)
  for b in boxes:
    assert len(b.names) == len(b.value.shape)
  bp = boxed["params"]
  assert bp["body"]["layers_0"]["self_attn"]["q_proj"]["kernel"].names == (
      "layers", "embed", "heads", "head_dim")
  assert bp["embed_tokens"]["embedding"].names == ("vocab", "embed")
  assert bp["layers_4"]["block_sparse_moe"]["experts"]["w1"].names == (
      "experts", "moe_latent", "expert_mlp")
  assert boxed["balance"]["body"]["layers_0"]["block_sparse_moe"]["gate"][
      "e_score_correction_bias"].names == ("layers", "experts")


def test_k3_layout_and_eval_shape_is_fast():
  cfg = preset("k3")
  kinds = layer_kinds(cfg)
  assert len(kinds["kda"]) == 69 and len(kinds["mla"]) == 24
  assert kinds["mla"] == list(range(3, 92, 4)) + [92]
  assert kinds["dense"] == [0] and kinds["moe"] == list(range(1, 93))
  assert cfg.stack_layout() == (4, 22, 1)
  assert source_counts(cfg)["output"] == 9
  t0 = time.perf_counter()
  shapes = jax.eval_shape(K3Model(cfg).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  elapsed = time.perf_counter() - t0
  assert elapsed < 30, elapsed  # seconds, not minutes (typ. ~2 s CPU time)
  p = nn.unbox(shapes)["params"]
  assert p["body"]["layers_0"]["block_sparse_moe"]["experts"]["w1"].shape == (22, 896, 3584, 3072)
  assert p["body"]["layers_3"]["self_attn"]["kv_b_proj"]["kernel"].shape == (22, 512, 96, 256)
  assert p["layers_0"]["mlp"]["gate_proj"]["kernel"].shape == (7168, 33792)
  assert p["layers_92"]["self_attn"]["q_b_proj"]["kernel"].shape == (1536, 96, 192)
  assert p["lm_head"]["kernel"].shape == (7168, 163840)


def test_tied_embeddings_mtp_tree_and_remat_trace():
  """Structure-only checks (traced with eval_shape, nothing compiled)."""
  tok = jnp.zeros((1, 4), jnp.int32)
  cfg = preset("tiny", tie_word_embeddings=True)
  shapes = nn.unbox(jax.eval_shape(K3Model(cfg).init, jax.random.key(0), tok))
  assert "lm_head" not in shapes["params"]
  assert jax.eval_shape(K3Model(cfg).apply, shapes, tok).shape == (1, 4, cfg.vocab_size)
  m = shapes["params"]["mtp"]
  assert sorted(m) == ["eh_proj", "enorm", "hnorm", "layer", "norm"]
  assert m["eh_proj"]["kernel"].shape == (2 * cfg.d_model, cfg.d_model)
  assert "kv_b_proj" in m["layer"]["self_attn"] and "block_sparse_moe" in m["layer"]
  # T = 1: init still creates the MTP params; return_mtp gives [B, 0, vocab]
  one = nn.unbox(jax.eval_shape(K3Model(cfg).init, jax.random.key(0), tok[:, :1]))
  assert jax.tree.map(lambda a: a.shape, one) == jax.tree.map(lambda a: a.shape, shapes)
  # remat: the gradient of the scanned, rematerialised body traces with the same tree
  cfg_r = preset("tiny", **SMALL, remat=True)
  v = nn.unbox(jax.eval_shape(K3Model(cfg_r).init, jax.random.key(0), tok))
  loss = lambda p, b: K3Model(cfg_r).apply({"params": p, "balance": b}, tok).sum()  # noqa: E731
  grads = jax.eval_shape(jax.grad(loss), v["params"], v["balance"])
  assert jax.tree.map(lambda a: a.shape, grads) == jax.tree.map(lambda a: a.shape, v["params"])


def test_remat_changes_nothing():
  """remat=True (scanned groups, unrolled prefix/suffix layers and the MTP layer recomputed in
  the backward) gives the same logits, MTP logits, sown stats and gradients as remat=False."""
  cfg, model, v, tok, fwd = setup("tiny", num_layers=9)
  assert cfg.stack_layout() == (4, 1, 1) and cfg.num_mtp_layers   # prefix, body, suffix, MTP
  model_r = K3Model(cfg.replace(remat=True))
  fwd_r = jax.jit(lambda v, t: model_r.apply(v, t, return_mtp=True, mutable=["stats"]))
  # Without differentiation remat is inert: bit-identical outputs, the same stats tree.
  chex.assert_trees_all_equal(fwd_r(v, tok), fwd(v, tok, None))

  def loss(m, params):
    logits, mtp = m.apply({**v, "params": params}, tok, return_mtp=True)
    return jnp.sum(logits ** 2) + jnp.sum(mtp ** 2), (logits, mtp)

  grad = lambda m: jax.jit(jax.value_and_grad(lambda p: loss(m, p), has_aux=True))(v["params"])
  (_, out0), g0 = grad(model)
  (_, out1), g1 = grad(model_r)
  # Differentiated, the two programs order fp32 sums differently (measured: logits 8e-4 of
  # a max of 3.9, gradients 1.3e-3 of each leaf's max); a layer skipped or run twice differs
  # by O(1).
  for a, b in zip(jax.tree.leaves((out1, g1)), jax.tree.leaves((out0, g0))):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-2 * float(jnp.max(jnp.abs(b))) + 1e-7)


def test_bad_input():
  cfg, model, v, tok, _ = setup("tiny_kimi_linear")
  with pytest.raises(ValueError, match="tokens must be an int array"):
    model.apply(v, tok[0])
  with pytest.raises(ValueError, match="integer dtype"):
    model.apply(v, tok.astype(jnp.float32))
  with pytest.raises(ValueError, match="vocab_size"):
    model.apply(v, tok.at[0, 0].set(cfg.vocab_size))
  with pytest.raises(ValueError, match="segment_ids"):
    model.apply(v, tok, segment_ids=jnp.zeros((B, T - 1), jnp.int32))
  with pytest.raises(ValueError, match="num_mtp_layers"):
    model.apply(v, tok, return_mtp=True)
  with pytest.raises(ValueError, match="experts_per_token"):
    preset("tiny", experts_per_token=9)
  with pytest.raises(ValueError, match="attn_res_block_size"):
    preset("tiny", attn_res_block_size=0)
