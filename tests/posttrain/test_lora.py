"""LoRA / QLoRA fine-tuning (k3jax/posttrain/lora.py): zero-B identity, adapter-only training,
merging, packed bases, adapter checkpoints, config errors, the trainer's train.lora.rank."""

import functools
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import LORA_TARGETS, preset
from k3jax.model import K3Model
from k3jax.quant import mx
from k3jax.posttrain import lora as L
from k3jax.train.run import base_config, run_config
from k3jax.train.state import init_state

# 2 layers: layer 0 KDA + dense MLP, layer 1 MLA + MoE: every adapter kind. One init, one
# train step (the trainer's own, shared with the trainer test), three forwards.
SHAPE = dict(num_layers=2, num_mtp_layers=0)
ALL = tuple(LORA_TARGETS)


@functools.cache
def _apply(config):
  return jax.jit(lambda v, t: K3Model(config).apply(v, t))


def _tokens():
  return jnp.asarray(np.random.RandomState(0).randint(0, 256, (2, 16)), jnp.int32)


def _batch():
  t = _tokens()
  return dict(inputs=t, targets=jnp.roll(t, -1, axis=1), loss_mask=jnp.ones(t.shape),
              segment_ids=jnp.ones(t.shape, jnp.int32))


def _base(v):
  return {"params": v["params"], "balance": v["balance"]}


def _run_config():
  cfg = base_config("tiny")
  for k, v in SHAPE.items():
    setattr(cfg.model, k, v)
  cfg.train.update(steps=2, batch_size=2, seq_len=16, checkpoint_every=1, eval_every=0,
                   log_every=1, progress=False, tensorboard=False, async_checkpoint=False,
                   mtp_weight=0.0, peak_flops=1e12)   # a given peak: no matmul benchmark
  cfg.optim.update(lr=3e-2, warmup_frac=0.0)
  cfg.train.lora.rank = 4
  cfg.train.lora.targets = ",".join(ALL)
  return cfg


def _view(state):
  """A LoRA state's parts by role: the adapters, the frozen base and its router bias."""
  return types.SimpleNamespace(lora=state.params["lora"], params=state.frozen["params"],
                               balance=state.frozen["balance"], opt_state=state.opt_state,
                               variables=state.variables)


@functools.cache
def _trained():
  """(config, state before, state after two steps) of a LoRA run on every target, through
  the trainer's cached step (k3jax.train.trainer._cached_step → build_adapter_step)."""
  from k3jax.train import trainer
  run = run_config(_run_config())
  config = run.model
  tx, _, step, _ = trainer._cached_step(L.RECIPE, run)
  s0 = jax.tree.map(np.asarray, init_state(L.with_adapters(config, jax.random.PRNGKey(run.seed)),
                                           L.ADAPTERS, tx))
  s = s0
  for _ in range(2):    # the step donates its input: s0 stays on the host
    s, _ = step(jax.tree.map(jnp.asarray, s), _batch())
  return config, _view(s0), _view(jax.tree.map(np.asarray, s))


def _packed(variables):
  """The same variables with the experts packed to MXFP4 (QLoRA's base)."""
  return {**variables, "params": mx.pack_expert_params(jax.tree.map(jnp.asarray,
                                                                    variables["params"]))}


def test_zero_b_is_base_and_training_touches_adapters_only():
  config, s0, s = _trained()
  base_config = config.replace(lora_rank=0)
  tok = _tokens()
  # B = 0 at init: exactly the base model's logits.
  y_base = _apply(base_config)(_base(s0.variables), tok)
  np.testing.assert_array_equal(np.asarray(_apply(config)(s0.variables, tok)),
                                np.asarray(y_base))
  # Two steps: every base leaf bit-identical, the router bias too; every adapter moved.
  for a, b in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s.params)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(s0.balance), jax.tree.leaves(s.balance)):
    np.testing.assert_array_equal(a, b)
  assert all(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s0.lora),
                                                       jax.tree.leaves(s.lora)))
  # Optimizer state: AdamW's two moments, leaf for leaf like the adapters, plus counters.
  shaped = [x for x in jax.tree.leaves(s.opt_state) if np.ndim(x) > 0]
  assert sorted(np.shape(x) for x in shaped) == sorted(
      2 * [np.shape(x) for x in jax.tree.leaves(s.lora)])
  assert sum(np.size(x) for x in jax.tree.leaves(s.opt_state)) < sum(
      np.size(x) for x in jax.tree.leaves(s.params)) / 2


