"""K3Model: the float64 reference written from the spec (tests/reference_model.py), causality,
bitwise isolation of packed documents, a document packed = alone, scan/unroll, stats, layout,
parameter tree, remat, bad input.

Compile time dominates on CPU, so every config gets ONE jitted forward (always with
segment_ids and stats; all-zero segment ids are the unpacked case) reused by all tests, and
variables are filled from `jax.eval_shape(init)` with numpy (no init compile), except in the
one test that checks `init` itself.
"""

import ast
import functools
import pathlib
import time

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import preset
from k3jax.model import K3Model, layer_kinds, source_counts
from reference_model import reference_forward

B, T = 2, 16


def random_variables(model, tokens, seed=0):
  """Variables with the shapes of `model.init`, filled by numpy by parameter name (fast).

  Well conditioned, so that fp32 rounding stays near its own size through the stack: Linear
  kernels N(0, 1/fan_in) (fan_in = the input axes: d for [d,H,K] projections, H·V for
  o_proj), AttnRes pseudo-queries 0.1·N(0,1) (non-zero, so the depth softmax is really
  tested). Kernels scaled by the head count and 0.3 pseudo-queries made `tiny` chaotic in
  depth: it amplified each sublayer's fp32 rounding (~5e-7) to 2–5e-4 of max|logits|.
  """
  shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens))
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    keys = [str(getattr(k, "key", k)) for k in path]
    name = keys[-1]
    shape = leaf.shape[1:] if "body" in keys else leaf.shape   # scanned: leading layer axis
    if name in ("weight", "norm", "o_norm"):
      x = 1 + 0.1 * rng.normal(size=leaf.shape)
    elif name == "proj":
      x = 0.1 * rng.normal(size=leaf.shape)
    elif name == "A_log":
      x = np.log(rng.uniform(1, 16, size=leaf.shape))
    elif name == "e_score_correction_bias":
      x = 0.02 * rng.normal(size=leaf.shape)
    elif name == "embedding":
      x = rng.normal(size=leaf.shape)
    elif name == "kernel":
      fan_in = shape[0] * shape[1] if keys[-2] == "o_proj" else shape[0]
      x = rng.normal(size=leaf.shape) / np.sqrt(fan_in)
    else:  # convs, dt_bias, experts ([E,in,out]: fan-in is the second-to-last axis)
      x = rng.normal(size=leaf.shape) / np.sqrt(max(8, shape[-2] if len(shape) > 1 else 8))
    return jnp.asarray(x, leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)


# The gradient tests (isolation, remat) run on a 5-layer tiny: layer 0 KDA + dense MLP and
# layer 1 MLA + MoE unrolled (prefix), one scanned group [KDA, MLA] (layers 2–3), the unrolled
# MLA suffix (layer 4), AttnRes blocks of 2 (a block appended inside the scanned body) and the
# MTP layer — every kind of layer and every path through the stack of the 13-layer tiny, whose
# second scanned group only repeats the first; its gradient costs half the compile.
GRAD = "tiny5"
_NAMED = {GRAD: ("tiny", dict(num_layers=5, mla_every=2, attn_res_block_size=2))}


@functools.lru_cache(maxsize=None)
def setup(name, **overrides):
  base, named = _NAMED.get(name, (name, {}))
  cfg = preset(base, **named, **overrides)
  model = K3Model(cfg)
  tokens = jax.random.randint(jax.random.key(7), (B, T), 0, cfg.text.vocab_size)
  v = random_variables(model, tokens)
  mtp = bool(cfg.text.num_mtp_layers)
  fwd = jax.jit(lambda v, t, s: model.apply(v, t, segment_ids=s, return_mtp=mtp,
                                            mutable=["stats"]))
  return cfg, model, v, tokens, fwd


PACKED = jnp.asarray(np.array([[0] * 6 + [1] * 10, [0] * 11 + [1] * 5]), jnp.int32)
UNPACKED = jnp.zeros((B, T), jnp.int32)
# Any two fp32 computations of the model are compared through the float64 reference written
# from the spec (tests/reference_model.py): each must be within REL_TOL·max|ref| of it.
REL_TOL = 1e-4


