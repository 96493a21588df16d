"""Re-tune a trained model's MTP layer as an EAGLE-3 draft and measure speculative decoding.

  python -m experiments.eagle --checkpoint=runs/tiny --out=runs/eagle --json=runs/eagle/eagle.json

The target (--checkpoint, any k3jax checkpoint with an MTP layer and Block AttnRes) stays
frozen. The draft (the MTP layer, started from the checkpoint's, and a fresh `draft_fuse` over
the AttnRes blocks --blocks) trains with AdamW on `k3jax.posttrain.eagle.chain_loss` (unrolled
--chain_steps steps, LK loss) over windows of the embedded corpus, through the trainer
(`k3jax.posttrain.eagle.recipe`: OUT/metrics.jsonl logs the loss and each chain step's
acceptance). Before and after, greedy
decoding of held-out prompts is timed three ways on the same prompts: plain `generate`,
speculative with the untuned MTP draft, speculative with the EAGLE-3 draft (both chaining
--draft_len tokens per round); speculative outputs must equal plain greedy token for token.
The JSON holds the loss curve, acceptance rates, tokens per round and tokens/s; the draft's
checkpoint (config with `eagle_blocks`) is written under OUT/draft, usable by
`experiments.generate --speculative --draft_len=N`.
"""

from __future__ import annotations

import pathlib
import sys
import time

from absl import app, flags

from experiments import results


def define_flags() -> None:
  """The command line's flags, defined only when run as a script: pytest workers import several
  entry points into one process, whose flags would share (and collide in) absl's FLAGS."""
  flags.DEFINE_string("checkpoint", None, "The target: a k3jax checkpoint / run directory.")
  flags.DEFINE_string("out", None, "Output directory (the draft checkpoint under OUT/draft).")
  flags.DEFINE_string("json", None, "Write the figures here (default OUT/eagle.json).")
  flags.DEFINE_string("blocks", "1,4,-1", "AttnRes blocks fused into the draft's input (-1: "
                      "the last); indices past the model's last block are an error.")
  flags.DEFINE_integer("steps", 200, "Draft training steps.")
  flags.DEFINE_integer("chain_steps", 7, "Unrolled chain steps of the loss.")
  flags.DEFINE_integer("anchor_stride", 2, "Chains start every this many positions.")
  flags.DEFINE_integer("batch_size", 8, "Windows per step.")
  flags.DEFINE_integer("seq_len", 64, "Window length.")
  flags.DEFINE_float("lr", 3e-3, "AdamW peak learning rate (cosine decay).")
  flags.DEFINE_integer("seed", 0, "Data order and draft_fuse init.")
  flags.DEFINE_integer("eval_prompts", 4, "Held-out prompts decoded (batched).")
  flags.DEFINE_integer("prompt_len", 32, "Tokens per eval prompt.")
  flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated per prompt.")
  flags.DEFINE_integer("draft_len", 3, "Drafted tokens per speculative round.")
  flags.DEFINE_integer("log_every", 10, "Log every this many steps.")


def parse_blocks(spec: str) -> tuple[int, ...]:
  try:
    blocks = tuple(int(x) for x in spec.split(",") if x.strip())
  except ValueError:
    raise ValueError(f"--blocks: expected comma-separated ints, found {spec!r}") from None
  if not blocks:
    raise ValueError("--blocks: at least one block index is needed")
  return blocks


def decode_figures(config, variables, prompts, *, max_new: int, draft_len: int,
                   plain=None) -> dict:
  """Greedy speculative decoding of `prompts`, timed after a warm-up (compiles excluded);
  `plain` (tokens, seconds) of `generate` is measured when None. Returns the figures."""
  import jax
  from k3jax.serve import generate as G
  from k3jax.serve.sampling import SamplingParams
  from k3jax.serve.speculative import speculative_generate
  greedy = SamplingParams(temperature=0.0)
  n_tok = len(prompts) * max_new

  def timed(fn):
    fn()   # compile
    t0 = time.perf_counter()
    out = fn()
    jax.effects_barrier()
    return out, time.perf_counter() - t0

  if plain is None:
    plain = timed(lambda: G.generate(config, variables, prompts, max_new_tokens=max_new,
                                     sampling=greedy))
  (spec, stats), secs = timed(lambda: speculative_generate(
      config, variables, prompts, max_new_tokens=max_new, sampling=greedy,
      draft_len=draft_len))
  plain_tokens = [list(map(int, o))[:max_new] for o in plain[0]]
  return {
      "plain": plain, "same_as_greedy": spec == plain_tokens,
      "acceptance_rate": stats["acceptance_rate"],
      "tokens_per_round": stats["tokens_per_round"], "rounds": stats["rounds"],
      "plain_tokens_per_s": n_tok / plain[1], "speculative_tokens_per_s": n_tok / secs,
      "speedup": plain[1] / secs}