def test_qlora_forward_is_lora_on_dequantised_base():
  config, _, s = _trained()
  packed = _packed(s.variables)
  assert any(x.dtype == np.uint8 for x in jax.tree.leaves(packed["params"]))
  dense = {**packed, "params": mx.unpack_expert_params(packed["params"], jnp.float32)}
  tok = _tokens()
  np.testing.assert_allclose(
      np.asarray(_apply(config.replace(expert_format="mxfp4"))(packed, tok)),
      np.asarray(_apply(config)(dense, tok)), rtol=1e-5, atol=1e-5)


def test_merged_model_is_base_plus_adapters():
  config, _, s = _trained()
  merged_config, merged = L.merge_adapters(config, s.variables)
  assert merged_config.modes.lora_rank == 0 and set(merged) == {"params", "balance"}
  tok = _tokens()
  y = np.asarray(_apply(config)(s.variables, tok))
  np.testing.assert_allclose(np.asarray(_apply(merged_config)(merged, tok)), y,
                             rtol=1e-4, atol=1e-4)
  # One kernel by hand: W + (alpha/r)·A·B.
  p = s.variables["params"]["layers_0"]["self_attn"]["q_proj"]["kernel"]
  lo = s.variables["lora"]["layers_0"]["self_attn"]["q_proj"]
  want = p + config.lora_scale * np.einsum("dr,rhk->dhk", lo["lora_a"], lo["lora_b"])
  np.testing.assert_allclose(np.asarray(merged["params"]["layers_0"]["self_attn"]["q_proj"]
                                        ["kernel"]), want, rtol=1e-5, atol=1e-6)


def test_adapters_in_a_scanned_group():
  """5 layers = 2 unrolled + one scanned group of 2 (+ the suffix): the body's adapters carry
  the group axis, zero B is the base model, and with non-zero B the adapted model equals its
  merge (the scanned kernels folded per group)."""
  config = preset("tiny", num_layers=5, mla_every=2, num_mtp_layers=0, lora_rank=2,
                  lora_targets=ALL)
  assert config.text.stack_layout()[1] == 1
  tok = _tokens()
  v = jax.tree.map(np.asarray, jax.jit(K3Model(config).init)(jax.random.PRNGKey(0), tok))
  v = jax.tree.map(lambda x: getattr(x, "value", x), v,
                   is_leaf=lambda x: hasattr(x, "value"))
  body_a = v["lora"]["body"]["layers_1"]["self_attn"]["q_b_proj"]["lora_a"]
  assert body_a.shape[0] == 1 and body_a.ndim == 3, body_a.shape
  base_config = config.replace(lora_rank=0)
  base = np.asarray(_apply(base_config)(_base(v), tok))
  np.testing.assert_array_equal(np.asarray(_apply(config)(v, tok)), base)
  rng = np.random.default_rng(1)
  v["lora"] = jax.tree_util.tree_map_with_path(
      lambda p, x: (0.3 * rng.standard_normal(x.shape)).astype(x.dtype)
      if jax.tree_util.keystr(p).endswith("['lora_b']") else x, v["lora"])
  y = np.asarray(_apply(config)(v, tok))
  assert np.abs(y - base).max() > 1e-2
  merged_config, merged = L.merge_adapters(config, v)
  np.testing.assert_allclose(np.asarray(_apply(merged_config)(merged, tok)), y, rtol=1e-4,
                             atol=1e-4)


def test_merge_requantises_packed_experts():
  config, _, s = _trained()
  config = config.replace(expert_format="mxfp4")
  packed = _packed(s.variables)
  merged_config, merged = L.merge_adapters(config, packed)
  assert merged_config.modes.expert_format == "mxfp4" and merged_config.modes.lora_rank == 0
  ex = packed["params"]["layers_1"]["block_sparse_moe"]["experts"]
  lo = s.variables["lora"]["layers_1"]["block_sparse_moe"]["experts"]
  for name in ("w1", "w3", "w2"):
    # numpy codec: dequantise, add (alpha/r)·A·B per expert, quantise again
    dense = mx.unpack_expert(np.asarray(ex[name]["weight_packed"]),
                             np.asarray(ex[name]["weight_scale"]))
    want = mx.pack_expert(dense + config.lora_scale * np.matmul(lo[f"{name}_lora_a"],
                                                                lo[f"{name}_lora_b"]))
    got = merged["params"]["layers_1"]["block_sparse_moe"]["experts"][name]
    assert got["weight_packed"].dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(got["weight_scale"]), want[1])
    # A code may differ only where fp32 summation order moves a value across a rounding tie.
    assert np.mean(np.asarray(got["weight_packed"]) != want[0]) < 1e-3
    assert not np.array_equal(np.asarray(got["weight_packed"]),
                              np.asarray(ex[name]["weight_packed"]))