def _split(out):
  """(logits, mtp_logits | None) of `setup`'s forward output."""
  res = out[0]
  return res if isinstance(res, tuple) else (res, None)


def _rel_err(got, ref):
  return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name,a_log_axis", [("tiny", "head"), ("tiny_kimi_linear", "head"),
                                              ("tiny", "channel")])
def test_model_matches_float64_reference(name, a_log_axis):
  """Packed, the jitted fp32 model = the float64 reference written from the spec alone, logits
  and MTP logits within REL_TOL of max|ref|. Dropless top-k is discontinuous, so the smallest
  gap between the k-th and (k+1)-th biased router score (every MoE layer, MTP included, every
  token) must be far above fp32 rounding of the scores: no routing decision can flip.
  "channel": A_log read as one decay rate per key channel shared by the heads ([K] = [16]
  for tiny's 2 heads; the release's other reading)."""
  overrides = {} if a_log_axis == "head" else {"kda_a_log_axis": a_log_axis}
  cfg, _, v, tok, fwd = setup(name, **overrides)
  assert v["params"]["layers_0"]["self_attn"]["A_log"].shape == (
      cfg.text.kda_num_heads if a_log_axis == "head" else cfg.text.kda_head_dim,)
  mtp = bool(cfg.text.num_mtp_layers)
  logits, mtp_logits = _split(fwd(v, tok, PACKED))
  ref = reference_forward(cfg, v, tok, PACKED, mtp=mtp)
  assert ref["min_route_margin"] > 1e-5, ref["min_route_margin"]
  assert ref["logits"].shape == logits.shape == (B, T, cfg.text.vocab_size)
  assert _rel_err(logits, ref["logits"]) <= REL_TOL
  if mtp:
    assert ref["mtp_logits"].shape == mtp_logits.shape == (B, T - 1, cfg.text.vocab_size)
    assert _rel_err(mtp_logits, ref["mtp_logits"]) <= REL_TOL
  else:
    assert ref["mtp_logits"] is None


def test_reference_uses_only_k3jax_config():
  """The reference must stay independent of the implementation it checks."""
  src = pathlib.Path(__file__).with_name("reference_model.py").read_text()
  for node in ast.walk(ast.parse(src)):
    if isinstance(node, ast.Import):
      mods = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      mods = [node.module or ""]
    else:
      continue
    for mod in mods:
      assert not mod.startswith("k3jax") or mod == "k3jax.config", mod


@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear"])
def test_causality(name):
  """A later token changed: the logits up to it move by no more than fp32 rounding (both runs
  are within REL_TOL of the float64 reference, whose prefix is exactly unchanged), and the
  changed position itself moves."""
  cfg, _, v, tok, fwd = setup(name)
  mtp = bool(cfg.text.num_mtp_layers)
  for seg in (UNPACKED, PACKED):
    base, base_mtp = _split(fwd(v, tok, seg))
    ref = reference_forward(cfg, v, tok, seg, mtp=mtp)
    for t in (2, 8):
      tok2 = tok.at[:, t + 1].set((tok[:, t + 1] + 1) % cfg.text.vocab_size)
      got, got_mtp = _split(fwd(v, tok2, seg))
      ref2 = reference_forward(cfg, v, tok2, seg, mtp=mtp)
      np.testing.assert_array_equal(ref2["logits"][:, :t + 1], ref["logits"][:, :t + 1])
      assert _rel_err(got, ref2["logits"]) <= REL_TOL
      np.testing.assert_allclose(got[:, :t + 1], base[:, :t + 1], rtol=0,
                                 atol=2 * REL_TOL * np.abs(ref["logits"]).max())
      assert np.abs(got[:, t + 1] - base[:, t + 1]).max() > 1e-2
      if mtp:  # mtp_logits[:, s] sees tokens ≤ s + 1
        assert _rel_err(got_mtp, ref2["mtp_logits"]) <= REL_TOL
        np.testing.assert_allclose(got_mtp[:, :t], base_mtp[:, :t], rtol=0,
                                   atol=2 * REL_TOL * np.abs(ref["mtp_logits"]).max())