def run(checkpoint: str, out: str, *, json_path: str | None = None, blocks: str = "1,4,-1",
        steps: int = 200, chain_steps: int = 7, anchor_stride: int = 2, batch_size: int = 8,
        seq_len: int = 64, lr: float = 3e-3, seed: int = 0, eval_prompts: int = 4,
        prompt_len: int = 32, max_new_tokens: int = 64, draft_len: int = 3,
        log_every: int = 10, command: str = "") -> dict:
  """The whole experiment (see the module docstring); returns the figures written to JSON."""
  import numpy as np
  from k3jax.convert.checkpoint import load_pretrained
  from k3jax.data import corpus
  from k3jax.posttrain import eagle
  from k3jax.train.run import DataConfig, OptimConfig, RunConfig, TrainConfig
  from k3jax.train.trainer import train

  out_dir = pathlib.Path(out)
  out_dir.mkdir(parents=True, exist_ok=True)
  config, variables = load_pretrained(checkpoint)
  if not config.text.num_mtp_layers:
    raise ValueError(f"--checkpoint {checkpoint}: the target has no MTP layer "
                     "(num_mtp_layers=0); the EAGLE-3 draft re-tunes it")
  target = config.replace(eagle_blocks=None).for_inference()
  draft_cfg = eagle.eagle_config(config, parse_blocks(blocks))

  text = corpus.load_corpus("stdlib", vocab_size=config.text.vocab_size)
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, len(text.eval) - prompt_len, eval_prompts)
  prompts = [list(map(int, text.eval[s:s + prompt_len])) for s in starts]

  print(f"[eagle] target {checkpoint}: {config.text.num_layers} layers, d={config.text.d_model}; "
        f"blocks {draft_cfg.eagle_block_indices()} of {config.text.num_attn_res_blocks}",
        flush=True)
  before = decode_figures(target, variables, prompts, max_new=max_new_tokens,
                          draft_len=draft_len)
  print(f"[eagle] untuned MTP draft: acceptance {before['acceptance_rate']:.3f}, "
        f"{before['tokens_per_round']:.2f} tokens/round, speed-up {before['speedup']:.2f}×",
        flush=True)

  # The draft trains through the trainer: windows of the embedded corpus, the target frozen.
  run_cfg = RunConfig(
      model=draft_cfg, seed=seed,
      train=TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq_len,
                        log_every=log_every, checkpoint_every=0, eval_every=0, mtp_weight=0.0,
                        tensorboard=False, async_checkpoint=False),
      optim=OptimConfig(lr=lr, muon=False, qk_clip_tau=None),
      data=DataConfig(source="stdlib"))
  t0 = time.perf_counter()
  records = train(run_cfg, str(out_dir), recipe=eagle.recipe(
      checkpoint, chain_steps=chain_steps, anchor_stride=anchor_stride))
  train_s = time.perf_counter() - t0
  curve = [{"step": r["step"], "loss": r["loss"],
            "accept_per_step": [r[f"accept_{k}"] for k in range(chain_steps)]}
           for r in records]

  draft_dir = out_dir / "draft"       # the recipe saves the tuned model there
  _, tuned = load_pretrained(draft_dir)
  after = decode_figures(draft_cfg, tuned, prompts, max_new=max_new_tokens,
                         draft_len=draft_len, plain=before["plain"])
  print(f"[eagle] EAGLE-3 draft: acceptance {after['acceptance_rate']:.3f}, "
        f"{after['tokens_per_round']:.2f} tokens/round, speed-up {after['speedup']:.2f}×",
        flush=True)
  for fig in (before, after):
    fig.pop("plain")
  result = {
      "command": command,
      "date": time.strftime("%Y-%m-%d"), "checkpoint": checkpoint,
      "blocks": list(draft_cfg.eagle_block_indices()), "chain_steps": chain_steps,
      "steps": steps, "train_seconds": train_s, "draft_len": draft_len,
      "eval_prompts": eval_prompts, "max_new_tokens": max_new_tokens,
      "untuned_mtp": before, "eagle3": after, "curve": curve}
  path = pathlib.Path(json_path or out_dir / "eagle.json")
  results.write_json(path, result, indent=1)
  print(f"[eagle] wrote {path}")
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  run(f.checkpoint, f.out, json_path=f.json, blocks=f.blocks, steps=f.steps,
      chain_steps=f.chain_steps, anchor_stride=f.anchor_stride, batch_size=f.batch_size,
      seq_len=f.seq_len, lr=f.lr, seed=f.seed, eval_prompts=f.eval_prompts,
      prompt_len=f.prompt_len, max_new_tokens=f.max_new_tokens, draft_len=f.draft_len,
      log_every=f.log_every,
      command=" ".join(["python -m experiments.eagle"] + sys.argv[1:]))


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["checkpoint", "out"])
  app.run(main)