def test_adapters_save_load_round_trip(tmp_path):
  config, _, s = _trained()
  path = L.save_adapters(tmp_path / "adapters", config, s.lora, step=2)
  assert path.name == "2"
  size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
  assert size < 4 * sum(np.size(x) for x in jax.tree.leaves(s.lora)) + 200_000
  got_config, got = L.load_adapters(tmp_path / "adapters", config)
  assert got_config == config
  assert jax.tree.structure(got) == jax.tree.structure(jax.tree.map(np.asarray, s.lora))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(s.lora)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="lora_rank"):
    L.load_adapters(tmp_path / "adapters", config.replace(lora_rank=2))
  with pytest.raises(ValueError, match="not a directory"):
    L.load_adapters(tmp_path / "missing")


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="ModelConfig.modes.lora_targets: unknown target"):
    preset("tiny", lora_rank=2, lora_targets=("q", "router"))
  with pytest.raises(ValueError, match="ModelConfig.modes.lora_rank"):
    preset("tiny", lora_rank=-1)
  with pytest.raises(ValueError, match="ModelConfig.modes.lora_alpha"):
    preset("tiny", lora_rank=2, lora_alpha=0.0)
  with pytest.raises(ValueError, match="ModelConfig.modes.lora_targets: lora_rank=2 needs"):
    preset("tiny", lora_rank=2, lora_targets=())
  with pytest.raises(ValueError, match="ModelConfig.modes.lora_targets: duplicate"):
    preset("tiny", lora_rank=2, lora_targets=("q", "q"))
  with pytest.raises(ValueError, match="lora_rank"):
    L.with_adapters(preset("tiny"), jax.random.PRNGKey(0))
  config, _, _ = _trained()
  bad = {"params": {"embed_tokens": {"embedding": jnp.zeros((3, 3))}}, "balance": {}}
  with pytest.raises(ValueError, match="base params"):
    L.with_adapters(config, jax.random.PRNGKey(0), base=bad)   # the cached init


def test_trainer_lora_run_and_resume(tmp_path):
  from k3jax.train import trainer
  cfg = _run_config()
  config, _, _ = _trained()
  assert config.modes.lora_rank == 4 and config.modes.lora_targets == ALL
  bad = cfg.copy_and_resolve_references()
  bad.train.lora.targets = "q,nope"
  with pytest.raises(ValueError, match="lora_targets: unknown target"):
    run_config(bad)
  bad.train.lora.targets = "q"
  bad.train.lora.rank = -2
  with pytest.raises(ValueError, match="train.lora.rank"):
    run_config(bad)
  text = tmp_path / "corpus.txt"    # a small corpus: no stdlib scan
  text.write_text("".join(f"line {i}: the adapters learn, the base stays.\n" for i in range(400)))
  cfg.data.source = str(text)
  run = run_config(cfg)
  records = trainer.train(run, str(tmp_path / "run"), recipe=L.RECIPE, until=1)
  assert [r["step"] for r in records] == [1]
  records = trainer.train(run, str(tmp_path / "run"), recipe=L.RECIPE)  # resumes from step 1
  assert [r["step"] for r in records] == [2]
  saved_config, lora = L.load_adapters(tmp_path / "run" / "adapters")
  assert saved_config == config
  # Two steps on the trainer's corpus moved every adapter off its init (B from 0).
  init = L.with_adapters(config, jax.random.PRNGKey(run.seed))["lora"]
  assert all(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(lora),
                                                       jax.tree.leaves(init)))