# The routed experts' weight gradients add each expert's rows in the order tokens reached the
# expert; another document's routing shifts a document's rows, so those sums round in another
# order (the only gradients that do). Reordering a sum of at most n = B·T fp32 terms moves it
# by ≤ 2·n·u·Σ|terms|; with Σ|terms| ≤ _COND·|max of the leaf| (assumed) that is the bound below.
_U32 = 2.0 ** -24
_COND = 10.0


def _expert_weight(path) -> bool:
  return "experts" in jax.tree_util.keystr(path) and "shared" not in jax.tree_util.keystr(path)


@functools.lru_cache(maxsize=None)
def _loss_grad(name, remat=False):
  """(ct, jitted grad): the gradient over params of Σ logits·ct·w + Σ mtp_logits·ct[:, 1:]·w_t·w_t+1
  for `setup(name)`'s model (remat as asked); w [B,T] weights the positions (a document's own
  loss, or all ones). Shared by the isolation and remat tests: one compile per program."""
  cfg, _, v, _, _ = setup(name)
  model = K3Model(cfg.replace(remat=remat))
  mtp = bool(cfg.text.num_mtp_layers)
  ct = np.random.default_rng(1).normal(size=(B, T, cfg.text.vocab_size)).astype(np.float32)

  def loss(params, tok, seg, w):
    out = model.apply({**v, "params": params}, tok, segment_ids=seg, return_mtp=mtp)
    logits, mtp_logits = out if mtp else (out, None)
    total = jnp.sum(logits * ct * w[..., None])
    if mtp:  # mtp_logits[:, t] reads tokens t and t + 1
      total = total + jnp.sum(mtp_logits * ct[:, 1:] * (w[:, :-1] * w[:, 1:])[..., None])
    return total

  return ct, jax.jit(jax.grad(loss))


