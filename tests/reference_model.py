"""Whole-model forward of Kimi K3 / Kimi Linear in float64 numpy, written from docs/k3.md.

Independent of the k3jax implementation: only `k3jax.config` is used (layer types, stack
layout, dimensions). The layer code was read for parameter names, the parameter tree and a few
conventions the spec leaves open (noted where used); the maths below is the spec's, written as
plain loops over tokens / heads / time:

  §2  pre-norm RMSNorm (eps = rms_norm_eps) before each token mixer and MLP, final norm, head.
  §3  KDA: q,k,v projections → causal depthwise conv (taps within the document) + SiLU →
      L2-normalised q,k (eps 1e-6 inside the sqrt), q·dk^-½ → per-channel decay g (A_log one
      rate per head, or one per key channel shared by the heads: `kda_a_log_axis`), β →
      the delta-rule recurrence token by token (state reset at each document start) →
      per-head RMSNorm(o)·sigmoid(output gate) → o_proj.
  §4  Gated MLA (NoPE): explicit masked softmax per (head, query) over keys of its document.
  §5  Block AttnRes with a python list of blocks.
  §6  Stable LatentMoE (or classic MoE), dropless, per token.
  MTP (model.py's DeepSeek-V3 convention; the spec only says "one extra layer predicting t+2"):
      eh_proj([enorm(embed(x_{t+1})), hnorm(h_t)]) → one MLA+MoE layer with plain residuals
      (segment ids of token t+1) → norm → the shared head.

A "document" is a maximal run of equal segment ids in a row; nothing crosses a document
boundary (KDA state, conv taps, attention). (K3Model's MLA mask and conv compare ids for
equality instead, so the two differ when a row reuses an id after another one, e.g.
[0,0,1,1,0,0]; k3jax.data.corpus numbers documents increasingly, where both agree.)

API: `reference_forward(cfg, variables, tokens, segment_ids=None, *, mtp=False)`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from k3jax.config import DENSE, KDA, MLA, MOE


# ------------------------------------------------------------------------------ helpers
def _f64(a) -> np.ndarray:
  """A parameter or input as float64 numpy (unboxes flax LogicallyPartitioned-like leaves)."""
  if hasattr(a, "names") and hasattr(a, "value"):
    a = a.value
  return np.asarray(a, dtype=np.float64)


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _silu(x):
  return x * _sigmoid(x)


def _softplus(x):
  return np.logaddexp(0.0, x)


def _rms(x, w, eps):
  """RMSNorm over the last axis: x / sqrt(mean(x²) + eps) · w. x [..., n], w [n]."""
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _glu(cfg, a, b):
  """Gated activation of the MLPs and experts (§6): SiTU-GLU or SwiGLU. a, b [..., F]."""
  if cfg.text.activation == "situ":
    b1, b2 = cfg.text.situ_beta1, cfg.text.situ_beta2
    return (b1 * np.tanh(a / b1) * _sigmoid(a)) * (b2 * np.tanh(b / b2))
  if cfg.text.activation == "swiglu":
    return _silu(a) * b
  raise ValueError(f"reference: unknown activation {cfg.text.activation!r}")


def _documents(seg_row) -> np.ndarray:
  """Document index of each token of one row [T]: increments where the segment id changes."""
  seg_row = np.asarray(seg_row)
  change = np.concatenate([[0], (seg_row[1:] != seg_row[:-1]).astype(np.int64)])
  return np.cumsum(change)


def _kernel(p, name):
  return _f64(p[name]["kernel"])


# ------------------------------------------------------------------------------ KDA (§3)
def _kda(cfg, p, x, docs):
  """One KDA token mixer. x [B,T,d] (already normed), docs [B,T] → [B,T,d]."""
  bsz, t_len, d = x.shape
  nh, dk = cfg.text.kda_num_heads, cfg.text.kda_head_dim
  dv = dk
  width = cfg.text.kda_conv_size
  out = np.zeros((bsz, t_len, d))
  for b in range(bsz):
    xb, doc = x[b], docs[b]

    def conv_silu(name, conv):
      # Causal depthwise conv per channel; tap width-1 multiplies the current token, tap j
      # the token (width-1-j) steps back, dropped when that token is in another document.
      lin = np.einsum("td,dhk->thk", xb, _kernel(p, name))
      kern = _f64(p[conv])                                   # [W,H,K]
      y = np.zeros_like(lin)
      for t in range(t_len):
        for tap in range(width):
          s = t - (width - 1 - tap)
          if s >= 0 and doc[s] == doc[t]:
            y[t] += lin[s] * kern[tap]
      return _silu(y)

    q = conv_silu("q_proj", "q_conv1d")                       # [T,H,K]
    k = conv_silu("k_proj", "k_conv1d")
    v = conv_silu("v_proj", "v_conv1d")                       # [T,H,V]
    q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + 1e-6) * dk ** -0.5
    k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + 1e-6)

    z = np.einsum("tr,rhk->thk", xb @ _kernel(p, "f_a_proj"), _kernel(p, "f_b_proj"))
    arg = z + _f64(p["dt_bias"])                              # dt_bias [H,K]
    if cfg.text.kda_a_log_axis == "head":
      rate = np.exp(_f64(p["A_log"]))[:, None]                # [H,1]: one rate per head
    else:
      rate = np.exp(_f64(p["A_log"]))[None, :]                # [1,K]: one per key channel,
                                                              # shared by the heads
    if cfg.text.kda_lower_bound is None:
      g = -rate * _softplus(arg)                              # Kimi Linear: unbounded
    else:
      g = cfg.text.kda_lower_bound * _sigmoid(rate * arg)          # K3: g ∈ (lower_bound, 0)
    beta = _sigmoid(xb @ _kernel(p, "b_proj"))                # [T,H]

    o = np.zeros((t_len, nh, dv))
    for h in range(nh):
      state = np.zeros((dk, dv))
      for t in range(t_len):
        if t > 0 and doc[t] != doc[t - 1]:
          state = np.zeros((dk, dv))                          # new document: fresh state
        state = np.exp(g[t, h])[:, None] * state              # Diag(α_t) S_{t-1}
        kt = k[t, h]
        # (I − β k kᵀ) D S + β k vᵀ  =  D S + β k (v − (D S)ᵀ k)ᵀ
        state = state + beta[t, h] * np.outer(kt, v[t, h] - state.T @ kt)
        o[t, h] = state.T @ q[t, h]                           # read after the update

    if cfg.text.full_rank_gates:
      gate = np.einsum("td,dhk->thk", xb, _kernel(p, "g_proj"))
    else:
      gate = np.einsum("tr,rhk->thk", xb @ _kernel(p, "g_a_proj"), _kernel(p, "g_b_proj"))
    o = _rms(o, _f64(p["o_norm"]), cfg.text.rms_norm_eps) * _sigmoid(gate)
    out[b] = np.einsum("thv,hvd->td", o, _kernel(p, "o_proj"))
  return out


# ------------------------------------------------------------------------------ MLA (§4)
def _mla(cfg, p, x, docs):
  """One Gated MLA (NoPE) token mixer. x [B,T,d] (already normed), docs [B,T] → [B,T,d]."""
  bsz, t_len, d = x.shape
  nh, nope, rope, dvh = cfg.text.num_heads, cfg.text.qk_nope_head_dim, cfg.text.qk_rope_head_dim, cfg.text.v_head_dim
  r = cfg.text.kv_lora_rank
  # The q/kv latent norms use mla_latent_norm_eps (1e-6, Moonshot's code; the spec is silent).
  leps = cfg.text.mla_latent_norm_eps
  scale = (nope + rope) ** -0.5
  out = np.zeros((bsz, t_len, d))
  for b in range(bsz):
    xb, doc = x[b], docs[b]
    if cfg.text.q_lora_rank is not None:
      qa = _rms(xb @ _kernel(p, "q_a_proj"), _f64(p["q_a_layernorm"]["weight"]), leps)
      q = np.einsum("tr,rhk->thk", qa, _kernel(p, "q_b_proj"))
    else:
      q = np.einsum("td,dhk->thk", xb, _kernel(p, "q_proj"))  # [T,H,nope+rope]
    kv = xb @ _kernel(p, "kv_a_proj_with_mqa")                # [T, r + rope]
    c = _rms(kv[:, :r], _f64(p["kv_a_layernorm"]["weight"]), leps)
    k_shared = kv[:, r:]                                      # [T,rope], never rotated (NoPE)
    kvb = np.einsum("tr,rhk->thk", c, _kernel(p, "kv_b_proj"))
    k_nope, v = kvb[..., :nope], kvb[..., nope:]              # [T,H,nope], [T,H,V]

    o = np.zeros((t_len, nh, dvh))
    for h in range(nh):
      for t in range(t_len):
        keys = [s for s in range(t + 1) if doc[s] == doc[t]]  # causal, same document
        logits = np.array([(q[t, h, :nope] @ k_nope[s, h] + q[t, h, nope:] @ k_shared[s]) * scale
                           for s in keys])
        w = np.exp(logits - logits.max())
        w /= w.sum()
        o[t, h] = sum(wi * v[s, h] for wi, s in zip(w, keys))
    if cfg.text.mla_output_gate:
      o = o * _sigmoid(np.einsum("td,dhv->thv", xb, _kernel(p, "g_proj")))
    out[b] = np.einsum("thv,hvd->td", o, _kernel(p, "o_proj"))
  return out


# ------------------------------------------------------------------------------ MLPs (§6)
def _dense_mlp(cfg, p, x):
  """Gated MLP (dense layer / fused shared experts). x [..., d] → [..., d]."""
  return _glu(cfg, x @ _kernel(p, "gate_proj"), x @ _kernel(p, "up_proj")) @ _kernel(p, "down_proj")


def _moe(cfg, p, bias, x, margins):
  """Stable LatentMoE (classic MoE when latent_moe_dim is None), dropless, token by token.

  x [B,T,d] (already normed), bias [E] → [B,T,d]. Appends each token's routing margin (k-th
  minus (k+1)-th largest biased score) to `margins`.
  """
  if cfg.modes.moe_capacity_factor is not None:
    raise ValueError("reference: only dropless MoE (moe_capacity_factor=None) is modelled")
  k = cfg.text.experts_per_token
  latent = cfg.text.latent_moe_dim is not None
  w_router = _kernel(p, "gate")                               # [d,E]
  w1, w3, w2 = (_f64(p["experts"][n]) for n in ("w1", "w3", "w2"))
  out = np.zeros_like(x)
  for b in range(x.shape[0]):
    for t in range(x.shape[1]):
      xt = x[b, t]
      s = _sigmoid(xt @ w_router)                             # [E]
      biased = s + bias                                       # the bias only selects
      order = np.argsort(-biased, kind="stable")
      chosen = order[:k]
      margins.append(biased[order[k - 1]] - biased[order[k]])
      weights = s[chosen] / (s[chosen].sum() + 1e-20) * cfg.text.routed_scaling_factor
      z = xt @ _kernel(p, "routed_expert_down_proj") if latent else xt
      u = np.zeros_like(z)
      for wi, e in zip(weights, chosen):
        u += wi * (_glu(cfg, z @ w1[e], z @ w3[e]) @ w2[e])
      if latent:
        y = _rms(u, _f64(p["routed_expert_norm"]["weight"]), cfg.text.rms_norm_eps) @ _kernel(
            p, "routed_expert_up_proj")
      else:
        y = u
      if cfg.text.num_shared_experts:
        y = y + _dense_mlp(cfg, p["shared_experts"], xt)
      out[b, t] = y
  return out


# ------------------------------------------------------------------------------ AttnRes (§5)
def _mix(cfg, sources, p):
  """Depth mixer: softmax over sources of w · RMSNorm(V_i) (no 1/√d), Σ weights · V_i.

  sources: list of [B,T,d]; p has `proj` (w) and `norm` [d]. The RMSNorm eps is
  rms_norm_eps (the spec does not give one).
  """
  w, nw = _f64(p["proj"]), _f64(p["norm"])
  bsz, t_len, _ = sources[0].shape
  out = np.zeros_like(sources[0])
  for b in range(bsz):
    for t in range(t_len):
      vals = [src[b, t] for src in sources]
      logits = np.array([_rms(val, nw, cfg.text.rms_norm_eps) @ w for val in vals])
      a = np.exp(logits - logits.max())
      a /= a.sum()
      out[b, t] = sum(ai * val for ai, val in zip(a, vals))
  return out


# ------------------------------------------------------------------------------ stack
def _layer_trees(cfg, variables, i):
  """(params, balance) subtrees of global layer i: `layers_{i}`, or slice g of body/layers_j."""
  params, balance = variables["params"], variables.get("balance", {})
  prefix, groups, _ = cfg.text.stack_layout()
  if prefix <= i < prefix + groups * cfg.text.mla_every:
    g, j = divmod(i - prefix, cfg.text.mla_every)

    def take(node):  # slice g of every leaf: the scanned body stacks groups on axis 0
      if isinstance(node, Mapping):
        return {key: take(val) for key, val in node.items()}
      return _f64(node)[g]
    return take(params["body"][f"layers_{j}"]), take(balance["body"][f"layers_{j}"])
  return params[f"layers_{i}"], balance.get(f"layers_{i}", {})


def _decoder_layer_fns(cfg, lp, lb, mixer, mlp, docs, margins):
  """(token mixer, MLP) of one layer as functions of normed inputs [B,T,d]."""
  if mixer == KDA:
    attn = lambda x: _kda(cfg, lp["self_attn"], x, docs)      # noqa: E731
  elif mixer == MLA:
    attn = lambda x: _mla(cfg, lp["self_attn"], x, docs)      # noqa: E731
  else:
    raise ValueError(f"reference: unknown mixer {mixer!r}")
  if mlp == DENSE:
    ffn = lambda x: _dense_mlp(cfg, lp["mlp"], x)             # noqa: E731
  elif mlp == MOE:
    bias = _f64(lb["block_sparse_moe"]["gate"]["e_score_correction_bias"])
    ffn = lambda x: _moe(cfg, lp["block_sparse_moe"], bias, x, margins)  # noqa: E731
  else:
    raise ValueError(f"reference: unknown mlp {mlp!r}")
  return attn, ffn


def _head(cfg, params, h):
  """Logits [B,T,V] from normed hidden states (untied lm_head, or the tied embedding)."""
  if cfg.text.tie_word_embeddings:
    return h @ _f64(params["embed_tokens"]["embedding"]).T
  return h @ _kernel(params, "lm_head")


def reference_forward(cfg, variables, tokens, segment_ids=None, *, mtp=False):
  """float64 forward of K3Model(cfg).

  Args:
    cfg: a `k3jax.config.ModelConfig` (dropless MoE).
    variables: {"params": ..., "balance": ...} as returned by `K3Model(cfg).init`.
    tokens: int [B,T].
    segment_ids: int [B,T] or None (one document per row).
    mtp: also run the MTP layer (needs cfg.text.num_mtp_layers == 1).

  Returns:
    dict(logits [B,T,V] float64, mtp_logits [B,T-1,V] float64 or None,
         min_route_margin: smallest gap, over all MoE layers (incl. MTP) and tokens, between
         the k-th and (k+1)-th largest biased router score; inf without MoE layers).
  """
  tokens = np.asarray(tokens)
  if tokens.ndim != 2:
    raise ValueError(f"reference: tokens must be [B,T], found {tokens.shape}")
  if mtp and not cfg.text.num_mtp_layers:
    raise ValueError("reference: mtp=True needs cfg.text.num_mtp_layers=1")
  bsz, t_len = tokens.shape
  seg = np.zeros((bsz, t_len), np.int64) if segment_ids is None else np.asarray(segment_ids)
  docs = np.stack([_documents(row) for row in seg])
  params = variables["params"]
  eps = cfg.text.rms_norm_eps
  margins: list[float] = []

  emb = _f64(params["embed_tokens"]["embedding"])[tokens]    # [B,T,d]
  bs = cfg.text.attn_res_block_size
  blocks, partial, h = [], emb, emb
  for i, (mixer, mlp) in enumerate(cfg.text.layer_types()):
    lp, lb = _layer_trees(cfg, variables, i)
    attn, ffn = _decoder_layer_fns(cfg, lp, lb, mixer, mlp, docs, margins)
    in_w = _f64(lp["input_layernorm"]["weight"])
    post_w = _f64(lp["post_attention_layernorm"]["weight"])
    if bs is None:                                            # plain pre-norm residuals
      h = h + attn(_rms(h, in_w, eps))
      h = h + ffn(_rms(h, post_w, eps))
      continue
    # §5: mix before the token mixer (skipped while no block is finished); every bs-th
    # layer the running partial becomes a block and restarts from zero.
    x = _mix(cfg, blocks + [partial], lp["self_attention_res"]) if blocks else partial
    if i % bs == 0:
      blocks.append(partial)
      partial = np.zeros_like(partial)
    partial = partial + attn(_rms(x, in_w, eps))
    x = _mix(cfg, blocks + [partial], lp["mlp_res"])
    partial = partial + ffn(_rms(x, post_w, eps))
  if bs is not None:
    h = _mix(cfg, blocks + [partial], params["output_attn_res"])
  logits = _head(cfg, params, _rms(h, _f64(params["norm"]["weight"]), eps))

  mtp_logits = None
  if mtp:
    m = params["mtp"]
    mb = variables["balance"]["mtp"]["layer"]
    # Position t: the main model's hidden state h_t (before the final norm; with eagle_blocks
    # the EAGLE-3 feature) and the embedding of token t+1. Its document is the pair (document
    # of t, document of t+1): a position whose two tokens lie in different documents is a
    # document of its own.
    feature = h
    if cfg.modes.eagle_blocks is not None:   # EAGLE-3: draft_fuse over the chosen block representations
      reps = blocks + [partial]        # reps[j]: block j (0: the embeddings; the last: partial)
      feature = np.concatenate([reps[j] for j in cfg.eagle_block_indices()], axis=-1)
      feature = feature @ _kernel(params, "draft_fuse")
    x = np.concatenate([_rms(emb[:, 1:], _f64(m["enorm"]["weight"]), eps),
                        _rms(feature[:, :-1], _f64(m["hnorm"]["weight"]), eps)], axis=-1)
    x = x @ _kernel(m, "eh_proj")
    mtp_docs = np.stack([_documents(row) for row in docs[:, :-1] * (t_len + 1) + docs[:, 1:]])
    attn, ffn = _decoder_layer_fns(cfg, m["layer"], mb, MLA, MOE, mtp_docs, margins)
    x = x + attn(_rms(x, _f64(m["layer"]["input_layernorm"]["weight"]), eps))
    x = x + ffn(_rms(x, _f64(m["layer"]["post_attention_layernorm"]["weight"]), eps))
    mtp_logits = _head(cfg, params, _rms(x, _f64(m["norm"]["weight"]), eps))

  return dict(logits=logits, mtp_logits=mtp_logits,
              min_route_margin=float(min(margins)) if margins else float("inf"))


__all__ = ["reference_forward"]