def test_merge_lora_tool(tmp_path):
  from k3jax.convert.checkpoint import load_pretrained, save_pretrained
  from tools.merge_lora import merge_checkpoint
  config, _, s = _trained()
  base_config = config.replace(lora_rank=0)
  save_pretrained(tmp_path / "base", base_config, _base(s.variables))
  L.save_adapters(tmp_path / "adapters", config, s.lora)
  merged_config, path = merge_checkpoint(str(tmp_path / "base"), str(tmp_path / "adapters"),
                                         str(tmp_path / "merged"))
  got_config, got = load_pretrained(path)
  assert got_config == merged_config == base_config
  tok = _tokens()
  np.testing.assert_allclose(np.asarray(_apply(base_config)(got, tok)),
                             np.asarray(_apply(config)(s.variables, tok)), rtol=1e-4, atol=1e-4)
  # A packed base stays packed: the same bytes as merge_adapters gives.
  packed_config = base_config.replace(expert_format="mxfp4")
  save_pretrained(tmp_path / "qbase", packed_config, _base(_packed(s.variables)))
  q_config, q_path = merge_checkpoint(str(tmp_path / "qbase"), str(tmp_path / "adapters"),
                                      str(tmp_path / "qmerged"))
  _, q = load_pretrained(q_path)
  _, want = L.merge_adapters(config.replace(expert_format="mxfp4"), _packed(s.variables))
  assert q_config.modes.expert_format == "mxfp4"
  for a, b in zip(jax.tree.leaves(q["params"]), jax.tree.leaves(want["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  other = tmp_path / "other"
  save_pretrained(other, base_config.replace(d_model=32, latent_moe_dim=32),
                  _base(s.variables))
  with pytest.raises(ValueError, match="another model"):
    merge_checkpoint(str(other), str(tmp_path / "adapters"), str(tmp_path / "bad"))


def test_adapters_shard_like_their_base():
  from jax.sharding import PartitionSpec as P

  import flax.linen as nn

  from k3jax import sharding
  from k3jax.model import abstract_variables
  from k3jax.train.sharded import train_state_shardings
  from k3jax.train.state import abstract_state
  config, _, _ = _trained()
  mesh = sharding.abstract_mesh(dict(data=1, fsdp=2, expert=2, tensor=2), 8)
  tx = L.adapter_optimizer(1e-3)
  boxed = abstract_variables(config)
  state = abstract_state(nn.unbox({c: v for c, v in boxed.items() if c != "stats"}),
                         L.ADAPTERS, tx)
  sh = _view(train_state_shardings(mesh, state, boxed, L.ADAPTERS))
  attn = sh.lora["layers_0"]["self_attn"]
  kernel = sh.params["layers_0"]["self_attn"]["q_proj"]["kernel"].spec     # [d, H, K]
  assert kernel == P("fsdp", "tensor")
  assert attn["q_proj"]["lora_a"].spec == P("fsdp")            # [d, r]: d like the kernel's
  assert attn["q_proj"]["lora_b"].spec == P(None, "tensor")    # [r, H, K]: H like the kernel's
  assert attn["o_proj"]["lora_a"].spec == P("tensor")          # [H, V, r]
  experts = sh.lora["layers_1"]["block_sparse_moe"]["experts"]
  assert experts["w1_lora_a"].spec[0] == "expert" and experts["w2_lora_b"].spec[0] == "expert"
  # AdamW's moments follow the adapters they mirror.
  mu = sh.opt_state[0].mu["lora"]["layers_1"]["block_sparse_moe"]["experts"]["w1_lora_a"]
  assert mu == experts["w1_lora_a"]


def test_lora_step_on_a_mesh_equals_one_device_with_compiler_layouts():
  """The LoRA step on an expert=2 mesh: the frozen base in the layouts its compiled
  step chose (`ShardedStep(compiler_layouts=("frozen",))`; default ones on CPU), one compile
  for both steps, the same adapters as the one-device run and the base untouched."""
  from k3jax import sharding
  from k3jax.train import trainer
  run = run_config(_run_config())
  config, s0, ref = _trained()
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, expert=2), devices=jax.devices()[:2])
  step = L.build_adapter_step(run, config, mesh)
  assert step.train.compiler_layouts == ("frozen",)
  tx = trainer._cached_step(L.RECIPE, run).tx
  s = init_state(jax.tree.map(jnp.asarray, s0.variables), L.ADAPTERS, tx)
  for _ in range(2):
    s, _ = step.train(s, _batch())
  (compiled,) = step.train._compiled.values()           # one program for both calls
  formats = compiled.input_formats[0][0].frozen
  assert all(jax.tree.leaves(jax.tree.map(lambda x, f: x.format == f, s.frozen, formats)))
  s = _view(s)
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, s.params), s0.params)
  # Adam's early steps are ≈ ±lr·sign(g): float noise on a near-zero gradient moves an entry
  # by up to ~1e-4 (one in a thousand here), far below the 3e-2 steps a wrong update would take.
  chex.assert_trees_all_close(jax.tree.map(np.asarray, s.lora), ref.lora, rtol=1e-3, atol=2e-4)
  with pytest.raises(ValueError, match="no field 'base'"):
    from k3jax.train.sharded import ShardedStep
    ShardedStep(lambda s, b: (s, {}), mesh, step.train.state_shardings,
                step.train.abstract_state, compiler_layouts=("base",))


def test_param_count_lora_from_shapes():
  from tools.param_count import count_lora
  c = count_lora(preset("tiny", **SHAPE), 2, ("o",))
  # KDA and MLA o_proj [H=2, V=16, d=64]: A [2, 16, 2] + B [2, 64] each.
  assert c["adapter_params"] == 2 * (2 * 16 * 2 + 2 * 64) == 384
  assert c["adapter_params_by_target"] == {"o": 384}
  # AdamW: two fp32 moments per adapter weight + one int32 step counter.
  assert c["optimizer_bytes"]["lora_adamw"] == 8 * 384 + 4
  assert c["full_params"] > 100 * c["adapter_params"]
  assert c["optimizer_bytes"]["full_adamw"] >= 8 * c["full_params"]