@pytest.mark.parametrize("name", [GRAD, "tiny_kimi_linear"])
@pytest.mark.parametrize("packed", [True, False])
def test_documents_are_bitwise_isolated(name, packed):
  """Packed (two documents in row 0) or unpacked (each row a document): every token of the
  other documents changed, a document's logits, MTP logits and the gradient of its own loss are
  bit-for-bit unchanged (the routed experts' weight gradients excepted: see _COND). GRAD's
  5 layers hold every layer kind, the scanned body and MTP (see GRAD); the 13-layer tiny's
  forward is isolated in test_causality too."""
  cfg, _, v, tok, fwd = setup(name)
  seg = PACKED if packed else UNPACKED
  doc = np.zeros((B, T), bool)
  if packed:
    doc[0, 6:] = True   # document 1 of row 0; its neighbour is tokens 0–5
    others = ~doc & (np.arange(B)[:, None] == 0)
  else:
    doc[1] = True       # row 1; the other document is row 0
    others = ~doc
  tok2 = jnp.where(jnp.asarray(others), (tok + 1 + jnp.arange(T)) % cfg.text.vocab_size, tok)
  base, base_mtp = _split(fwd(v, tok, seg))
  got, got_mtp = _split(fwd(v, tok2, seg))
  if base_mtp is not None:   # mtp_logits[:, t] reads tokens t and t + 1
    mtp_doc = doc[:, :-1] & doc[:, 1:]
    np.testing.assert_array_equal(np.asarray(got_mtp)[mtp_doc], np.asarray(base_mtp)[mtp_doc])
  np.testing.assert_array_equal(np.asarray(got)[doc], np.asarray(base)[doc])
  assert np.abs(np.asarray(got)[others] - np.asarray(base)[others]).max() > 1e-2  # they did change

  _, grad = _loss_grad(name)
  w = jnp.asarray(doc, jnp.float32)
  g0 = grad(v["params"], tok, seg, w)
  g1 = grad(v["params"], tok2, seg, w)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
    a, b = np.asarray(a), np.asarray(b)
    if _expert_weight(path):
      bound = 2 * B * T * _U32 * _COND * np.abs(a).max()
      np.testing.assert_allclose(b, a, rtol=0, atol=bound, err_msg=jax.tree_util.keystr(path))
    else:
      np.testing.assert_array_equal(b, a, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("name", ["tiny", "tiny_kimi_linear"])
def test_packed_document_equals_document_alone(name):
  """Row 0 packs documents A (tokens 0–5) and B (6–15). A alone in a row padded to the same
  length (padding as a second segment) has bit-for-bit A's packed logits: same positions, same
  program. B alone at offset 0 cannot be bitwise equal to B at offset 6: MLA's softmax sums
  and KDA's 16-token tiles group a document's terms by absolute position, so B's sums round in
  another grouping. Both B's are within REL_TOL of the float64 reference of B."""
  cfg, _, v, tok, fwd = setup(name)
  pad = (tok[0] + 7) % cfg.text.vocab_size
  row_b = jnp.concatenate([tok[0, 6:], pad[:6]])
  alone_a = tok.at[0, 6:].set(pad[6:])
  alone_b = tok.at[0].set(row_b)
  seg_b = PACKED.at[0].set(jnp.asarray([0] * 10 + [1] * 6, jnp.int32))
  packed, packed_mtp = _split(fwd(v, tok, PACKED))
  a, a_mtp = _split(fwd(v, alone_a, PACKED))
  np.testing.assert_array_equal(a[0, :6], packed[0, :6])
  if a_mtp is not None:   # MTP positions 0–4 read two tokens of A
    np.testing.assert_array_equal(a_mtp[0, :5], packed_mtp[0, :5])
  b, _ = _split(fwd(v, alone_b, seg_b))
  ref = reference_forward(cfg, v, alone_b, seg_b)["logits"][0, :10]
  for got in (packed[0, 6:], b[0, :10]):
    assert _rel_err(got, ref) <= REL_TOL


def test_stats_collection():
  cfg, _, v, tok, fwd = setup("tiny")
  _, st = fwd(v, tok, UNPACKED)
  st = st["stats"]
  prefix, groups, _ = cfg.text.stack_layout()
  e, h = cfg.text.num_experts, cfg.text.num_heads
  moe_layers = [f"layers_{i}" for i in range(cfg.text.first_dense_layers, prefix)] + ["layers_12"]
  for name in moe_layers:
    s = st[name]["block_sparse_moe"]
    np.testing.assert_array_equal(s["load"].sum(), B * T * cfg.text.experts_per_token)
    assert s["margin_hist"].shape == (e, cfg.modes.qb_num_bins) and s["margin_hist"].dtype == jnp.int32
    np.testing.assert_array_equal(s["margin_hist"].sum(1), np.full(e, B * T))
    assert s["dropped"].shape == () and int(s["dropped"]) == 0
  assert "block_sparse_moe" not in st.get("layers_0", {})  # dense layer 0
  for j in range(cfg.text.mla_every):
    s = st["body"][f"layers_{j}"]["block_sparse_moe"]
    assert s["load"].shape == (groups, e) and s["margin_hist"].shape == (groups, e,
                                                                         cfg.modes.qb_num_bins)
    np.testing.assert_array_equal(s["load"].sum(1), np.full(groups, B * T * cfg.text.experts_per_token))
  assert st["body"][f"layers_{cfg.text.mla_every - 1}"]["self_attn"]["max_logit"].shape == (groups, h)
  for name in ("layers_3", "layers_12"):
    ml = st[name]["self_attn"]["max_logit"]
    assert ml.shape == (h,) and ml.dtype == jnp.float32 and np.all(np.isfinite(ml))
  assert st["mtp"]["layer"]["self_attn"]["max_logit"].shape == (h,)
  # plain apply: logits only (traced, not compiled: the contract is the output structure)
  plain = jax.eval_shape(K3Model(cfg).apply, v, tok)
  assert isinstance(plain, jax.ShapeDtypeStruct) and plain.shape == (B, T, cfg.text.vocab_size)


SMALL = dict(num_layers=5, first_dense_layers=0, mla_every=2, attn_res_block_size=2)  # body of 2 groups [KDA, MLA] from layer 0, blocks close inside


def test_scan_and_unrolled_match_the_reference():
  """The scanned body (traced layer index) and the unrolled loop both compute docs/k3.md §5: each
  within REL_TOL of the float64 reference (a wrong layer order or schedule is off by O(max))."""
  cfg = preset("tiny", **SMALL, num_mtp_layers=0)
  assert cfg.text.stack_layout() == (0, 2, 1)
  tok = jax.random.randint(jax.random.key(3), (B, T), 0, cfg.text.vocab_size)
  v = random_variables(K3Model(cfg), tok)
  seg = PACKED
  ref = reference_forward(cfg, v, tok, seg)
  assert ref["min_route_margin"] > 1e-5   # no routing decision within fp32 rounding of a tie
  for c in (cfg, cfg.replace(scan_layers=False)):
    got = jax.jit(lambda v, t, c=c: K3Model(c).apply(v, t, segment_ids=seg))(v, tok)
    assert _rel_err(got, ref["logits"]) <= REL_TOL, c.modes.scan_layers


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
  assert body["layers_0"]["self_attn"]["A_log"].shape == (2, cfg.text.kda_num_heads)
  assert "kv_b_proj" in body["layers_1"]["self_attn"] and "kv_b_proj" in p["layers_4"]["self_attn"]
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(v))
  assert v["balance"]["body"]["layers_0"]["block_sparse_moe"]["gate"][
      "e_score_correction_bias"].shape == (2, cfg.text.num_experts)
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
  assert cfg.text.stack_layout() == (4, 22, 1)
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
  """Structure-only checks (traced with eval_shape, nothing compiled). Tied embeddings and the
  MTP tree do not depend on the depth: 5 layers (SMALL) trace in a third of tiny's time."""
  tok = jnp.zeros((1, 4), jnp.int32)
  cfg = preset("tiny", **SMALL, tie_word_embeddings=True)
  shapes = nn.unbox(jax.eval_shape(K3Model(cfg).init, jax.random.key(0), tok))
  assert "lm_head" not in shapes["params"]
  assert jax.eval_shape(K3Model(cfg).apply, shapes, tok).shape == (1, 4, cfg.text.vocab_size)
  m = shapes["params"]["mtp"]
  assert sorted(m) == ["eh_proj", "enorm", "hnorm", "layer", "norm"]
  assert m["eh_proj"]["kernel"].shape == (2 * cfg.text.d_model, cfg.text.d_model)
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


def test_mtp_full_length_equals_the_shifted_positions():
  """`mtp_full`: the MTP layer on all T positions (the last on a stand-in, in a document of its
  own) gives the T−1 real positions' logits of `return_mtp` alone (packed rows, 2 layers:
  KDA + dense, MLA + MoE, dropless), and a last position that is finite."""
  cfg = preset("tiny", num_layers=2)
  model = K3Model(cfg)
  tokens = jax.random.randint(jax.random.key(3), (B, T), 0, cfg.text.vocab_size)
  v = random_variables(model, tokens)
  fwd = jax.jit(lambda v, full: model.apply(v, tokens, segment_ids=PACKED, return_mtp=True,
                                            mtp_full=full), static_argnums=1)
  logits, shifted = fwd(v, False)
  logits_full, full = fwd(v, True)
  assert shifted.shape == (B, T - 1, cfg.text.vocab_size)
  assert full.shape == (B, T, cfg.text.vocab_size) and np.isfinite(np.asarray(full)).all()
  np.testing.assert_array_equal(logits_full, logits)
  assert _rel_err(full[:, :T - 1], np.asarray(shifted, np.float64)) <= 1e-6


# Parameter groups along which the gradients are checked against the float64 reference.
_GRAD_GROUPS = ("self_attn", "block_sparse_moe", "mlp", "_res", "mtp", "embed_tokens", "lm_head")


def test_remat_changes_nothing():
  """remat=True (scanned groups, unrolled prefix/suffix layers and the MTP layer recomputed in
  the backward): the same logits, MTP logits and sown stats bit for bit (without
  differentiation remat is inert), and, differentiated, gradients that agree with remat=False
  within fp32 rounding: each program's directional derivatives along random directions, one
  per parameter group, match central differences of the float64 reference (a layer skipped
  or run twice is off by O(1)). On GRAD's 5 layers: a prefix of two unrolled layers, one
  scanned (rematerialised) group, an unrolled suffix and MTP — each remat site once."""
  cfg, model, v, tok, fwd = setup(GRAD)
  assert cfg.text.stack_layout() == (2, 1, 1) and cfg.text.num_mtp_layers   # prefix, body, suffix, MTP
  model_r = K3Model(cfg.replace(remat=True))
  fwd_r = jax.jit(lambda v, t, s: model_r.apply(v, t, segment_ids=s, return_mtp=True,
                                                mutable=["stats"]))   # the same program as fwd's
  chex.assert_trees_all_equal(fwd_r(v, tok, UNPACKED), fwd(v, tok, UNPACKED))

  ct, grad = _loss_grad(GRAD)
  _, grad_r = _loss_grad(GRAD, remat=True)
  ones = jnp.ones((B, T), jnp.float32)
  grads = [g(v["params"], tok, UNPACKED, ones) for g in (grad, grad_r)]

  def loss64(params):    # the same loss on the float64 reference (linear in the logits)
    ref = reference_forward(cfg, {**v, "params": params}, tok, UNPACKED, mtp=True)
    return float(np.sum(ref["logits"] * ct) + np.sum(ref["mtp_logits"] * ct[:, 1:]))

  assert reference_forward(cfg, v, tok, UNPACKED, mtp=True)["min_route_margin"] > 1e-5
  rng = np.random.default_rng(5)
  p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), v["params"])
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(p64)]
  eps = 1e-6   # moves a router score by ~1e-6, far below the routing margin
  for group in _GRAD_GROUPS:
    u = [rng.normal(size=a.shape) * (group in path) for path, a in
         zip(paths, jax.tree.leaves(p64))]
    assert any(np.any(x) for x in u), group
    step = lambda sign: jax.tree.unflatten(jax.tree.structure(p64), [
        a + sign * eps * x for a, x in zip(jax.tree.leaves(p64), u)])
    fd = (loss64(step(1)) - loss64(step(-1))) / (2 * eps)
    for g in grads:
      terms = [np.asarray(a, np.float64) * x for a, x in zip(jax.tree.leaves(g), u)]
      dot, scale = sum(t.sum() for t in terms), sum(np.abs(t).sum() for t in terms)
      assert abs(dot - fd) <= REL_TOL * scale, (group, dot, fd, scale)


def test_bad_input():
  cfg, model, v, tok, _ = setup("tiny_kimi_linear")
  with pytest.raises(ValueError, match="tokens must be an int array"):
    model.apply(v, tok[0])
  with pytest.raises(ValueError, match="integer dtype"):
    model.apply(v, tok.astype(jnp.float32))
  with pytest.raises(ValueError, match="vocab_size"):
    model.apply(v, tok.at[0, 0].set(cfg.text.vocab_size))
  with pytest.raises(ValueError, match="segment_ids"):
    model.apply(v, tok, segment_ids=jnp.zeros((B, T - 1), jnp.int32))
  with pytest.raises(ValueError, match="num_mtp_layers"):
    model.apply(v, tok, return_mtp=True)
  with pytest.raises(ValueError, match="experts_per_token"):
    preset("tiny", experts_per_token=9)
  with pytest.raises(ValueError, match="attn_res_block_size"):
    preset("tiny", attn_res_block_size=0)


def test_remat_offload_moves_the_layer_inputs_to_host():
  """remat_offload: the differentiated program moves each layer's residual stream to host
  memory and back (device_put to MemorySpace.Host / Device: copies, so the gradient is plain
  remat's); plain remat moves nothing. Traced abstractly."""
  base = preset("tiny", num_layers=5, num_mtp_layers=0, remat=True)   # prefix, group, suffix
  tok = jax.ShapeDtypeStruct((1, 16), jnp.int32)
  v = nn.unbox(jax.eval_shape(K3Model(base).init, jax.random.PRNGKey(0), tok))

  def moves(cfg, space):
    g = jax.grad(lambda p, t: jnp.sum(K3Model(cfg).apply({**v, "params": p}, t)))
    return str(jax.make_jaxpr(g)(v["params"], tok)).count(f"MemorySpace.{space}")

  off = base.replace(remat_offload=True)
  assert moves(base, "Host") == 0
  assert moves(off, "Host") == moves(off, "Device") >= 3   # prefix, scanned group, suffix
